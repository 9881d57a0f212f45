"""Regenerate the committed protobuf/gRPC code and mypy stubs from protos/.

    python scripts/gen_protos.py            # rewrite rendezvousd/_gen/
    python scripts/gen_protos.py --out DIR  # write elsewhere (the drift test)

protoc names Python modules after the .proto path (``rendezvous.v1``), but our
code installs under ``rendezvousd._gen``; the only fix-up is rewriting those
imports so the package stays importable without a bare top-level ``rendezvous``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
PACKAGE = "rendezvousd._gen"
GENERATED = (
    "rendezvous_pb2.py",
    "rendezvous_pb2.pyi",
    "rendezvous_pb2_grpc.py",
    "rendezvous_pb2_grpc.pyi",
)


def generate(out: Path) -> list[Path]:
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        # protoc finds the mypy-protobuf plugins on PATH, next to this interpreter.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"--python_out={tmp}",
                f"--grpc_python_out={tmp}",
                f"--mypy_out={tmp}",
                f"--mypy_grpc_out={tmp}",
                *[str(p.relative_to(PROTO_ROOT)) for p in protos],
            ],
            check=True,
            cwd=PROTO_ROOT,
            env=env,
            capture_output=True,
        )
        written = []
        for src in sorted(Path(tmp).rglob("*.py*")):
            rel = src.relative_to(tmp)
            text = src.read_text()
            text = text.replace("from rendezvous.v1 import", f"from {PACKAGE}.rendezvous.v1 import")
            text = text.replace("import rendezvous.v1.", f"import {PACKAGE}.rendezvous.v1.")
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
            written.append(dst)
        for pkg in {p.parent for p in written} | {out / "rendezvous"}:
            init = pkg / "__init__.py"
            if not init.exists():
                init.write_text("")
            written.append(init)
    return sorted(set(written))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "rendezvousd" / "_gen")
    args = parser.parse_args()
    if args.out == ROOT / "rendezvousd" / "_gen":
        shutil.rmtree(args.out / "rendezvous", ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "__init__.py").touch()
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    main()
