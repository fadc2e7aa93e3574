from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_path", "vocab_size", "max_context", "eos_token_ids", "bos_token_id", "pad_token_id", "page_size", "num_pages", "instance_id")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    pad_token_id: int
    page_size: int
    num_pages: int
    instance_id: str
    def __init__(self, model_path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "seed", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("prompt_ids", "params", "seed", "cached_len")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    seed: int
    cached_len: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., cached_len: _Optional[int] = ...) -> None: ...

class StepEntry(_message.Message):
    __slots__ = ("request_id", "slot", "ordinal", "input_ids", "input_ref", "num_draft", "sample", "new_pages", "new", "constrained")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    INPUT_REF_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    NEW_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    slot: int
    ordinal: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    input_ref: bool
    num_draft: int
    sample: bool
    new_pages: _containers.RepeatedScalarFieldContainer[int]
    new: NewRequest
    constrained: bool
    def __init__(self, request_id: _Optional[str] = ..., slot: _Optional[int] = ..., ordinal: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., input_ref: _Optional[bool] = ..., num_draft: _Optional[int] = ..., sample: _Optional[bool] = ..., new_pages: _Optional[_Iterable[int]] = ..., new: _Optional[_Union[NewRequest, _Mapping]] = ..., constrained: _Optional[bool] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "entries")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    entries: _containers.RepeatedCompositeFieldContainer[StepEntry]
    def __init__(self, step_id: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[StepEntry, _Mapping]]] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("plan", "release")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    plan: StepPlan
    release: Release
    def __init__(self, plan: _Optional[_Union[StepPlan, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class SampledRun(_message.Message):
    __slots__ = ("request_id", "ordinal", "token_ids", "num_drafted", "num_accepted", "logprobs", "has_logprobs", "top_logprobs", "has_top_logprobs", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ordinal: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_drafted: int
    num_accepted: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    has_logprobs: bool
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    has_top_logprobs: bool
    error: str
    def __init__(self, request_id: _Optional[str] = ..., ordinal: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., has_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., has_top_logprobs: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("masks_started", "forward_started", "forward_done", "done", "forward_cpu", "draft_seconds")
    MASKS_STARTED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_STARTED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CPU_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    masks_started: float
    forward_started: float
    forward_done: float
    done: float
    forward_cpu: float
    draft_seconds: float
    def __init__(self, masks_started: _Optional[float] = ..., forward_started: _Optional[float] = ..., forward_done: _Optional[float] = ..., done: _Optional[float] = ..., forward_cpu: _Optional[float] = ..., draft_seconds: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "runs", "timing")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    runs: _containers.RepeatedCompositeFieldContainer[SampledRun]
    timing: StepTiming
    def __init__(self, step_id: _Optional[int] = ..., runs: _Optional[_Iterable[_Union[SampledRun, _Mapping]]] = ..., timing: _Optional[_Union[StepTiming, _Mapping]] = ...) -> None: ...

class ReleaseDone(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("step_id", "code", "message")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    code: str
    message: str
    def __init__(self, step_id: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("result", "released", "error")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result: StepResult
    released: ReleaseDone
    error: StepError
    def __init__(self, result: _Optional[_Union[StepResult, _Mapping]] = ..., released: _Optional[_Union[ReleaseDone, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorState(_message.Message):
    __slots__ = ("buffers", "steps", "session_open", "forward_cpu_seconds", "draft_slots")
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SESSION_OPEN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    buffers: int
    steps: int
    session_open: bool
    forward_cpu_seconds: float
    draft_slots: int
    def __init__(self, buffers: _Optional[int] = ..., steps: _Optional[int] = ..., session_open: _Optional[bool] = ..., forward_cpu_seconds: _Optional[float] = ..., draft_slots: _Optional[int] = ...) -> None: ...
