"""Engine configuration: one frozen value passed explicitly to every part that needs it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class AttentionBackendKind(enum.Enum):
    """The executor's attention kernels (``--attention-backend``; engine/model/attention_backend.py)."""

    AUTO = "auto"  # flex on CUDA, torch elsewhere
    TORCH = "torch"  # the reference: native CPU decode kernel, SDPA over gathered pages
    FLEX = "flex"  # FlexAttention with paged block masks (Triton on CUDA)


# The decode batch sizes a CUDA graph is captured for (a batch is padded up to the next one), SGLang's spacing.
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class CudaGraphConfig:
    """CUDA graphs for decode steps (``--no-cuda-graph`` turns them off; they exist only on CUDA).

    A step whose every query is a decode query (single tokens and short verify chains: engine/model/graphs.py) is
    padded to the smallest of ``batch_sizes`` that holds its query rows and replayed from the graph captured for
    that size; larger steps, prefill chunks and draft trees run eagerly."""

    enabled: bool = True
    batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or any(b < 1 for b in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"CUDA graph batch sizes must be distinct, ascending and >= 1, got {sizes}")

    @classmethod
    def up_to(cls, max_batch: int, enabled: bool = True) -> CudaGraphConfig:
        """The default sizes up to ``max_batch`` (included as the last size)."""
        if max_batch < 1:
            raise ValueError(f"CUDA graph max batch size must be >= 1, got {max_batch}")
        sizes = (*(b for b in DEFAULT_GRAPH_BATCH_SIZES if b < max_batch), max_batch)
        return cls(enabled, sizes)


class SpecAlgorithm(enum.Enum):
    """Where speculative drafts come from (SGLang's ``--speculative-algorithm`` names)."""

    NONE = "none"
    DRAFT = "draft"  # a separate, smaller model sharing the target's tokenizer
    NGRAM = "ngram"  # prompt lookup: what followed the longest matching suffix earlier in the request


# The draft depth where --speculative-num-steps is not given. A draft model drafts deeper than n-gram lookup: its
# chains end where it is unsure (draft_min_prob), so the deep positions are drafted only where they tend to be
# accepted (the embedded draft at one stream, side by side in the services: depth 6 with a bar of 0.5-0.7 read
# 1.9x-2.0x plain against depth 4's 1.6x-1.9x with none on the repeating prompts, 2.8x-3.0x against 2.6x-2.7x on the
# fresh ones; docs/speculative.md).
DEFAULT_NUM_STEPS = {SpecAlgorithm.DRAFT: 6, SpecAlgorithm.NGRAM: 4}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in SGLang's vocabulary.

    Each decode step verifies ``num_draft_tokens`` tokens per request: its pending token and up to
    ``num_draft_tokens - 1`` draft nodes, in a tree at most ``num_steps`` deep with at most ``topk`` children per
    node (``topk`` 1: a chain); ``num_steps`` 0 takes the algorithm's default, 6 for a draft model (whose drafts end
    early where it is unsure, ``draft_min_prob``) and 4 for n-gram lookup. ``draft_model_path`` (algorithm DRAFT): the
    draft checkpoint; None with the
    embedded target serves the embedded draft. ``adaptive``: the scheduler turns speculation down per request and
    per batch when it does not pay (engine/scheduler/spec_policy.py). ``draft_grammar`` (algorithm DRAFT): the draft
    model drafts each constrained request under its grammar, a fenced mask per draft depth (one grammar round trip
    per depth, and in delayed-verify mode the first depth waits at the fence for the previous step's commit); off,
    it drafts unmasked and only the verify is masked. Either way the output is the same (the verify is lossless).
    ``draft_min_prob`` (algorithm DRAFT): a draft model's draft ends after its first spine token it gives less than
    this probability (Hugging Face's ``assistant_confidence_threshold``): past a token the draft is unsure of, its
    next ones are rarely accepted and each costs a verify row, which is what lets a deeper draft pay (the embedded
    draft at one stream: docs/speculative.md); 0 drafts every request to its depth. ``disable_by_batch_size`` (vLLM's
    ``--speculative-disable-by-batch-size``): a step with more decoding requests than this decodes plainly, whatever
    the adaptive rule would choose (0: never); for an operator who knows where speculation stops paying on a machine,
    with none of the rule's exploring above it."""

    algorithm: SpecAlgorithm = SpecAlgorithm.NONE
    draft_model_path: str | None = None
    num_steps: int = 0  # 0: the algorithm's (DEFAULT_NUM_STEPS)
    topk: int = 1
    num_draft_tokens: int = 0  # 0: num_steps + 1 for a chain, num_steps * topk + 1 for a tree (capped below)
    adaptive: bool = True
    draft_grammar: bool = False
    draft_min_prob: float = 0.6
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.num_steps == 0:
            object.__setattr__(self, "num_steps", DEFAULT_NUM_STEPS.get(self.algorithm, 4))
        for name in ("num_steps", "topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"speculative {name} must be >= 1, got {getattr(self, name)}")
        if self.num_draft_tokens == 1 or self.num_draft_tokens < 0:
            raise ValueError(
                f"speculative num_draft_tokens must be >= 2 (the pending token and at least one draft), got "
                f"{self.num_draft_tokens}"
            )
        if self.disable_by_batch_size < 0:
            raise ValueError(
                f"speculative disable_by_batch_size must be >= 0 (0: never), got {self.disable_by_batch_size}"
            )
        if not 0.0 <= self.draft_min_prob < 1.0:
            raise ValueError(f"speculative draft_min_prob must be in [0, 1), got {self.draft_min_prob}")
        if self.draft_grammar and self.algorithm is not SpecAlgorithm.DRAFT:
            raise ValueError(
                "speculative draft_grammar (--speculative-draft-grammar on) needs the draft-model proposer "
                f"(--speculative-algorithm draft), got {self.algorithm.value}: n-gram drafts are lookups, and the "
                "verify masks them in any case"
            )

    @property
    def enabled(self) -> bool:
        return self.algorithm is not SpecAlgorithm.NONE

    @property
    def draft_nodes(self) -> int:
        """Draft positions a decode entry carries at most (0 when speculation is off)."""
        if not self.enabled:
            return 0
        if self.num_draft_tokens:
            return self.num_draft_tokens - 1
        return self.num_steps * self.topk if self.topk > 1 else self.num_steps


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs.

    ``model_path`` None serves the embedded default model. ``chunk_size`` is the most prompt tokens one step
    prefills (longer prompts are split into chunks of at most this many tokens); decodes ride along in the
    same step. ``max_running`` is the number of request slots (requests admitted at once).
    ``overlap`` plans and launches step N+1 before committing step N. With ``grammar_overlap`` (the default)
    constrained requests stay overlapped: the executor delays only their sampling until the mask fenced at their
    ordinal exists (waiting up to ``grammar_wait_s``). Without it the scheduler commits step N before launching a
    step with constrained entries (early commit) and the executor does not wait for masks at all.
    ``speculative``: speculative decoding (off by default): each decode entry carries up to
    ``speculative.draft_nodes`` draft positions, which the executor fills with its proposer's drafts; it returns
    the accepted ones with the token sampled after them.
    ``check_invariants`` (for tests) has the loop check the scheduler's KV accounting and the prefix cache's
    invariants after every scheduler event; a violation stops the loop loudly.
    ``outage_timeout_s``: how long a request waits for a lost executor or grammar service to come back (queued
    requests for the executor, new constrained requests for the grammar service) before it ends UNAVAILABLE.
    ``attention_backend`` and ``cuda_graph``: the executor's attention kernels and decode CUDA graphs (CUDA only).
    """

    model_path: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int = 4096
    max_running: int = 128
    chunk_size: int = 512
    overlap: bool = True
    prefix_cache: bool = True
    seed: int = 0
    cache_dir: str | None = None
    grammar_overlap: bool = True
    grammar_wait_s: float = 5.0
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    check_invariants: bool = False
    outage_timeout_s: float = 30.0
    attention_backend: AttentionBackendKind = AttentionBackendKind.AUTO
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("page_size", "num_pages", "max_running", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.outage_timeout_s < 0:
            raise ValueError(f"outage_timeout_s must be >= 0, got {self.outage_timeout_s}")

    @property
    def mask_wait_s(self) -> float:
        """How long the executor waits at the grammar fence: not at all when the scheduler commits early."""
        return self.grammar_wait_s if self.grammar_overlap else 0.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
