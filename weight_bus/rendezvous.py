"""The Redis side of the weight bus: manifests, the current version, announcements, fleet reports."""

from __future__ import annotations

import logging
import time

import msgspec
import redis as syncredis
import redis.asyncio as aioredis

from channels.retry import retry_sync
from protos.records import (
    ReportStatus,
    VersionReport,
    WeightManifest,
    decode_manifest,
    decode_report,
    encode,
)
from protos.redis_keys import RedisKeys

logger = logging.getLogger(__name__)

# How long a superseded manifest stays readable (a server that began fetching it finishes). The latest one never
# expires: a server that (re)starts after a long step still finds the weights it must load.
MANIFEST_TTL_S = 3600


def publish_manifest(
    client: syncredis.Redis, keys: RedisKeys, manifest: WeightManifest, timeout_s: float = 60.0
) -> None:
    """Trainer side: store the manifest, then move the version pointer and announce it (one transaction); the
    manifest it supersedes starts to expire. The trainer's rank 0 is the only writer of the version pointer.

    A broken connection is retried for ``timeout_s``: repeating the transaction sets the same values, and a second
    announcement of a version is a no-op for the servers (they already hold it or fetch it once).
    """

    def transaction() -> None:
        previous = client.get(keys.policy_version)
        pipe = client.pipeline(transaction=True)
        pipe.set(keys.manifest(manifest.version), encode(manifest))
        if previous is not None and int(previous) != manifest.version:
            pipe.expire(keys.manifest(int(previous)), MANIFEST_TTL_S)
        pipe.set(keys.policy_version, manifest.version)
        pipe.xadd(keys.weight_announcements, {"v": manifest.version}, maxlen=1000, approximate=True)
        pipe.execute()

    retry_sync(transaction, f"publishing the manifest of v{manifest.version}", timeout_s)


async def get_ipc_version(client: aioredis.Redis, keys: RedisKeys, version: int) -> bytes | None:
    """The encoded CudaIpcVersion of ``version`` (transport 'ipc'), or None once the trainer dropped it."""
    return await client.get(keys.ipc_buckets(version))


async def latest_version(client: aioredis.Redis, keys: RedisKeys) -> int:
    """The trainer's latest published version, or 0 before the first publish."""
    raw = await client.get(keys.policy_version)
    return int(raw) if raw is not None else 0


async def version_and_offset(client: aioredis.Redis, keys: RedisKeys) -> tuple[int, int]:
    """``latest_version`` and ``RedisKeys.version_offset`` (version - steps) in one round trip, read together (a
    restarted trainer sets the offset before it publishes the version that makes them)."""
    raw_version, raw_offset = await client.mget(keys.policy_version, keys.version_offset)
    return int(raw_version or 0), int(raw_offset or 0)


async def get_manifest(client: aioredis.Redis, keys: RedisKeys, version: int) -> WeightManifest | None:
    raw = await client.get(keys.manifest(version))
    return decode_manifest(raw) if raw is not None else None


def get_manifest_sync(client: syncredis.Redis, keys: RedisKeys, version: int) -> WeightManifest | None:
    """``get_manifest`` for threads without an event loop (the nccl subscriber)."""
    raw = client.get(keys.manifest(version))
    return decode_manifest(raw) if raw is not None else None


async def wait_for_announcement(
    client: aioredis.Redis, keys: RedisKeys, last_id: str, timeout_s: float
) -> tuple[str, int | None]:
    """Block up to ``timeout_s`` for a version announced after stream id ``last_id``.

    Returns (new last id, newest announced version or None on timeout).
    """
    reply = await client.xread({keys.weight_announcements: last_id}, block=int(timeout_s * 1000))
    if not reply:
        return last_id, None
    entries = reply[0][1]
    newest_id, fields = entries[-1]
    newest_id = newest_id.decode() if isinstance(newest_id, bytes) else newest_id
    return newest_id, int(fields[b"v"])


async def report_version(
    client: aioredis.Redis,
    keys: RedisKeys,
    server_id: str,
    address: str,
    policy_version: int,
    status: ReportStatus = ReportStatus.OK,
    message: str = "",
    update_s: float = 0.0,
    paused_s: float = 0.0,
) -> None:
    """Rollout side: record which version this server serves (the coordinator's fleet view) and what its last
    weight update cost."""
    report = VersionReport(server_id, address, policy_version, status, message, time.time(), update_s, paused_s)
    await client.hset(keys.fleet, server_id, encode(report))


async def fleet_reports(client: aioredis.Redis, keys: RedisKeys) -> dict[str, VersionReport]:
    """Every server's latest VersionReport; an undecodable entry is skipped with a warning, not fatal."""
    reports = {}
    for server_id, payload in (await client.hgetall(keys.fleet)).items():
        try:
            reports[server_id.decode()] = decode_report(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            logger.warning("undecodable fleet entry %r in %s: %s", server_id, keys.fleet, error)
    return reports
