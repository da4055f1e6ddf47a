"""The NCCL board: the records the NCCL weight broadcast coordinates through (weight_bus/nccl_group.py has the
protocol and its decisions, weight_bus/nccl.py the publisher and subscribers).

Keys (names: protos/redis_keys.py; records: protos/records.py):

* ``weights:nccl:group`` (``NcclGroup``): the current broadcast group (generation, NCCL unique id, members in rank
  order); the publisher alone writes it.
* ``weights:nccl:round`` (``NcclRound``): the version being broadcast and its chunk plan inputs; the publisher alone
  writes it.
* ``weights:nccl:members`` (hash member id -> ``NcclMember``): each subscriber's heartbeat.

Every call is a single idempotent command (a SET or HSET of the same record, a GET, an HDEL). Outages propagate to
the caller as ``channels.retry.UNREACHABLE``: the publisher's round fails and falls back to tcp, a subscriber's
heartbeat loop logs and beats again next period (the rule in channels/retry.py).
"""

from __future__ import annotations

import redis

from protos.records import (
    NcclGroup,
    NcclMember,
    NcclRound,
    decode_nccl_group,
    decode_nccl_member,
    decode_nccl_round,
    encode,
)
from protos.redis_keys import RedisKeys, as_text


class NcclBoard:
    """The NCCL records of one run over a sync client (the publisher's and subscribers' threads have no loop)."""

    def __init__(self, client: redis.Redis, keys: RedisKeys):
        self.client = client
        self.keys = keys

    def write_group(self, group: NcclGroup) -> None:
        self.client.set(self.keys.nccl_group, encode(group))

    def read_group(self) -> NcclGroup | None:
        raw = self.client.get(self.keys.nccl_group)
        return decode_nccl_group(raw) if raw is not None else None

    def write_round(self, record: NcclRound) -> None:
        self.client.set(self.keys.nccl_round, encode(record))

    def read_round(self) -> NcclRound | None:
        raw = self.client.get(self.keys.nccl_round)
        return decode_nccl_round(raw) if raw is not None else None

    def heartbeat(self, member: NcclMember) -> None:
        self.client.hset(self.keys.nccl_members, member.member_id, encode(member))

    def leave(self, member_id: str) -> None:
        self.client.hdel(self.keys.nccl_members, member_id)

    def read_heartbeats(self) -> dict[str, NcclMember]:
        """Every subscriber's last heartbeat, by member id."""
        raw = self.client.hgetall(self.keys.nccl_members)
        return {as_text(member_id): decode_nccl_member(value) for member_id, value in raw.items()}
