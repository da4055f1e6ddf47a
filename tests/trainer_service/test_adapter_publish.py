"""Publishing a LoRA version (trainer.lora.sync='adapters'): what one step sends, over the real weight bus.

Against the embedded valkey and the tcp publisher: the manifest says it carries an adapter (``LoraAdapter``,
transport tcp whatever carries full versions), a receiver gets the exact tensors back, and the trainer's
``publish_weights`` publishes adapters or merged layers by ``trainer.lora.sync``.
"""

from __future__ import annotations

import pytest
import redis
import torch

from channels.version_board import VersionBoard
from protos.config import LoraConfig, TrainerConfig, WeightBusConfig
from protos.redis_keys import RedisKeys
from tests.rollout_service.lora_models import adapter_trainer, make_dense_model, set_random_adapters
from trainer_service import ranks
from trainer_service.publisher import WeightPublisher, policy_update
from trainer_service.torch_backend import TorchBackend
from weight_bus import packing, receiver

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    return make_dense_model("qwen3", tmp_path_factory.mktemp("dense"))


def received(manifest) -> dict[str, torch.Tensor]:
    buffer = bytearray(packing.total_nbytes(manifest))
    assert receiver.receive_into(manifest, memoryview(buffer), timeout_s=30) == "publisher"
    return {name: tensor.clone() for name, tensor in packing.iter_tensors(manifest, memoryview(buffer))}


def test_an_adapter_version_is_announced_with_its_record_and_received_exactly(dense_model, redis_url):
    backend = adapter_trainer(dense_model)
    set_random_adapters(backend, seed=1)
    client, keys = redis.Redis.from_url(redis_url), RedisKeys("adapter-publish")
    publisher = WeightPublisher(client, keys, WeightBusConfig(transport="ipc"))  # no CUDA here: tcp
    try:
        publisher.publish(1, *policy_update(backend))
        manifest = VersionBoard(client, keys).manifest(1)
        assert manifest.adapter == backend.adapter_record() and manifest.transport == "tcp"
        sent = dict(backend.export_adapter_weights())
        got = received(manifest)
        assert got.keys() == sent.keys() and all(torch.equal(got[name], sent[name]) for name in sent)
        assert publisher.last_stats.num_bytes == packing.total_nbytes(manifest)
    finally:
        publisher.close()


def test_publish_weights_sends_adapters_or_merged_layers_by_the_sync_setting(dense_model, redis_url):
    client, keys = redis.Redis.from_url(redis_url), RedisKeys("sync-setting")
    merged_backend = TorchBackend(dense_model, TrainerConfig(geo_mask=None, lora=LoraConfig(rank=8, alpha=16.0)))
    adapter_backend = adapter_trainer(dense_model)
    publisher = WeightPublisher(client, keys, WeightBusConfig())
    board = VersionBoard(client, keys)
    try:
        ranks.publish_weights(publisher, merged_backend, 1)
        ranks.publish_weights(publisher, adapter_backend, 2)
        merged, adapters = board.manifest(1), board.manifest(2)
    finally:
        publisher.close()
    assert merged.adapter is None and {e.name for e in merged.tensors} == {
        n for n, _ in merged_backend.export_hf_weights()
    }
    assert adapters.adapter is not None and all(e.name.startswith("base_model.model.") for e in adapters.tensors)
    # Adapter-only: a small fraction of the merged layers' bytes (rank 8 against hidden 64 here).
    assert packing.total_nbytes(adapters) < 0.6 * packing.total_nbytes(merged)
    assert ranks.publish_weights(None, adapter_backend, 3) == 0.0  # another rank: iterates, sends nothing
