"""Checkpoints: bit-exact resume of model, optimizer, LR schedule and ledger; pruning; bad resume paths; the durable
half of a save on the writer's thread."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from synthetic import make_group

from modeling.tiny_model import init_tiny
from protos.config import TrainerConfig
from tests.waiting import wait_until
from trainer_service.checkpoint import CheckpointManager, CheckpointWriter, TrainerState
from trainer_service.torch_backend import TorchBackend
from trainer_service.trainer import Trainer

pytestmark = pytest.mark.integration

CONFIG = TrainerConfig(geo_mask=None, lr_warmup_steps=3, micro_batch_tokens=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


def _train(trainer: Trainer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        groups = trainer.filter_new([make_group(2 * step, seed=3), make_group(2 * step + 1, seed=3)])
        losses.append(trainer.step(groups)["loss"])
    return losses


def test_resume_from_checkpoint_continues_bit_exactly(model_dir, tmp_path):
    checkpoints = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    trainer = Trainer(TorchBackend(model_dir, CONFIG), max_staleness=100)
    _train(trainer, range(4))
    saved = checkpoints.save(trainer.backend, TrainerState(4, trainer.policy_version, trainer.ledger))
    continued = _train(trainer, range(4, 6))
    final_weights = {k: v.clone() for k, v in trainer.backend.model.state_dict().items()}

    fresh_backend = TorchBackend(model_dir, CONFIG)  # a new process would start exactly like this
    state = CheckpointManager.load(checkpoints.latest(), fresh_backend)
    assert checkpoints.latest() == saved and state.step == 4 and state.policy_version == 4
    assert list(state.ledger) == [f"g{i}" for i in range(8)]
    resumed = Trainer(fresh_backend, max_staleness=100, policy_version=state.policy_version, ledger=state.ledger)
    assert _train(resumed, range(4, 6)) == continued  # bit-exact, not approximately
    assert fresh_backend.scheduler.get_last_lr() == trainer.backend.scheduler.get_last_lr()
    for name, tensor in fresh_backend.model.state_dict().items():
        assert torch.equal(tensor, final_weights[name]), name


def test_the_version_each_group_was_trained_by_is_checkpointed_with_the_ledger(model_dir, tmp_path):
    """What a sample's staleness is measured against after the run (the chaos soak's audit): v_trainer of its step,
    across a restore."""
    checkpoints = CheckpointManager(tmp_path, keep_last=1)
    trainer = Trainer(TorchBackend(model_dir, CONFIG), max_staleness=100, policy_version=5)
    _train(trainer, range(2))
    state = TrainerState(2, trainer.policy_version, trainer.ledger, trained_versions=trainer.trained_versions)
    checkpoints.save(trainer.backend, state)
    restored = CheckpointManager.load(checkpoints.latest(), TorchBackend(model_dir, CONFIG))
    assert restored.trained_versions == {"g0": 5, "g1": 5, "g2": 6, "g3": 6}
    resumed = Trainer(
        trainer.backend, 100, restored.policy_version, restored.ledger, trained_versions=restored.trained_versions
    )
    _train(resumed, range(2, 3))
    assert resumed.trained_versions == {**restored.trained_versions, "g4": 7, "g5": 7}
    legacy = {"step": 1, "policy_version": 1, "ledger": {"g0": "trained"}, "totals": {}}  # saved before the field
    assert TrainerState(**legacy).trained_versions == {}


def test_keeps_the_last_k_and_ignores_partial_checkpoints(model_dir, tmp_path):
    checkpoints = CheckpointManager(tmp_path, keep_last=2)
    backend = TorchBackend(model_dir, TrainerConfig())
    for step in (1, 2, 3):
        checkpoints.save(backend, TrainerState(step, step, {f"g{step}": "trained"}))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    (tmp_path / "step-000004.partial").mkdir()  # a save cut short by a crash
    assert checkpoints.latest().name == "step-000003"
    (tmp_path / "latest").unlink()  # even without the pointer, the newest complete one is found
    assert checkpoints.latest().name == "step-000003"
    state = json.loads((tmp_path / "step-000003" / "trainer_state.json").read_text())
    assert state["ledger"] == {"g3": "trained"}


def test_resume_setting_none_latest_and_bad_path(tmp_path):
    checkpoints = CheckpointManager(tmp_path / "empty")
    assert checkpoints.resolve("latest") is None and checkpoints.resolve("none") is None
    with pytest.raises(FileNotFoundError, match="trainer.resume_path"):
        checkpoints.resolve(str(tmp_path / "missing"))


class GatedCheckpoints(CheckpointManager):
    """The real manager with a gate before its durable half (fsync, rename), which holds the writer's thread at a
    known point, as the fault tests freeze a process with SIGSTOP."""

    def __init__(self, root, gate: threading.Event):
        super().__init__(root, keep_last=2)
        self.gate = gate

    def make_durable(self, pending):
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return super().make_durable(pending)


def test_the_next_step_trains_while_a_checkpoint_becomes_durable_and_its_entries_wait_for_that(model_dir, tmp_path):
    gate = threading.Event()
    checkpoints = GatedCheckpoints(tmp_path, gate)
    writer = CheckpointWriter(checkpoints)
    trainer = Trainer(TorchBackend(model_dir, CONFIG), max_staleness=100)
    _train(trainer, range(2))
    at_save = {k: v.clone() for k, v in trainer.backend.model.state_dict().items()}
    state = TrainerState(2, trainer.policy_version, trainer.ledger)
    pending = checkpoints.write(trainer.backend, state, snapshot=True)  # copied at the step, written on the thread
    assert not (pending.partial / "model.safetensors").exists()  # the step does not wait for the disk's writes
    assert writer.submit(pending, ["1-0", "2-0"]) == []  # nothing durable before it
    _train(trainer, range(2, 4))  # training goes on while the checkpoint of step 2 is not durable
    assert checkpoints.latest() is None  # a crash now restores nothing of step 2: its entries stay pending
    assert writer.take_durable() == []  # the loop's per-step question does not wait for it
    gate.set()
    # what the loop asks at each step
    durable = wait_until(writer.take_durable, "the checkpoint of step 2 durable", 60, poll_s=0.01)
    assert durable == ["1-0", "2-0"]  # durable now: these may be acknowledged
    assert writer.take_durable() == [] and writer.wait() == []  # handed out once
    assert checkpoints.latest() == tmp_path / "step-000002"
    restored = TorchBackend(model_dir, CONFIG)
    state = CheckpointManager.load(checkpoints.latest(), restored)
    assert state.step == 2 and list(state.ledger) == ["g0", "g1", "g2", "g3"]  # step 2's ledger, not step 4's
    for name, tensor in restored.model.state_dict().items():
        assert torch.equal(tensor, at_save[name]), name  # the weights of the moment of the write
    writer.close()


def test_a_failed_durable_half_raises_on_the_training_thread(model_dir, tmp_path):
    checkpoints = CheckpointManager(tmp_path)
    writer = CheckpointWriter(checkpoints)
    pending = checkpoints.write(TorchBackend(model_dir, CONFIG), TrainerState(1, 1, {}))
    shutil.rmtree(pending.partial)  # the files are gone before they could be made durable
    writer.submit(pending, ["1-0"])
    with pytest.raises(FileNotFoundError):
        writer.wait(timeout_s=60)
    assert checkpoints.latest() is None and writer.wait() == []
    writer.close()


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_writing_naming_path_needed_and_free(
    model_dir, tmp_path, monkeypatch
):
    """The H200 run's find: a 15.3 GB torch.save on a full disk died inside the write ("unexpected pos")."""
    from trainer_service import checkpoint

    checkpoints = CheckpointManager(tmp_path, keep_last=2)
    backend = TorchBackend(model_dir, CONFIG)
    first = checkpoints.save(backend, TrainerState(1, 1, {"g0": "trained"}))
    needed = checkpoint.directory_bytes(first)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: needed - 1)  # the filesystem: an external edge
    with pytest.raises(checkpoint.CheckpointSpaceError) as refused:
        checkpoints.write(backend, TrainerState(2, 2, {}))
    assert str(tmp_path) in str(refused.value) and f"{needed} bytes needed" in str(refused.value)
    assert f"{needed - 1} bytes free" in str(refused.value)
    assert not list(tmp_path.glob("*.partial")) and checkpoints.latest() == first


class DiskFullBackend(TorchBackend):
    """A backend whose write stops half-way with ENOSPC, as a full disk stops ``torch.save``."""

    def save_checkpoint(self, directory):
        import errno

        super().save_checkpoint(directory)
        (directory / "optimizer.pt").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_write_that_fails_half_way_leaves_the_previous_checkpoint_whole_and_no_partial(model_dir, tmp_path):
    checkpoints = CheckpointManager(tmp_path, keep_last=1)
    trainer = Trainer(TorchBackend(model_dir, CONFIG), max_staleness=100)
    _train(trainer, range(1))
    good = checkpoints.save(trainer.backend, TrainerState(1, trainer.policy_version, trainer.ledger))
    failing = DiskFullBackend(model_dir, CONFIG)
    with pytest.raises(OSError, match="No space left"):
        checkpoints.write(failing, TrainerState(2, 2, {}))
    assert checkpoints.latest() == good and not list(tmp_path.glob("*.partial"))
    restored = TorchBackend(model_dir, CONFIG)
    state = CheckpointManager.load(checkpoints.latest(), restored)
    assert state.step == 1 and list(state.ledger) == ["g0", "g1"]
    for name, tensor in restored.model.state_dict().items():
        assert torch.equal(tensor, trainer.backend.model.state_dict()[name]), name


def test_partial_checkpoints_a_crash_left_behind_are_removed_by_the_next_durable_one(model_dir, tmp_path):
    checkpoints = CheckpointManager(tmp_path, keep_last=2)
    (tmp_path / "step-000003.partial").mkdir()  # a save cut short by a crash: nothing will complete it
    checkpoints.save(TorchBackend(model_dir, CONFIG), TrainerState(4, 4, {}))
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-000004"]


def test_a_megatron_checkpoint_before_the_first_optimizer_step_saves_and_resumes_bit_exactly(model_dir, tmp_path):
    """The H200 run's find: every group stale, no optimizer step, then the checkpoint died in megatron's distributed
    optimizer (``assert len(steps) == 1`` in ``state_dict``)."""
    from trainer_service.batch import build_batch
    from trainer_service.megatron.backend import MegatronBackend

    config = TrainerConfig(backend="megatron", lr=1e-2, geo_mask=None)
    checkpoints = CheckpointManager(tmp_path, keep_last=2)
    never_stepped = MegatronBackend(model_dir, config)
    saved = checkpoints.save(never_stepped, TrainerState(1, 0, {"g0": "stale"}))
    restored = MegatronBackend(model_dir, config)
    assert CheckpointManager.load(saved, restored).ledger == {"g0": "stale"}
    batch = build_batch([make_group(0, seed=3), make_group(1, seed=3)])
    assert restored.train_step(batch)["loss"] == never_stepped.train_step(batch)["loss"]
    for (name, mine), (_, theirs) in zip(restored.export_hf_weights(), never_stepped.export_hf_weights(), strict=True):
        assert torch.equal(mine, theirs), name
    # Once stepped, the optimizer state is saved; a snapshot (the one-process trainer's) restores the same state.
    pending = checkpoints.write(restored, TrainerState(2, 1, {}), snapshot=True)
    restored.train_step(batch)  # trains on while the snapshot waits for its writer
    resumed = MegatronBackend(model_dir, config)
    CheckpointManager.load(checkpoints.make_durable(pending), resumed)
    assert resumed.train_step(batch)["loss"] == never_stepped.train_step(batch)["loss"]


def test_a_snapshot_reuses_the_host_buffers_of_the_one_written_before_and_holds_its_own_step(model_dir, tmp_path):
    checkpoints = CheckpointManager(tmp_path, keep_last=2)
    trainer = Trainer(TorchBackend(model_dir, CONFIG), max_staleness=100)
    _train(trainer, range(1))
    first = checkpoints.make_durable(checkpoints.write(trainer.backend, TrainerState(1, 1, {}), snapshot=True))
    buffers = {name: tensor.data_ptr() for name, tensor in trainer.backend._snapshot[0].items()}
    _train(trainer, range(1, 2))
    at_second = {k: v.clone() for k, v in trainer.backend.model.state_dict().items()}
    second = checkpoints.write(trainer.backend, TrainerState(2, 2, {}), snapshot=True)
    assert {name: tensor.data_ptr() for name, tensor in trainer.backend._snapshot[0].items()} == buffers
    restored = TorchBackend(model_dir, CONFIG)
    CheckpointManager.load(checkpoints.make_durable(second), restored)
    for name, tensor in restored.model.state_dict().items():
        assert torch.equal(tensor, at_second[name]), name
    assert CheckpointManager.load(first, TorchBackend(model_dir, CONFIG)).step == 1  # written before the reuse
