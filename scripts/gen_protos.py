"""Regenerate the checked-in gRPC stubs (with .pyi) from protos/ into pdserve/v1/.

    .venv/bin/python scripts/gen_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out: Path) -> None:
    # protos/pdserve/v1/x.proto becomes <out>/pdserve/v1/x_pb2.py, imported as `pdserve.v1.x_pb2`.
    out.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    (out / "pdserve" / "v1" / "__init__.py").write_text('"""Generated gRPC stubs: run scripts/gen_protos.py."""\n')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT, help="root under which pdserve/v1/ is written")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
