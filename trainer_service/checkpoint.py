"""Checkpoints of the trainer: backend state (model, optimizer, scheduler, RNG) plus the trainer state.

The trainer state holds the step, the policy version and the **ledger**: every trajectory group id whose
step is inside these weights, with its outcome (and the policy version that step updated). A queue entry is acknowledged only after the checkpoint
that contains its group id is on disk, so after a crash the trainer reclaims the unacknowledged entries,
skips the ids already in the ledger, and trains the rest: every group is consumed exactly once by the
lineage of weights that survives.

Layout: ``<root>/step-000042/{trainer_state.json, <backend files>}`` written as ``step-000042.partial``
and renamed when complete; ``<root>/latest`` names the newest complete one (replaced atomically).

A save is two halves: ``write`` puts the files in the partial directory, and ``make_durable`` fsyncs them, renames
the directory and moves ``latest``. The files hold the state of the moment ``write`` ran, so the second half can run
while training goes on: ``CheckpointWriter`` runs it on a thread, and the entries a checkpoint holds are acknowledged
once it is durable. A one-process trainer writes snapshots (``write(..., snapshot=True)``): the state is copied to
host memory at the step and its files are written on the thread as well, so the step waits for neither the
disk's writes nor its syncs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    """What a checkpoint records besides the backend: where training stands and what it consumed."""

    step: int
    policy_version: int
    # group id -> outcome ("trained", "stale", "nonfinite"), in the order consumed
    ledger: dict[str, str] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    # group id -> the policy version its step updated (v_trainer of its staleness), for the groups of the ledger:
    # with the samples' token versions on the stream, each sample's staleness can be audited after the run
    trained_versions: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint written into ``partial`` but not yet durable; ``make_durable`` turns it into ``final``. A snapshot
    (``write(..., snapshot=True)``) carries its files still to write: ``files`` (the backend's) and ``state_json``."""

    partial: Path
    final: Path
    files: Callable[[Path], None] | None = None
    state_json: str = ""  # the trainer state as of ``write`` (its ledger goes on growing)


class CheckpointSpaceError(OSError):
    """The checkpoint directory's filesystem cannot hold the next checkpoint (checked before writing it)."""


def write_files(partial: Path, backend_files: Callable[[Path], None], state_json: str) -> None:
    """The backend's files and the trainer state into ``partial``; removed whole if any write fails (a full disk)."""
    try:
        backend_files(partial)
        (partial / STATE_FILE).write_text(state_json)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # its bytes would only fill the disk further
        raise


def free_bytes(path: Path) -> int:
    """Bytes free to this user on ``path``'s filesystem."""
    return shutil.disk_usage(path).free


def directory_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def parameter_bytes(backend) -> int:
    """Bytes of this process's model parameters (``backend.model``: one module, or megatron's list of chunks)."""
    model = backend.model
    chunks = model if isinstance(model, list) else [model]
    return sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves, finds, loads and prunes checkpoints under ``root``."""

    def __init__(self, root: str | Path, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last})")
        self.root = Path(root)
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)

    def save(self, backend, state: TrainerState) -> Path:
        """Write a complete checkpoint of ``backend`` and ``state``; durable when this returns."""
        return self.make_durable(self.write(backend, state))

    def write(self, backend, state: TrainerState, snapshot: bool = False) -> PendingCheckpoint:
        """The first half of a save: ``backend`` and ``state`` as they are now, into the partial directory (not
        durable, not found by ``latest`` until ``make_durable``). ``snapshot``: copied to host memory only, the files
        are written by ``make_durable`` (one process: on the writer's thread, so the step does not wait for the
        disk). Refuses (``CheckpointSpaceError``) when the disk cannot hold it; a write that fails removes its partial
        directory, the previous checkpoints stay whole."""
        final = self.root / f"step-{state.step:06d}"
        partial = final.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.check_space(backend)
        partial.mkdir()
        if snapshot:
            try:
                return PendingCheckpoint(partial, final, backend.checkpoint_snapshot(), json.dumps(asdict(state)))
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
        write_files(partial, backend.save_checkpoint, json.dumps(asdict(state)))
        return PendingCheckpoint(partial, final)

    def check_space(self, backend) -> None:
        """Raise ``CheckpointSpaceError`` unless the checkpoint directory's filesystem has room for one more
        checkpoint: as large as the newest complete one, or without one 3x the backend's parameter bytes (weights
        and two Adam moments; the first checkpoint's size is not known before it is written)."""
        previous = self.latest()
        needed = directory_bytes(previous) if previous is not None else 3 * parameter_bytes(backend)
        free = free_bytes(self.root)
        if needed > free:
            raise CheckpointSpaceError(
                f"checkpoint directory {self.root}: {needed} bytes needed (the size of "
                f"{previous.name if previous else 'the weights and Adam state'}), {free} bytes free; free space "
                "there, lower trainer.keep_last_checkpoints or point trainer.ckpt_dir elsewhere"
            )

    def make_durable(self, pending: PendingCheckpoint) -> Path:
        """The second half: write a snapshot's files, fsync every file, rename the directory, point ``latest`` at
        it, prune old ones."""
        if pending.files is not None:
            write_files(pending.partial, pending.files, pending.state_json)
        for file in pending.partial.iterdir():  # the rename below must not outrun the files' bytes
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        shutil.rmtree(pending.final, ignore_errors=True)  # a same-step leftover of an earlier incarnation
        os.rename(pending.partial, pending.final)
        pointer = self.root / "latest.tmp"
        pointer.write_text(pending.final.name)
        os.replace(pointer, self.root / "latest")
        _fsync_dir(self.root)
        self._prune(pending.final)
        return pending.final

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        pointer = self.root / "latest"
        if pointer.exists():
            path = self.root / pointer.read_text().strip()
            if (path / STATE_FILE).exists():
                return path
        complete = sorted(p for p in self.root.glob("step-*") if p.suffix != ".partial" and (p / STATE_FILE).exists())
        return complete[-1] if complete else None

    def resolve(self, resume: str) -> Path | None:
        """Which checkpoint ``trainer.resume`` asks for: 'latest', 'none', or (from_path) ``trainer.resume_path``."""
        if resume == "none":
            return None
        if resume == "latest":
            return self.latest()
        path = Path(resume).expanduser()
        if not (path / STATE_FILE).exists():
            raise FileNotFoundError(
                f"trainer.resume_path={resume!r} (trainer.resume=from_path): no {STATE_FILE} there; "
                "point it at a complete step-NNNNNN directory"
            )
        return path

    @staticmethod
    def load(path: str | Path, backend) -> TrainerState:
        """Restore ``backend`` from ``path`` and return the trainer state saved with it."""
        path = Path(path)
        backend.load_checkpoint(path)
        with open(path / STATE_FILE) as handle:
            raw = json.load(handle)
        return TrainerState(**raw)

    def _prune(self, newest: Path) -> None:
        """Keep the last ``keep_last`` complete checkpoints; drop the partial ones older than ``newest`` (saves a
        crash or a failed write cut short: nothing will complete them)."""
        complete = sorted(p for p in self.root.glob("step-*") if p.suffix != ".partial")
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob("step-*.partial"):
            if stale.stem < newest.name:
                shutil.rmtree(stale, ignore_errors=True)


class CheckpointWriter:
    """Makes written checkpoints durable on a thread while training goes on.

    One checkpoint is in flight at a time. ``submit`` and ``wait`` first wait for the one before: they return the
    queue entry ids it holds, now safe to acknowledge (on the caller's thread, which owns the queue), and re-raise
    its error there, so a failed save stops the trainer as a synchronous one would.
    """

    def __init__(self, manager: CheckpointManager):
        self.manager = manager
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._in_flight: tuple[Future, list[str]] | None = None

    def submit(self, pending: PendingCheckpoint, entry_ids: list[str]) -> list[str]:
        """Make ``pending`` (holding ``entry_ids``) durable in the background; returns the previous one's ids."""
        durable = self.wait()
        self._in_flight = (self._executor.submit(self.manager.make_durable, pending), entry_ids)
        return durable

    def take_durable(self) -> list[str]:
        """The entry ids of the checkpoint in flight if it is durable by now, else [] (never blocks): the trainer asks
        at each poll of its wait for groups (``RedisSide.durable_acks``), so entries are acknowledged soon after their
        checkpoint, not at the next one, also while the trainer is idle."""
        if self._in_flight is None or not self._in_flight[0].done():
            return []
        return self.wait()

    def wait(self, timeout_s: float | None = None) -> list[str]:
        """Until the checkpoint in flight (if any) is durable; returns the entry ids it holds ([] without one)."""
        if self._in_flight is None:
            return []
        (future, entry_ids), self._in_flight = self._in_flight, None
        future.result(timeout=timeout_s)
        return entry_ids

    def close(self) -> None:
        self._executor.shutdown(wait=True)
