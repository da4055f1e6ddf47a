"""The version board: what the trainer has published for the fleet to load, and what each server serves.

Keys (names: protos/redis_keys.py; records: protos/records.py):

* ``version`` (int): the trainer's latest published policy version; rank 0 is its only writer.
* ``version_offset`` (int): the trainer's policy version minus the steps it has taken (the coordinator's slot map).
* ``weights:<v>`` (``WeightManifest``) and ``weights:<v>:ipc`` (``CudaIpcVersion``): where version v's bytes are.
* ``weights:announce`` (stream, field ``v``): one entry per publish; rollout servers and ``fleetrl sync`` follow it.
* ``fleet`` (hash server id -> ``VersionReport``): the registry of rollout servers: each one's address, the version
  it has put in force and its load, re-sent as a heartbeat; a server removes its entry when it stops.
* ``fleet:changes`` (stream, field ``s``): one entry per changed report (not per heartbeat); the coordinator's fleet
  watcher wakes on it and on ``weights:announce`` instead of waiting for its next poll.

``VersionBoard`` takes a sync client (the trainer's rank 0, the weight bus's publishers and the nccl subscriber's
threads); ``AsyncVersionBoard`` an asyncio one (coordinator, rollout servers, dashboard). Outages: writes that are
idempotent retry through ``channels.retry``; reads propagate ``UNREACHABLE`` to the caller, whose loop decides.
"""

from __future__ import annotations

import logging

import msgspec
import redis
import redis.asyncio as aioredis

from channels.retry import retry_sync
from protos.records import (
    CudaIpcVersion,
    VersionReport,
    WeightManifest,
    decode_manifest,
    decode_report,
    encode,
)
from protos.redis_keys import RedisKeys, as_text

logger = logging.getLogger(__name__)

# How long a superseded manifest (and a dropped version's IPC record) stays readable: a server that began fetching
# it finishes. The latest manifest never expires: a server that (re)starts after a long step still finds the weights
# it must load.
MANIFEST_TTL_S = 3600
MAX_ANNOUNCEMENTS = 1000
MAX_FLEET_CHANGES = 1000  # entries kept on fleet_changes: only its newest ids matter (a wake-up, not a log)


class VersionBoard:
    """The board over a sync client: the trainer's writes, and the manifest reads of threads without a loop."""

    def __init__(self, client: redis.Redis, keys: RedisKeys):
        self.client = client
        self.keys = keys

    def latest_version(self) -> int:
        """The latest published version, or 0 before the first publish."""
        return int(self.client.get(self.keys.policy_version) or 0)

    def init_version(self, version: int) -> bool:
        """Set the version pointer only if no trainer has set it yet (SETNX); returns whether this call set it."""
        return bool(self.client.setnx(self.keys.policy_version, version))

    def set_version_offset(self, offset: int) -> None:
        """SET the trainer's ``policy_version - steps`` (RedisKeys.version_offset); repeating it changes nothing."""
        self.client.set(self.keys.version_offset, offset)

    def publish_manifest(self, manifest: WeightManifest, timeout_s: float = 60.0) -> None:
        """Store the manifest, then move the version pointer and announce it (one transaction); the manifest it
        supersedes starts to expire.

        A broken connection is retried for ``timeout_s``: repeating the transaction sets the same values, and a second
        announcement of a version is a no-op for the servers (they already hold it or fetch it once).
        """
        keys = self.keys

        def transaction() -> None:
            previous = self.client.get(keys.policy_version)
            pipe = self.client.pipeline(transaction=True)
            pipe.set(keys.manifest(manifest.version), encode(manifest))
            if previous is not None and int(previous) != manifest.version:
                pipe.expire(keys.manifest(int(previous)), MANIFEST_TTL_S)
            pipe.set(keys.policy_version, manifest.version)
            pipe.xadd(keys.weight_announcements, {"v": manifest.version}, maxlen=MAX_ANNOUNCEMENTS, approximate=True)
            pipe.execute()

        retry_sync(transaction, f"publishing the manifest of v{manifest.version}", timeout_s)

    def replace_manifest(self, manifest: WeightManifest, timeout_s: float = 60.0) -> bool:
        """Overwrite the stored manifest of an announced version (its checksummed form, transport 'ipc') without
        announcing anything or changing its expiry; False when it is gone already (expired: nobody can fetch it)."""
        key = self.keys.manifest(manifest.version)
        return bool(
            retry_sync(
                lambda: self.client.set(key, encode(manifest), xx=True, keepttl=True),
                f"storing the checksummed manifest of v{manifest.version}",
                timeout_s,
            )
        )

    def manifest(self, version: int) -> WeightManifest | None:
        """The manifest of ``version``, or None (never published, or expired)."""
        raw = self.client.get(self.keys.manifest(version))
        return decode_manifest(raw) if raw is not None else None

    def store_ipc_record(self, record: CudaIpcVersion, timeout_s: float = 60.0) -> None:
        """Post the device buckets' IPC handles of ``record.version`` (expiring like a superseded manifest); a SET of
        the same value, so retried for ``timeout_s``."""
        retry_sync(
            lambda: self.client.set(self.keys.ipc_buckets(record.version), encode(record), ex=MANIFEST_TTL_S),
            f"storing the IPC handles of v{record.version}",
            timeout_s,
        )

    def drop_ipc_record(self, version: int, timeout_s: float = 60.0) -> None:
        """Remove the IPC handles of ``version`` (a DEL, retried for ``timeout_s``; 0 tries once)."""
        retry_sync(
            lambda: self.client.delete(self.keys.ipc_buckets(version)),
            f"dropping the IPC handles of v{version}",
            timeout_s,
        )

    def fleet_reports(self) -> dict[str, VersionReport]:
        """``AsyncVersionBoard.fleet_reports`` for callers without an event loop (the demo launcher)."""
        return _decode_fleet(self.client.hgetall(self.keys.fleet), self.keys)


class AsyncVersionBoard:
    """The board over an asyncio client: the readers of the version, and the rollout servers' reports."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys):
        self.client = client
        self.keys = keys

    async def published_version(self) -> int | None:
        """The latest published version, or None before the first publish."""
        raw = await self.client.get(self.keys.policy_version)
        return int(raw) if raw is not None else None

    async def latest_version(self) -> int:
        """The latest published version, or 0 before the first publish."""
        return await self.published_version() or 0

    async def version_and_offset(self) -> tuple[int, int]:
        """``latest_version`` and ``RedisKeys.version_offset`` (version - steps) in one round trip, read together (a
        restarted trainer sets the offset before it publishes the version that makes them)."""
        raw_version, raw_offset = await self.client.mget(self.keys.policy_version, self.keys.version_offset)
        return int(raw_version or 0), int(raw_offset or 0)

    async def manifest(self, version: int) -> WeightManifest | None:
        """The manifest of ``version``, or None (never published, or expired)."""
        raw = await self.client.get(self.keys.manifest(version))
        return decode_manifest(raw) if raw is not None else None

    async def ipc_record(self, version: int) -> bytes | None:
        """The encoded CudaIpcVersion of ``version`` (transport 'ipc'), or None once the trainer dropped it.

        Encoded, not decoded: the engine's workers decode it themselves (it crosses their process boundary as bytes).
        """
        return await self.client.get(self.keys.ipc_buckets(version))

    async def last_announcement_id(self) -> str:
        """The stream id of the newest announcement ("0-0" before the first): waiting after it sees only new ones."""
        last = await self.client.xrevrange(self.keys.weight_announcements, count=1)
        return as_text(last[0][0]) if last else "0-0"

    async def wait_for_announcement(self, last_id: str, timeout_s: float) -> tuple[str, int | None]:
        """Block up to ``timeout_s`` for a version announced after stream id ``last_id`` ("$": after now).

        Returns (new last id, newest announced version), or (``last_id``, None) on timeout.
        """
        block_ms = max(1, int(timeout_s * 1000))  # BLOCK 0 would wait forever
        reply = await self.client.xread({self.keys.weight_announcements: last_id}, block=block_ms)
        if not reply:
            return last_id, None
        newest_id, fields = reply[0][1][-1]
        return as_text(newest_id), int(fields[b"v"])

    async def report_version(self, report: VersionReport, changed: bool = True) -> None:
        """Rollout side: record which version ``report.server_id`` serves and what its last weight update cost, and
        (``changed``) say so on ``fleet_changes``: the coordinator routes to it from then on, without waiting for a
        poll. A heartbeat's unchanged report wakes nobody: at 256 servers beating every second the coordinator would
        read the whole fleet 256 times a second."""
        if not changed:
            await self.client.hset(self.keys.fleet, report.server_id, encode(report))
            return
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.fleet, report.server_id, encode(report))
            pipe.xadd(self.keys.fleet_changes, {"s": report.server_id}, maxlen=MAX_FLEET_CHANGES, approximate=True)
            await pipe.execute()

    async def last_change_ids(self) -> dict[str, str]:
        """The newest entry ids of the streams ``wait_for_change`` watches ("0-0" for an empty one)."""
        ids = {}
        for stream in (self.keys.weight_announcements, self.keys.fleet_changes):
            last = await self.client.xrevrange(stream, count=1)
            ids[stream] = as_text(last[0][0]) if last else "0-0"
        return ids

    async def wait_for_change(self, last_ids: dict[str, str], timeout_s: float) -> dict[str, str]:
        """Block up to ``timeout_s`` for a version announced or a server report made after ``last_ids`` (from
        ``last_change_ids`` or an earlier call); returns the ids to wait after next (``last_ids`` on timeout)."""
        block_ms = max(1, int(timeout_s * 1000))  # BLOCK 0 would wait forever
        reply = await self.client.xread(last_ids, block=block_ms)
        return {**last_ids, **{as_text(stream): as_text(entries[-1][0]) for stream, entries in reply or []}}

    async def deregister(self, server_id: str) -> None:
        """Rollout side, at shutdown: remove ``server_id``'s report, so discovery stops routing to it at once."""
        await self.client.hdel(self.keys.fleet, server_id)

    async def fleet_reports(self) -> dict[str, VersionReport]:
        """Every server's latest VersionReport; an undecodable entry is skipped with a warning, not fatal."""
        return _decode_fleet(await self.client.hgetall(self.keys.fleet), self.keys)


def _decode_fleet(fleet_hash: dict, keys: RedisKeys) -> dict[str, VersionReport]:
    reports = {}
    for server_id, payload in fleet_hash.items():
        try:
            reports[as_text(server_id)] = decode_report(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            logger.warning("undecodable fleet entry %r in %s: %s", server_id, keys.fleet, error)
    return reports
