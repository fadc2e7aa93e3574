"""Token sampler: turns one step's logits into one token per request, reproducibly per seed."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.native import token_bitmask_kernel
from engine.sampling_params import SamplingParams

# torch.Generator.manual_seed accepts any 64-bit pattern; masking lets clients send any integer seed.
_SEED_MASK = (1 << 64) - 1
# Dividing by a vanishing temperature would overflow float32; below this the row is as good as greedy.
_MIN_TEMPERATURE = 1e-5
# Exp(1) noise of exactly 0 would turn probs / noise into inf or nan; the smallest normal float avoids it.
_MIN_NOISE = torch.finfo(torch.float32).tiny
_BITS_PER_WORD = 32


def _byte_caps(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: for each byte value, +inf at the bits that are set and -inf at the others (bit 0 first)."""
    if sys.byteorder != "little":  # _caps reads the words' bytes in memory order
        raise RuntimeError("grammar bitmasks are read as little-endian words; this host is big-endian")
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1  # [256, 8]
    return torch.where(bits.bool(), float("inf"), float("-inf")).to(device)  # [256, 8]


@dataclass(frozen=True)
class PenaltyTensors:
    """Device data for repetition/frequency/presence penalties; the counts are updated in place."""

    output_counts: torch.Tensor  # [V] float32: times each token was output
    prompt_mask: torch.Tensor  # [V] bool: token occurs in the prompt


class SamplingState:
    """Per-request sampling state that the runner keeps in the request's slot for its whole life.

    Owns the request's random generator (seeded with ``params.seed`` if set, else ``default_seed``, which
    the runner derives deterministically per request), the number of output tokens so far and, only when
    ``params.needs_penalties``, the penalty data as device tensors: output token counts ``[V]`` and prompt
    token presence ``[V]``. The sampler reads this state; the runner calls :meth:`record` after sampling.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        eos_token_ids: frozenset[int],
        vocab_size: int,
        device: torch.device | str,
        default_seed: int,
    ) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._num_output = 0
        seed = params.seed if params.seed is not None else default_seed
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed & _SEED_MASK)
        # Lowest eos id so that the choice for a row with nothing allowed is deterministic.
        self.fallback_token = min(eos_token_ids) if eos_token_ids else 0
        self.logit_bias = self._bias_tensors(params)
        self.min_new_banned = self._min_new_banned(params, eos_token_ids)
        self.min_new_banned_ids = tuple(self.min_new_banned.tolist()) if self.min_new_banned is not None else ()
        self.penalties: PenaltyTensors | None = None
        # Decided once, read every step: greedy with nothing to apply but (maybe) min_new_tokens, and no logprobs.
        self.plain_greedy = params.greedy and self.logit_bias is None and not params.needs_penalties
        self.wants_logprobs = params.logprobs or params.top_logprobs > 0
        if params.needs_penalties:
            self.penalties = PenaltyTensors(
                output_counts=torch.zeros(vocab_size, dtype=torch.float32, device=self.device),  # [V]
                prompt_mask=self._presence(prompt_ids),  # [V]
            )

    @property
    def num_output(self) -> int:
        return self._num_output

    @property
    def min_new_active(self) -> bool:
        """True while eos and stop token ids must be masked because min_new_tokens is not reached."""
        return self.min_new_active_after(0)

    def min_new_active_after(self, ahead: int) -> bool:
        """:attr:`min_new_active` once ``ahead`` more tokens are output (a draft node's row in a verify)."""
        return self.min_new_banned is not None and self._num_output + ahead < self.params.min_new_tokens

    def min_new_left(self) -> int:
        """How many of the next tokens, the next one first, min_new_tokens still bans :attr:`min_new_banned_ids` for:
        what a draft of this request must not propose at its first that many depths."""
        if self.min_new_banned is None:
            return 0
        return max(0, self.params.min_new_tokens - self._num_output)

    def record(self, token_id: int) -> None:
        """Append one sampled output token (the runner calls this after :meth:`Sampler.sample`)."""
        self._num_output += 1
        if self.penalties is not None:
            self.penalties.output_counts[token_id] += 1

    def _presence(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)  # [V]
        ids = [t for t in prompt_ids if 0 <= t < self.vocab_size]
        if ids:
            mask[torch.tensor(ids, dtype=torch.long, device=self.device)] = True
        return mask

    def _bias_tensors(self, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token ids [N], biases [N]) or None without logit_bias."""
        if not params.logit_bias:
            return None
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=self.device)  # [N]
        values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=self.device)  # [N]
        return ids, values

    def _min_new_banned(self, params: SamplingParams, eos_token_ids: frozenset[int]) -> torch.Tensor | None:
        if params.min_new_tokens <= 0:
            return None
        # eos is banned even with ignore_eos: min_new_tokens promises that many tokens before any end.
        banned = sorted(t for t in eos_token_ids | set(params.stop_token_ids) if 0 <= t < self.vocab_size)
        if not banned:
            return None
        return torch.tensor(banned, dtype=torch.long, device=self.device)  # [K]


@dataclass(frozen=True)
class SampleOutput:
    """One token per row, plus log-probabilities under the raw model distribution when any row asked.

    ``logprobs`` is None when no row asked for logprobs (``logprobs`` or ``top_logprobs > 0``); otherwise
    every row gets its chosen token's value, asked or not. ``top_logprobs`` is None when no row has
    ``top_logprobs > 0``; otherwise one list per row of (token id, logprob), most likely first, with exactly
    that row's ``top_logprobs`` entries (empty for rows that asked for none).
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Picks one token per row from a batch of logits.

    Processing order per row:

    1. logprobs: log_softmax of the RAW logits (before anything below) for the chosen token and the top
       ``top_logprobs`` tokens;
    2. logit_bias is added;
    3. grammar bitmask: disallowed tokens become -inf;
    4. min_new_tokens: while ``num_output < min_new_tokens``, eos ids (even with ignore_eos) and
       stop_token_ids become -inf;
    5. repetition penalty over prompt and output tokens (HF: positive logits divided, negative multiplied),
       then frequency and presence penalties over output tokens (OpenAI: ``logit -= freq*count +
       pres*(count > 0)``);
    6. greedy rows take the largest logit (ties go to the lowest id);
    7. other rows: temperature, top-k, top-p (on the top-k renormalized distribution), min-p (relative to
       the largest remaining probability), then a draw with the row's own generator by the exponential race
       ``argmax(probs / Exp(1) noise)``. Each sampled row draws exactly one ``[vocab_size]`` noise vector
       per step from its own generator, so the same seed gives the same tokens whatever the batch.

    Ids at or above ``vocab_size`` (padded vocab columns) are never chosen. A row whose masks allow nothing
    does not fail: it gets its lowest eos id (token 0 without eos), which the grammar layer treats as a
    rejection. The sampler never calls :meth:`SamplingState.record`; the runner does after sampling.
    A grammar bitmask, when given, covers every row (rows without grammar pass all bits set, i.e. -1).
    """

    def __init__(self, vocab_size: int, device: torch.device | str, *, native: bool = True) -> None:
        """``native``: on CPU, apply grammar bitmasks with the C kernel when it can be built (else, or False: torch)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._byte_caps = _byte_caps(self.device)  # [256, 8]
        self._minus_inf = torch.tensor(float("-inf"), device=self.device)
        self._bitmask_kernel = token_bitmask_kernel() if native and self.device.type == "cpu" else None

    def sample(
        self, logits: torch.Tensor, states: Sequence[SamplingState], bitmask: torch.Tensor | None = None
    ) -> SampleOutput:
        self._check_shapes(logits, states, bitmask)
        if not states:
            return SampleOutput(token_ids=[], logprobs=None, top_logprobs=None)
        raw = logits[:, : self.vocab_size].float()  # [B, V]
        if self._is_trivial(states, bitmask):
            tokens = _argmax(raw)  # [B]
        else:
            processed = self.process_logits(raw, states, bitmask)  # [B, V]
            tokens = self._choose(processed, states)  # [B]
        device_logprobs = self._logprobs(raw, tokens, states)
        # One host sync per step: the tokens and any logprobs come back together.
        host = to_host([tokens, *(t for t in device_logprobs if t is not None)])
        token_ids = host[0]
        logprobs, top = self._host_logprobs(device_logprobs, host[1:], states)
        return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    def _check_shapes(
        self, logits: torch.Tensor, states: Sequence[SamplingState], bitmask: torch.Tensor | None
    ) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(states) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits must be [B={len(states)}, >= {self.vocab_size}], got {tuple(logits.shape)}")
        if bitmask is None:
            return
        words = -(-self.vocab_size // _BITS_PER_WORD)
        if bitmask.dim() != 2 or bitmask.shape[0] != len(states) or bitmask.shape[1] < words:
            raise ValueError(f"bitmask must be [B={len(states)}, >= {words}], got {tuple(bitmask.shape)}")

    @staticmethod
    def _is_trivial(states: Sequence[SamplingState], bitmask: torch.Tensor | None) -> bool:
        """True when one argmax over the raw logits gives every row's token."""
        if bitmask is not None:
            return False
        return all(s.plain_greedy and not s.min_new_active for s in states)

    # ---- logit processing (steps 2-5), all rows at once ----

    def process_logits(
        self,
        raw: torch.Tensor,
        states: Sequence[SamplingState],
        bitmask: torch.Tensor | None = None,
        ahead: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Steps 2-5 (bias, bitmask, min_new_tokens, penalties) on ``raw`` [B, >= V]; returns a new [B, V].

        ``ahead[r]`` (speculative verify): row r is processed as if its request had also output these tokens after
        the ones its state recorded, the draft tokens on the path to the row's node: they count for min_new_tokens
        and for the penalties exactly as recorded tokens would."""
        x = raw[:, : self.vocab_size].float().clone()  # [B, V]; raw may be a view of the runner's logits
        self._apply_bias(x, states)
        if bitmask is not None:
            self.apply_bitmask(x, bitmask)
        self.apply_min_new(x, states, ahead)
        self._apply_penalties(x, states, ahead)
        return x

    def _apply_bias(self, x: torch.Tensor, states: Sequence[SamplingState]) -> None:
        rows = [(r, s.logit_bias) for r, s in enumerate(states) if s.logit_bias is not None]
        if not rows:
            return
        biases = [bias for _, bias in rows if bias is not None]
        row_idx = self._repeat_rows([r for r, _ in rows], [ids.numel() for ids, _ in biases])  # [N]
        ids = torch.cat([ids for ids, _ in biases])  # [N]
        values = torch.cat([values for _, values in biases])  # [N]
        x.index_put_((row_idx, ids), values, accumulate=True)

    def apply_bitmask(self, x: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Disallowed tokens of ``x`` [B, V] become -inf, the others stay as they are (for any logits but NaN).

        On CPU one native call does it, without the GIL: about 30 us for 32 rows of 2048 tokens against 90 us for the
        torch path alone. Elsewhere the words become a [B, V] table of caps, the smaller of which is kept: several
        ops, each one a GIL handoff too while a grammar's commit runs beside the step.
        """
        if self._bitmask_kernel is not None and bitmask.device.type == "cpu":
            self._bitmask_kernel(x, bitmask.to(torch.int32).contiguous(), self.vocab_size)
        else:
            torch.minimum(x, self._caps(bitmask), out=x)

    def _caps(self, bitmask: torch.Tensor) -> torch.Tensor:
        """xgrammar layout -> per-token cap [B, V]: +inf where allowed (bit j of word i set <=> token 32i + j), -inf
        where not. One table lookup per byte of the words instead of unpacking 32 bits per word with shifts."""
        words = bitmask.to(device=self.device, dtype=torch.int32).contiguous()  # [B, W]
        # Viewed as bytes, word i of a little-endian host is bytes 4i..4i+3, lowest bits first: byte k holds tokens
        # 8k..8k+7, so the table's row for its value is exactly its 8 tokens' caps.
        octets = words.view(torch.uint8).int()  # [B, 4W]
        caps = torch.nn.functional.embedding(octets, self._byte_caps)  # [B, 4W, 8]
        return caps.reshape(words.shape[0], -1)[:, : self.vocab_size]  # [B, V]

    def apply_min_new(
        self, x: torch.Tensor, states: Sequence[SamplingState], ahead: Sequence[Sequence[int]] | None
    ) -> None:
        """Step 4 on ``x`` [B, V] in place: -inf at eos and stop ids in the rows whose request is short of its
        min_new_tokens (``ahead[r]``: row r's tokens past the request's outputs). Also what a draft bans."""
        rows = [(r, s.min_new_banned) for r, s in enumerate(states) if s.min_new_active_after(_count(ahead, r))]
        if not rows:
            return
        banned = [ids for _, ids in rows if ids is not None]
        row_idx = self._repeat_rows([r for r, _ in rows], [ids.numel() for ids in banned])  # [K]
        x.index_put_((row_idx, torch.cat(banned)), self._minus_inf)

    def _apply_penalties(
        self, x: torch.Tensor, states: Sequence[SamplingState], ahead: Sequence[Sequence[int]] | None
    ) -> None:
        rows = [r for r, s in enumerate(states) if s.penalties is not None]
        if not rows:
            return
        picked = [states[r] for r in rows]
        tensors = [s.penalties for s in picked if s.penalties is not None]
        counts = torch.stack([t.output_counts for t in tensors])  # [P, V]
        if ahead is not None:
            counts = counts + self._counts_ahead([ahead[r] for r in rows])  # [P, V]
        prompt = torch.stack([t.prompt_mask for t in tensors])  # [P, V]
        rep = self._column([s.params.repetition_penalty for s in picked])  # [P, 1]
        freq = self._column([s.params.frequency_penalty for s in picked])  # [P, 1]
        pres = self._column([s.params.presence_penalty for s in picked])  # [P, 1]
        row_idx = to_device(rows, torch.long, self.device)  # [P]
        sel = x[row_idx]  # [P, V]
        output_seen = counts > 0  # [P, V]
        penalized = torch.where(sel > 0, sel / rep, sel * rep)  # [P, V]
        sel = torch.where(prompt | output_seen, penalized, sel)  # [P, V]
        sel = sel - freq * counts - pres * output_seen.float()  # [P, V]
        x[row_idx] = sel

    def _counts_ahead(self, ahead: Sequence[Sequence[int]]) -> torch.Tensor:
        """[P, V] how often each token occurs in each row's ``ahead`` tokens."""
        counts = torch.zeros(len(ahead), self.vocab_size, dtype=torch.float32, device=self.device)  # [P, V]
        row_idx = self._repeat_rows(list(range(len(ahead))), [len(a) for a in ahead])  # [N]
        if row_idx.numel():
            ids = to_device([t for a in ahead for t in a], torch.long, self.device)  # [N]
            counts.index_put_((row_idx, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        return counts

    # ---- token choice (steps 6-7) ----

    def _choose(self, x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        tokens = _argmax(x)  # [B]
        sampled = [r for r, s in enumerate(states) if not s.params.greedy]
        if sampled:
            idx = to_device(sampled, torch.long, self.device)  # [S]
            tokens[idx] = self._draw(x[idx], [states[r] for r in sampled])
        # A row with every logit at -inf has no valid choice (its argmax / draw is meaningless).
        dead = x.amax(dim=-1) == float("-inf")  # [B]
        fallback = to_device([s.fallback_token for s in states], torch.long, self.device)  # [B]
        return torch.where(dead, fallback, tokens)  # [B]

    def _draw(self, x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Sample one token per row of ``x`` [S, V] with each row's own generator."""
        probs = self.probabilities(x, states)  # [S, V]
        noise = torch.stack([self.noise(s.generator) for s in states])  # [S, V]
        return race(probs, noise)  # [S]

    def probabilities(self, x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Step 7 but the draw: processed logits ``x`` [S, V] of sampled rows -> the (unnormalised) distribution each
        row's token is drawn from, after temperature, top-k, top-p and min-p [S, V]."""
        temps = self._column([max(s.params.temperature, _MIN_TEMPERATURE) for s in states])  # [S, 1]
        probs = torch.softmax(x / temps, dim=-1)  # [S, V]
        probs = self._top_k_top_p(probs, states)  # [S, V]
        return self._min_p(probs, states)  # [S, V]

    def noise(self, generator: torch.Generator) -> torch.Tensor:
        """One draw's Exp(1) noise [V] from a request's generator: each sampled token consumes exactly one."""
        noise = torch.empty(self.vocab_size, dtype=torch.float32, device=self.device)  # [V]
        return noise.exponential_(generator=generator).clamp_min_(_MIN_NOISE)  # [V]

    def _top_k_top_p(self, probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        top_k = [s.params.top_k if 0 < s.params.top_k < self.vocab_size else self.vocab_size for s in states]
        top_p = [s.params.top_p for s in states]
        if all(k == self.vocab_size for k in top_k) and all(p >= 1.0 for p in top_p):
            return probs
        # Stable sort: among equal probabilities the lowest id ranks first, as with argmax.
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [S, V]
        ranks = torch.arange(self.vocab_size, device=self.device).unsqueeze(0)  # [1, V]
        k = to_device(top_k, torch.long, self.device).unsqueeze(1)  # [S, 1]
        drop = ranks >= k  # [S, V]
        kept = sorted_probs.masked_fill(drop, 0.0)  # [S, V]
        cum = kept.cumsum(dim=-1)  # [S, V]
        p = self._column(top_p)  # [S, 1]
        # Keep a token while the mass strictly before it is within top_p of the top-k mass (rank 0 stays).
        over = (cum - kept) > p * cum[:, -1:]  # [S, V]
        drop |= over & (p < 1.0)  # [S, V]
        unsorted_drop = torch.zeros_like(drop).scatter_(1, order, drop)  # [S, V]
        return probs.masked_fill(unsorted_drop, 0.0)  # [S, V]

    def _min_p(self, probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        min_p = [s.params.min_p for s in states]
        if all(m <= 0.0 for m in min_p):
            return probs
        threshold = self._column(min_p) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
        return probs.masked_fill(probs < threshold, 0.0)  # [S, V]

    # ---- logprobs (step 1) ----

    def _logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, states: Sequence[SamplingState]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """On the device: the chosen tokens' logprobs [B] and the top ``max top_logprobs`` values and ids [B, k]
        (None where no row asked)."""
        if not any(s.wants_logprobs for s in states):
            return None, None, None
        lp = torch.log_softmax(raw, dim=-1)  # [B, V]
        chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]
        k_max = max(s.params.top_logprobs for s in states)
        if k_max == 0:
            return chosen, None, None
        values, ids = lp.topk(min(k_max, self.vocab_size), dim=-1)  # [B, k_max], sorted descending
        return chosen, values, ids

    @staticmethod
    def _host_logprobs(
        on_device: tuple[torch.Tensor | None, ...], host: list[list[Any]], states: Sequence[SamplingState]
    ) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
        """What :meth:`_logprobs` computed, as host lists (``host``: its non-None tensors, in order)."""
        if on_device[0] is None:
            return None, None
        chosen = host[0]
        if on_device[1] is None:
            return chosen, None
        value_rows, id_rows = host[1], host[2]
        top = [list(zip(id_rows[r], value_rows[r], strict=True))[: s.params.top_logprobs] for r, s in enumerate(states)]
        return chosen, top

    # ---- helpers ----

    def _column(self, values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, self.device).unsqueeze(1)  # [N, 1]

    def _repeat_rows(self, rows: list[int], counts: list[int]) -> torch.Tensor:
        """Row index of every (row, token) pair when row r contributes counts[r] tokens."""
        row_t = to_device(rows, torch.long, self.device)  # [R]
        count_t = to_device(counts, torch.long, self.device)  # [R]
        # output_size: with it known on the host, repeat_interleave need not read the counts back from the device.
        return torch.repeat_interleave(row_t, count_t, output_size=sum(counts))  # [sum(counts)]


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step host list as a device tensor. On CUDA through pinned memory without blocking: a copy from
    pageable memory would first wait for everything queued on the stream (the forward), a host sync per call."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def to_host(tensors: Sequence[torch.Tensor]) -> list[list[Any]]:
    """Each tensor as (nested) host lists, with one wait for the device: on CUDA the copies go into pinned host
    buffers without blocking, then the stream is synchronised once, instead of one blocking copy per tensor."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, tensor in zip(pinned, tensors, strict=True):
        host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [host.tolist() for host in pinned]


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: ``argmax(p / E)`` with E ~ Exp(1) picks token i with probability p_i / sum(p), no
    renormalisation needed."""
    return torch.argmax(probs / noise, dim=-1)


def _count(ahead: Sequence[Sequence[int]] | None, row: int) -> int:
    return len(ahead[row]) if ahead is not None else 0


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B]: the index of each row's largest value, the lowest one on ties. ``max(dim).indices`` has the
    same semantics as ``argmax`` (the first maximal index) and is about three times faster on CPU (136 against 400
    us for 128 rows of 2048 on one thread here), where greedy sampling is on every decode step's path."""
    return x.max(dim=-1).indices  # [B]
