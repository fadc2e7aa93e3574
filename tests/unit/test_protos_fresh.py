"""The committed generated code in protos/ is what scripts/gen_protos makes from the .proto files today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generated_files(root: Path) -> list[str]:
    protos = root / "protos"
    return sorted(p.name for p in protos.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """Fails when a .proto changed without `scripts/gen_protos` (or a generated file was edited by hand)."""
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos"), str(tmp_path)],
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    fresh = _generated_files(tmp_path)
    assert fresh, "gen_protos generated nothing"
    assert _generated_files(ROOT) == fresh, "generated files are missing from (or extra in) protos/"
    stale = [n for n in fresh if (tmp_path / "protos" / n).read_bytes() != (ROOT / "protos" / n).read_bytes()]
    if stale:
        pytest.fail(f"stale generated code: {stale}; run scripts/gen_protos and commit the result")
