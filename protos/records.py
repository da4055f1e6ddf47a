"""msgspec records that travel through Redis and the weight bus.

Rules (see docs/architecture.md): records are append-only (new fields last, with a default, marked
``# added in vN``), arrays are ``Array`` (bytes + dtype + shape), enums are IntEnum, no pickle.
Each record names its producer -> consumer.
"""

from __future__ import annotations

import enum

import msgspec
import numpy as np


class Array(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A dense array as raw little-endian bytes; used inside other records."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> Array:
        array = np.ascontiguousarray(array)
        if array.dtype.byteorder == ">":  # the wire is little-endian; dtype names carry no byte order
            array = array.astype(array.dtype.newbyteorder("<"))
        return cls(data=array.tobytes(), dtype=array.dtype.name, shape=tuple(array.shape))

    def to_numpy(self) -> np.ndarray:
        expected = int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize
        if len(self.data) != expected:
            raise ValueError(
                f"Array.data has {len(self.data)} bytes, dtype {self.dtype} shape {self.shape} needs {expected}"
            )
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)


class FinishReason(enum.IntEnum):
    """Why a sample ended. The values are rollout.proto's ``FinishReason`` too (FINISH_REASON_<NAME>), so the one
    enum serves the gRPC messages and the records (tests/protos checks they agree)."""

    UNSPECIFIED = 0
    STOP = 1  # EOS or a stop token
    LENGTH = 2  # max_tokens reached
    ABORT = 3
    ERROR = 4

    @classmethod
    def from_engine(cls, name: str | None) -> FinishReason:
        """vLLM's finish reason ('stop', 'length', 'abort', 'error'); anything else is UNSPECIFIED."""
        return cls.__members__.get((name or "").upper(), cls.UNSPECIFIED)


class VersionSpan(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Tokens ``[start, end)`` of a response were produced by policy ``version``."""

    version: int
    start: int
    end: int


class Sample(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One response of a group. Producer: coordinator (from rollout output) -> trainer."""

    response_token_ids: Array  # int32 [T]
    rollout_logprobs: Array  # float32 [T], logprob of each sampled token under the rollout policy
    version_spans: list[VersionSpan]
    finish_reason: FinishReason
    reward: float
    server_id: str = ""
    routed_experts: Array | None = None  # [prompt + T - 1, layers, top_k], as vLLM returns them
    error: str = ""
    # added in v2: uint8 [T], 1 = trained (the engine generated it), 0 = appended by an agent (a tool result, a user
    # turn: context, not trained); None = every token trained
    loss_mask: Array | None = None

    @property
    def min_version(self) -> int:
        return min((span.version for span in self.version_spans), default=-1)


class TrajectoryGroup(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One prompt and its n samples: the unit on the trajectory stream.

    Producer: coordinator -> consumer: trainer (Redis Stream ``fleetrl:<run>:trajectories``).
    """

    group_id: str
    prompt_id: str
    prompt_token_ids: Array  # int32 [P]
    samples: list[Sample]
    data_source: str
    admission_index: int  # 0-based order in which the coordinator admitted the prompt
    admitted_at_version: int  # trainer policy version when admitted
    created_s: float  # wall time the group was completed
    # The temperature its samples were drawn at (it can change live); < 0: not recorded, the trainer's own applies.
    sampling_temperature: float = -1.0


class TensorEntry(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Where one tensor lies in the buckets of a published version."""

    name: str  # HF checkpoint layout name
    dtype: str  # torch dtype name of the payload, e.g. "float32", "bfloat16", "float8_e4m3fn"
    shape: tuple[int, ...]
    codec: str  # "raw" | "mxfp8" (then a companion "<name>_scale" entry exists)
    bucket: int
    offset: int  # byte offset inside the bucket
    nbytes: int
    checksum: int  # crc32 of the tensor bytes


class LoraAdapter(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """What a manifest's tensors are when they are a LoRA adapter rather than weights: PEFT names
    (``base_model.model.<HF module>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]; routed experts one module
    per expert), served in vLLM's LoRA slot on the frozen base. Inside ``WeightManifest`` (trainer -> rollout servers).
    """

    rank: int  # adapter_config.json ``r``: the dense adapters' rank
    alpha: float  # ``lora_alpha``: vLLM scales every delta by alpha / rank
    target_modules: list[str]  # the HF module names adapted (q_proj, o_proj, gate_proj, ...)
    # The routed experts' rank (rank / top_k with normalize_moe_lora; 0 = no expert adapters). Their lora_B carries
    # the factor rank / expert_rank, so vLLM's one scale alpha / rank gives the trainer's alpha / expert_rank.
    expert_rank: int = 0


class WeightManifest(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A published policy version. Producer: trainer (weight bus) -> rollout servers."""

    version: int
    tensors: list[TensorEntry]
    bucket_nbytes: list[int]
    publisher_address: str  # "host:port" of the tcp publisher holding the buckets
    transport: str  # "tcp" | "nccl"
    created_s: float
    adapter: LoraAdapter | None = None  # added in v2: the tensors are this LoRA adapter (None: weights)
    # added in v3: False while the entries' checksums are not computed yet (transport 'ipc' announces a version as
    # soon as its device buckets are packed; the checksummed manifest replaces it once the host copy is held)
    checksummed: bool = True


class ReportStatus(enum.IntEnum):
    OK = 0
    STALE = 1  # could not receive the version; still serving an older one
    FAILED = 2


ROLLOUT_RATE_WINDOW_S = 10.0  # VersionReport.tokens_per_s and every displayed rollout tokens/s average this long


class VersionReport(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A rollout server's registration: address, current policy version, load. Producer: rollout server ->
    coordinator (discovery, routing), launchers, CLI."""

    server_id: str
    address: str
    policy_version: int
    status: ReportStatus
    message: str
    time_s: float
    update_s: float = 0.0  # added in v2: seconds the last weight update took (receive + commit; 0 = none yet)
    paused_s: float = 0.0  # added in v2: seconds generation was paused for that update's commit
    # added in v3: the heartbeat. The server re-sends its report every rollout.heartbeat_interval_s (time_s is the
    # last beat) with its engine's load, and the coordinator discovers servers from these reports.
    running: int = 0  # added in v3: requests the engine's scheduler is running
    waiting: int = 0  # added in v3: requests waiting in the engine's scheduler
    capacity: int = 0  # added in v3: sequences the engine schedules at once (rollout.max_num_seqs); 0 = unknown
    tokens_per_s: float = 0.0  # added in v4: tokens the engine generated per second, the last ROLLOUT_RATE_WINDOW_S


class MetricsReport(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Periodic figures of one role, an entry of its metrics stream (channels/metrics_stream.py). Producer: any role
    (trainer rank 0, coordinator, each rollout server) -> coordinator dashboard, demo launcher, CLI."""

    role: str
    step: int
    policy_version: int
    time_s: float
    values: dict[str, float]
    source: str = ""  # added in v2: which instance of the role wrote it (a rollout server's id; "" = the only one)


class NcclGroup(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """The NCCL broadcast group of one generation. Producer: trainer (weight_bus.nccl) -> rollout subscribers."""

    generation: int
    unique_id: bytes  # ncclUniqueId (128 bytes)
    members: list[str]  # members[i] has rank i + 1; rank 0 is the publisher
    created_s: float

    @property
    def world_size(self) -> int:
        return 1 + len(self.members)

    def rank_of(self, member_id: str) -> int | None:
        return self.members.index(member_id) + 1 if member_id in self.members else None


class NcclRound(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One version's broadcast, written before its first byte. Producer: trainer -> subscribers."""

    generation: int
    version: int
    bucket_nbytes: list[int]
    buffer_nbytes: int  # size of each of the two rotating device buffers
    created_s: float


class NcclMember(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A subscriber's heartbeat. Producer: subscriber -> trainer (group membership, rebuild decisions)."""

    member_id: str
    generation: int  # generation it is joining or has joined (0 = none yet)
    version: int  # policy version it holds
    time_s: float  # written by its heartbeat thread: the process lives
    progress_s: float  # last poll of its receive loop: it takes part in broadcasts

    def is_alive(self, now: float, timeout_s: float) -> bool:
        return now - self.time_s <= timeout_s and now - self.progress_s <= timeout_s


class OrderKind(enum.IntEnum):
    TRAIN = 0  # one step's groups
    CONTROL = 1  # operator commands (sync, set) to apply on every rank at the same point
    STOP = 2  # rank 0 was asked to stop: every rank leaves at this step boundary
    ERROR = 3  # rank 0 failed: every rank raises


class StepOrder(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """What a multi-rank trainer does next. Producer: trainer rank 0 -> its other ranks (trainer_service.ranks),
    over a torch.distributed broadcast, once per step and once per batch of control commands."""

    kind: OrderKind
    groups: list[TrajectoryGroup] = []
    sync: bool = False
    settings: list[tuple[str, str]] = []  # (key, JSON value) of ``set`` commands
    message: str = ""


class PromptCursor(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Where a restarted coordinator resumes its prompt stream. Producer: the coordinator, with each group it pushes
    (in one server-side step with the XADD, RedisKeys.prompt_cursor); consumer: the next coordinator of the run."""

    task: str  # the task's name: "echo", "tail" or the dataset's
    group_id: str  # the group pushed with it: a push retried after a lost reply finds here that it landed
    position: dict[str, int]  # the task's position before the first draw of the earliest unpushed slot


class RoleDone(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A role finished its run: the last entry it writes to its metrics stream, field ``d`` (reports are field
    ``m``). Producer: the trainer after its last step -> the demo launcher, the dashboard, tests."""

    role: str
    steps: int  # steps the role took
    policy_version: int
    time_s: float


class ControlKind(enum.IntEnum):
    SYNC = 1  # publish the current weights now
    SET = 2  # a run-time setting changed


class ControlCommand(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """An operator's command to the other roles, one entry of RedisKeys.control (field ``c``). Producer: the
    coordinator's admin API (fleetrl set / sync) -> the trainer (and any role that reads the control stream)."""

    kind: ControlKind
    request_id: str
    key: str = ""  # SET: the dotted config key, e.g. max_staleness
    value_json: str = ""  # SET: the new value as JSON; each role applies the keys it uses and ignores the others


class CudaIpcBucket(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One device bucket of a version, shared by a CUDA IPC handle (the fields of torch's ``reduce_tensor`` for a
    1-D uint8 CUDA tensor). Inside ``CudaIpcVersion``."""

    nbytes: int
    storage_offset: int  # the tensor's offset in its storage, in elements (bytes: uint8)
    handle: bytes  # cudaIpcMemHandle of the allocation
    storage_size_bytes: int
    storage_offset_bytes: int  # the storage's offset in the allocation
    ref_counter_handle: bytes  # torch's shared ref counter: the producer frees nothing a consumer still holds
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class CudaIpcVersion(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A version's buckets on the trainer's GPU, for rollout engines on the same GPU. Producer: trainer (weight_bus
    ipc publisher, RedisKeys.ipc_buckets) -> rollout workers; the manifest says where each tensor lies in them."""

    version: int
    device_uuid: str  # the GPU holding the buckets; a worker on another GPU cannot open them
    producer_pid: int  # a process cannot open its own IPC handles
    buckets: list[CudaIpcBucket]


_encoder = msgspec.msgpack.Encoder()
_group_decoder = msgspec.msgpack.Decoder(TrajectoryGroup)
_manifest_decoder = msgspec.msgpack.Decoder(WeightManifest)
_report_decoder = msgspec.msgpack.Decoder(VersionReport)
_metrics_decoder = msgspec.msgpack.Decoder(MetricsReport)


def encode(record: msgspec.Struct) -> bytes:
    return _encoder.encode(record)


def decode_group(data: bytes) -> TrajectoryGroup:
    return _group_decoder.decode(data)


def decode_manifest(data: bytes) -> WeightManifest:
    return _manifest_decoder.decode(data)


def decode_report(data: bytes) -> VersionReport:
    return _report_decoder.decode(data)


def decode_metrics(data: bytes) -> MetricsReport:
    return _metrics_decoder.decode(data)


_nccl_group_decoder = msgspec.msgpack.Decoder(NcclGroup)
_nccl_round_decoder = msgspec.msgpack.Decoder(NcclRound)
_nccl_member_decoder = msgspec.msgpack.Decoder(NcclMember)


def decode_nccl_group(data: bytes) -> NcclGroup:
    return _nccl_group_decoder.decode(data)


def decode_nccl_round(data: bytes) -> NcclRound:
    return _nccl_round_decoder.decode(data)


def decode_nccl_member(data: bytes) -> NcclMember:
    return _nccl_member_decoder.decode(data)


_order_decoder = msgspec.msgpack.Decoder(StepOrder)


def decode_order(data: bytes) -> StepOrder:
    return _order_decoder.decode(data)


_done_decoder = msgspec.msgpack.Decoder(RoleDone)


def decode_done(data: bytes) -> RoleDone:
    return _done_decoder.decode(data)


_control_decoder = msgspec.msgpack.Decoder(ControlCommand)


def decode_control(data: bytes) -> ControlCommand:
    return _control_decoder.decode(data)


_ipc_version_decoder = msgspec.msgpack.Decoder(CudaIpcVersion)


def decode_ipc_version(data: bytes) -> CudaIpcVersion:
    return _ipc_version_decoder.decode(data)


_cursor_decoder = msgspec.msgpack.Decoder(PromptCursor)


def decode_cursor(data: bytes) -> PromptCursor:
    return _cursor_decoder.decode(data)
