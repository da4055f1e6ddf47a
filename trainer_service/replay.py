"""Replay of the steps a dead trainer had published but not checkpointed.

A trainer that dies after publishing version v, before the checkpoint that holds v's step is durable, leaves v on the
rollout servers and in the tokens of queued groups, while the trainer restarted from its checkpoint holds older
weights. Publishing those as latest + 1 (a new lineage, ``versions.PolicyVersions``) skips versions: every group admitted
under the old numbering then looks older than it is (version arithmetic counts v_trainer - token version), and the
trainer dropped whole steps of on-policy groups as stale (the chaos soak, docs/chaos.md).

The lost steps can be trained again instead. Their queue entries are still pending (acknowledged only once a durable
checkpoint holds them), in the order the dead trainer read them, and the restored state (weights, optimizer, RNG) is
the one it trained them from: the same groups from the same state give the same weights (bit-exact on one device,
tests/trainer_service/test_checkpoint.py). So the restarted trainer trains those steps without publishing, checks
each replayed version against the checksums of its published manifest, and continues from the published version:
no version is skipped and every queued sample keeps the staleness it was admitted with. The last replayed version is
published once more, under the same number, from the restarted trainer: its manifest named the dead trainer's
address, and a server that had not fetched it yet could not (the long chaos soak: the run stalled there). A replayed version that
differs (a non-deterministic kernel, an operator's setting applied between the lost steps, weights published other
than whole) or whose manifest has expired ends the replay: the trainer then publishes its weights as latest + 1, as
without it.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable

import torch

from protos.records import WeightManifest
from weight_bus.packing import WireCodec, encode_tensors

logger = logging.getLogger("trainer_service")


def differing_tensors(
    manifest: WeightManifest | None, named_tensors: Iterable[tuple[str, torch.Tensor]], codec: WireCodec
) -> list[str]:
    """Names whose wire bytes (under ``codec``) differ from ``manifest``'s checksums, or that only one side has;
    ["<no manifest>"] without a manifest. Consumes ``named_tensors`` whole (an export is a collective)."""
    if manifest is not None and not manifest.checksummed:  # an ipc version whose host copy never finished
        manifest = None
    expected = {entry.name: entry.checksum for entry in manifest.tensors} if manifest is not None else None
    differing = []
    for name, payload, _codec in encode_tensors(named_tensors, codec):
        if expected is None:
            continue
        data = payload.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        if expected.pop(name, None) != zlib.crc32(memoryview(data)):
            differing.append(name)
    if expected is None:
        return ["<no manifest>"]
    return differing + sorted(expected)


class Replay:
    """The versions a restarted trainer trains again without publishing: its restored one up to ``target``, the
    latest published (None: nothing to replay, or the replay is over)."""

    def __init__(self, target: int | None):
        self.target = target

    def covers(self, version: int) -> bool:
        """Whether ``version`` (the trainer's after a step) is one of the replayed, already published versions."""
        return self.target is not None and version <= self.target

    def checked(self, version: int, differing: list[str]) -> bool:
        """Record the check of replayed ``version`` against the published one; True when they are the same weights
        (the replay goes on, or ends at its target), False when not (the replay ends: a new lineage follows)."""
        if differing:
            logger.warning(
                "replayed v%d differs from the published v%d (%d tensors, e.g. %s); publishing as v%d instead",
                version,
                version,
                len(differing),
                differing[:3],
                self.target + 1,
            )
            return False
        logger.info("replayed v%d: the published weights, bit for bit", version)
        if version == self.target:
            self.target = None
        return True
