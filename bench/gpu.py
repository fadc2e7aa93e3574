"""The executor on a GPU: decode and prefill throughput of a Llama-3-8B-shaped model with random weights, beside the
HBM bandwidth limit, and the GPU's idle fraction per decode step.

    .venv/bin/python bench/gpu.py                 # on CUDA: 8B shape, bf16, batches 1 8 64 256 (scripts/gpu-check)
    .venv/bin/python bench/gpu.py --cpu           # a smoke run of this script on a tiny shape on CPU

No checkpoint is needed: the weights are seeded random numbers (throughput does not depend on their values). The
executor's ModelRunner runs real step plans (prefill chunks, then decodes that name the pending token by reference,
two steps in flight as under the scheduler's overlap loop), with the attention backend and CUDA graphs chosen by
flags as in serving. Per decode batch it prints tok/s, the bandwidth limit (weights + KV bytes read per step over
the bandwidth this script measures with a device copy) and the share of it reached, and the GPU idle fraction from
torch.profiler (the time between kernels over the span of a few profiled steps; the profiler adds host time, so
this is an upper bound). ``--compare`` adds each batch eagerly (no CUDA graphs), side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.config import AttentionBackendKind, CudaGraphConfig
from engine.executor.runner import ModelRunner
from engine.kv.pool import KVPool
from engine.model.attention_backend import attention_backend
from engine.model.config import ModelConfig
from engine.model.graphs import DecodeGraphs, GraphMode
from engine.model.loader import random_model
from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams
from engine.step import NewRequest, StepEntry, StepPlan, StepResult

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
}
TINY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
PREFILL_TOKENS_PER_STEP = 8192
PROFILED_STEPS = 6


@dataclass(frozen=True)
class Setup:
    """What one run measures on."""

    shape: dict[str, object]
    device: torch.device
    dtype: torch.dtype
    batches: tuple[int, ...]
    context: int  # prompt tokens per request
    steps: int  # timed decode steps per batch
    page_size: int
    backend: AttentionBackendKind
    graphs: GraphMode
    compare: bool


@dataclass(frozen=True)
class Row:
    batch: int
    graphs: str
    tok_s: float
    step_ms: float
    limit_tok_s: float
    idle: float | None

    @property
    def share(self) -> float:
        return self.tok_s / self.limit_tok_s


class Bench:
    """One model and KV pool; a ModelRunner per graph mode over them."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.bandwidth = measure_bandwidth(setup.device)  # before the model and pool take the memory
        self.config = ModelConfig.from_hf(setup.shape)
        backend = attention_backend(setup.backend, setup.device, setup.page_size)
        self.backend_name = backend.name
        self.model = random_model(self.config, setup.dtype, setup.device, seed=0, attention=backend)
        pages_per_seq = -(-(setup.context + setup.steps + PROFILED_STEPS + 8) // setup.page_size)
        self.pages_per_seq = pages_per_seq
        cfg = self.config
        self.num_pages = max(setup.batches) * pages_per_seq
        self.kv = KVPool(
            cfg.num_layers, self.num_pages, setup.page_size, cfg.num_kv_heads, cfg.head_dim, setup.dtype,
            setup.device, scratch_page=True,
        )  # fmt: skip
        self.info = ModelInfo("random", cfg.vocab_size, cfg.max_position_embeddings, frozenset(), None, None,
                              setup.page_size, self.num_pages)  # fmt: skip
        self._steps = 0

    def runner(self, mode: GraphMode) -> ModelRunner:
        graphs = None
        if mode is not GraphMode.OFF:
            widest = -(-self.config.max_position_embeddings // self.setup.page_size)
            sizes = CudaGraphConfig.up_to(max(self.setup.batches))
            graphs = DecodeGraphs(self.model, self.kv, sizes, widest, capture=mode is GraphMode.CAPTURE)
        return ModelRunner(self.model, self.kv, self.info, self.setup.device, graphs=graphs)

    def plan(self, entries: Sequence[StepEntry]) -> StepPlan:
        self._steps += 1
        return StepPlan(self._steps, tuple(entries))

    def prefill(self, runner: ModelRunner, batch: int) -> float:
        """Prefill ``batch`` prompts of ``context`` tokens, several per step; returns tok/s (the kernels are warm from
        the batches before: the largest batch's figure is the one reported)."""
        context, per_step = self.setup.context, max(1, PREFILL_TOKENS_PER_STEP // self.setup.context)
        params = SamplingParams(temperature=0.0, max_new_tokens=1 << 20, ignore_eos=True)
        gen = torch.Generator().manual_seed(batch)
        started = time.perf_counter()
        for first in range(0, batch, per_step):
            entries = []
            for slot in range(first, min(batch, first + per_step)):
                prompt = tuple(torch.randint(10, self.config.vocab_size, (context,), generator=gen).tolist())
                pages = tuple(range(slot * self.pages_per_seq, (slot + 1) * self.pages_per_seq))
                new = NewRequest(prompt, params, seed=slot)
                entries.append(StepEntry(f"r{slot}", slot, 0, prompt, new_pages=pages, new=new))
            runner.execute(self.plan(entries))
        sync(self.setup.device)
        return batch * context / (time.perf_counter() - started)

    def decode(self, runner: ModelRunner, batch: int, steps: int, ordinal: int) -> tuple[float, int]:
        """``steps`` decode steps of the whole batch, two in flight; returns (seconds, the next ordinal)."""
        started = time.perf_counter()
        in_flight: deque[object] = deque()
        for _ in range(steps):
            entries = [StepEntry(f"r{s}", s, ordinal, input_ref=True) for s in range(batch)]
            in_flight.append(runner.launch(self.plan(entries)))
            ordinal += 1
            if len(in_flight) == 2:
                _result(in_flight.popleft())
        while in_flight:
            _result(in_flight.popleft())
        sync(self.setup.device)
        return time.perf_counter() - started, ordinal

    def measure(self, batch: int, mode: GraphMode) -> tuple[Row, float]:
        runner = self.runner(mode)
        try:
            prefill_tok_s = self.prefill(runner, batch)
            _, ordinal = self.decode(runner, batch, 3, 0)  # warm up: graph capture, compiles
            seconds, ordinal = self.decode(runner, batch, self.setup.steps, ordinal)
            idle = self.idle_fraction(runner, batch, ordinal)
            runner.release(range(batch)).result()
        finally:
            runner.shutdown()
        tok_s = batch * self.setup.steps / seconds
        row = Row(batch, mode.value, tok_s, 1e3 * seconds / self.setup.steps, self.limit(batch), idle)
        return row, prefill_tok_s

    def idle_fraction(self, runner: ModelRunner, batch: int, ordinal: int) -> float | None:
        if self.setup.device.type != "cuda":
            return None
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            self.decode(runner, batch, PROFILED_STEPS, ordinal)
        return idle_share(list(_kernel_intervals(prof)))

    def limit(self, batch: int) -> float:
        """Decode tok/s if every step only read the weights (the embedding table aside) and the batch's KV once, at
        the measured bandwidth."""
        cfg = self.config
        params = {p.data_ptr(): p.numel() * p.element_size() for p in self.model.parameters()}
        if not cfg.tie_word_embeddings:  # a step reads only its batch's rows of the embedding table
            params.pop(self.model.model.embed_tokens.weight.data_ptr())
        kv_per_token = KVPool.bytes_per_page(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, self.setup.dtype)
        kv_len = self.setup.context + self.setup.steps // 2
        step_bytes = sum(params.values()) + batch * kv_len * kv_per_token
        return batch * self.bandwidth / step_bytes


def _result(future: object) -> StepResult:
    result = future.result()  # type: ignore[attr-defined]
    assert isinstance(result, StepResult)
    return result


def _kernel_intervals(prof: object) -> Iterator[tuple[float, float]]:
    from torch.autograd import DeviceType

    for event in prof.events():  # type: ignore[attr-defined]
        if event.device_type == DeviceType.CUDA:
            yield float(event.time_range.start), float(event.time_range.end)


def idle_share(intervals: list[tuple[float, float]]) -> float:
    """The share of the span from the first kernel's start to the last one's end during which none ran."""
    if not intervals:
        return float("nan")
    intervals.sort()
    busy, (cur_start, cur_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(end for _, end in intervals) - intervals[0][0]
    return 1.0 - busy / span if span > 0 else 0.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write), the best of a few."""
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size / best


def table(setup: Setup, backend: str, bandwidth: float, rows: list[Row], prefill: float) -> str:
    gbps = bandwidth / 1e9
    lines = [
        f"# bench/gpu.py: {setup.device} ({_device_name(setup.device)}), {setup.dtype}, attention {backend}, "
        f"prompt {setup.context} tokens, page size {setup.page_size}, measured copy bandwidth {gbps:.0f} GB/s",
        "",
        "| batch | graphs | decode tok/s | step ms | bandwidth limit tok/s | share of limit | GPU idle per step |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        idle = "n/a (cpu)" if r.idle is None else f"{100 * r.idle:.1f}%"
        lines.append(
            f"| {r.batch} | {r.graphs} | {r.tok_s:.1f} | {r.step_ms:.2f} | {r.limit_tok_s:.1f} | "
            f"{100 * r.share:.0f}% | {idle} |"
        )
    lines += ["", f"prefill: {prefill:.0f} tok/s (chunks of up to {PREFILL_TOKENS_PER_STEP} tokens)"]
    return "\n".join(lines)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def parse(argv: Sequence[str] | None = None) -> Setup:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="smoke run: a tiny shape on CPU (graph bookkeeping eager)")
    parser.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,64,256; --cpu 1,3)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per request (default 512; --cpu 24)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per batch (default 64; --cpu 6)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--attention-backend", choices=[k.value for k in AttentionBackendKind], default="auto")
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--compare", action="store_true", help="also run each batch without CUDA graphs")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu for the smoke run")
    device = torch.device("cpu" if args.cpu else "cuda")
    batches = tuple(int(b) for b in (args.batches or ("1,3" if args.cpu else "1,8,64,256")).split(","))
    mode = GraphMode.OFF if args.no_cuda_graph else (GraphMode.STATIC if args.cpu else GraphMode.CAPTURE)
    return Setup(
        shape=TINY if args.cpu else LLAMA3_8B,
        device=device,
        dtype=torch.float32 if args.cpu else torch.bfloat16,
        batches=batches,
        context=args.context or (24 if args.cpu else 512),
        steps=args.steps or (6 if args.cpu else 64),
        page_size=args.page_size,
        backend=AttentionBackendKind(args.attention_backend),
        graphs=mode,
        compare=args.compare,
    )


def main(argv: Sequence[str] | None = None) -> None:
    setup = parse(argv)
    started = time.perf_counter()
    bench = Bench(setup)
    out = Path(os.environ.get("OUT") or "bench-out")
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    prefill = float("nan")
    modes = [setup.graphs] + ([GraphMode.OFF] if setup.compare and setup.graphs is not GraphMode.OFF else [])
    for batch in setup.batches:
        for mode in modes:
            row, prefill_tok_s = bench.measure(batch, mode)
            rows.append(row)
            if batch == max(setup.batches) and mode is modes[0]:
                prefill = prefill_tok_s
            print(f"batch {batch} graphs {mode.value}: {row.tok_s:.1f} tok/s", flush=True)
            # Written after every row: a run cut short by its time limit still leaves what it measured.
            write(out, table(setup, bench.backend_name, bench.bandwidth, rows, prefill), rows, prefill, bench.bandwidth)
    print(table(setup, bench.backend_name, bench.bandwidth, rows, prefill))
    print(f"(took {time.perf_counter() - started:.0f} s)")


def write(out: Path, text: str, rows: list[Row], prefill: float, bandwidth: float) -> None:
    (out / "gpu-bench.md").write_text(text + "\n", encoding="utf-8")
    record = {"rows": [asdict(r) for r in rows], "prefill_tok_s": prefill, "bandwidth": bandwidth}
    (out / "gpu-bench.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
