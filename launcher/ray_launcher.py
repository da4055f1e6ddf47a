"""``fleetrl up``: the roles of ``fleetrl demo`` on a Ray cluster, each role process owned by a Ray actor.

The driver is the ``fleetrl up`` process. It is a ``DemoLauncher`` whose processes live in actors: the same role
specs (launcher/roles.py), the same step lines and summary. Placement (docs/deploy.md, Ray launcher):

* a rollout replica (launcher/ray_replicas.py): its own placement group, one STRICT_PACK bundle of
  ``launcher.ray.rollout_cpus`` CPUs and, with GPUs, TP x PP of them; the replica's ``RoleActor`` takes the bundle;
* the trainer: one placement group for its gang, a bundle per node of ``trainer.num_processes`` ranks (STRICT_PACK on
  one node, STRICT_SPREAD over ``trainer.num_nodes``), one ``RoleActor`` per rank with torchrun's environment;
* the coordinator: an actor of ``coordinator_cpus``; Redis: the run's ``redis_url``, or the embedded valkey as a role
  like the others (a ``RoleActor`` of ``redis_cpus``: restarted on the same address, its AOF in <run dir>/valkey);
* on a KubeRay cluster (launcher/ray_placement.py) each also asks for its group's custom resource.

Healing: a rollout server's, the coordinator's or valkey's actor restarts its process by ``launcher.restart``; the trainer's
ranks restart together (``TrainerGang``) under the same policy. ``fleetrl scale`` and ``fleetrl down`` reach the driver
through the run's named ``RunControl`` actor (launcher/ray_control.py).
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launcher import roles
from launcher.demo import DemoLauncher
from launcher.ray_actors import RoleActor, RunControl, control_actor_name
from launcher.ray_control import AUTH_MODE_ENV, RunLocation, write_state
from launcher.ray_placement import (
    TrainerGang,
    actor_options,
    check_placeable,
    coordinator_resources,
    resolve_cluster_choices,
)
from launcher.ray_replicas import STOP_GRACE_S, RolloutReplicas
from launcher.redis_server import REDIS_ROLE, redis_spec, wait_accepting
from launcher.supervision import RoleFailed, write_roles
from protos.config import RunConfig


class RunStopped(Exception):
    """``fleetrl down`` asked the run to stop."""


class RayLauncher(DemoLauncher):
    """The driver of ``fleetrl up``: starts the actors, supervises them through their reports, acts on
    ``fleetrl down|scale``, and stops everything at the end."""

    def __init__(self, config: RunConfig, out_dir: Path):
        super().__init__(config, out_dir)
        self.ray_config = config.launcher.ray
        self.local = self.ray_config.address == "local"
        self.replicas: RolloutReplicas | None = None
        self.gang: TrainerGang | None = None
        self.coordinator = None
        self.redis_actor = None
        self.control = None
        self.reports: dict[str, dict] = {}
        self.config_path = Path()
        self.actor_options = {"log_dir": str(out_dir / "logs"), "cwd": os.getcwd()}

    # the run -------------------------------------------------------------------------------
    def start(self) -> str:
        # 1) settle what the cluster decides (GPUs, KubeRay's role resources); refuse what this launcher cannot place
        #    and a second driver of the same run id
        resolve_cluster_choices(self.config, ray.cluster_resources())
        check_placeable(self.config, self.local)
        self.control = self._claim_run()
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        # 2) Redis: the run's redis_url, or the embedded valkey as a supervised role
        redis_url = self.config.redis_url or self.start_redis_role()
        # 3) the config every role reads, and where `fleetrl down|scale` find this run
        self.config_path = self.prepare(redis_url)
        address = ray.get_runtime_context().gcs_address
        location = RunLocation(
            address,
            self.ray_config.namespace,
            self.config.run_id,
            str(self.out_dir),
            os.getpid(),
            os.environ.get(AUTH_MODE_ENV, ""),
        )
        write_state(self.out_dir, location)
        # 4) rollout replicas, each in its own placement group; the trainer's ranks in one
        make_spec = partial(roles.rollout_spec, self.config, self.config_path, self.out_dir)
        self.replicas = RolloutReplicas(self.config, make_spec, self._role_actor, self.local)
        for _ in range(self.config.rollout.num_servers):
            self.replicas.add(wait=True)
        self.gang = TrainerGang(self.config, self.config_path, self.actor_options, self.local)
        self.gang.start()
        # 5) the coordinator, once every rollout server serves (it finds them in Redis, or is handed the list)
        addresses = self.wait_for_rollouts()
        self.coordinator = self._role_actor(coordinator_resources(self.config), None)
        node = ray.get(self.coordinator.placement.remote(), timeout=60)
        extra = () if self.local else (f"coordinator.admin_host={node['ip']}",)
        spec = roles.coordinator_spec(self.config, self.config_path, addresses, extra)
        ray.get(self.coordinator.start.remote(spec), timeout=60)
        return redis_url

    def start_redis_role(self, timeout_s: float = 60.0) -> str:
        """valkey in a RoleActor of its own, as ``fleetrl demo`` runs it (launcher/redis_server.py): a crash is
        restarted by ``launcher.restart`` on the same host:port and data directory, whose AOF (fsynced at every write)
        brings back every acknowledged write; the roles ride out the gap with their outage retry."""
        self.redis_actor = self._role_actor({"CPU": self.ray_config.redis_cpus}, None)
        node = ray.get(self.redis_actor.placement.remote(), timeout=60)
        host = "127.0.0.1" if self.local else node["ip"]
        port = ray.get(self.redis_actor.free_port.remote(), timeout=60)
        spec = redis_spec(self.out_dir / "valkey", host, port)
        ray.get(self.redis_actor.start.remote(spec), timeout=60)
        try:
            wait_accepting(host, port, timeout_s)
        except (RuntimeError, TimeoutError) as error:
            raise RoleFailed(f"the embedded Redis did not start: {error} (its log: {self.out_dir / 'logs'})") from None
        return f"redis://{host}:{port}/0"

    def _claim_run(self):
        try:
            return (
                ray.remote(RunControl)
                .options(name=control_actor_name(self.config.run_id), num_cpus=0)
                .remote(self.config.run_id, str(self.out_dir))
            )
        except ValueError:
            raise RoleFailed(
                f"run {self.config.run_id!r} is already up on this Ray cluster (namespace "
                f"{self.ray_config.namespace!r}): stop it with `fleetrl down --run-dir DIR` (its run directory) or "
                f"`fleetrl down --ray ADDRESS --run-id {self.config.run_id}`, or choose another run_id"
            ) from None

    def _role_actor(self, resources: dict[str, float], group: PlacementGroup | None):
        """A RoleActor asking for ``resources`` (a replica: its whole bundle of ``group``)."""
        strategy = PlacementGroupSchedulingStrategy(group, 0) if group is not None else "DEFAULT"
        options = {**actor_options(resources), "scheduling_strategy": strategy}
        policy = self.config.launcher.restart.model_dump()
        return ray.remote(RoleActor).options(**options).remote(policy=policy, **self.actor_options)

    def wait_for_rollouts(self, timeout_s: float = 900.0) -> list[str]:
        """The rollout servers' host:port, once each serves (a CPU engine starts in ~30 s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_children()
            addresses = {name: self.reports[name].get("address") for name in self.replicas.serving}
            if all(addresses.values()):
                return list(addresses.values())
            if time.monotonic() > deadline:
                missing = [name for name, address in addresses.items() if not address]
                raise RoleFailed(f"{missing} not serving within {timeout_s:.0f}s (logs in {self.out_dir / 'logs'})")
            time.sleep(0.5)

    # supervision ---------------------------------------------------------------------------
    def check_children(self) -> None:
        """Collect the actors' reports (printing their events), restart a failed trainer gang, finish the scaled-away
        replicas, act on ``fleetrl down|scale``, and post the reports (RunControl, roles.json)."""
        actors = {name: r.actor for name, r in self.replicas.serving.items()} if self.replicas else {}
        if self.coordinator is not None:
            actors["coordinator"] = self.coordinator
        if self.redis_actor is not None:
            actors[REDIS_ROLE] = self.redis_actor
        names = list(actors) + (self.gang.names if self.gang else [])
        refs = [actor.report.remote() for actor in actors.values()] + (self.gang.report_refs() if self.gang else [])
        try:
            reports = dict(zip(names, ray.get(refs, timeout=60), strict=True))
        except ray.exceptions.RayActorError as error:
            raise RoleFailed(f"an actor of the run died (its node may be gone): {error}") from None
        except ray.exceptions.GetTimeoutError:
            raise RoleFailed(
                f"the actors of {names} did not report within 60s (is the Ray cluster overloaded?)"
            ) from None
        for report in reports.values():
            for event in report["events"]:
                print(f"fleetrl: {event}", flush=True)
            if report["error"]:
                raise RoleFailed(report["error"])
        if self.gang is not None:
            event = self.gang.supervise([reports[name] for name in self.gang.names])
            if event:
                print(f"fleetrl: {event}", flush=True)
        self.reports = reports
        for event in self.replicas.advance() if self.replicas else []:
            print(f"fleetrl: {event}", flush=True)
        self._act_on_requests()
        self._post_reports()

    def _act_on_requests(self) -> None:
        stop_reason, scale = ray.get(self.control.take_requests.remote(), timeout=30)
        if stop_reason:
            raise RunStopped(stop_reason)
        if roles.ROLLOUT in scale:
            print(f"fleetrl: {self.replicas.scale_to(scale[roles.ROLLOUT])}", flush=True)

    def _post_reports(self) -> None:
        posted = {name: {k: v for k, v in r.items() if k != "events"} for name, r in self.reports.items()}
        posted.update(self.replicas.transient_reports() if self.replicas else {})
        if self.gang is not None:
            for name in self.gang.names:
                posted[name]["restarts"] = self.gang.restarts
        self.control.post.remote(posted)
        if posted != self.posted_reports:
            write_roles(self.out_dir, posted)
            self.posted_reports = posted

    def coordinator_running(self) -> bool:
        report = self.reports.get("coordinator")
        return report is None or report["state"] not in ("finished", "failed")

    def restarts(self) -> dict[str, int]:
        counts = {name: r["restarts"] for name, r in self.reports.items() if r.get("kind") != roles.TRAINER}
        return {**counts, roles.TRAINER: self.gang.restarts if self.gang else 0}

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every process (in parallel, each with ``grace_s``), then the actors, groups and Redis."""
        actors = (self.gang.actors if self.gang else []) + ([self.coordinator] if self.coordinator else [])
        stops = [actor.stop.remote(grace_s) for actor in actors] + (
            self.replicas.stop_refs(grace_s) if self.replicas else []
        )
        ray.get(stops, timeout=grace_s + 60)
        for actor in actors:
            ray.kill(actor)
        if self.replicas is not None:
            self.replicas.release()
        if self.gang is not None:
            remove_placement_group(self.gang.group)
        if self.redis_actor is not None:  # last: the others may still write on their way out
            ray.get(self.redis_actor.stop.remote(grace_s), timeout=grace_s + 60)
            ray.kill(self.redis_actor)
        if self.control is not None:
            ray.kill(self.control)


def run_up(config: RunConfig, out_dir: Path) -> dict:
    """``fleetrl up``: join or start the cluster, run to the end (or ``fleetrl down``), stop everything; returns and
    writes the summary."""
    from launcher.ray_control import connect

    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir = out_dir.resolve()
    connect(config.launcher.ray.address, config.launcher.ray.namespace, config.launcher.ray.num_cpus)
    launcher = RayLauncher(config, out_dir)
    try:
        redis_url = launcher.start()
        print(_banner(launcher, redis_url), flush=True)
        summary = launcher.monitor(redis_url)
        summary["restarts"] = launcher.restarts()
        summary["launcher"] = "ray"
    finally:
        launcher.stop_all()
        ray.shutdown()
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _banner(launcher: RayLauncher, redis_url: str) -> str:
    cfg, out_dir = launcher.config.coordinator, launcher.out_dir
    admin = f"{cfg.admin_host}:{cfg.admin_port}" if cfg.admin_port else "(port in logs/coordinator.log)"
    return (
        f"run dir {out_dir} | Ray {ray.get_runtime_context().gcs_address} | Redis {redis_url} | logs in "
        f"{out_dir / 'logs'} | admin API {admin} (fleetrl status --admin ADDR) | fleetrl scale rollout=N --run-dir "
        f"{out_dir} | fleetrl down --run-dir {out_dir}"
    )
