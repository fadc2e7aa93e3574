"""Proto <-> engine values for the executor protocol, both directions, used by the executor and its client.

Every field of the step values round-trips exactly, with two deliberate exceptions: stop strings (and
``no_stop_trim``) are matched by the scheduler on text and do not travel, and seeds travel as 64-bit
patterns (the sampler uses only a seed's low 64 bits, so a seed outside the signed 64-bit range comes back
as the equal-in-effect value inside it). Proto3 defaults are not semantic defaults: fields whose "unset"
differs from zero (seed, logprobs, top logprobs, the new-request part of an entry, a run's error) use presence.
"""

from __future__ import annotations

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


def entry_to_proto(entry: StepEntry) -> pb.StepEntry:
    # Once per request per step on the scheduler: fields at their proto3 default are not set at all.
    msg = pb.StepEntry(request_id=entry.request_id, slot=entry.slot, ordinal=entry.ordinal, sample=entry.sample)
    if entry.input_ids:
        msg.input_ids.extend(entry.input_ids)
    if entry.input_ref:
        msg.input_ref = True
    if entry.num_draft:
        msg.num_draft = entry.num_draft
    if entry.new_pages:
        msg.new_pages.extend(entry.new_pages)
    if entry.constrained:
        msg.constrained = True
    if entry.new is not None:
        msg.new.CopyFrom(new_request_to_proto(entry.new))
    return msg


def entry_from_proto(msg: pb.StepEntry) -> StepEntry:
    # Once per request per step on the executor: positional, and empty repeated fields skip the tuple copy.
    ids, pages = msg.input_ids, msg.new_pages
    return StepEntry(
        msg.request_id,
        msg.slot,
        msg.ordinal,
        tuple(ids) if ids else (),
        msg.input_ref,
        msg.num_draft,
        msg.sample,
        tuple(pages) if pages else (),
        new_request_from_proto(msg.new) if msg.HasField("new") else None,
        msg.constrained,
    )


def plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    return pb.StepPlan(step_id=plan.step_id, entries=[entry_to_proto(e) for e in plan.entries])


def plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    return StepPlan(step_id=msg.step_id, entries=tuple(entry_from_proto(e) for e in msg.entries))


# ---------------------------------------------------------------- step results


def run_to_proto(run: SampledRun) -> pb.SampledRun:
    msg = pb.SampledRun(request_id=run.request_id, ordinal=run.ordinal, token_ids=run.token_ids)
    if run.num_drafted:
        msg.num_drafted = run.num_drafted
    if run.num_accepted:
        msg.num_accepted = run.num_accepted
    if run.logprobs is not None:
        msg.has_logprobs = True
        msg.logprobs.extend(run.logprobs)
    if run.top_logprobs is not None:
        msg.has_top_logprobs = True
        for top in run.top_logprobs:
            msg.top_logprobs.add().entries.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top)
    if run.error is not None:
        msg.error = run.error
    return msg


def run_from_proto(msg: pb.SampledRun) -> SampledRun:
    top = (
        tuple(tuple((t.token_id, t.logprob) for t in row.entries) for row in msg.top_logprobs)
        if msg.has_top_logprobs
        else None
    )
    return SampledRun(  # once per sampled request per step: positional
        msg.request_id,
        msg.ordinal,
        tuple(msg.token_ids),
        msg.num_drafted,
        msg.num_accepted,
        tuple(msg.logprobs) if msg.has_logprobs else None,
        top,
        msg.error if msg.HasField("error") else None,
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
    return msg


def timing_from_proto(msg: pb.StepTiming) -> StepTiming:
    return StepTiming(
        masks_started=msg.masks_started if msg.HasField("masks_started") else None,
        forward_started=msg.forward_started,
        forward_done=msg.forward_done,
        done=msg.done,
        forward_cpu=msg.forward_cpu,
        draft_seconds=msg.draft_seconds,
    )


def result_to_proto(result: StepResult) -> pb.StepResult:
    return pb.StepResult(
        step_id=result.step_id,
        runs=[run_to_proto(r) for r in result.runs],
        timing=timing_to_proto(result.timing),
    )


def result_from_proto(msg: pb.StepResult) -> StepResult:
    return StepResult(
        step_id=msg.step_id,
        runs=tuple(run_from_proto(r) for r in msg.runs),
        timing=timing_from_proto(msg.timing),
    )
