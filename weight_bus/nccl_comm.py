"""The thin GPU layer of the NCCL weight bus: one non-blocking NCCL communicator.

cupy supplies NCCL (``cupy.cuda.nccl`` loads ``libnccl`` from its wheel and makes unique ids). Its
``NcclCommunicator`` is blocking only: ``ncclCommInitRank`` waits for every rank and a collective can
block the host while connecting to a dead peer, and its error table has no ``ncclInProgress``. The
calls a timeout needs (``ncclCommInitRankConfig`` with ``blocking = 0``, ``ncclCommGetAsyncError``,
``ncclCommAbort``) therefore go through ctypes on the same library. cupy is imported lazily, on first
use, so CPU machines never need it.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import time

from weight_bus.nccl_group import NCCL_IN_PROGRESS, NCCL_SUCCESS

NCCL_UINT8 = 1  # ncclUint8
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21400  # NCCL 2.14.0: the first with ncclConfig_t.blocking
_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT


class NcclError(RuntimeError):
    """An NCCL call failed; ``status`` is the ncclResult_t."""

    def __init__(self, status: int, what: str):
        self.status = status
        super().__init__(f"NCCL {what} failed: {_error_string(status)} (status {status})")


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class _Config(ctypes.Structure):
    # The prefix of ncclConfig_t up to ``blocking``; NCCL copies ``size`` bytes and defaults the rest.
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cga_cluster_size", ctypes.c_int),
    ]


def _find_library() -> ctypes.CDLL:
    import cupy.cuda.nccl as cupy_nccl  # noqa: F401 - preloads libnccl from the cupy / nvidia-nccl wheel

    if not cupy_nccl.available:
        raise RuntimeError("weight bus (nccl): cupy was built without NCCL; install nvidia-nccl-cu12/13")
    candidates = ["libnccl.so.2", "libnccl.so"]
    try:
        import nvidia.nccl

        for root in nvidia.nccl.__path__:
            candidates += glob.glob(os.path.join(root, "lib", "libnccl.so*"))
    except ImportError:
        pass
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError(f"weight bus (nccl): libnccl not found (tried {candidates})")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    lib = _find_library()
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetErrorString.argtypes = [ctypes.c_int]
    lib.ncclCommInitRankConfig.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        _UniqueId,
        ctypes.c_int,
        ctypes.POINTER(_Config),
    ]
    lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
    lib.ncclBroadcast.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return lib


def _error_string(status: int) -> str:
    try:
        return library().ncclGetErrorString(status).decode()
    except (RuntimeError, ImportError):
        return "unknown error"


def nccl_version() -> int:
    version = ctypes.c_int()
    status = library().ncclGetVersion(ctypes.byref(version))
    if status != NCCL_SUCCESS:
        raise NcclError(status, "ncclGetVersion")
    return version.value


def new_unique_id() -> bytes:
    """A fresh ncclUniqueId (128 bytes) for a new group generation."""
    from cupy.cuda import nccl as cupy_nccl

    return bytes(byte & 0xFF for byte in cupy_nccl.get_unique_id())


class NcclCommunicator:
    """A non-blocking communicator: every call returns at once; ``wait_ready`` polls with a deadline."""

    def __init__(self, unique_id: bytes, world_size: int, rank: int):
        if len(unique_id) != 128:
            raise ValueError(f"ncclUniqueId must be 128 bytes, got {len(unique_id)}")
        uid = _UniqueId.from_buffer_copy(unique_id)  # (``uid.internal`` would be a bytes copy, not the field)
        config = _Config(ctypes.sizeof(_Config), _CONFIG_MAGIC, _CONFIG_VERSION, 0, _UNDEF_INT)
        self._comm = ctypes.c_void_p()
        self.world_size, self.rank = world_size, rank
        status = library().ncclCommInitRankConfig(ctypes.byref(self._comm), world_size, uid, rank, ctypes.byref(config))
        if status not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclError(status, f"init of rank {rank}/{world_size}")

    @property
    def alive(self) -> bool:
        return bool(self._comm.value)

    def async_error(self) -> int:
        """ncclSuccess, ncclInProgress (init or a call still running) or the error that broke the group."""
        if not self.alive:
            return NCCL_SUCCESS
        result = ctypes.c_int(NCCL_SUCCESS)
        status = library().ncclCommGetAsyncError(self._comm, ctypes.byref(result))
        return status if status != NCCL_SUCCESS else result.value

    def wait_ready(self, timeout_s: float, what: str, poll_s: float = 0.01) -> None:
        """Poll until the last call (init or an enqueue) finished; abort and raise on error or timeout."""
        deadline = time.monotonic() + timeout_s
        while (state := self.async_error()) == NCCL_IN_PROGRESS:
            if time.monotonic() >= deadline:
                self.abort()
                raise TimeoutError(f"weight bus (nccl): {what} not done after {timeout_s:.1f}s; communicator aborted")
            time.sleep(poll_s)
        if state != NCCL_SUCCESS:
            self.abort()
            raise NcclError(state, what)

    def broadcast(self, buffer, nbytes: int, root: int, stream: int, timeout_s: float) -> None:
        """Enqueue an in-place broadcast of the first ``nbytes`` of device tensor ``buffer`` on ``stream``.

        Returns once enqueued (connection setup included, bounded by ``timeout_s``); completion is
        watched by the caller through a CUDA event and ``async_error``.
        """
        pointer = buffer.data_ptr()
        status = library().ncclBroadcast(pointer, pointer, nbytes, NCCL_UINT8, root, self._comm, stream)
        if status not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            self.abort()
            raise NcclError(status, "broadcast")
        self.wait_ready(timeout_s, f"enqueueing a {nbytes}-byte broadcast")

    def abort(self) -> None:
        """Abort uncompleted operations and free the communicator; never blocks on peers."""
        if self.alive:
            library().ncclCommAbort(self._comm)
            self._comm = ctypes.c_void_p()

    close = abort
