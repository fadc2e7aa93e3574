"""The seams between the sides hold: each service's process loads its own side of the engine and the shared values,
never another side's implementation.

Each case imports one side in a fresh interpreter (as its service's process does) and lists the modules loaded. The
scheduler side (the scheduler service with its executor and grammar clients) must load neither xgrammar nor the
grammar engine, nor the model or the executor; the executor side not the scheduler's bookkeeping or the grammar
engine; the grammar service neither the model nor the scheduler; the executor's mask relay process nothing of
the engine, not even torch. They meet only in the shared values
(``engine.step``, ``engine.grammar_calls``, ``engine.model_info``, ``engine.constraint``, ``engine.finish``, ...).

Fails if, say, ``engine/scheduler/engine.py`` imports ``ModelRunner`` or ``LocalGrammar`` at the top again, instead of
in ``_in_process`` (the scheduler side then loads the model and xgrammar; checked once).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SIDES = {
    "scheduler": (
        ["services.scheduler.__main__", "services.remote_runner", "services.grammar_client", "engine.scheduler.engine"],
        ["xgrammar", "engine.grammar.", "engine.model.llama", "engine.executor", "engine.kv.pool", "transformers"],
    ),
    "executor": (
        ["services.executor.__main__", "engine.executor.runner"],
        ["engine.scheduler", "engine.grammar.", "xgrammar", "engine.kv.prefix_cache"],
    ),
    "grammar": (
        ["services.grammar.__main__", "services.grammar.server"],
        ["engine.scheduler", "engine.executor", "engine.model.llama", "engine.kv"],
    ),
    # The executor's mask relay process: grpc and the protos only, so that it starts in a fraction of a second.
    "mask_relay": (["services.mask_relay_process"], ["torch", "numpy", "engine.", "xgrammar"]),
}


def _loaded(modules: list[str]) -> list[str]:
    code = "import json, sys\n" + "".join(f"import {m}\n" for m in modules) + "print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("side", sorted(SIDES))
def test_each_side_loads_nothing_of_the_others(side: str) -> None:
    imports, forbidden = SIDES[side]
    loaded = _loaded(imports)
    leaks = sorted(m for m in loaded for prefix in forbidden if m == prefix.rstrip(".") or m.startswith(prefix))
    assert not leaks, f"the {side} side loads {leaks}"
    assert "engine.step" in loaded or side in ("grammar", "mask_relay")  # the sides do meet in the shared values
