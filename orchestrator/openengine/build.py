"""Regenerate the Python stubs in this package (and their .pyi type stubs) from proto/openengine/v1/*.proto.

    python -m orchestrator.openengine.build [--out DIR]

grpcio-tools writes imports as `from openengine.v1 import x_pb2`; we ship the stubs inside the
`orchestrator` package (so they cannot clash with another distribution's `openengine`), which
means rewriting those imports to `from orchestrator.openengine.v1 import x_pb2`. The stubs are
committed; tests/unit/test_wire_schema.py checks that a fresh build gives identical files.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "proto"
PACKAGE_DIR = Path(__file__).resolve().parent / "v1"
_IMPORT = re.compile(r"^from openengine\.v1 import ", re.MULTILINE)


def build(out_dir: Path) -> list[Path]:
    import grpc_tools  # dev dependency, needed only to regenerate
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.glob("openengine/v1/*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *map(str, protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT}")
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        generated_dir = Path(tmp) / "openengine" / "v1"
        for generated in sorted([*generated_dir.glob("*.py"), *generated_dir.glob("*.pyi")]):
            text = _IMPORT.sub("from orchestrator.openengine.v1 import ", generated.read_text())
            target = out_dir / generated.name
            target.write_text(text)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR)
    args = parser.parse_args(argv)
    for path in build(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
