"""Proto <-> engine conversion for the public ``SglangScheduler`` API, and the checks the engine does not make.

Proto3 has no presence for plain scalars, so a zero can mean "unset" or "zero". The rules here:

- an absent ``sampling_params`` message means every semantic default (temperature 1.0, top_p 1.0, top_k off,
  repetition_penalty 1.0, n 1);
- inside a present message the values are taken as sent (the proto asks clients to set them explicitly),
  except ``top_k`` 0, which SGLang clients use for "off" like -1; a zero ``top_p``, ``repetition_penalty`` or
  ``n`` is refused with a hint, since those zeros are never meaningful;
- ``max_new_tokens`` is ``optional``: absent means "as many as fit", i.e. the context length minus the prompt,
  capped by what the KV pool can ever hold for one request (SGLang's semantics when a client gives none).
- the ``constraint`` oneof (``json_schema``, ``regex``, ``ebnf_grammar``, ``structural_tag``) becomes an engine
  :class:`~engine.grammar.Constraint`, its text verbatim; whether it compiles is the engine's to say. A JSON schema's
  mode (strict, checked, loose) may be chosen per request as ``custom_params {"json_schema_mode": ...}``, the one
  field of the public API that can carry it (smg never sets it; its requests get the grammar service's default);
  other ``custom_params`` keys are ignored, as SGLang leaves them to custom logit processors.

Field names in error details are the proto's (``sampling_params.top_p``, ``tokenized.input_ids``) so that a
client can find what to fix.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from engine.config import EngineConfig, SpeculativeConfig
from engine.constraint import MODE_PARAM, Constraint, JsonSchemaMode
from engine.errors import InvalidRequestError
from engine.finish import Finish
from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams
from engine.scheduler.request import RequestOutput, TokenLogprob
from engine.scheduler.scheduler import SchedulerStats

# Engine field names whose proto name is not ``sampling_params.<name>``.
_PROTO_FIELDS = {
    "input_ids": "tokenized.input_ids",
    "request_id": "request_id",
    "top_logprobs": "top_logprobs_num",
    "logprobs": "return_logprob",
    "data_parallel_rank": "data_parallel_rank",
}


class UnsupportedRequestError(Exception):
    """A well-formed request asks for something this server cannot do yet (mapped to UNIMPLEMENTED)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ModelLimits:
    """What bounds a request: the vocabulary, the context window, the KV pool and the request slots."""

    vocab_size: int
    max_context: int
    pool_tokens: int  # KV positions the whole pool holds (pages x page size)
    max_running: int


@dataclass(frozen=True)
class GenerateSpec:
    """A converted ``GenerateRequest``: ``n`` engine requests share the prompt, the params and the constraint.

    ``constraint_field`` names the ``constraint`` oneof field that was set (for error details)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    n: int
    stream: bool
    constraint: Constraint | None = None
    constraint_field: str | None = None

    def engine_ids(self) -> tuple[str, ...]:
        """Engine request ids: the public id itself, or ``<id>-<i>`` per sample when ``n`` > 1."""
        if self.n == 1:
            return (self.request_id,)
        return tuple(f"{self.request_id}-{i}" for i in range(self.n))


def proto_field(engine_field: str) -> str:
    """The proto path of an engine field name, for error details."""
    return _PROTO_FIELDS.get(engine_field, f"sampling_params.{engine_field}")


def invalid_details(err: InvalidRequestError) -> str:
    return f"{proto_field(err.field)}: {err.message}"


# ------------------------------------------------------------------------------------------ requests


def generate_spec(request: pb.GenerateRequest, limits: ModelLimits) -> GenerateSpec:
    """Convert and pre-check a request; raises InvalidRequestError or UnsupportedRequestError.

    The engine validates the sampling values itself when the request is submitted (before allocating)."""
    prompt = _prompt_ids(request)
    _refuse_unsupported(request)
    sp = request.sampling_params if request.HasField("sampling_params") else None
    n = _num_samples(sp, limits)
    params = _sampling_params(request, sp, len(prompt), limits)
    field, constraint = _constraint(sp)
    rid = request.request_id or uuid.uuid4().hex
    return GenerateSpec(
        request_id=rid,
        prompt_ids=prompt,
        params=params,
        n=n,
        stream=request.stream,
        constraint=constraint,
        constraint_field=field,
    )


def _prompt_ids(request: pb.GenerateRequest) -> tuple[int, ...]:
    ids = tuple(request.tokenized.input_ids)
    if not ids and request.tokenized.original_text:
        raise InvalidRequestError(
            "input_ids", "tokenized input is required: this server does not tokenize text, send the token ids"
        )
    if not ids:
        raise InvalidRequestError("input_ids", "must not be empty")
    return ids


def _constraint(sp: pb.SamplingParams | None) -> tuple[str | None, Constraint | None]:
    """The ``constraint`` oneof as (field name, engine constraint); (None, None) when none is set."""
    field = sp.WhichOneof("constraint") if sp is not None else None
    mode = _json_schema_mode(sp)
    if sp is None or field is None:
        if mode is not None:
            raise InvalidRequestError(f"custom_params.{MODE_PARAM}", "applies to a json_schema constraint: none is set")
        return None, None
    if mode is not None and field != "json_schema":
        raise InvalidRequestError(f"custom_params.{MODE_PARAM}", f"applies to json_schema constraints, not to {field}")
    try:
        return field, Constraint.from_public_field(field, getattr(sp, field), mode)
    except InvalidRequestError as exc:  # e.g. an empty grammar: name the proto field, not the engine's
        raise InvalidRequestError(field, exc.message) from None


def _json_schema_mode(sp: pb.SamplingParams | None) -> JsonSchemaMode | None:
    """The request's JSON-schema mode from ``custom_params``, or None (the grammar service's default)."""
    if sp is None or not sp.HasField("custom_params") or MODE_PARAM not in sp.custom_params.fields:
        return None
    value = sp.custom_params.fields[MODE_PARAM]
    if value.WhichOneof("kind") != "string_value":
        raise InvalidRequestError(
            f"custom_params.{MODE_PARAM}", f"must be a string, one of {[m.value for m in JsonSchemaMode]}"
        )
    return JsonSchemaMode.parse(value.string_value, f"custom_params.{MODE_PARAM}")


def invalid_grammar_details(field: str | None, message: str | None) -> str:
    """INVALID_ARGUMENT details for a constraint xgrammar refused: the proto field, then xgrammar's reason.

    The engine's finish message reads ``constraint.<kind>: invalid grammar: <reason>``; the client knows the field
    by its proto name, so that one replaces the engine's."""
    text = message or "invalid grammar"
    if text.startswith("constraint.") and ": " in text:
        text = text.split(": ", 1)[1]
    return f"sampling_params.{field or 'constraint'}: {text}"


def _refuse_unsupported(request: pb.GenerateRequest) -> None:
    unsupported = (
        ("mm_inputs", request.HasField("mm_inputs") and bool(request.mm_inputs.ListFields()), "multimodal input"),
        ("input_embeds", bool(request.input_embeds), "input embeddings"),
        ("token_ids_logprob", bool(request.token_ids_logprob), "logprobs of chosen token ids"),
        ("return_hidden_states", request.return_hidden_states, "hidden states"),
        ("lora_id", bool(request.lora_id), "LoRA adapters"),
        ("custom_logit_processor", bool(request.custom_logit_processor), "custom logit processors"),
        (
            "disaggregated_params",
            request.HasField("disaggregated_params") and bool(request.disaggregated_params.bootstrap_host),
            "disaggregated prefill/decode",
        ),
    )
    for field, asked, what in unsupported:
        if asked:
            raise UnsupportedRequestError(field, f"{what} is not available on this server")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidRequestError(
            "data_parallel_rank", f"rank {request.data_parallel_rank} does not exist: this server has only rank 0"
        )


def _num_samples(sp: pb.SamplingParams | None, limits: ModelLimits) -> int:
    if sp is None:
        return 1
    if sp.n < 1:
        raise InvalidRequestError("n", "must be >= 1 (an unset n reads as 0 in proto3: send n=1)")
    if sp.n > limits.max_running:
        raise InvalidRequestError("n", f"must be <= {limits.max_running} (the requests this server runs at once)")
    return int(sp.n)


def _sampling_params(
    request: pb.GenerateRequest, sp: pb.SamplingParams | None, prompt_len: int, limits: ModelLimits
) -> SamplingParams:
    logprobs = request.return_logprob
    if request.top_logprobs_num < 0:
        raise InvalidRequestError("top_logprobs", f"must be >= 0, got {request.top_logprobs_num}")
    top = int(request.top_logprobs_num) if logprobs else 0
    if sp is None:
        return SamplingParams(
            max_new_tokens=_default_max_new_tokens(prompt_len, limits), logprobs=logprobs, top_logprobs=top
        )
    if sp.top_p == 0.0:
        raise InvalidRequestError("top_p", "must be in (0, 1], got 0 (an unset top_p reads as 0: send 1.0)")
    if sp.repetition_penalty == 0.0:
        raise InvalidRequestError(
            "repetition_penalty", "must be > 0, got 0 (an unset repetition_penalty reads as 0: send 1.0)"
        )
    max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else _default_max_new_tokens(prompt_len, limits)
    return SamplingParams(
        max_new_tokens=int(max_new),
        min_new_tokens=int(sp.min_new_tokens),
        temperature=float(sp.temperature),
        top_k=-1 if sp.top_k == 0 else int(sp.top_k),  # proto3's unset 0 means "off", like -1
        top_p=float(sp.top_p),
        min_p=float(sp.min_p),
        frequency_penalty=float(sp.frequency_penalty),
        presence_penalty=float(sp.presence_penalty),
        repetition_penalty=float(sp.repetition_penalty),
        logit_bias=_logit_bias(sp.logit_bias.items()),
        stop_token_ids=tuple(int(t) for t in sp.stop_token_ids),
        stop=tuple(sp.stop),
        no_stop_trim=sp.no_stop_trim,
        ignore_eos=sp.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top,
    )


def _default_max_new_tokens(prompt_len: int, limits: ModelLimits) -> int:
    # The reservation of one request covers positions [0, prompt + max_new - 1) of the pool.
    room = min(limits.max_context - prompt_len, limits.pool_tokens + 1 - prompt_len)
    if room < 1:
        raise InvalidRequestError(
            "input_ids",
            f"the prompt ({prompt_len} tokens) leaves no room for output within the context length "
            f"{limits.max_context} and the KV pool of {limits.pool_tokens} tokens",
        )
    return room


def _logit_bias(items: Iterable[tuple[str, float]]) -> tuple[tuple[int, float], ...]:
    bias: dict[int, float] = {}
    for key, value in items:
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError("logit_bias", f"keys must be token ids, got {key!r}") from None
        if not math.isfinite(value):
            raise InvalidRequestError("logit_bias", f"bias for token {token_id} must be finite, got {value}")
        bias[token_id] = float(value)
    return SamplingParams.logit_bias_from(bias)


# ------------------------------------------------------------------------------------------ responses


def output_logprobs(logprobs: Sequence[TokenLogprob]) -> pb.OutputLogProbs:
    """Chosen-token logprobs with the top alternatives at each position."""
    return pb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs],
        token_ids=[lp.token_id for lp in logprobs],
        top_logprobs=[
            pb.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top]) for lp in logprobs
        ],
    )


def chunk_response(
    request_id: str, index: int, out: RequestOutput, completion_tokens: int, with_logprobs: bool
) -> pb.GenerateResponse:
    """One stream chunk: the tokens ``out`` added, with cumulative counts (``completion_tokens`` streamed)."""
    # Once per stream per step: filled in place (a message passed to a constructor would be copied).
    response = pb.GenerateResponse(request_id=request_id)
    chunk = response.chunk
    chunk.token_ids.extend(out.new_token_ids)
    chunk.prompt_tokens = out.num_prompt_tokens
    chunk.completion_tokens = completion_tokens
    chunk.cached_tokens = out.num_cached_tokens
    chunk.index = index
    if with_logprobs:
        chunk.output_logprobs.CopyFrom(output_logprobs(out.logprobs))
    return response


def complete_response(
    request_id: str, index: int, out: RequestOutput, logprobs: Sequence[TokenLogprob] | None
) -> pb.GenerateResponse:
    """The final message of one sample: all output ids, finish reason, counts, cumulative logprobs."""
    assert out.finish is not None
    output_ids = list(out.output_ids or ())
    complete = pb.GenerateComplete(
        output_ids=output_ids,
        finish_reason=out.finish.reason.value,
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_output_tokens,
        cached_tokens=out.num_cached_tokens,
        index=index,
        spec_accepted_tokens=out.spec_accepted_tokens,
        spec_draft_tokens=out.spec_draft_tokens,
    )
    _set_matched(complete, out.finish)
    if logprobs is not None:
        # A trimmed stop string removed trailing ids: keep the logprobs aligned with what is returned.
        complete.output_logprobs.CopyFrom(output_logprobs(logprobs[: len(output_ids)]))
    return pb.GenerateResponse(request_id=request_id, complete=complete)


def _set_matched(complete: pb.GenerateComplete, finish: Finish) -> None:
    if finish.matched_token is not None:
        complete.matched_token_id = finish.matched_token
    elif finish.matched_stop is not None:
        complete.matched_stop_str = finish.matched_stop


# ------------------------------------------------------------------------------------------ model and server info


@dataclass(frozen=True)
class ServedModel:
    """The model as the public API describes it. ``info.model_path`` is the executor's model folder, which also
    holds the tokenizer files (reported as ``tokenizer_path``)."""

    name: str
    info: ModelInfo
    model_type: str = ""
    architectures: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerState:
    """Runtime facts GetServerInfo reports besides the configuration."""

    version: str
    start_time: float
    last_receive_time: float
    executor: str | None
    grammar: str | None = None


def model_info_response(model: ServedModel) -> pb.GetModelInfoResponse:
    info = model.info
    return pb.GetModelInfoResponse(
        model_path=info.model_path,
        tokenizer_path=info.model_path,
        is_generation=True,
        weight_version="default",
        served_model_name=model.name,
        max_context_length=info.max_context,
        vocab_size=info.vocab_size,
        supports_vision=False,
        model_type=model.model_type,
        eos_token_ids=sorted(info.eos_token_ids),
        # proto3 has no "none" for these ints; 0 is what SGLang sends when the checkpoint names no token.
        pad_token_id=info.pad_token_id if info.pad_token_id is not None else 0,
        bos_token_id=info.bos_token_id if info.bos_token_id is not None else 0,
        max_req_input_len=info.max_context - 1,
        architectures=list(model.architectures),
    )


def server_args(
    config: EngineConfig, model: ServedModel, executor: str | None, grammar: str | None = None
) -> dict[str, object]:
    """The server's configuration under SGLang's argument names where one exists (gateways label workers by them).

    ``grammar`` says where constrained requests' grammars live: a service's HOST:PORT, ``in-process``, or None
    when this server cannot serve constraints."""
    return {
        "model_path": model.info.model_path,
        "tokenizer_path": model.info.model_path,
        "served_model_name": model.name,
        "context_length": model.info.max_context,
        "page_size": config.page_size,
        "num_pages": config.num_pages,
        "max_total_num_tokens": config.num_pages * config.page_size,
        "max_running_requests": config.max_running,
        "chunked_prefill_size": config.chunk_size,
        "disable_overlap_schedule": not config.overlap,
        "disable_radix_cache": not config.prefix_cache,
        "device": config.device,
        "dtype": config.dtype,
        "random_seed": config.seed,
        "disaggregation_mode": "null",
        **_speculative_args(config.speculative),
        "executor": executor if executor is not None else "in-process",
        # SGLang's name; "none" tells a gateway that constrained requests will be refused.
        "grammar_backend": "xgrammar" if grammar is not None else "none",
        "grammar": grammar or "none",
    }


def _speculative_args(spec: SpeculativeConfig) -> dict[str, object]:
    """SGLang's speculative arguments (``speculative_algorithm`` None when off, as SGLang reports it)."""
    if not spec.enabled:
        return {"speculative_algorithm": None}
    return {
        "speculative_algorithm": spec.algorithm.value.upper(),
        "speculative_draft_model_path": spec.draft_model_path,
        "speculative_num_steps": spec.num_steps,
        "speculative_eagle_topk": spec.topk,
        "speculative_num_draft_tokens": spec.draft_nodes + 1,
        "speculative_draft_grammar": spec.draft_grammar,  # ordinal's own: the draft model drafts under the grammar
        "speculative_draft_min_prob": spec.draft_min_prob,  # ordinal's own: a draft ends after a token it is unsure of
        "speculative_disable_by_batch_size": spec.disable_by_batch_size,  # vLLM's: plain above this many decodes
    }


def server_info_response(
    config: EngineConfig, model: ServedModel, stats: SchedulerStats, state: ServerState, now: float
) -> pb.GetServerInfoResponse:
    args = Struct()
    args.update(server_args(config, model, state.executor, state.grammar))
    scheduler_info = Struct()
    scheduler_info.update(
        {
            "max_total_num_tokens": config.num_pages * config.page_size,
            "max_req_input_len": model.info.max_context - 1,
            "max_running_requests": config.max_running,
            "vocab_size": model.info.vocab_size,
            "is_generation": True,
            "spec_verify_steps": stats.spec.verify_steps,
            "spec_draft_tokens": stats.spec.draft_tokens,
            "spec_accepted_tokens": stats.spec.accepted_tokens,
            "avg_spec_accept_length": stats.spec.accept_length,
            "spec_accept_rate": stats.spec.accept_rate,
        }
    )
    start = Timestamp()
    start.FromNanoseconds(int(state.start_time * 1e9))
    return pb.GetServerInfoResponse(
        server_args=args,
        scheduler_info=scheduler_info,
        active_requests=stats.num_running + stats.num_waiting,
        is_paused=False,
        last_receive_timestamp=state.last_receive_time,
        uptime_seconds=now - state.start_time,
        sglang_version=state.version,
        server_type="grpc",
        start_time=start,
        max_total_num_tokens=config.num_pages * config.page_size,
    )


def loads_response(
    stats: SchedulerStats, config: EngineConfig, include: Sequence[str], version: str, now: float
) -> pb.GetLoadsResponse:
    """One data-parallel rank's load from the scheduler's stats. KV pages are reported in tokens (pages x page
    size); prefix-cache pages that can be evicted count as free, as in SGLang."""
    total_tokens = stats.total_pages * config.page_size
    used_tokens = stats.used_pages * config.page_size
    usage = stats.used_pages / stats.total_pages if stats.total_pages else 0.0
    seen = stats.cached_prompt_tokens + stats.prefill_tokens
    load = pb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=stats.num_running,
        num_waiting_reqs=stats.num_waiting,
        num_total_reqs=stats.num_running + stats.num_waiting,
        num_used_tokens=used_tokens,
        max_total_num_tokens=total_tokens,
        token_usage=usage,
        cache_hit_rate=stats.cached_prompt_tokens / seen if seen else 0.0,
        utilization=stats.num_running / config.max_running,
        max_running_requests=config.max_running,
    )
    sections = set(include)
    everything = "all" in sections
    if everything or "memory" in sections:
        load.memory.CopyFrom(pb.MemoryMetrics(token_capacity=total_tokens))
    if everything or "queues" in sections:
        load.queues.CopyFrom(pb.QueueMetrics(waiting=stats.num_waiting))
    if everything or "spec" in sections:
        spec = stats.spec
        load.speculative.CopyFrom(pb.SpeculativeMetrics(accept_length=spec.accept_length, accept_rate=spec.accept_rate))
    if everything or "disagg" in sections:
        load.disaggregation.CopyFrom(pb.DisaggregationMetrics(mode="null"))
    aggregate = pb.AggregateMetrics(
        total_running_reqs=load.num_running_reqs,
        total_waiting_reqs=load.num_waiting_reqs,
        total_reqs=load.num_total_reqs,
        avg_token_usage=usage,
        avg_utilization=load.utilization,
    )
    stamp = datetime.fromtimestamp(now, tz=timezone.utc).isoformat()
    return pb.GetLoadsResponse(timestamp=stamp, version=version, dp_rank_count=1, loads=[load], aggregate=aggregate)
