"""bench/gpu.py's smoke mode, so that the script scripts/gpu-check runs on a device keeps working where none is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu


def test_idle_share_counts_the_time_between_kernels() -> None:
    # Busy 0-4 and 6-10 (overlapping kernels merged), idle 4-6: a fifth of the span.
    assert gpu.idle_share([(6.0, 10.0), (0.0, 3.0), (2.0, 4.0), (7.0, 8.0)]) == pytest.approx(0.2)
    assert gpu.idle_share([(0.0, 5.0)]) == 0.0


def test_the_cpu_smoke_run_writes_its_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny shape through the real runner: prefill, decodes two in flight through the graph runner's static
    buffers (and without them, --compare), the table and the JSON under $OUT."""
    monkeypatch.setenv("OUT", str(tmp_path))
    gpu.main(["--cpu", "--batches", "1,2", "--steps", "3", "--context", "12", "--compare"])
    record = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert [(r["batch"], r["graphs"]) for r in record["rows"]] == [(1, "static"), (1, "off"), (2, "static"), (2, "off")]
    assert all(r["tok_s"] > 0 and r["limit_tok_s"] > 0 for r in record["rows"]) and record["prefill_tok_s"] > 0
    table = (tmp_path / "gpu-bench.md").read_text()
    assert "| batch | graphs | decode tok/s |" in table and "bandwidth limit" in table
