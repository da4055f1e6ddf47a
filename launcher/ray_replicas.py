"""RolloutReplicas: the rollout servers of a ``fleetrl up`` run, each a placement group and a ``RoleActor``.

A replica is ``placing`` (its group waits for resources; a scale-up never blocks the driver), then ``serving``
(its actor runs ``rollout-<index>``; indices are never reused), then ``leaving`` once scaled away (the server leaves
the fleet hash, drains, and stops) until its actor and group are gone. ``advance`` moves them along; the driver calls
it on every look at the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from launcher import roles
from launcher.ray_placement import rollout_bundle, wait_placed
from protos.config import RunConfig

STOP_GRACE_S = 30.0  # a rollout server drains its calls (--grace-s) and shuts its engine down within this


@dataclass
class Replica:
    """One rollout server: its index, placement group and (once placed) actor."""

    index: int
    group: PlacementGroup
    actor: ray.actor.ActorHandle | None = None
    placed_by_s: float = 0.0  # monotonic deadline of a replica still placing
    stopping: ray.ObjectRef | None = None  # the stop call of a replica scaled away
    ready: ray.ObjectRef | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"rollout-{self.index}"


class RolloutReplicas:
    """Adds, starts, retires and stops the run's rollout replicas; ``make_actor(resources, group)`` builds the actor
    that takes a replica's whole bundle."""

    def __init__(self, config: RunConfig, make_spec: Callable[[int, str], roles.RoleSpec], make_actor, local: bool):
        self.config = config
        self.make_spec = make_spec  # (index, host) -> the server's RoleSpec
        self.make_actor = make_actor
        self.local = local
        self.timeout_s = config.launcher.ray.placement_timeout_s
        self.serving: dict[str, Replica] = {}
        self.placing: dict[str, Replica] = {}
        self.leaving: dict[str, Replica] = {}
        self.num_made = 0

    def add(self, wait: bool) -> None:
        """One more replica in a STRICT_PACK placement group of its own; ``wait``: until it is placed and started
        (the run's start: RoleFailed if the cluster cannot hold it), else it starts from ``advance``."""
        replica = Replica(self.num_made, self._group(self.num_made))
        self.num_made += 1
        if wait:
            wait_placed(replica.group, replica.name, self.timeout_s)
            self._start(replica)
            return
        replica.ready, replica.placed_by_s = replica.group.ready(), time.monotonic() + self.timeout_s
        self.placing[replica.name] = replica

    def _group(self, index: int) -> PlacementGroup:
        name = f"fleetrl-{self.config.run_id}-rollout-{index}"
        return placement_group([rollout_bundle(self.config)], strategy="STRICT_PACK", name=name)

    def _start(self, replica: Replica) -> None:
        replica.actor = self.make_actor(rollout_bundle(self.config), replica.group)
        host = "" if self.local else ray.get(replica.actor.placement.remote(), timeout=60)["ip"]
        ray.get(replica.actor.start.remote(self.make_spec(replica.index, host)), timeout=60)
        self.serving[replica.name] = replica

    def scale_to(self, count: int) -> str:
        """Add replicas (placed in the background) or retire the newest ones; returns what it does."""
        current = len(self.serving) + len(self.placing)
        for _ in range(count - current):
            self.add(wait=False)
        newest_first = sorted([*self.placing.values(), *self.serving.values()], key=lambda r: r.index, reverse=True)
        for replica in newest_first[: max(0, current - count)]:
            self.retire(replica)
        return f"scaling rollout servers {current} -> {count}"

    def retire(self, replica: Replica) -> None:
        """SIGTERM the server: it leaves the fleet hash (the coordinator stops routing to it) and drains its calls
        (they finish or are re-dispatched); its actor and group go once it stopped. A replica still placing just
        gives its group back."""
        if self.placing.pop(replica.name, None) is not None:
            remove_placement_group(replica.group)
            return
        del self.serving[replica.name]
        replica.stopping = replica.actor.stop.remote(STOP_GRACE_S)
        self.leaving[replica.name] = replica

    def advance(self) -> list[str]:
        """Start the replicas placed meanwhile, give up on those not placed in time, and remove the actors and groups
        of those that stopped; returns what happened."""
        events = []
        for name, replica in list(self.placing.items()):
            done, _ = ray.wait([replica.ready], timeout=0)
            if done:
                del self.placing[name]
                self._start(replica)
                events.append(f"{name} placed and starting")
            elif time.monotonic() > replica.placed_by_s:
                del self.placing[name]
                remove_placement_group(replica.group)
                events.append(
                    f"{name} not placed within {self.timeout_s:.0f}s (launcher.ray.placement_timeout_s); "
                    f"the cluster has {ray.available_resources()} free; that replica is not started"
                )
        for name, replica in list(self.leaving.items()):
            if ray.wait([replica.stopping], timeout=0)[0]:
                ray.kill(replica.actor)
                remove_placement_group(replica.group)
                del self.leaving[name]
                events.append(f"{name} stopped")
        return events

    def transient_reports(self) -> dict[str, dict]:
        """Reports of the replicas without a process to report: placing and leaving ones."""
        reports = {name: {"name": name, "kind": roles.ROLLOUT, "state": "placing"} for name in self.placing}
        for name in self.leaving:
            reports[name] = {"name": name, "kind": roles.ROLLOUT, "state": "leaving", "leaving": True}
        return reports

    def stop_refs(self, grace_s: float) -> list:
        return [r.actor.stop.remote(grace_s) for r in (*self.serving.values(), *self.leaving.values())]

    def release(self) -> None:
        """After the stop: every actor and placement group goes."""
        for replica in (*self.serving.values(), *self.leaving.values(), *self.placing.values()):
            if replica.actor is not None:
                ray.kill(replica.actor)
            remove_placement_group(replica.group)
