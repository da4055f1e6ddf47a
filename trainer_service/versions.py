"""Policy versions on the trainer's side: what a version is and how it moves. One owner for the rules below
(docs/architecture.md has them as a table).

- A version names weights. v0 is ``model_path``; the trainer publishes v+1 after each step whose optimizer update
  ran, and nothing after a step that trained nothing (every group stale, a non-finite update).
- Versions only go up, and no number is ever given to weights it does not name: a trainer restarted with no
  checkpoint behind a published version refuses to start (``CannotResume``) instead of publishing its v0 weights as
  latest + 1 (the rewind of issue 26).
- A trainer restored from a checkpoint older than the latest published version replays the lost steps without
  publishing and checks each against its manifest (``trainer_service.replay``); the last one goes out again from
  this trainer's weight bus. A replayed version that differs ends the replay: its weights (new: trained on the same
  groups) go out as latest + 1, a lineage of their own.
- ``version_offset`` = version - steps (RedisKeys.version_offset): the coordinator's key to which version trains
  which slot. Set at start, after a step that published nothing (down by one), and before a latest + 1 publish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from trainer_service.replay import Replay

logger = logging.getLogger("trainer_service")


class CannotResume(RuntimeError):
    """The run's state forbids this trainer to start (a published version it has no checkpoint of): a restart would
    meet the same state, so the trainer exits EXIT_CANNOT_RESTART (protos/exit_codes.py)."""


class PolicyVersions:
    """The trainer's versions through a run: catch-up at start, then publish (or not) after every step.

    ``side`` is rank 0's ``RedisSide`` (None on the other ranks, which take part in every export: a collective);
    ``publish_current`` publishes the trainer's weights under its current version.
    """

    def __init__(self, side, trainer, publish_current: Callable[[], float]):
        self.side = side
        self.trainer = trainer
        self.publish_current = publish_current
        self.replay = Replay(None)

    def start(self, restored, step: int, new_lineage: bool = False) -> None:
        """Catch up with what is published: replay the versions past the checkpoint, publish the checkpoint's own
        version again from here, or (nothing restored behind a published version) raise ``CannotResume``.

        ``new_lineage`` (``trainer.resume=none``, the operator's explicit choice to start from model_path): behind a
        published version the model_path weights go out as the next version instead, a lineage of its own that the
        version offset follows; they are those weights, named by a version no other weights had."""
        from trainer_service import metrics, ranks

        side, trainer = self.side, self.trainer
        published = side.published_version() if side else None
        if ranks.world_size() > 1:
            published = ranks.broadcast_json(published)
        if side:
            logger.info(
                "trainer start: step %d, policy_version=%d (checkpoint %s), published v%d, %d entries reclaimed, "
                "ledger %d groups, %d ranks",
                step,
                trainer.policy_version,
                restored,
                published,
                side.reclaimed,
                len(trainer.ledger),
                ranks.world_size(),
            )
        starts_lineage = new_lineage and not restored and published > trainer.policy_version
        if starts_lineage:
            logger.warning(
                "trainer start: trainer.resume=none behind published v%d: model_path's weights go out as v%d, "
                "a new lineage (the fleet moves onto them; nothing of the earlier versions is resumed)",
                published,
                published + 1,
            )
            self.record_offset(published + 1, step)  # before the publish: no version without its offset
            trainer.policy_version = published + 1
            self.publish_current()
        elif not restored and published > trainer.policy_version:
            raise CannotResume(
                f"trainer start: v{published} of this run is published but no checkpoint was restored (none in the "
                f"checkpoint directory, or trainer.resume=none): the weights here are v{trainer.policy_version} "
                f"(model_path), and publishing them as v{published + 1} would rewind the policy under a newer number. "
                "Resume from a checkpoint of this run (trainer.ckpt_interval > 0 makes them), or start a new run "
                "(another run_id)"
            )
        self.replay = Replay(published if restored and published > trainer.policy_version else None)
        if self.replay.target is not None:
            logger.info("trainer start: replaying the steps of v%d..v%d", trainer.policy_version + 1, published)
        elif not starts_lineage:  # (a new lineage is published with its offset above)
            self.record_offset(trainer.policy_version, step)
            if restored and published == trainer.policy_version > 0:
                # The checkpoint holds the published version's weights, but its manifest names the weight bus of the
                # trainer that died: a server that had not fetched it yet never could (the long chaos soak stalled
                # so). The same version goes out again from here (servers that hold it take it as a no-op).
                self.publish_current()
        if side:
            side.board.init_version(trainer.policy_version)
            metrics.POLICY_VERSION.set(trainer.policy_version)

    def after_step(self, previous_version: int, step: int) -> float:
        """Step 4: publish the new version if the step trained (seconds spent); one that did not moves the version
        offset, so that the coordinator's slot map follows. A replayed version is checked against the published one
        instead (the last one replayed is then published again from here); one that differs goes out as latest + 1."""
        trainer, replay = self.trainer, self.replay
        if trainer.policy_version == previous_version:
            self.record_offset(trainer.policy_version, step)
            return 0.0
        if not replay.covers(trainer.policy_version):
            return self.publish_current()
        started, latest = time.monotonic(), replay.target
        if replay.checked(trainer.policy_version, self.replayed_differs()):
            if trainer.policy_version == latest:
                # The latest version's manifest names the dead trainer's address: a server that had not fetched it
                # yet never could, and waits for an announcement that needs its groups. The same version, the same
                # bytes, published again from here (servers that hold it take the announcement as a no-op).
                self.publish_current()
            return time.monotonic() - started
        replay.target = None
        # New weights (the replay trained the same groups to other bits): a lineage of their own, as latest + 1;
        # the offset rises first (the coordinator must not see the version without it).
        self.record_offset(latest + 1, step)
        trainer.policy_version = latest + 1
        return self.publish_current()

    def replayed_differs(self) -> list[str]:
        """Every rank exports (a collective); rank 0 compares the export with the manifest of the trainer's version."""
        from trainer_service import ranks
        from trainer_service.replay import differing_tensors
        from weight_bus.packing import WireCodec

        tensors = self.trainer.backend.export_hf_weights()
        differing: list[str] = []
        if self.side is None:
            for _name, _tensor in tensors:  # drained: the export is a collective
                pass
        else:
            manifest = self.side.board.manifest(self.trainer.policy_version)
            differing = differing_tensors(manifest, tensors, WireCodec.from_config(self.side.config.weight_bus))
        return ranks.broadcast_json(differing) if ranks.world_size() > 1 else differing

    def record_offset(self, policy_version: int, step: int) -> None:
        """Set the run's ``version_offset`` to ``policy_version - step`` (rank 0). A SET of the value: repeating it
        (a restart before the publish) changes nothing."""
        if self.side:
            self.side.board.set_version_offset(policy_version - step)
