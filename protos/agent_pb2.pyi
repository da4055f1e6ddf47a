from protos import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_STATE_UNSPECIFIED: _ClassVar[GroupState]
    GROUP_STATE_WAITING: _ClassVar[GroupState]
    GROUP_STATE_QUEUED: _ClassVar[GroupState]
    GROUP_STATE_ACCEPTED: _ClassVar[GroupState]
    GROUP_STATE_SKIPPED: _ClassVar[GroupState]

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_OPEN: _ClassVar[SessionState]
    SESSION_STATE_CLOSED: _ClassVar[SessionState]
    SESSION_STATE_SUBMITTED: _ClassVar[SessionState]
    SESSION_STATE_ABANDONED: _ClassVar[SessionState]
GROUP_STATE_UNSPECIFIED: GroupState
GROUP_STATE_WAITING: GroupState
GROUP_STATE_QUEUED: GroupState
GROUP_STATE_ACCEPTED: GroupState
GROUP_STATE_SKIPPED: GroupState
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_OPEN: SessionState
SESSION_STATE_CLOSED: SessionState
SESSION_STATE_SUBMITTED: SessionState
SESSION_STATE_ABANDONED: SessionState

class SessionSampling(_message.Message):
    __slots__ = ("temperature",)
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    def __init__(self, temperature: _Optional[float] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "group_key", "group_size", "sampling", "metadata", "task_id", "open_id")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    group_key: str
    group_size: int
    sampling: SessionSampling
    metadata: _containers.ScalarMap[str, str]
    task_id: str
    open_id: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., group_key: _Optional[str] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SessionSampling, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., task_id: _Optional[str] = ..., open_id: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "policy_version", "server_id", "prompt_token_ids", "max_model_len")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    policy_version: int
    server_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    def __init__(self, session_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., server_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "max_tokens", "stop_token_ids", "expected_length", "stream_interval", "top_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    expected_length: int
    stream_interval: int
    top_logprobs: int
    def __init__(self, session_id: _Optional[str] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., expected_length: _Optional[int] = ..., stream_interval: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finished", "finish_reason", "version_spans", "routed_experts", "turn_index", "session_length", "top_token_ids", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    finish_reason: _rollout_pb2.FinishReason
    version_spans: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.VersionSpan]
    routed_experts: _rollout_pb2.Tensor
    turn_index: int
    session_length: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_rollout_pb2.FinishReason, str]] = ..., version_spans: _Optional[_Iterable[_Union[_rollout_pb2.VersionSpan, _Mapping]]] = ..., routed_experts: _Optional[_Union[_rollout_pb2.Tensor, _Mapping]] = ..., turn_index: _Optional[int] = ..., session_length: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "expected_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    expected_length: int
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., expected_length: _Optional[int] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("turn_index", "session_length")
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    turn_index: int
    session_length: int
    def __init__(self, turn_index: _Optional[int] = ..., session_length: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "abandon")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    abandon: bool
    def __init__(self, session_id: _Optional[str] = ..., abandon: _Optional[bool] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("session_id", "submission_id", "reward", "expected_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    submission_id: str
    reward: float
    expected_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., submission_id: _Optional[str] = ..., reward: _Optional[float] = ..., expected_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("group_state", "sessions_submitted", "group_size", "group_id")
    GROUP_STATE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_state: GroupState
    sessions_submitted: int
    group_size: int
    group_id: str
    def __init__(self, group_state: _Optional[_Union[GroupState, str]] = ..., sessions_submitted: _Optional[int] = ..., group_size: _Optional[int] = ..., group_id: _Optional[str] = ...) -> None: ...

class SetRewardRequest(_message.Message):
    __slots__ = ("session_id", "reward")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reward: float
    def __init__(self, session_id: _Optional[str] = ..., reward: _Optional[float] = ...) -> None: ...

class SetRewardResponse(_message.Message):
    __slots__ = ("group_state",)
    GROUP_STATE_FIELD_NUMBER: _ClassVar[int]
    group_state: GroupState
    def __init__(self, group_state: _Optional[_Union[GroupState, str]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("generated", "token_ids", "logprobs", "finish_reason", "version_spans", "routed_experts", "top_token_ids", "top_logprobs")
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    generated: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _rollout_pb2.FinishReason
    version_spans: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.VersionSpan]
    routed_experts: _rollout_pb2.Tensor
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, generated: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_rollout_pb2.FinishReason, str]] = ..., version_spans: _Optional[_Iterable[_Union[_rollout_pb2.VersionSpan, _Mapping]]] = ..., routed_experts: _Optional[_Union[_rollout_pb2.Tensor, _Mapping]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "state", "group_key", "policy_version", "server_id", "prompt_token_ids", "turns", "session_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    state: SessionState
    group_key: str
    policy_version: int
    server_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    session_length: int
    def __init__(self, session_id: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ..., group_key: _Optional[str] = ..., policy_version: _Optional[int] = ..., server_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., session_length: _Optional[int] = ...) -> None: ...
