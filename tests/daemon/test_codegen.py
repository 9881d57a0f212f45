"""The committed generated code matches protos/ exactly (no hand edits, no drift)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

GEN = ROOT / "rendezvousd" / "_gen"
FIX = "run `python scripts/gen_protos.py` and commit rendezvousd/_gen/"


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"gen_protos.py failed: {result.stderr[-2000:]}"
    fresh, committed = _files(out), _files(GEN)
    assert fresh, "gen_protos.py wrote nothing"
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    assert not missing, f"rendezvousd/_gen/ lacks generated files {missing}; {FIX}"
    assert not extra, f"rendezvousd/_gen/ holds files the generator does not write {extra}; {FIX}"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"rendezvousd/_gen/ differs from protos/ in {stale}; {FIX}"


def test_generated_code_names_our_package() -> None:
    # The import fix-up ran: no bare top-level ``rendezvous`` package is imported.
    for name, data in _files(GEN).items():
        text = data.decode()
        assert "from rendezvous.v1 import" not in text, name
        assert "import rendezvous.v1." not in text, name
    grpc_module = (GEN / "rendezvous" / "v1" / "rendezvous_pb2_grpc.py").read_text()
    assert "from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2" in grpc_module
