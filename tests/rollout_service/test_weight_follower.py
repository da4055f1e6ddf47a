"""A rollout server following the trainer's versions through a Redis outage (real vLLM engine, real valkey).

Redis going away must not stop a rollout server (its engine is the expensive part to restart): it keeps
generating on the version it holds, and once Redis is back it catches up to the latest version, including
one announced while it could not see Redis. A version it cannot fetch (its publisher gone) is tried again until the
bytes are reachable, not only at the next announcement.
"""

from __future__ import annotations

import os
import signal

import grpc
import msgspec
import pytest
import redis

from channels.version_board import VersionBoard
from launcher.redis_server import free_port
from modeling.tiny_model import init_tiny
from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from protos.config import TrainerConfig, WeightBusConfig
from protos.records import encode
from protos.redis_keys import RedisKeys
from tests.redis_faults import redis_proxy
from tests.rollout_service.server_process import spawn_rollout_server
from tests.waiting import wait_until
from trainer_service.publisher import WeightPublisher
from trainer_service.torch_backend import TorchBackend

pytestmark = pytest.mark.integration


def _wait_for_version(stub, version: int, timeout_s: float = 90) -> None:
    wait_until(
        lambda: stub.ServerInfo(pb.ServerInfoRequest(), timeout=10).policy_version == version,
        f"the server at v{version}",
        timeout_s,
        poll_s=0.2,
    )


def test_a_redis_outage_neither_stops_a_following_server_nor_leaves_it_behind(redis_server, tmp_path):
    model = str(init_tiny(tmp_path / "tiny"))
    keys = RedisKeys("follower-outage")
    backend = TorchBackend(model, TrainerConfig())
    publisher = WeightPublisher(redis.Redis.from_url(redis_server.url), keys, WeightBusConfig())
    with redis_proxy(redis_server.url) as (proxy_url, proxy):
        server = spawn_rollout_server(
            model,
            tmp_path / "rollout.log",
            "--server-id",
            "follower",
            "--redis-url",
            proxy_url,
            "--run-id",
            keys.run_id,
        )
        channel = None
        try:
            channel = grpc.insecure_channel(server.wait_serving(timeout_s=300).address)
            stub = pb_grpc.RolloutServiceStub(channel)
            publisher.publish(1, backend.export_hf_weights())
            _wait_for_version(stub, 1)

            proxy.cut()  # Redis unreachable for the server from here on
            wait_until(
                lambda: "Redis unreachable" in server.log_path.read_text(), "its follower meeting the outage", 60
            )
            request = pb.GenerateRequest(prompt_token_ids=[1, 4, 5], sampling=pb.SamplingParams(max_tokens=4))
            chunks = list(stub.Generate(request, timeout=60))  # it still serves, on the version it has
            assert [c for c in chunks if c.finished][0].version_spans[0].version == 1
            refused = proxy.refused
            publisher.publish(2, backend.export_hf_weights())  # announced while the server cannot see it
            wait_until(lambda: proxy.refused > refused, "the server trying Redis again after v2's announcement", 30)
            assert server.process.poll() is None
            assert stub.ServerInfo(pb.ServerInfoRequest(), timeout=10).policy_version == 1

            proxy.restore()
            _wait_for_version(stub, 2)  # caught up once Redis was back
            assert server.process.poll() is None

            # v3 announced with the address of a publisher that is gone (a trainer killed after its publish): the
            # server stays on v2 and keeps trying; once v3's bytes are reachable (the restarted trainer publishes
            # them again) it takes them, here without any further announcement
            manifest, buckets = publisher.tcp_sender.pack(3, backend.export_hf_weights())
            board = VersionBoard(redis.Redis.from_url(redis_server.url), keys)
            board.publish_manifest(msgspec.structs.replace(manifest, publisher_address=f"127.0.0.1:{free_port()}"))
            wait_until(lambda: "stays on v2" in server.log_path.read_text(), "the server trying the unreachable v3", 60)
            publisher.tcp_sender.tcp.hold(3, buckets)
            board.client.set(keys.manifest(3), encode(manifest))  # the reachable manifest, not announced
            _wait_for_version(stub, 3)
        finally:
            publisher.close()
            if channel is not None:
                channel.close()
            if server.process.poll() is None:
                os.killpg(server.process.pid, signal.SIGTERM)
                server.process.wait(timeout=60)
