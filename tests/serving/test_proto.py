"""The committed gRPC stubs are what protoc makes of the committed proto."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_committed_stubs_are_current_with_the_proto():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_proto_ships_in_the_package():
    from importlib import resources

    proto = (resources.files("meshserve.serving.grpc_api") / "proto" / "meshserve" / "v1"
             / "generation.proto")
    assert "service Generation" in proto.read_text()
