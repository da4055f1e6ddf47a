"""``python -m trainer_service train --config run.json --model DIR --redis-url URL``: the trainer role.

Several ranks (backend megatron, ``trainer.num_processes`` > 1): ``python -m trainer_service.torchrun --standalone
--nproc-per-node N -m trainer_service train ...``. Every rank runs ``run``; rank 0 alone talks to Redis
(``RedisSide``) and hands each step's groups and every operator command to the others (``ranks``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

logger = logging.getLogger("trainer_service")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer_service", description=__doc__)
    parser.add_argument("command", choices=["train"])
    parser.add_argument("--config", default=None)
    parser.add_argument("--model", default=None, help="alias of the config key model_path")
    parser.add_argument("--redis-url", default=None, help="alias of the config key redis_url")
    parser.add_argument(
        "--linger-s", type=float, default=60.0, help="keep serving weights this long after the last step"
    )
    parser.add_argument("overrides", nargs="*")
    return parser.parse_intermixed_args(argv)


def checkpoint_root(config) -> Path:
    """``trainer.ckpt_dir`` ('~' and '{run_id}' expanded), default <run dir>/checkpoints."""
    if config.trainer.ckpt_dir:
        return Path(config.expand_path(config.trainer.ckpt_dir))
    return config.run_dir() / "checkpoints"


def resume_target(tcfg) -> str:
    """What ``CheckpointManager.resolve`` gets for ``trainer.resume``: 'latest', 'none' or the resume_path."""
    return tcfg.resume_path if tcfg.resume == "from_path" else tcfg.resume


class CannotStart(RuntimeError):
    """This trainer cannot start, and a restart would fail the same way: it exits EXIT_CANNOT_RESTART."""


def refuse_unimplemented(tcfg) -> None:
    """Switches the config holds ahead of their trainer-side implementation: refused at start, never ignored."""
    megatron = tcfg.megatron
    pending = {
        f"trainer.megatron.optimizer_state_disk_dir={megatron.optimizer_state_disk_dir!r} (disk streaming of the "
        "offloaded optimizer state; '' offloads to host memory)": bool(megatron.optimizer_state_disk_dir),
    }
    asked = [name for name, is_set in pending.items() if is_set]
    if asked:
        raise ValueError(f"not implemented by this trainer yet: {'; '.join(asked)}; turn them off to train")


def make_backend(model_path: str, config):
    """The configured backend on the GPU when there is one (the CPU otherwise)."""
    import torch

    tcfg, temperature = config.trainer, config.temperature
    refuse_unimplemented(tcfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if tcfg.backend == "megatron":
        from trainer_service.megatron.backend import MegatronBackend

        return MegatronBackend(model_path, tcfg, temperature=temperature, device=device)
    from trainer_service.torch_backend import TorchBackend

    return TorchBackend(model_path, tcfg, temperature=temperature, device=device)


def load_config(args: argparse.Namespace):
    """The resolved run config: the file, then the flags (config aliases), then the dotted overrides."""
    from protos.config import flag_overrides, load_run_config

    config = load_run_config(
        args.config, [*flag_overrides({"model_path": args.model, "redis_url": args.redis_url}), *args.overrides]
    )
    if not config.model_path or not config.redis_url:
        raise ValueError("trainer: model_path and redis_url must be set (config keys, or --model / --redis-url)")
    return config


@contextmanager
def refused_at_start(what: str):
    """What fails the same way at every start (a configuration refused, a missing module, a model that does not fit
    the device) raises ``CannotStart``: the launcher ends the run with this message instead of restarting."""
    import torch

    try:
        yield
    except (ValueError, ImportError, FileNotFoundError, torch.OutOfMemoryError) as error:
        raise CannotStart(f"trainer: {what} failed: {type(error).__name__}: {error}") from error


def restore(config, stop: threading.Event):
    """Every rank's backend and Trainer from the same checkpoint (rank 0 resolves it); rank 0 opens Redis
    (``RedisSide``), which takes over the entries a dead trainer left pending.

    Returns (trainer, checkpoints, side or None, the restored checkpoint or None, the restored step).
    """
    from trainer_service import ranks
    from trainer_service.checkpoint import CheckpointManager, TrainerState
    from trainer_service.redis_side import RedisSide
    from trainer_service.trainer import Trainer, TrainerTotals

    tcfg = config.trainer
    with refused_at_start(f"building the {tcfg.backend} backend of {config.model_path}"):
        backend = make_backend(config.model_path, config)
    checkpoints = CheckpointManager(checkpoint_root(config), tcfg.keep_last_checkpoints)
    with refused_at_start("finding and loading the checkpoint to resume from"):
        restored = ranks.resolve_checkpoint(checkpoints, resume_target(tcfg))
        state = CheckpointManager.load(restored, backend) if restored else TrainerState(step=0, policy_version=0)
    trainer = Trainer(
        backend,
        config.max_staleness,
        state.policy_version,
        ledger=state.ledger,
        trained_versions=state.trained_versions,
        mini_batches=tcfg.mini_batches,
        measure_replay_mismatch=tcfg.measure_replay_mismatch,
    )
    # The run's counts go on from the checkpoint: a restarted trainer reports the samples of the whole run.
    saved = {name: int(value) for name, value in state.totals.items() if name in TrainerTotals.__dataclass_fields__}
    trainer.totals = TrainerTotals(**{"steps": state.step - saved.get("steps_skipped", 0), **saved})
    side = RedisSide(config.redis_url, config, trainer, stop) if ranks.world_rank() == 0 else None
    return trainer, checkpoints, side, restored, state.step


def run(args: argparse.Namespace, stop: threading.Event) -> None:
    """The trainer loop, the same on every rank; rank 0 alone talks to Redis (``RedisSide``, ``ranks``)."""
    import torch

    from trainer_service import ranks
    from trainer_service.checkpoint import CheckpointWriter
    from trainer_service.redis_side import apply_commands
    from trainer_service.versions import PolicyVersions

    with refused_at_start("reading the configuration"):
        config = load_config(args)
    torch.set_num_threads(1)

    # 0) restore every rank from the same checkpoint; rank 0 opens Redis and takes over the entries a dead trainer
    #    left pending; the steps of versions published past the checkpoint are replayed (trainer_service/replay.py)
    trainer, checkpoints, side, restored, start_step = restore(config, stop)
    publisher = side.publisher if side else None

    def publish_current() -> float:  # collective: every rank exports, rank 0 sends
        return ranks.publish_weights(publisher, trainer.backend, trainer.policy_version)

    feed = ranks.OrderFeed(side.read_groups if side else None, partial(apply_commands, trainer, publish_current))
    versions = PolicyVersions(side, trainer, publish_current)
    # catch up with what is published (trainer_service/versions.py); resume=none may start a lineage of its own
    versions.start(restored, start_step, new_lineage=config.trainer.resume == "none")
    # one process: checkpoints become durable (fsync, rename) on a thread while the next step trains
    writer = CheckpointWriter(checkpoints) if ranks.world_size() == 1 else None
    if writer is not None and side:
        side.durable_acks = writer.take_durable  # asked at each poll of the wait for groups, the first at every step
    completed = False  # every step taken (a stop ends the loop early)
    for step in range(start_step + 1, config.num_steps + 1):
        started = time.monotonic()
        # 1) one step's new groups: rank 0 pops them (entries already in the ledger are skipped but acknowledged
        #    later) and acts on operator commands while it waits; every rank gets the same groups
        groups = feed.next_groups(stop)
        if groups is None:
            break
        wait_s = time.monotonic() - started
        # 2) check policy lag and 3) take the optimizer step (inside Trainer.step, alike on every rank)
        previous_version = trainer.policy_version
        values = trainer.step(groups)
        # 4) publish weights v+1 if the step was taken (a replayed one is out already: checked against it); a step
        #    that was not moves the coordinator's slot map back
        publish_s = versions.after_step(previous_version, step)
        # 5) checkpoint (every rank its shard, rank 0 the ledger), then rank 0 acknowledges what it holds
        ckpt_s = checkpoint_step(config, checkpoints, side, trainer, step, writer)
        # 6) log and report
        if side:
            side.report(
                step, values, wait_s=wait_s, publish_s=publish_s, checkpoint_s=ckpt_s, step_s=time.monotonic() - started
            )
    else:
        completed = True  # also a trainer restored after its last step
    if writer is not None:  # the last checkpoint durable and its entries acknowledged before the export
        finish_checkpoints(writer, side)
    if completed:
        # 7) the final policy as an HF checkpoint (and LoRA's adapters) under the export path
        export_final(config, trainer)
    if side:
        side.finish(args.linger_s, stop)


def export_final(config, trainer) -> None:
    """Every rank takes part in the export (a collective); rank 0 writes it."""
    from trainer_service import ranks
    from trainer_service.hf_export import export_policy

    export_policy(
        trainer.backend, config.model_path, config.export_path(), config.trainer.lora.enabled, ranks.world_rank() == 0
    )


def checkpoint_step(config, checkpoints, side, trainer, step: int, writer=None) -> float:
    """Step 5: at the interval (and the last step) save the trainer state; the queue entries it holds are
    acknowledged once it is durable. Returns the seconds the loop spent (0 between checkpoints).

    One process (``writer``): the files are written now (on a GPU: the state is copied to host memory now and its
    files are written on the writer's thread) and made durable (fsync, rename) on the writer's thread while the next
    step trains; its entries are acknowledged at the first poll of the wait for groups (one at every
    step, then about one a second while idle) that finds it durable (at the latest the next checkpoint, or the
    run's end). Several ranks:
    every rank saves its shard at once, then rank 0 acknowledges.

    ``trainer.ckpt_interval`` 0 saves nothing: the entries are acknowledged after the last step only. A trainer
    restarted after it published has nothing to resume from and refuses to start (``CannotResume``)."""
    import torch

    from trainer_service import ranks
    from trainer_service.checkpoint import TrainerState

    tcfg = config.trainer
    if tcfg.ckpt_interval == 0:
        if side and step == config.num_steps:
            side.ack_consumed()
        return 0.0
    if step % tcfg.ckpt_interval != 0 and step != config.num_steps:
        return 0.0
    started = time.monotonic()
    state = TrainerState(step, trainer.policy_version, trainer.ledger, _totals(trainer), trainer.trained_versions)
    if writer is None:
        ranks.save_checkpoint(checkpoints, trainer.backend, state)
        if side:
            side.ack_consumed()
    else:
        # On a GPU the state is snapshot into host memory and its files are written on the writer's thread (the step
        # waits for the device-to-host copy, not the disk); on a CPU writing into the page cache costs the step less
        # than a copy (benchmarks/checkpoint_snapshot.py: 0.13 s against 0.7-2 s for 0.2 GiB on the CI machine).
        snapshot = torch.cuda.is_available()
        if snapshot:
            side.ack(writer.wait())  # the previous snapshot written: this one reuses its host buffers
        pending = checkpoints.write(trainer.backend, state, snapshot=snapshot)
        side.ack(writer.submit(pending, side.take_unacked()))
    return time.monotonic() - started


def finish_checkpoints(writer, side, timeout_s: float = 600.0) -> None:
    """The run's end: wait for the last checkpoint to be durable, then acknowledge what it holds."""
    try:
        side.ack(writer.wait(timeout_s))
    except TimeoutError as error:
        raise TimeoutError(f"the last checkpoint was not durable (fsync, rename) within {timeout_s:.0f}s") from error
    finally:
        writer.close()


def _totals(trainer) -> dict[str, float]:
    totals = trainer.totals
    return {
        "samples_trained": totals.samples_trained,
        "stale_dropped": totals.stale_dropped,
        "duplicates_skipped": totals.duplicates_skipped,
        "steps_skipped": totals.steps_skipped,
    }


def main(argv: list[str] | None = None) -> None:
    from trainer_service import ranks

    rank = ranks.world_rank()
    # Ranks > 0 run the same steps as rank 0 and talk to no one but it: their warnings and errors are enough.
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s trainer[rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(level)  # megatron's loggers would inherit INFO from elsewhere
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from protos.exit_codes import EXIT_CANNOT_RESTART
    from trainer_service.checkpoint import CheckpointSpaceError
    from trainer_service.versions import CannotResume

    try:
        run(args, stop)
    except (
        CannotStart,
        CannotResume,
        CheckpointSpaceError,
    ) as refused:  # a restart would meet the same state, the same disk
        logger.error("%s", refused)
        raise SystemExit(EXIT_CANNOT_RESTART) from None


if __name__ == "__main__":
    main()
