"""Regenerates the committed gRPC stubs in serving/grpc_api/stubs/ from serving/grpc_api/proto/.

    .venv/bin/python scripts/gen_protos.py          # rewrite the stubs
    .venv/bin/python scripts/gen_protos.py --check  # exit 1 if the committed stubs are stale

protoc writes `from meshserve.v1 import generation_pb2`, after the proto's own path; the stubs live
in `meshserve.serving.grpc_api.stubs`, so that import is rewritten. `tests/serving/test_proto.py`
runs the check.

The check ignores the version stamps protoc writes (`GRPC_GENERATED_VERSION`, the protobuf runtime
version): a newer grpcio-tools than the one that wrote the committed stubs makes the same code with
another stamp, and the committed stamp is the floor the stubs need (`grpcio>=` in pyproject.toml).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "serving" / "grpc_api" / "proto"
PROTO = Path("meshserve/v1/generation.proto")
OUT = ROOT / "serving" / "grpc_api" / "stubs"
STUBS = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")
# What differs between grpcio-tools releases for the same proto: the stamps, not the code.
STAMPS = (
    (re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M), "GRPC_GENERATED_VERSION = ..."),
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: ..."),
    (re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)"
                r"\s*\d+,\s*\d+,\s*\d+,\s*'[^']*',"), r"\1 ..."),
)


def unstamped(text: str) -> str:
    for pattern, replacement in STAMPS:
        text = pattern.sub(replacement, text)
    return text


def generate(out: Path) -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO)]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        generated = Path(tmp) / PROTO.parent
        for name in STUBS:
            text = (generated / name).read_text()
            text = text.replace("from meshserve.v1 import generation_pb2",
                                "from meshserve.serving.grpc_api.stubs import generation_pb2")
            (out / name).write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    if not parser.parse_args().check:
        generate(OUT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [n for n in STUBS
                 if unstamped((Path(tmp) / n).read_text()) != unstamped((OUT / n).read_text())]
    if stale:
        print(f"stale stubs: {stale}; run scripts/gen_protos.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
