from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_PAUSED: _ClassVar[RunState]
    RUN_STATE_DRAINING: _ClassVar[RunState]
    RUN_STATE_DRAINED: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_PAUSED: RunState
RUN_STATE_DRAINING: RunState
RUN_STATE_DRAINED: RunState
RUN_STATE_FINISHED: RunState

class ServerStatus(_message.Message):
    __slots__ = ("address", "server_id", "healthy", "policy_version", "inflight", "requests", "failures")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    address: str
    server_id: str
    healthy: bool
    policy_version: int
    inflight: int
    requests: int
    failures: int
    def __init__(self, address: _Optional[str] = ..., server_id: _Optional[str] = ..., healthy: _Optional[bool] = ..., policy_version: _Optional[int] = ..., inflight: _Optional[int] = ..., requests: _Optional[int] = ..., failures: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("run_id", "state", "trainer_policy_version", "start_policy_version", "max_staleness", "groups_per_step", "group_size", "groups_admitted", "slots_admitted", "admission_limit", "groups_pushed", "total_groups", "groups_in_flight", "groups_skipped", "redispatches", "queue_depth", "max_staleness_at_push", "tokens_per_s", "groups_per_s", "uptime_s", "servers", "eval", "eval_version", "next_eval_version", "task")
    class EvalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    START_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_LIMIT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    REDISPATCHES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_AT_PUSH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    EVAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEXT_EVAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    trainer_policy_version: int
    start_policy_version: int
    max_staleness: int
    groups_per_step: int
    group_size: int
    groups_admitted: int
    slots_admitted: int
    admission_limit: int
    groups_pushed: int
    total_groups: int
    groups_in_flight: int
    groups_skipped: int
    redispatches: int
    queue_depth: int
    max_staleness_at_push: int
    tokens_per_s: float
    groups_per_s: float
    uptime_s: float
    servers: _containers.RepeatedCompositeFieldContainer[ServerStatus]
    eval: _containers.ScalarMap[str, float]
    eval_version: int
    next_eval_version: int
    task: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., trainer_policy_version: _Optional[int] = ..., start_policy_version: _Optional[int] = ..., max_staleness: _Optional[int] = ..., groups_per_step: _Optional[int] = ..., group_size: _Optional[int] = ..., groups_admitted: _Optional[int] = ..., slots_admitted: _Optional[int] = ..., admission_limit: _Optional[int] = ..., groups_pushed: _Optional[int] = ..., total_groups: _Optional[int] = ..., groups_in_flight: _Optional[int] = ..., groups_skipped: _Optional[int] = ..., redispatches: _Optional[int] = ..., queue_depth: _Optional[int] = ..., max_staleness_at_push: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., groups_per_s: _Optional[float] = ..., uptime_s: _Optional[float] = ..., servers: _Optional[_Iterable[_Union[ServerStatus, _Mapping]]] = ..., eval: _Optional[_Mapping[str, float]] = ..., eval_version: _Optional[int] = ..., next_eval_version: _Optional[int] = ..., task: _Optional[str] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    def __init__(self, state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    def __init__(self, state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("wait_s",)
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    wait_s: float
    def __init__(self, wait_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("state", "groups_in_flight", "groups_pushed")
    STATE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    groups_in_flight: int
    groups_pushed: int
    def __init__(self, state: _Optional[_Union[RunState, str]] = ..., groups_in_flight: _Optional[int] = ..., groups_pushed: _Optional[int] = ...) -> None: ...

class SetConfigRequest(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class SetConfigResponse(_message.Message):
    __slots__ = ("key", "old_value", "new_value", "control_entry_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUE_FIELD_NUMBER: _ClassVar[int]
    NEW_VALUE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    old_value: str
    new_value: str
    control_entry_id: str
    def __init__(self, key: _Optional[str] = ..., old_value: _Optional[str] = ..., new_value: _Optional[str] = ..., control_entry_id: _Optional[str] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("wait_s",)
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    wait_s: float
    def __init__(self, wait_s: _Optional[float] = ...) -> None: ...

class SyncResponse(_message.Message):
    __slots__ = ("control_entry_id", "published", "policy_version")
    CONTROL_ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    control_entry_id: str
    published: bool
    policy_version: int
    def __init__(self, control_entry_id: _Optional[str] = ..., published: _Optional[bool] = ..., policy_version: _Optional[int] = ...) -> None: ...

class AddServerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class AddServerResponse(_message.Message):
    __slots__ = ("server_id", "policy_version", "num_servers")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    policy_version: int
    num_servers: int
    def __init__(self, server_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., num_servers: _Optional[int] = ...) -> None: ...

class RemoveServerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RemoveServerResponse(_message.Message):
    __slots__ = ("num_servers", "inflight")
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_servers: int
    inflight: int
    def __init__(self, num_servers: _Optional[int] = ..., inflight: _Optional[int] = ...) -> None: ...
