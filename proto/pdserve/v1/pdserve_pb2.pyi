from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools_json", "tool_choice", "tool_choice_function")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    tool_choice: str
    tool_choice_function: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., tool_choice: _Optional[str] = ..., tool_choice_function: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos", "presence_penalty", "frequency_penalty", "stop_token_ids", "logprobs", "prompt_logprobs", "guided")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    prompt_logprobs: int
    guided: Guided
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., guided: _Optional[_Union[Guided, _Mapping]] = ...) -> None: ...

class Guided(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choices
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "token_ids", "messages", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "ttft_s", "mean_tpot_s", "prefill_worker", "decode_worker", "prefill_placement")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_TPOT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    ttft_s: float
    mean_tpot_s: float
    prefill_worker: str
    decode_worker: str
    prefill_placement: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., ttft_s: _Optional[float] = ..., mean_tpot_s: _Optional[float] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., prefill_placement: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "logprobs", "prompt_logprobs", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "received_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    received_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., received_tokens: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "context_length", "vocab_size", "dtype", "quantization", "speculative", "block_size", "kernels", "memory")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    model: str
    context_length: int
    vocab_size: int
    dtype: str
    quantization: str
    speculative: str
    block_size: int
    kernels: str
    memory: _containers.RepeatedCompositeFieldContainer[WorkerMemory]
    def __init__(self, model: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., speculative: _Optional[str] = ..., block_size: _Optional[int] = ..., kernels: _Optional[str] = ..., memory: _Optional[_Iterable[_Union[WorkerMemory, _Mapping]]] = ...) -> None: ...

class WorkerMemory(_message.Message):
    __slots__ = ("worker_id", "role", "weights_gb", "packed_copies_gb", "kv_cache_gb", "other_gb", "rss_gb", "pss_gb", "peak_rss_gb")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_GB_FIELD_NUMBER: _ClassVar[int]
    PACKED_COPIES_GB_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GB_FIELD_NUMBER: _ClassVar[int]
    OTHER_GB_FIELD_NUMBER: _ClassVar[int]
    RSS_GB_FIELD_NUMBER: _ClassVar[int]
    PSS_GB_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_GB_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    weights_gb: float
    packed_copies_gb: float
    kv_cache_gb: float
    other_gb: float
    rss_gb: float
    pss_gb: float
    peak_rss_gb: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., weights_gb: _Optional[float] = ..., packed_copies_gb: _Optional[float] = ..., kv_cache_gb: _Optional[float] = ..., other_gb: _Optional[float] = ..., rss_gb: _Optional[float] = ..., pss_gb: _Optional[float] = ..., peak_rss_gb: _Optional[float] = ...) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ("check_blocks",)
    CHECK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    check_blocks: bool
    def __init__(self, check_blocks: _Optional[bool] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "state", "running", "waiting", "kv_blocks_used", "kv_blocks_total", "tokens_per_s", "metrics_address", "restarts", "speculative_acceptance", "speculative_tokens_per_verify", "stranded_blocks", "memory")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_TOKENS_PER_VERIFY_FIELD_NUMBER: _ClassVar[int]
    STRANDED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    state: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_per_s: float
    metrics_address: str
    restarts: int
    speculative_acceptance: float
    speculative_tokens_per_verify: float
    stranded_blocks: int
    memory: WorkerMemory
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., metrics_address: _Optional[str] = ..., restarts: _Optional[int] = ..., speculative_acceptance: _Optional[float] = ..., speculative_tokens_per_verify: _Optional[float] = ..., stranded_blocks: _Optional[int] = ..., memory: _Optional[_Union[WorkerMemory, _Mapping]] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("mode", "workers", "metrics_address", "queued_requests", "active_requests", "autoscale_events", "blocks_checked")
    MODE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    mode: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    metrics_address: str
    queued_requests: int
    active_requests: int
    autoscale_events: _containers.RepeatedScalarFieldContainer[str]
    blocks_checked: bool
    def __init__(self, mode: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., metrics_address: _Optional[str] = ..., queued_requests: _Optional[int] = ..., active_requests: _Optional[int] = ..., autoscale_events: _Optional[_Iterable[str]] = ..., blocks_checked: _Optional[bool] = ...) -> None: ...
