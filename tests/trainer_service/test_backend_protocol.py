"""Both training backends offer the trainer the same interface (trainer_service.backend.Backend)."""

from __future__ import annotations

import inspect

import pytest

from trainer_service.backend import Backend

pytestmark = pytest.mark.unit

MEMBERS = [name for name in Backend.__dict__ if not name.startswith("_") and callable(Backend.__dict__[name])]


def _backends():
    from trainer_service.megatron.backend import MegatronBackend
    from trainer_service.torch_backend import TorchBackend

    return [TorchBackend, MegatronBackend]


@pytest.mark.parametrize("backend", _backends(), ids=lambda cls: cls.__name__)
def test_each_backend_has_every_method_of_the_protocol_with_its_parameters(backend):
    assert set(MEMBERS) == {
        "train_step",
        "policy_logprobs",
        "export_hf_weights",
        "export_adapter_weights",
        "adapter_record",
        "save_checkpoint",
        "checkpoint_snapshot",
        "load_checkpoint",
    }
    for name in MEMBERS:
        wanted = list(inspect.signature(getattr(Backend, name)).parameters)
        have = inspect.signature(getattr(backend, name)).parameters
        # the protocol's parameters come first and in order; a backend may add optional ones after them
        assert list(have)[: len(wanted)] == wanted, (backend.__name__, name, list(have))
        assert all(p.default is not inspect.Parameter.empty for p in list(have.values())[len(wanted) :]), name
    assert "temperature" in inspect.getsource(backend.__init__)  # the attribute the protocol names
