"""Regenerates the committed gRPC stubs in serving/grpc_api/stubs/ from serving/grpc_api/proto/.

    .venv/bin/python scripts/gen_protos.py          # rewrite the stubs
    .venv/bin/python scripts/gen_protos.py --check  # exit 1 if the committed stubs are stale

protoc writes `from meshserve.v1 import generation_pb2`, after the proto's own path; the stubs live
in `meshserve.serving.grpc_api.stubs`, so that import is rewritten. `tests/serving/test_proto.py`
runs the check.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "serving" / "grpc_api" / "proto"
PROTO = Path("meshserve/v1/generation.proto")
OUT = ROOT / "serving" / "grpc_api" / "stubs"
STUBS = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


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
        stale = [n for n in STUBS if (Path(tmp) / n).read_text() != (OUT / n).read_text()]
    if stale:
        print(f"stale stubs: {stale}; run scripts/gen_protos.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
