"""The trainer's side of the control stream: `fleetrl sync` re-publishes, `fleetrl set` changes live settings."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from channels.control_stream import ControlStreamReader
from coordinator.control import ControlChannel
from modeling.tiny_model import init_tiny
from protos.config import TrainerConfig, WeightBusConfig
from protos.records import ControlKind
from protos.redis_keys import RedisKeys
from trainer_service.publisher import WeightPublisher
from trainer_service.redis_side import apply_commands
from trainer_service.torch_backend import TorchBackend
from trainer_service.trainer import Trainer

pytestmark = pytest.mark.integration


def test_sync_republishes_the_current_version_and_set_changes_staleness_and_temperature(redis_url, tmp_path):
    keys = RedisKeys("control-test")
    client = redis.Redis.from_url(redis_url)
    trainer = Trainer(
        TorchBackend(str(init_tiny(tmp_path / "tiny")), TrainerConfig()), max_staleness=1, policy_version=3
    )
    publisher = WeightPublisher(client, keys, WeightBusConfig())

    async def send(*commands):
        channel = ControlChannel(aioredis.Redis.from_url(redis_url), keys)
        for command in commands:
            await command(channel)
        await channel.stream.client.aclose()

    asyncio.run(send(lambda c: c.send(ControlKind.SYNC)))  # written before the trainer started: not for it
    stream = ControlStreamReader(client, keys)

    def poll() -> None:  # what rank 0 does between steps (ranks.OrderFeed, one process here)
        batch = stream.read()
        publish = lambda: publisher.publish(trainer.policy_version, trainer.backend.export_hf_weights())  # noqa: E731
        apply_commands(trainer, publish, batch.sync, batch.settings)

    poll()
    assert publisher.num_published == 0
    try:
        asyncio.run(
            send(
                lambda c: c.announce_setting("max_staleness", 4),
                lambda c: c.announce_setting("temperature", 0.7),
                lambda c: c.announce_setting("coordinator.request_timeout_s", 9.0),  # another role's setting
                lambda c: c.send(ControlKind.SET, "max_staleness", "not json"),  # ignored, logged
                lambda c: c.send(ControlKind.SYNC),
                lambda c: c.send(ControlKind.SYNC),  # two requests before one poll: one publish
            )
        )
        poll()
        assert trainer.max_staleness == 4 and trainer.backend.temperature == 0.7
        assert publisher.num_published == 1 and trainer.policy_version == 3  # same version number
        assert int(client.get(keys.policy_version)) == 3 and client.exists(keys.manifest(3))
        poll()  # nothing new
        assert publisher.num_published == 1
        client.xadd(keys.control, {"c": b"not a record"})  # an entry no role can decode: skipped, logged
        client.xadd(keys.control, {"c": b"\x94\x01\xa1x\xa0\xa0"})  # then a SYNC: still acted on
        poll()
        assert publisher.num_published == 2
    finally:
        publisher.close()
        client.close()
