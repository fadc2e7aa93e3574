"""The ``ordinal`` command.

``ordinal serve`` loads the model (the embedded default unless ``--model`` names an HF folder) into the
in-process engine and streams a completion of a sample prompt, so a fresh machine can see the engine work
end to end. (The gRPC services and the gateway arrive with the services issue; the flags already match.)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

SAMPLE_PROMPT = "Write a JSON object that describes a small cat."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ordinal", description="ordinal: an LLM serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="load the model and run a sample prompt through the in-process engine",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_args(serve)
    serve.add_argument("--prompt", default=SAMPLE_PROMPT, help="the prompt to complete (chat template applied)")
    serve.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate")
    serve.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    return parser


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default=None, help="HF checkpoint folder; default: the embedded tiny model")
    parser.add_argument("--device", default=defaults.device, help="cpu or cuda")
    parser.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, default=defaults.page_size, help="tokens per KV page")
    parser.add_argument("--num-pages", type=int, default=defaults.num_pages, help="KV pages in the pool")
    parser.add_argument("--max-running", type=int, default=defaults.max_running, help="requests admitted at once")
    parser.add_argument("--chunk-size", type=int, default=defaults.chunk_size, help="max prefill tokens per step")
    parser.add_argument("--no-overlap", action="store_true", help="commit step N before launching N+1")
    parser.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_path=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_running=args.max_running,
        chunk_size=args.chunk_size,
        overlap=not args.no_overlap,
        prefix_cache=not args.no_prefix_cache,
    )


async def _stream_sample(engine: Engine, prompt: str, params: SamplingParams) -> None:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if tok.chat_template else prompt
    ids = tok.encode(text)
    started = time.perf_counter()
    n = 0
    print(f"prompt ({len(ids)} tokens): {prompt}")
    print("completion: ", end="", flush=True)
    async for out in engine.generate(ids, params):
        n = out.num_output_tokens
        print(out.text_delta, end="", flush=True)
        if out.finish is not None:
            elapsed = time.perf_counter() - started
            print(f"\n[{n} tokens, finish: {out.finish.reason.value}, {n / elapsed:.1f} tokens/s]")


def serve(args: argparse.Namespace) -> int:
    config = engine_config(args)
    print(f"loading {config.model_path or 'the embedded default model'} on {config.device} ...", flush=True)
    with Engine(config) as engine:
        print(f"model: {engine.info.model_path} (vocab {engine.info.vocab_size})")
        params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
        asyncio.run(_stream_sample(engine, args.prompt, params))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
