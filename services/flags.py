"""The engine flags every service takes, spelled the same way in each process (``ordinal serve`` passes them on).

``add_engine_args`` / ``engine_config`` build and read them; ``engine_argv`` turns parsed flags back into a command
line for a child service. Nothing here imports the engine at module level: the engine imports torch (seconds), and
a subcommand that only parses flags should not pay for it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import AttentionBackendKind, CudaGraphConfig, EngineConfig, SpeculativeConfig

DEFAULT_PORT = 30000
DEFAULT_EXECUTOR_PORT = 30001
DEFAULT_GRAMMAR_PORT = 30002
DEFAULT_GATEWAY_PORT = 8000
DEFAULT_METRICS_PORT = 29000
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # logging's names; lower case is accepted too
JSON_SCHEMA_MODES = ("strict", "checked", "loose")  # engine.constraint.JsonSchemaMode's values (no engine import)
DEFAULT_JSON_SCHEMA_MODE = "checked"
# engine.grammar.IntegerRange's values, the default first (no engine import; a test holds them equal)
JSON_INTEGER_RANGES = ("safe", "unbounded")
# engine.grammar.json_schema_compiler.DEFAULT_JSON_MAX_WHITESPACE (no engine import; a test holds them equal)
DEFAULT_JSON_WHITESPACE = 8
UNBOUNDED_WHITESPACE = "unbounded"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags of every process that builds an engine (serve, generate, executor, scheduler)."""
    add_model_args(parser)
    add_engine_tuning_args(parser)
    obs = parser.add_argument_group("observability")
    obs.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port at /metrics (0 = off)"
    )
    obs.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="logging verbosity")


def add_json_schema_args(parser: argparse.ArgumentParser) -> None:
    """``--json-schema`` (and its older spelling ``--loose-json-schema``): how the grammar reads JSON schemas."""
    group = parser.add_argument_group("JSON schemas")
    group.add_argument(
        "--json-schema",
        choices=JSON_SCHEMA_MODES,
        default=None,
        help=f"how JSON schemas are served when a request does not say (default: {DEFAULT_JSON_SCHEMA_MODE}). "
        "strict: only schemas the grammar enforces exactly, others refused naming keyword and place; checked: every "
        "schema xgrammar compiles, the keywords it cannot enforce checked on the output (a violation aborts the "
        "request, naming keyword, place and value); loose: as given, some keywords enforced loosely (SGLang's way)",
    )
    group.add_argument("--loose-json-schema", action="store_true", help="the same as --json-schema loose")
    group.add_argument(
        "--json-integer-range",
        choices=JSON_INTEGER_RANGES,
        default=JSON_INTEGER_RANGES[0],
        help="what an integer a JSON schema leaves unbounded may be (default: safe). safe: within +-(2^53 - 1), "
        "exact for every client that reads JSON numbers as doubles (JavaScript; the smg gateway beyond 64 bits, in "
        "tool-call arguments); unbounded: any number of digits, as the schema is written. Explicit bounds and listed "
        "values are kept as written either way",
    )
    group.add_argument(
        "--json-whitespace",
        type=parse_json_whitespace,
        default=DEFAULT_JSON_WHITESPACE,
        metavar="N|unbounded",
        help=f"whitespace characters a JSON grammar (json_schema, json_object, tool calls) allows in a row between "
        f"tokens (default: {DEFAULT_JSON_WHITESPACE}); {UNBOUNDED_WHITESPACE!r} lets any amount through, xgrammar's "
        "own default, which a model unsure of the next token can fill with newlines until max_tokens",
    )


def parse_json_whitespace(text: str) -> int | None:
    """The value of ``--json-whitespace``: a number of characters >= 1, or None for ``unbounded``."""
    if text == UNBOUNDED_WHITESPACE:
        return None
    value = int(text) if text.isdecimal() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a number of whitespace characters >= 1, or {UNBOUNDED_WHITESPACE!r}"
        )
    return value


def parse_cpus(text: str) -> frozenset[int]:
    """A set of CPU cores as ``taskset -c`` spells it: ``1``, ``1,3``, ``2-5``, ``0,2-3``."""
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        last = last if dash else first
        if not first.isdecimal() or not last.isdecimal() or int(first) > int(last):
            raise argparse.ArgumentTypeError(f"{text!r}: expected cores as taskset -c spells them, e.g. 1 or 0,2-3")
        cores.update(range(int(first), int(last) + 1))
    return frozenset(cores)


def cpus_text(cores: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def json_schema_argv(args: argparse.Namespace) -> list[str]:
    """The JSON-schema flags of ``args`` spelled back for a grammar service (the mode resolved)."""
    whitespace = UNBOUNDED_WHITESPACE if args.json_whitespace is None else str(args.json_whitespace)
    return [
        "--json-schema",
        json_schema_mode(args),
        "--json-integer-range",
        args.json_integer_range,
        "--json-whitespace",
        whitespace,
    ]


def json_schema_mode(args: argparse.Namespace) -> str:
    """The mode ``--json-schema`` / ``--loose-json-schema`` chose (a value of engine.grammar.JsonSchemaMode)."""
    if args.loose_json_schema:
        if args.json_schema not in (None, "loose"):
            raise SystemExit(f"--loose-json-schema contradicts --json-schema {args.json_schema}")
        return "loose"
    return str(args.json_schema or DEFAULT_JSON_SCHEMA_MODE)


def _engine_defaults() -> EngineConfig:
    from engine.config import EngineConfig

    return EngineConfig()


def add_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    defaults = _engine_defaults()
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="HF checkpoint folder (config.json, *.safetensors, tokenizer.json, tokenizer_config.json); "
        "default: the embedded tiny model, built locally on first use",
    )
    group.add_argument("--device", default=defaults.device, help="cpu, cuda or cuda:N")
    group.add_argument(
        "--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"], help="weights and KV cache dtype"
    )
    return group


def add_engine_tuning_args(parser: argparse.ArgumentParser) -> None:
    defaults = _engine_defaults()
    kv = parser.add_argument_group("KV cache (executor and scheduler must agree)")
    kv.add_argument("--page-size", type=int, default=defaults.page_size, help="tokens per KV page")
    kv.add_argument("--num-pages", type=int, default=defaults.num_pages, help="KV pages in the pool")
    kv.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    sched = parser.add_argument_group("scheduling")
    sched.add_argument("--max-running", type=int, default=defaults.max_running, help="requests admitted at once")
    sched.add_argument("--chunk-size", type=int, default=defaults.chunk_size, help="max prefill tokens per step")
    sched.add_argument("--no-overlap", action="store_true", help="commit step N before launching N+1")
    add_switch(
        sched,
        "--grammar-overlap",
        defaults.grammar_overlap,
        "on: constrained requests stay overlapped (the executor waits for each step's fenced grammar masks "
        "while the forward runs); off: the scheduler commits before launching a constrained step and the executor "
        "never waits (executor and scheduler must agree)",
    )
    sched.add_argument(
        "--outage-timeout",
        type=float,
        default=defaults.outage_timeout_s,
        metavar="SECONDS",
        help="how long a request waits for a lost executor or grammar service to come back (queued requests for the "
        "executor, new constrained ones for the grammar service) before it fails with UNAVAILABLE",
    )
    add_speculative_args(parser)
    add_kernel_args(parser)


ATTENTION_BACKENDS = ("auto", "torch", "flex")  # engine.config.AttentionBackendKind's values (no engine import)


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    """How the executor runs its forward on a GPU: attention kernels and decode CUDA graphs."""
    defaults = _engine_defaults().cuda_graph
    group = parser.add_argument_group("executor kernels")
    group.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="torch: the reference (native CPU decode kernel, SDPA over gathered pages elsewhere); flex: "
        "FlexAttention with paged block masks, reading the KV pages in place (Triton on CUDA); auto: flex on CUDA, "
        "torch elsewhere",
    )
    group.add_argument(
        "--no-cuda-graph", action="store_true", help="run decode steps eagerly on CUDA (graphs exist only on CUDA)"
    )
    group.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        metavar="N",
        help="the executor's torch CPU threads; 0: on a CPU device every core this process may use but one (the "
        "scheduler, the gateway and the grammar service need a core: threads that spin for one starve them), "
        "torch's default on CUDA",
    )
    group.add_argument(
        "--executor-cpus",
        type=parse_cpus,
        default=None,
        metavar="CORES",
        help="pin the executor to these cores (as taskset -c spells them); ordinal serve runs the other services on "
        "the rest of its own. On a small CPU host the forward is the critical path and a woken scheduler, gateway or "
        "gRPC thread on its core preempts it (default: no pinning)",
    )
    group.add_argument(
        "--grammar-mask-relay",
        choices=("auto", "on", "off"),
        default="auto",
        help="the executor's mask exchange with the grammar service run by a helper process (services/mask_relay.py)"
        ", so that gRPC's threads stay off the forward's core; auto: on for a CPU executor pinned to fewer cores than"
        " the process that started it, the relay then on that process's others",
    )
    group.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=defaults.batch_sizes[-1],
        help="the largest decode batch (query rows) captured in a CUDA graph; larger steps run eagerly",
    )


def kernel_config(args: argparse.Namespace) -> tuple[AttentionBackendKind, CudaGraphConfig]:
    from engine.config import AttentionBackendKind, CudaGraphConfig

    try:
        graphs = CudaGraphConfig.up_to(args.cuda_graph_max_bs, enabled=not args.no_cuda_graph)
    except ValueError as error:
        raise SystemExit(f"ordinal: --cuda-graph-max-bs: {error}") from error
    return AttentionBackendKind(args.attention_backend), graphs


def add_switch(group: argparse._ArgumentGroup, flag: str, default: bool, text: str) -> None:
    """An ``on|off`` flag (parsed as the string; compare with "on") defaulting to ``default``."""
    group.add_argument(flag, choices=["on", "off"], default="on" if default else "off", help=text)


SPEC_ALGORITHMS = ("draft", "ngram")  # engine.config.SpecAlgorithm's values but none (no engine import)
# SGLang's spellings: its names are upper case, and its draft-model algorithm is STANDALONE.
_SPEC_ALIASES = {"standalone": "draft"}
_SPEC_NOT_BUILT = ("eagle", "eagle3", "nextn", "medusa", "lookahead")


def spec_algorithm(text: str) -> str:
    """``--speculative-algorithm``'s value: ``draft`` or ``ngram``, in any case, SGLang's ``STANDALONE`` for
    ``draft``; EAGLE-style heads (which read the target's hidden states) are refused by name."""
    name = _SPEC_ALIASES.get(text.lower(), text.lower())
    if name in SPEC_ALGORITHMS:
        return name
    if name in _SPEC_NOT_BUILT:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not available: ordinal drafts with a separate draft model (draft, SGLang's STANDALONE) or "
            "n-gram prompt lookup (ngram); heads that read the target's hidden states (EAGLE, NEXTN) are not built"
        )
    raise argparse.ArgumentTypeError(f"{text!r} is not one of draft, ngram (or SGLang's STANDALONE, NGRAM)")


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """SGLang's speculative-decoding flags (executor and scheduler must agree)."""
    defaults = _engine_defaults().speculative
    spec = parser.add_argument_group("speculative decoding (executor and scheduler must agree)")
    spec.add_argument(
        "--speculative-algorithm",
        type=spec_algorithm,
        metavar="{draft,ngram}",
        default=None,
        help="draft: a smaller model sharing the tokenizer drafts tokens; ngram: prompt lookup (what followed the "
        "longest matching suffix earlier in the request); default: off",
    )
    spec.add_argument(
        "--speculative-draft-model-path",
        default=None,
        metavar="PATH",
        help="the draft checkpoint (default: the embedded draft, when serving the embedded model)",
    )
    spec.add_argument(
        "--speculative-num-steps",
        type=int,
        default=0,
        help="draft depth: tokens drafted per step at most (default 0: the algorithm's, 6 for draft, 4 for ngram)",
    )
    spec.add_argument(
        "--speculative-eagle-topk",
        type=int,
        default=defaults.topk,
        help="tree branching: candidates per draft node (1: a chain)",
    )
    spec.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="tokens verified per request and step, the pending one included (default: num_steps + 1 for a chain, "
        "num_steps * topk + 1 for a tree)",
    )
    add_switch(
        spec,
        "--speculative-adaptive",
        defaults.adaptive,
        "on: turn speculation down per request and per batch when it does not pay; off: always draft",
    )
    add_switch(
        spec,
        "--speculative-draft-grammar",
        defaults.draft_grammar,
        "on: the draft model drafts each constrained request under its grammar (a grammar mask per draft depth: "
        "fewer wasted drafts, one grammar round trip per depth, and with --grammar-overlap on the first depth waits "
        "for the previous step's commit); off: it drafts unmasked and only the verify is masked. The output is the "
        "same either way. Needs --speculative-algorithm draft",
    )
    spec.add_argument(
        "--speculative-draft-min-prob",
        type=float,
        default=defaults.draft_min_prob,
        help="a draft model's draft ends after its first token it gives less than this probability (Hugging Face's "
        "assistant_confidence_threshold): fewer verify rows for tokens that would be rejected, so deeper drafts pay; "
        "0 drafts to the full depth. In [0, 1); the output is the same either way",
    )
    spec.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=defaults.disable_by_batch_size,
        metavar="N",
        help="a step with more than N decoding requests decodes plainly (vLLM's flag), whatever the adaptive rule "
        "would choose and without its exploring; default 0: never",
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    from engine.config import SpecAlgorithm, SpeculativeConfig

    algorithm = SpecAlgorithm(args.speculative_algorithm) if args.speculative_algorithm else SpecAlgorithm.NONE
    try:
        return SpeculativeConfig(
            algorithm=algorithm,
            draft_model_path=args.speculative_draft_model_path,
            num_steps=args.speculative_num_steps,
            topk=args.speculative_eagle_topk,
            num_draft_tokens=args.speculative_num_draft_tokens or 0,
            adaptive=args.speculative_adaptive == "on",
            draft_grammar=args.speculative_draft_grammar == "on",
            draft_min_prob=args.speculative_draft_min_prob,
            disable_by_batch_size=args.speculative_disable_by_batch_size,
        )
    except ValueError as error:
        raise SystemExit(f"ordinal: {error}") from error


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from engine.config import EngineConfig

    attention, graphs = kernel_config(args)
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
        grammar_overlap=args.grammar_overlap == "on",
        speculative=speculative_config(args),
        outage_timeout_s=args.outage_timeout,
        attention_backend=attention,
        cuda_graph=graphs,
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` spelled back as a command line (``--model`` and observability excluded)."""
    argv = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--page-size",
        str(args.page_size),
        "--num-pages",
        str(args.num_pages),
        "--max-running",
        str(args.max_running),
        "--chunk-size",
        str(args.chunk_size),
        "--grammar-overlap",
        args.grammar_overlap,
        "--outage-timeout",
        str(args.outage_timeout),
        "--attention-backend",
        args.attention_backend,
        "--cuda-graph-max-bs",
        str(args.cuda_graph_max_bs),
        "--cpu-threads",
        str(args.cpu_threads),
        "--grammar-mask-relay",
        args.grammar_mask_relay,
    ]
    if args.executor_cpus is not None:
        argv += ["--executor-cpus", cpus_text(args.executor_cpus)]
    if args.speculative_algorithm:
        argv += ["--speculative-algorithm", args.speculative_algorithm]
        argv += ["--speculative-num-steps", str(args.speculative_num_steps)]
        argv += ["--speculative-eagle-topk", str(args.speculative_eagle_topk)]
        argv += ["--speculative-adaptive", args.speculative_adaptive]
        argv += ["--speculative-draft-grammar", args.speculative_draft_grammar]
        argv += ["--speculative-draft-min-prob", str(args.speculative_draft_min_prob)]
        argv += ["--speculative-disable-by-batch-size", str(args.speculative_disable_by_batch_size)]
        if args.speculative_draft_model_path:
            argv += ["--speculative-draft-model-path", args.speculative_draft_model_path]
        if args.speculative_num_draft_tokens:
            argv += ["--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens)]
    if args.no_overlap:
        argv.append("--no-overlap")
    if args.no_prefix_cache:
        argv.append("--no-prefix-cache")
    if args.no_cuda_graph:
        argv.append("--no-cuda-graph")
    return argv


def model_folder(model: str | None) -> Path:
    """The model folder every process gets explicitly: built once here so the children find it cached."""
    if model is not None:
        path = Path(model).expanduser().resolve()
        if not path.is_dir():
            raise SystemExit(f"ordinal: --model {model}: no such folder")
        return path
    from engine.model.embedded import ensure_embedded_model

    print("ordinal: preparing the embedded default model (built once, then cached) ...", file=sys.stderr, flush=True)
    return ensure_embedded_model()
