"""Proto <-> engine values for the executor protocol, both directions, used by the executor and its client.

Every field of the step values round-trips exactly, with two deliberate exceptions: stop strings (and
``no_stop_trim``) are matched by the scheduler on text and do not travel, and seeds travel as 64-bit
patterns (the sampler uses only a seed's low 64 bits, so a seed outside the signed 64-bit range comes back
as the equal-in-effect value inside it). Proto3 defaults are not semantic defaults: fields whose "unset"
differs from zero (seed, logprobs, top logprobs, the new-request part of an entry, a run's error) use presence.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from engine.errors import ProtocolError
from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams
from engine.step import NewRequest, SampledRun, StepEntry, StepPlan, StepResult, StepTiming
from protos import executor_pb2 as pb

# Sent as initial metadata when a session is accepted, so that a client can tell "accepted" from "refused".
SESSION_METADATA_KEY = "ordinal-executor-instance"

_U64 = 1 << 64
_I64_MIN = -(1 << 63)


def wrap_int64(value: int) -> int:
    """The signed 64-bit integer with the same low 64 bits as ``value``."""
    return (value - _I64_MIN) % _U64 + _I64_MIN


# ---------------------------------------------------------------- model info


def model_info_to_proto(info: ModelInfo, instance_id: str) -> pb.ModelInfo:
    msg = pb.ModelInfo(
        model_path=info.model_path,
        vocab_size=info.vocab_size,
        max_context=info.max_context,
        eos_token_ids=sorted(info.eos_token_ids),
        page_size=info.page_size,
        num_pages=info.num_pages,
        instance_id=instance_id,
    )
    if info.bos_token_id is not None:
        msg.bos_token_id = info.bos_token_id
    if info.pad_token_id is not None:
        msg.pad_token_id = info.pad_token_id
    return msg


def model_info_from_proto(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_path=msg.model_path,
        vocab_size=msg.vocab_size,
        max_context=msg.max_context,
        eos_token_ids=frozenset(msg.eos_token_ids),
        bos_token_id=msg.bos_token_id if msg.HasField("bos_token_id") else None,
        pad_token_id=msg.pad_token_id if msg.HasField("pad_token_id") else None,
        page_size=msg.page_size,
        num_pages=msg.num_pages,
    )


# ---------------------------------------------------------------- sampling params


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=params.min_new_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=[pb.LogitBias(token_id=t, bias=b) for t, b in params.logit_bias],
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
    )
    if params.seed is not None:
        msg.seed = wrap_int64(params.seed)
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """The executor's view of the params: everything but the scheduler-only stop strings."""
    return SamplingParams(
        max_new_tokens=msg.max_new_tokens,
        min_new_tokens=msg.min_new_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        min_p=msg.min_p,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        repetition_penalty=msg.repetition_penalty,
        logit_bias=tuple((b.token_id, b.bias) for b in msg.logit_bias),
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
    )


# ---------------------------------------------------------------- step plans


def new_request_to_proto(new: NewRequest) -> pb.NewRequest:
    return pb.NewRequest(
        prompt_ids=new.prompt_ids,
        params=params_to_proto(new.params),
        seed=wrap_int64(new.seed),
        cached_len=new.cached_len,
    )


def new_request_from_proto(msg: pb.NewRequest) -> NewRequest:
    return NewRequest(
        prompt_ids=tuple(msg.prompt_ids),
        params=params_from_proto(msg.params),
        seed=msg.seed,
        cached_len=msg.cached_len,
    )


# A plan's entries and a result's runs travel as packed columns (protos/executor.proto): once per step, with one
# Python pass per column instead of one proto message per request.


def plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    entries = plan.entries
    msg = pb.StepPlan(
        step_id=plan.step_id,
        request_ids=[e.request_id for e in entries],
        slots=[e.slot for e in entries],
        ordinals=[e.ordinal for e in entries],
        flags=[_flags(e) for e in entries],
    )
    if any(e.num_draft for e in entries):
        msg.num_draft.extend([e.num_draft for e in entries])
    if any(e.input_ids for e in entries):
        msg.input_counts.extend([len(e.input_ids) for e in entries])
        msg.input_ids.extend(itertools.chain.from_iterable(e.input_ids for e in entries))
    if any(e.new_pages for e in entries):
        msg.page_counts.extend([len(e.new_pages) for e in entries])
        msg.new_pages.extend(itertools.chain.from_iterable(e.new_pages for e in entries))
    news = [new_request_to_proto(e.new) for e in entries if e.new is not None]
    if news:
        msg.new.extend(news)
    return msg


def _flags(entry: StepEntry) -> int:
    return (
        (pb.INPUT_REF if entry.input_ref else 0)
        | (pb.SAMPLE if entry.sample else 0)
        | (pb.CONSTRAINED if entry.constrained else 0)
        | (pb.NEW if entry.new is not None else 0)
    )


def plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    """The plan's entries; :class:`ProtocolError` when its columns disagree (before anything of it runs)."""
    ids = list(msg.request_ids)
    n = len(ids)
    slots, ordinals, flags = list(msg.slots), list(msg.ordinals), list(msg.flags)
    _check_column("slots", len(slots), n)
    _check_column("ordinals", len(ordinals), n)
    _check_column("flags", len(flags), n)
    drafts = list(msg.num_draft) if msg.num_draft else [0] * n
    _check_column("num_draft", len(drafts), n)
    inputs = _split("input_counts", msg.input_counts, msg.input_ids, n)
    pages = _split("page_counts", msg.page_counts, msg.new_pages, n)
    flagged_new = sum(1 for f in flags if f & pb.NEW)
    if flagged_new != len(msg.new):
        raise ProtocolError(f"step message: {flagged_new} entries flagged NEW, {len(msg.new)} NewRequest messages")
    news = iter(msg.new)
    entries = tuple(
        StepEntry(
            rid,
            slot,
            ordinal,
            run,
            bool(f & pb.INPUT_REF),
            draft,
            bool(f & pb.SAMPLE),
            page,
            new_request_from_proto(next(news)) if f & pb.NEW else None,
            bool(f & pb.CONSTRAINED),
        )
        for rid, slot, ordinal, f, draft, run, page in zip(
            ids, slots, ordinals, flags, drafts, inputs, pages, strict=True
        )
    )
    return StepPlan(step_id=msg.step_id, entries=entries)


def _check_column(name: str, length: int, n: int) -> None:
    if length != n:
        raise ProtocolError(f"step message: column {name} has {length} values for {n} entries")


def _split(name: str, counts: Sequence[int], flat: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """Cut the concatenated ``flat`` into ``n`` tuples of ``counts`` (empty counts: every tuple empty)."""
    if not counts:
        if flat:
            raise ProtocolError(f"step message: {len(flat)} values but no {name}")
        return [()] * n
    _check_column(name, len(counts), n)
    values = list(flat)
    if sum(counts) != len(values):
        raise ProtocolError(f"step message: {name} add up to {sum(counts)}, {len(values)} values came")
    out: list[tuple[int, ...]] = []
    pos = 0
    for count in counts:
        out.append(tuple(values[pos : pos + count]) if count else ())
        pos += count
    return out


# ---------------------------------------------------------------- step results


def result_to_proto(result: StepResult) -> pb.StepResult:
    runs = result.runs
    msg = pb.StepResult(
        step_id=result.step_id,
        timing=timing_to_proto(result.timing),
        request_ids=[r.request_id for r in runs],
        ordinals=[r.ordinal for r in runs],
        token_counts=[len(r.token_ids) for r in runs],
        token_ids=list(itertools.chain.from_iterable(r.token_ids for r in runs)),
    )
    if any(r.num_drafted or r.num_accepted for r in runs):
        msg.num_drafted.extend([r.num_drafted for r in runs])
        msg.num_accepted.extend([r.num_accepted for r in runs])
    for i, run in enumerate(runs):
        if run.logprobs is not None or run.top_logprobs is not None or run.error is not None:
            _extra_to_proto(run, msg.extras.add(run=i))
    return msg


def _extra_to_proto(run: SampledRun, msg: pb.RunExtra) -> None:
    if run.logprobs is not None:
        msg.has_logprobs = True
        msg.logprobs.extend(run.logprobs)
    if run.top_logprobs is not None:
        msg.has_top_logprobs = True
        for top in run.top_logprobs:
            msg.top_logprobs.add().entries.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top)
    if run.error is not None:
        msg.error = run.error


def result_from_proto(msg: pb.StepResult) -> StepResult:
    """The result's runs; :class:`ProtocolError` when its columns disagree."""
    ids = list(msg.request_ids)
    n = len(ids)
    ordinals = list(msg.ordinals)
    _check_column("ordinals", len(ordinals), n)
    _check_column("token_counts", len(msg.token_counts), n)
    tokens = _split("token_counts", msg.token_counts, msg.token_ids, n)
    drafted = list(msg.num_drafted) if msg.num_drafted else [0] * n
    accepted = list(msg.num_accepted) if msg.num_accepted else [0] * n
    _check_column("num_drafted", len(drafted), n)
    _check_column("num_accepted", len(accepted), n)
    runs = [
        SampledRun(rid, ordinal, run, d, a)
        for rid, ordinal, run, d, a in zip(ids, ordinals, tokens, drafted, accepted, strict=True)
    ]
    for extra in msg.extras:
        if extra.run >= n:
            raise ProtocolError(f"step message: extras for run {extra.run} of {n}")
        runs[extra.run] = _with_extra(runs[extra.run], extra)
    return StepResult(step_id=msg.step_id, runs=tuple(runs), timing=timing_from_proto(msg.timing))


def _with_extra(run: SampledRun, msg: pb.RunExtra) -> SampledRun:
    top = (
        tuple(tuple((t.token_id, t.logprob) for t in row.entries) for row in msg.top_logprobs)
        if msg.has_top_logprobs
        else None
    )
    return replace(
        run,
        logprobs=tuple(msg.logprobs) if msg.has_logprobs else None,
        top_logprobs=top,
        error=msg.error if msg.HasField("error") else None,
    )


def timing_to_proto(timing: StepTiming) -> pb.StepTiming:
    msg = pb.StepTiming(
        forward_started=timing.forward_started,
        forward_done=timing.forward_done,
        done=timing.done,
        forward_cpu=timing.forward_cpu,
        draft_seconds=timing.draft_seconds,
    )
    if timing.masks_started is not None:
        msg.masks_started = timing.masks_started
    if timing.masks_ready is not None:
        msg.masks_ready = timing.masks_ready
    return msg


def timing_from_proto(msg: pb.StepTiming) -> StepTiming:
    return StepTiming(
        masks_started=msg.masks_started if msg.HasField("masks_started") else None,
        forward_started=msg.forward_started,
        forward_done=msg.forward_done,
        done=msg.done,
        forward_cpu=msg.forward_cpu,
        draft_seconds=msg.draft_seconds,
        masks_ready=msg.masks_ready if msg.HasField("masks_ready") else None,
    )
