#!/usr/bin/env python
"""Regenerate the Python gRPC stubs for ``proto/pdserve/v1/*.proto``.

Usage (from anywhere)::

    /work/venv/bin/python scripts/gen_protos.py          # writes pdserve/v1/
    /work/venv/bin/python scripts/gen_protos.py --out D  # writes D/pdserve/v1/

Equivalent to running, from the repo root::

    python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. \
        --grpc_python_out=. proto/pdserve/v1/*.proto

The generated modules import each other as ``from pdserve.v1 import ...``.
``tests/services/common/test_protos.py`` fails if the committed stubs differ from a fresh run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "pdserve" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """All .proto sources, sorted for deterministic output."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """Generated stub files under ``root/pdserve/v1`` (sorted)."""
    pkg = root / "pdserve" / "v1"
    return sorted(p for p in pkg.glob("*") if p.name.endswith(GENERATED_SUFFIXES))


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Run protoc into ``out_root``; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    out_root.mkdir(parents=True, exist_ok=True)
    wkt_include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{wkt_include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p) for p in proto_files()),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return generated_files(out_root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
