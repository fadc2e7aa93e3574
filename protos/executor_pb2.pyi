from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EntryFlag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENTRY_FLAG_NONE: _ClassVar[EntryFlag]
    INPUT_REF: _ClassVar[EntryFlag]
    SAMPLE: _ClassVar[EntryFlag]
    CONSTRAINED: _ClassVar[EntryFlag]
    NEW: _ClassVar[EntryFlag]
ENTRY_FLAG_NONE: EntryFlag
INPUT_REF: EntryFlag
SAMPLE: EntryFlag
CONSTRAINED: EntryFlag
NEW: EntryFlag

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

class StepPlan(_message.Message):
    __slots__ = ("step_id", "request_ids", "slots", "ordinals", "flags", "num_draft", "input_counts", "input_ids", "page_counts", "new_pages", "new")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ORDINALS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    INPUT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    NEW_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    slots: _containers.RepeatedScalarFieldContainer[int]
    ordinals: _containers.RepeatedScalarFieldContainer[int]
    flags: _containers.RepeatedScalarFieldContainer[int]
    num_draft: _containers.RepeatedScalarFieldContainer[int]
    input_counts: _containers.RepeatedScalarFieldContainer[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    page_counts: _containers.RepeatedScalarFieldContainer[int]
    new_pages: _containers.RepeatedScalarFieldContainer[int]
    new: _containers.RepeatedCompositeFieldContainer[NewRequest]
    def __init__(self, step_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., slots: _Optional[_Iterable[int]] = ..., ordinals: _Optional[_Iterable[int]] = ..., flags: _Optional[_Iterable[int]] = ..., num_draft: _Optional[_Iterable[int]] = ..., input_counts: _Optional[_Iterable[int]] = ..., input_ids: _Optional[_Iterable[int]] = ..., page_counts: _Optional[_Iterable[int]] = ..., new_pages: _Optional[_Iterable[int]] = ..., new: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ...) -> None: ...

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

class RunExtra(_message.Message):
    __slots__ = ("run", "logprobs", "has_logprobs", "top_logprobs", "has_top_logprobs", "error")
    RUN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    run: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    has_logprobs: bool
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    has_top_logprobs: bool
    error: str
    def __init__(self, run: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., has_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., has_top_logprobs: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("masks_started", "forward_started", "forward_done", "done", "forward_cpu", "draft_seconds", "masks_ready")
    MASKS_STARTED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_STARTED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CPU_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MASKS_READY_FIELD_NUMBER: _ClassVar[int]
    masks_started: float
    forward_started: float
    forward_done: float
    done: float
    forward_cpu: float
    draft_seconds: float
    masks_ready: float
    def __init__(self, masks_started: _Optional[float] = ..., forward_started: _Optional[float] = ..., forward_done: _Optional[float] = ..., done: _Optional[float] = ..., forward_cpu: _Optional[float] = ..., draft_seconds: _Optional[float] = ..., masks_ready: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "timing", "request_ids", "ordinals", "token_counts", "token_ids", "num_drafted", "num_accepted", "extras")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ORDINALS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    timing: StepTiming
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    ordinals: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_drafted: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    extras: _containers.RepeatedCompositeFieldContainer[RunExtra]
    def __init__(self, step_id: _Optional[int] = ..., timing: _Optional[_Union[StepTiming, _Mapping]] = ..., request_ids: _Optional[_Iterable[str]] = ..., ordinals: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_drafted: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[_Iterable[int]] = ..., extras: _Optional[_Iterable[_Union[RunExtra, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("buffers", "steps", "session_open", "forward_cpu_seconds", "draft_slots", "masked_steps", "mask_wait_seconds", "busy_seconds", "before_forward_seconds", "forward_seconds", "draft_seconds")
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SESSION_OPEN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MASKED_STEPS_FIELD_NUMBER: _ClassVar[int]
    MASK_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    buffers: int
    steps: int
    session_open: bool
    forward_cpu_seconds: float
    draft_slots: int
    masked_steps: int
    mask_wait_seconds: float
    busy_seconds: float
    before_forward_seconds: float
    forward_seconds: float
    draft_seconds: float
    def __init__(self, buffers: _Optional[int] = ..., steps: _Optional[int] = ..., session_open: _Optional[bool] = ..., forward_cpu_seconds: _Optional[float] = ..., draft_slots: _Optional[int] = ..., masked_steps: _Optional[int] = ..., mask_wait_seconds: _Optional[float] = ..., busy_seconds: _Optional[float] = ..., before_forward_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., draft_seconds: _Optional[float] = ...) -> None: ...
