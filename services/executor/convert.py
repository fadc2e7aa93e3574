"""Proto <-> engine values for the executor protocol, both directions, used by the executor and its client.

Every field of the step values round-trips exactly, with two deliberate exceptions: stop strings (and
``no_stop_trim``) are matched by the scheduler on text and do not travel, and seeds travel as 64-bit
patterns (the sampler uses only a seed's low 64 bits, so a seed outside the signed 64-bit range comes back
as the equal-in-effect value inside it). Proto3 defaults are not semantic defaults: fields whose "unset"
differs from zero (seed, logprob, top logprobs, the new-request part of an entry, a sample's error) use presence.
"""

from __future__ import annotations

from engine.runner import ModelInfo
from engine.sampling_params import SamplingParams
from engine.step import NewRequest, SampledToken, StepEntry, StepPlan, StepResult
from protos import executor_pb2 as pb

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
    return pb.NewRequest(prompt_ids=new.prompt_ids, params=params_to_proto(new.params), seed=wrap_int64(new.seed))


def new_request_from_proto(msg: pb.NewRequest) -> NewRequest:
    return NewRequest(prompt_ids=tuple(msg.prompt_ids), params=params_from_proto(msg.params), seed=msg.seed)


def entry_to_proto(entry: StepEntry) -> pb.StepEntry:
    msg = pb.StepEntry(
        request_id=entry.request_id,
        slot=entry.slot,
        ordinal=entry.ordinal,
        start_pos=entry.start_pos,
        input_ids=entry.input_ids,
        input_ref=entry.input_ref,
        page_table=entry.page_table,
        sample=entry.sample,
        constrained=entry.constrained,
    )
    if entry.new is not None:
        msg.new.CopyFrom(new_request_to_proto(entry.new))
    return msg


def entry_from_proto(msg: pb.StepEntry) -> StepEntry:
    return StepEntry(
        request_id=msg.request_id,
        slot=msg.slot,
        ordinal=msg.ordinal,
        start_pos=msg.start_pos,
        input_ids=tuple(msg.input_ids),
        input_ref=msg.input_ref,
        page_table=tuple(msg.page_table),
        sample=msg.sample,
        new=new_request_from_proto(msg.new) if msg.HasField("new") else None,
        constrained=msg.constrained,
    )


def plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    return pb.StepPlan(step_id=plan.step_id, entries=[entry_to_proto(e) for e in plan.entries])


def plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    return StepPlan(step_id=msg.step_id, entries=tuple(entry_from_proto(e) for e in msg.entries))


# ---------------------------------------------------------------- step results


def sample_to_proto(sample: SampledToken) -> pb.SampledToken:
    msg = pb.SampledToken(request_id=sample.request_id, ordinal=sample.ordinal, token_id=sample.token_id)
    if sample.logprob is not None:
        msg.logprob = sample.logprob
    if sample.top_logprobs is not None:
        msg.has_top_logprobs = True
        msg.top_logprobs.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in sample.top_logprobs)
    if sample.error is not None:
        msg.error = sample.error
    return msg


def sample_from_proto(msg: pb.SampledToken) -> SampledToken:
    top = tuple((t.token_id, t.logprob) for t in msg.top_logprobs) if msg.has_top_logprobs else None
    return SampledToken(
        request_id=msg.request_id,
        ordinal=msg.ordinal,
        token_id=msg.token_id,
        logprob=msg.logprob if msg.HasField("logprob") else None,
        top_logprobs=top,
        error=msg.error if msg.HasField("error") else None,
    )


def result_to_proto(result: StepResult) -> pb.StepResult:
    return pb.StepResult(
        step_id=result.step_id,
        samples=[sample_to_proto(s) for s in result.samples],
        forward_seconds=result.forward_seconds,
    )


def result_from_proto(msg: pb.StepResult) -> StepResult:
    return StepResult(
        step_id=msg.step_id,
        samples=tuple(sample_from_proto(s) for s in msg.samples),
        forward_seconds=msg.forward_seconds,
    )
