"""WeightFollower: keeps a rollout server on the trainer's latest published policy version.

Sequence per version (docs/architecture.md): receive manifest + buckets into staging -> verify
checksums -> pause(keep) -> load -> label v -> resume -> report v to Redis. A version that cannot be
received or verified is reported STALE and the server stays on its old version, never half-loaded.
Bytes come from the publisher, or from its disk snapshot (``weight_bus.snapshot_dir``) when it is
unreachable; MXFP8 manifests are dequantized to the engine's dtype inside the worker at load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from channels.retry import UNREACHABLE
from channels.version_board import AsyncVersionBoard
from protos.config import WeightBusConfig
from protos.records import ReportStatus, VersionReport, WeightManifest, encode
from protos.redis_keys import RedisKeys
from rollout_service import metrics
from rollout_service.engine_protocol import GenerationEngine
from rollout_service.staging import StagingFile
from rollout_service.vllm_adapter import serves_mxfp8_checkpoint
from weight_bus import packing, receiver, tcp
from weight_bus.ipc import IpcUnavailable

logger = logging.getLogger(__name__)
# A failed update (the publisher unreachable, a manifest expired) is tried again this often until it succeeds: the
# next announcement may never come (a restarted trainer waits for groups that only an updated server can make).
FAILED_UPDATE_RETRY_S = 2.0

CHECKSUM_POLL_S = 0.05  # how often a tcp receiver of an ipc version looks for its checksummed manifest
STAGING_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class UpdateConflict(Exception):
    """A weight-update step asked for in the wrong state (nothing begun, another version pending, ...)."""


@dataclass
class PendingUpdate:
    """A begun update: the manifest of ``version`` and the staging file its buckets go into."""

    version: int
    manifest: WeightManifest
    path: str
    loaded: bool = False
    ipc_record: bytes | None = None  # transport 'ipc': the trainer's device buckets, opened by the engine itself
    source: str = ""  # where its bytes come from: ipc | publisher | snapshot | nccl


class WeightFollower:
    """Follows the weight announcements of one run and applies new versions to ``engine``.

    An update is three steps, each callable on its own through gRPC (begin, load, commit) or all at
    once (``update_to``); one version may be pending at a time.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        client: aioredis.Redis,
        keys: RedisKeys,
        config: WeightBusConfig,
        address: str,
        nccl_subscriber_factory=None,
    ):
        self.engine = engine
        # transport 'nccl': makes the NcclWeightSubscriber this server takes part in broadcasts with (None: tcp only)
        self.nccl_subscriber_factory = nccl_subscriber_factory
        self.client = client
        self.keys = keys
        self.board = AsyncVersionBoard(client, keys)
        self.config = config
        self.address = address
        self.last_update_s = 0.0  # receive + commit of the last version (reported with the version)
        self.last_paused_s = 0.0
        self.last_receive_s = 0.0  # receive + verify of the last version's bytes into staging (0 for ipc)
        self.last_source = ""  # where the last committed version came from: ipc | publisher | snapshot | nccl
        self.pending: PendingUpdate | None = None
        # The last report's status and message: what the heartbeat repeats (rollout_service.heartbeat).
        self.last_status, self.last_message = ReportStatus.OK, ""
        self.registered = True  # False once the server left the fleet hash at shutdown
        receiver.check_receive_mode(config.receive_mode, _serves_mxfp8(engine), _cuda_available())
        # The announcement follower and gRPC calls may race for the same version.
        self._lock = asyncio.Lock()

    async def report(self, status: ReportStatus = ReportStatus.OK, message: str = "", changed: bool = True) -> None:
        """Register the server in the fleet hash with its version, status and load (also the heartbeat's beat, which
        passes ``changed=False``: a beat wakes no coordinator)."""
        if not self.registered:  # a commit finishing during shutdown must not register the leaving server again
            return
        self.last_status, self.last_message = status, message
        engine = self.engine
        running, waiting, _ = engine.load()
        report = VersionReport(
            engine.server_id,
            self.address,
            engine.policy_version,
            status,
            message,
            time.time(),
            self.last_update_s,
            self.last_paused_s,
            running=running,
            waiting=waiting,
            capacity=engine.config.max_num_seqs,
            tokens_per_s=metrics.current_rate(),
        )
        await self.board.report_version(report, changed)

    async def begin(self, version: int) -> PendingUpdate:
        """Reserve staging for ``version`` (0 = latest); replaces an older pending update."""
        async with self._lock:
            return await self._begin_locked(version)

    async def load(self, version: int) -> int:
        """Receive and verify the pending version's buckets; returns the bytes received."""
        async with self._lock:
            pending = self._expect_pending(version, loaded=False)
            await self._load_locked(pending)
            return packing.total_nbytes(pending.manifest)

    async def commit(self, version: int) -> float:
        """Put the loaded pending version in force; returns the seconds generation was paused."""
        async with self._lock:
            return await self._commit_locked(self._expect_pending(version, loaded=True))

    async def abort(self) -> int:
        """Drop the pending update, if any; returns its version (0 = none)."""
        async with self._lock:
            version = self.pending.version if self.pending else 0
            self._drop_pending()
            return version

    async def update_to(self, version: int) -> int:
        """Begin, load and commit ``version`` (0 = latest); returns the version in force afterwards.

        Asking for a version the server already has (or has passed) is not an error.
        """
        async with self._lock:
            target = version if version > 0 else await self._latest_version()
            if target <= self.engine.policy_version:
                return self.engine.policy_version
            started = time.monotonic()
            pending = self.pending if self.pending and self.pending.version == target else None
            pending = pending or await self._begin_locked(target)
            if not pending.loaded:
                await self._load_locked(pending)
            paused_s = await self._commit_locked(pending, started)
            metrics.UPDATE_SECONDS.observe(self.last_update_s)
            logger.info(
                "server %s policy_version=%d committed in %.2fs (generation held %.2fs, engine %s)",
                self.engine.server_id,
                target,
                self.last_update_s,
                paused_s,
                "paused" if self.engine.last_commit_paused else "idle: not paused",
            )
            return target

    async def _begin_locked(self, version: int) -> PendingUpdate:
        if version <= 0:
            version = await self._latest_version()
        if version <= self.engine.policy_version:
            raise UpdateConflict(f"version {version} is not newer than the server's v{self.engine.policy_version}")
        manifest = await self.board.manifest(version)
        # A late or restarted server whose Redis lost the manifest still finds it with the snapshot.
        manifest = receiver.resolve_manifest(manifest, version, self.config.snapshot_dir)
        if manifest is None:
            raise LookupError(f"no manifest for policy version {version} in Redis")
        self._drop_pending()
        path = os.path.join(STAGING_DIR, f"fleetrl-{self.engine.server_id}-v{version}")
        self.pending = PendingUpdate(version, manifest, path, ipc_record=await self._openable_ipc(manifest))
        return self.pending

    async def _openable_ipc(self, manifest: WeightManifest) -> bytes | None:
        """The version's CUDA IPC record when this engine can load it straight from the trainer's GPU, else None
        (the bytes then come over tcp). Single-GPU engines only: ranks on other GPUs could not open the buckets."""
        config = self.engine.config
        if not self.engine.loads_weight_bytes:
            return None
        if manifest.transport != "ipc" or config.tensor_parallel_size * config.pipeline_parallel_size != 1:
            return None
        record = await self.board.ipc_record(manifest.version)
        if record is None:
            return None
        reason = await self.engine.ipc_unopenable_reason(record)
        if reason:
            logger.info("server %s: v%d over tcp, not IPC: %s", self.engine.server_id, manifest.version, reason)
            return None
        return record

    async def _latest_version(self) -> int:
        # Redis is the truth; after Redis lost its keys the newest snapshot still says how far the trainer got.
        latest = await self.board.latest_version()
        return max(latest, receiver.latest_snapshot_version(self.config.snapshot_dir))

    async def _load_locked(self, pending: PendingUpdate) -> None:
        if pending.ipc_record is not None:  # the engine reads the trainer's device buckets at commit
            pending.loaded, pending.source, self.last_receive_s = True, "ipc", 0.0
            return
        if not self.engine.loads_weight_bytes:  # the synthetic stand-in only labels the version
            pending.loaded, pending.source, self.last_receive_s = True, "synthetic", 0.0
            return
        started = time.monotonic()
        try:
            pending.manifest = await self._checksummed(pending.manifest)
            pending.source = await asyncio.to_thread(self._receive, pending.manifest, pending.path)
            self.last_receive_s = time.monotonic() - started
        except BaseException:
            self._drop_pending()  # a half-received version is never committed
            raise
        pending.loaded = True

    async def _checksummed(self, manifest: WeightManifest) -> WeightManifest:
        """``manifest`` with its checksums: an ipc version is announced before its host copy is held and checksummed
        (weight_bus.ipc.HostMirror); a receiver over tcp waits for the stored manifest that has them."""
        deadline = time.monotonic() + self.config.fetch_timeout_s
        while not manifest.checksummed:
            if time.monotonic() > deadline:
                raise tcp.WeightUnavailableError(
                    f"v{manifest.version}: the trainer's host copy (checksums, tcp hold) did not come within "
                    f"weight_bus.fetch_timeout_s={self.config.fetch_timeout_s}s"
                )
            await asyncio.sleep(CHECKSUM_POLL_S)
            stored = await self.board.manifest(manifest.version)
            if stored is None:
                raise LookupError(f"the manifest of v{manifest.version} expired before its host copy was held")
            manifest = stored
        return manifest

    async def _commit_locked(self, pending: PendingUpdate, started: float | None = None) -> float:
        """Commit ``pending``; ``started`` (monotonic) is when its update began, for the reported duration."""
        timeout_s = self.config.load_timeout_s
        try:
            try:
                paused_s = await self.engine.commit_weights(
                    pending.version, pending.path, encode(pending.manifest), pending.ipc_record, timeout_s
                )
            except IpcUnavailable as error:  # nothing was loaded: take the version over tcp instead
                logger.warning("server %s: %s; receiving v%d over tcp", self.engine.server_id, error, pending.version)
                pending.ipc_record, pending.loaded = None, False
                await self._load_locked(pending)
                paused_s = await self.engine.commit_weights(
                    pending.version, pending.path, encode(pending.manifest), None, timeout_s
                )
        finally:
            self._drop_pending()
        metrics.UPDATE_PAUSE_SECONDS.observe(paused_s)
        self.last_paused_s, self.last_source = paused_s, pending.source
        if started is not None:
            self.last_update_s = time.monotonic() - started
        await self.report()
        return paused_s

    def _expect_pending(self, version: int, loaded: bool) -> PendingUpdate:
        pending = self.pending
        if pending is None:
            raise UpdateConflict(f"no weight update begun (server on v{self.engine.policy_version})")
        if version and version != pending.version:
            raise UpdateConflict(f"version {version} is not the pending one (v{pending.version})")
        if loaded and not pending.loaded:
            raise UpdateConflict(f"v{pending.version} is begun but not loaded; call LoadWeights first")
        if not loaded and pending.loaded:
            raise UpdateConflict(f"v{pending.version} is already loaded; commit or abort it")
        return pending

    def _drop_pending(self) -> None:
        if self.pending is not None and os.path.exists(self.pending.path):
            os.unlink(self.pending.path)
        self.pending = None

    def _receive(self, manifest: WeightManifest, path: str) -> str:
        """Receive ``manifest``'s bytes into the staging file at ``path``; returns where they came from."""
        with StagingFile(path) as staging:
            view = staging.view(packing.total_nbytes(manifest))
            if view is None:
                return "publisher"
            try:
                source = receiver.receive_into(manifest, view, self.config.fetch_timeout_s, self.config.snapshot_dir)
            finally:
                view.release()
        logger.info("server %s received v%d from the %s", self.engine.server_id, manifest.version, source)
        return source

    async def follow_broadcasts(self, stop: asyncio.Event, poll_s: float = 1.0) -> None:
        """transport 'nccl': take part in every broadcast (one rank of the trainer's group) into this server's
        staging file, then the same commit as a tcp version. A broadcast missed (joined late, failed, timed out)
        is caught up over tcp by ``run``, which sees the announcement; whichever path is first commits it."""
        subscriber = await asyncio.to_thread(self.nccl_subscriber_factory)
        path = os.path.join(STAGING_DIR, f"fleetrl-{self.engine.server_id}-nccl")
        try:
            while not stop.is_set():
                started = time.monotonic()
                with StagingFile(path) as staging:
                    try:
                        manifest = await asyncio.to_thread(
                            subscriber.receive, self.engine.policy_version, staging.view, poll_s
                        )
                    except TimeoutError:
                        continue  # nothing broadcast meanwhile; look at stop, then listen again
                    finally:
                        staging.release()
                async with self._lock:
                    if manifest.version > self.engine.policy_version:
                        self.pending = PendingUpdate(manifest.version, manifest, path, loaded=True, source="nccl")
                        await self._commit_locked(self.pending, started)
                        logger.info(
                            "server %s policy_version=%d committed from the nccl broadcast",
                            self.engine.server_id,
                            manifest.version,
                        )
        finally:
            await asyncio.to_thread(subscriber.close)

    async def run(self, stop: asyncio.Event) -> None:
        """Catch up to the latest version, then follow announcements until ``stop`` is set.

        Redis going away does not stop the server (it keeps generating on the version it has): the follower waits
        for Redis to come back and then catches up to the latest version, whatever it missed meanwhile.
        """
        last_id, catch_up = "$", True
        while not stop.is_set():
            try:
                if catch_up:
                    catch_up = not await self._try_update(0)
                last_id, announced = await self.board.wait_for_announcement(last_id, timeout_s=1.0)
                if announced is not None:
                    catch_up = not await self._try_update(0)
                elif catch_up:  # a failed update is retried without waiting for the next announcement
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=FAILED_UPDATE_RETRY_S)
            except UNREACHABLE as error:  # the loop is periodic: its next pass is the retry
                logger.warning(
                    "server %s (v%d): Redis unreachable, following again once it is back: %s",
                    self.engine.server_id,
                    self.engine.policy_version,
                    error,
                )
                catch_up = True
                try:
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
                except TimeoutError:
                    pass

    async def _try_update(self, version: int) -> bool:
        """Update to ``version`` (0: the latest); False when it failed and the server stays where it is."""
        try:
            await self.update_to(version)
            return True
        except (LookupError, OSError, ValueError, UpdateConflict, tcp.WeightUnavailableError) as error:
            # Stay on the old version and say so; the follower retries (run), the next announcement at once.
            metrics.UPDATE_FAILURES.inc()
            logger.warning("server %s stays on v%d: %s", self.engine.server_id, self.engine.policy_version, error)
            await self.report(ReportStatus.STALE, str(error))
            return False


def _serves_mxfp8(engine: GenerationEngine) -> bool:
    """Whether the engine serves an MXFP8 checkpoint (then it loads (q, scale) pairs, not bf16). An engine that
    quantizes online (rollout.quantization='mxfp8') loads high-precision weights and quantizes them itself."""
    llm = getattr(engine, "_llm", None)
    return serves_mxfp8_checkpoint(getattr(getattr(llm, "model_config", None), "quantization", None))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
