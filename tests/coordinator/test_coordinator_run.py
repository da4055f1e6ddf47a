"""The coordinator as a real process in real runs: two vLLM rollout servers, the trainer, Redis.

The two servers are shared by the module (their start is the slow part) and follow the weight
announcements of RUN_ID. Versions only go up, so each run continues from the versions the previous
one left: the trainer of a new run (fresh checkpoint dir) publishes the next version at start, and the
coordinator is started after that, so its start version is the trainer's. The test that kills a
server runs last. The helpers (a run, the admin CLI, what Redis holds) are coordinator_runs.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import grpc
import pytest

from modeling.tiny_model import init_tiny
from tests.coordinator.coordinator_runs import (
    PLUGINS,
    ServerProcess,
    assert_every_slot_once_within_the_bound,
    coordinator_reports,
    fleetrl,
    following_servers,
    pushed_groups,
    spawn_coordinator,
    start_run,
    status,
    wait_for_admin,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def servers(model_dir, redis_server, tmp_path_factory) -> list[ServerProcess]:
    """Two rollout server processes following RUN_ID's weight announcements."""
    with following_servers(model_dir, redis_server.url, tmp_path_factory.mktemp("rollout-logs")) as started:
        yield started


def test_admin_verbs_steer_a_live_run_that_keeps_the_staleness_bound(tmp_path, model_dir, servers, redis_server):
    # Far more steps than the test lets it run (it ends with a drain): on a fast machine 40 steps of 8 tokens were
    # all trained while the test was still running its CLI calls, and the drain found no coordinator.
    b, steps = 4, 1000
    run = start_run(
        tmp_path,
        model_dir,
        servers,
        redis_server.url,
        {"group_size": 4, "groups_per_step": b, "sampling": {"max_tokens": 8}},
        steps,
    )
    try:
        wait_for_admin(run)
        # pause: nothing more is admitted, in-flight groups still finish and are pushed
        assert "coordinator paused" in fleetrl(run, "pause").stdout
        time.sleep(1.0)  # kept: an admission decided just before the pause may still be landing; none says when
        paused = status(run)
        time.sleep(1.5)  # kept: that nothing is admitted while paused is a check that needs time to pass
        assert status(run)["slotsAdmitted"] == paused["slotsAdmitted"] and paused["state"] == "RUN_STATE_PAUSED"
        table = fleetrl(run, "status").stdout
        assert "| paused |" in table and all(s.address in table for s in servers)
        scrape = urllib.request.urlopen(run.metrics_url, timeout=10).read().decode()
        assert "coordinator_groups_admitted_total" in scrape and "coordinator_trainer_policy_version" in scrape
        # set: lowering k is always safe; an unknown key is refused with a clear error
        assert "max_staleness: 1 -> 0" in fleetrl(run, "set", "max_staleness=0").stdout
        assert status(run)["maxStaleness"] == 0
        assert "max_staleness: 0 -> 1" in fleetrl(run, "set", "max_staleness=1").stdout
        refused = fleetrl(run, "set", "no_such_key=1", check=False)
        assert refused.returncode == 2 and "unknown key coordinator.no_such_key" in refused.stderr
        # servers: remove one (it gets no new calls), add it back
        assert "1 servers" in fleetrl(run, "servers", "remove", servers[1].address).stdout
        assert [s["address"] for s in status(run)["servers"]] == [servers[0].address]
        assert "2 servers" in fleetrl(run, "servers", "add", servers[1].address).stdout
        assert "coordinator running" in fleetrl(run, "resume").stdout
        # a live temperature change applies to requests made after it; each group records the one it was drawn at
        assert "temperature: 1.0 -> 0.9" in fleetrl(run, "set", "temperature=0.9").stdout
        changed_at = int(status(run).get("groupsPushed", 0))
        enough = max(3 * b, changed_at + 2 * b + 1)  # > 2B in flight at the change: later groups are all at 0.9

        def pushed() -> int:
            count = int(status(run).get("groupsPushed", 0))
            return count if count >= enough else 0

        wait_until(pushed, f"{enough} groups pushed by the resumed run", 120, poll_s=0.2)
        # drain: admitted work is finished and pushed, nothing new is admitted, the coordinator stops
        drained = fleetrl(run, "drain", "--wait-s", "60").stdout
        assert drained.startswith("coordinator drained: 0 groups in flight, ")
        run.wait()
    finally:
        run.stop()
    groups = pushed_groups(redis_server.url)
    final = coordinator_reports(redis_server.url)[-1].values
    assert 3 * b <= len(groups) == final["slots_admitted"] == final["groups_pushed"] < steps * b
    assert_every_slot_once_within_the_bound(groups, len(groups), run.start_version, b, k=1)
    assert final["max_staleness_at_push"] <= 1
    temperatures = [g.sampling_temperature for g in groups]
    assert temperatures[0] == 1.0 and temperatures[-1] == 0.9 and set(temperatures) == {1.0, 0.9}
    assert temperatures == sorted(temperatures, reverse=True)  # one change: every group after it at 0.9


def test_dataset_run_with_dynamic_sampling_and_pinned_eval_rounds(tmp_path, model_dir, servers, redis_server):
    train = tmp_path / "train.jsonl"
    train.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "problem": f"what is {i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(6)
        )
    )
    evalset = tmp_path / "tiny-eval.jsonl"
    evalset.write_text("".join(json.dumps({"problem": f"{i}*3", "answer": str(3 * i)}) + "\n" for i in range(3)))
    b, steps = 2, 4
    run = start_run(
        tmp_path,
        model_dir,
        servers,
        redis_server.url,
        {
            "task": str(train),
            "reward_fn": f"{PLUGINS}:zero_for_even_ids",
            "prompt_template": "{problem}=",
            "group_size": 4,
            "groups_per_step": b,
            "sampling": {"max_tokens": 8},
            "dynamic_sampling": True,
            "dynamic_sampling_max_tries": 3,
            "eval": {
                "datasets": [str(evalset)],
                "interval_steps": 2,
                "at_start": True,
                "samples_per_problem": 2,
                "reward_fn": f"{PLUGINS}:always_one",
            },
        },
        steps,
    )
    try:
        run.wait()
    finally:
        run.stop()
    v0 = run.start_version
    groups = pushed_groups(redis_server.url)
    assert_every_slot_once_within_the_bound(groups, steps * b, v0, b, k=1)
    reports = coordinator_reports(redis_server.url)
    final = [r for r in reports if "groups_skipped" in r.values][-1].values
    uniform = [g for g in groups if len({s.reward for s in g.samples}) == 1]
    assert final["groups_skipped"] >= 1 and len(uniform) == final["groups_kept_uniform"]
    assert final["groups_admitted"] == steps * b + final["groups_skipped"]  # each skip drew a replacement
    # eval: one round per scheduled version, every sample produced by exactly that version
    evals = [r for r in reports if "eval/version" in r.values]
    assert [r.policy_version for r in evals] == [v0, v0 + 2, v0 + 4]
    assert [r.step for r in evals] == [0, 2, 4]  # the trainer's steps at those versions
    for report in evals:
        assert report.values["eval/tiny-eval/acc"] == 1.0 and report.values["eval/tiny-eval/pass@2"] == 1.0
        rows = [json.loads(line) for line in (tmp_path / "export" / "eval" / f"v{report.policy_version}.jsonl").open()]
        assert len(rows) == 3 * 2
        assert {span[0] for row in rows for span in row["version_spans"]} == {report.policy_version}


def test_eval_requests_go_only_to_servers_at_the_pinned_version(tmp_path, model_dir, servers):
    from coordinator.evaluation import EvalProblem, EvalRunner, EvalSet
    from coordinator.fleet import Fleet
    from coordinator.rewards import get_reward_fn
    from coordinator.rollout_client import RolloutClient
    from coordinator.tasks import ResponseScorer
    from modeling.tiny_model import build_tokenizer
    from protos.config import load_run_config

    async def rounds() -> tuple:
        config = load_run_config(
            overrides=[
                "coordinator.eval.timeout_s=3",
                "coordinator.eval.samples_per_problem=3",
                "coordinator.eval.datasets=[x.jsonl]",
            ]
        )
        fleet = Fleet([RolloutClient(s.address) for s in servers])
        for client in fleet.clients:
            await client.info()
        current = fleet.clients[0].policy_version
        assert {c.policy_version for c in fleet.clients} == {current}
        problem = type("P", (), {"problem_id": "p", "ground_truth": "1"})()
        sets = [EvalSet("pin", [EvalProblem(problem, [1, 5, 6, 7])] * 4, 0)]
        tokenizer = build_tokenizer()
        scorer = ResponseScorer(tokenizer, get_reward_fn(f"{PLUGINS}:always_one"), None, 5)
        runner = EvalRunner(config, fleet, sets, scorer, str(tmp_path))
        stale = await runner.run_round(current + 1)  # no server is there: the round waits, then gives up
        requests_after_stale = sum(c.requests for c in fleet.clients)
        pinned = await runner.run_round(current)
        await fleet.close()
        return current, stale, requests_after_stale, pinned, runner

    current, stale, requests_after_stale, pinned, runner = asyncio.run(rounds())
    assert stale is None and runner.rounds_failed == 1 and requests_after_stale == 0
    assert pinned["eval/pin/acc"] == 1.0 and pinned["eval/pin/num_problems"] == 4
    rows = [json.loads(line) for line in (tmp_path / "eval" / f"v{current}.jsonl").open()]
    assert len(rows) == 4 * 3 and {span[0] for row in rows for span in row["version_spans"]} == {current}
    assert not (tmp_path / "eval" / f"v{current + 1}.jsonl").exists()


# Keep this test last: it kills one of the module's servers.
def test_a_coordinator_killed_mid_run_is_restarted_and_every_prompt_is_pushed_once_in_order(
    tmp_path, model_dir, servers, redis_server
):
    from coordinator.tasks import EchoTask
    from protos import admin_pb2, admin_pb2_grpc
    from protos.config import load_run_config

    b, steps = 4, 10
    run = start_run(
        tmp_path,
        model_dir,
        servers,
        redis_server.url,
        {"group_size": 4, "groups_per_step": b, "sampling": {"max_tokens": 32}},
        steps,
    )
    try:
        wait_for_admin(run)
        stub = admin_pb2_grpc.CoordinatorAdminStub(grpc.insecure_channel(run.admin))
        wait_until(  # mid-step: the kill lands between two steps' pushes
            lambda: stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10).groups_pushed >= b + 2,
            f"{b + 2} groups pushed",
            120,
            poll_s=0.02,
        )
        os.kill(run.coordinator.pid, signal.SIGKILL)
        run.coordinator.wait()
        pushed_before = len(pushed_groups(redis_server.url))
        run.coordinator = spawn_coordinator(tmp_path, model_dir, servers, redis_server.url)
        run.wait()
        restarted_log = run.log("coordinator")
    finally:
        run.stop()
    groups = pushed_groups(redis_server.url)
    assert "coordinator restart: task echo continues at" in restarted_log, restarted_log
    assert b + 2 <= pushed_before < len(groups) == steps * b
    assert len({g.group_id for g in groups}) == len(groups)  # a repeated id is dropped by the trainer as a duplicate
    # The restarted coordinator produced only the rest of the run and continued the seeded prompt stream where the
    # pushed groups left it: prompts admitted but lost with the killed coordinator come again, none twice or skipped.
    task = EchoTask(seed=load_run_config().coordinator.seed)
    expected = [task.next_prompt() for _ in range(steps * b)]
    assert [g.prompt_id for g in groups] == [p.prompt_id for p in expected]
    assert all(
        g.prompt_token_ids.to_numpy().tolist() == p.prompt_token_ids for g, p in zip(groups, expected, strict=False)
    )
    for position, group in enumerate(groups):  # the bound holds across the restart (stream order = train order)
        oldest = min(span.version for sample in group.samples for span in sample.version_spans)
        assert 0 <= run.start_version + position // b - oldest <= 1, (position, oldest, run.start_version)


def _freeze_coordinator_calls(stub, engine, address: str, run, timeout_s: float = 120) -> None:
    """Catch the server at ``address`` generating for the coordinator and pause it there (PAUSE_MODE_KEEP): only a
    kill can end those calls then."""
    from protos import admin_pb2, rollout_pb2

    def busy() -> bool:
        assert run.coordinator.poll() is None, f"the coordinator exited before {address} was caught busy:\n" + (
            run.log("coordinator")
        )
        now = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
        assert now.groups_pushed < now.total_groups, f"{address} never busy mid-run"
        return now.groups_pushed >= 1 and any(s.address == address and s.inflight for s in now.servers)

    def frozen() -> bool:
        # The coordinator's count alone can include a call whose samples all finished before the pause
        # and whose stream is still closing: a request the paused engine still holds is frozen.
        for _ in range(2):
            if not engine.ServerInfo(rollout_pb2.ServerInfoRequest(), timeout=10).num_engine_requests:
                return False
            time.sleep(0.2)  # kept: "still held a moment later" is the check; no event marks a stream done closing
        return True

    def caught() -> bool:
        if not busy():
            return False
        engine.Pause(rollout_pb2.PauseRequest(mode=rollout_pb2.PAUSE_MODE_KEEP), timeout=10)
        if frozen() and busy():
            return True
        engine.Resume(rollout_pb2.ResumeRequest(), timeout=10)
        return False

    wait_until(caught, f"{address} generating for the coordinator, then frozen there", timeout_s, poll_s=0.01)


def test_a_server_killed_mid_run_loses_no_prompt_and_its_requests_are_redispatched(
    tmp_path, model_dir, servers, redis_server
):
    from protos import admin_pb2, admin_pb2_grpc, rollout_pb2_grpc

    # enough steps that the run is still going once the admin API answers (10 were done before that in CI)
    b, steps = 4, 24
    run = start_run(
        tmp_path,
        model_dir,
        servers,
        redis_server.url,
        {"group_size": 4, "groups_per_step": b, "sampling": {"max_tokens": 96}, "request_timeout_s": 60},
        steps,
    )
    victim = servers[1]
    try:
        wait_for_admin(run)
        stub = admin_pb2_grpc.CoordinatorAdminStub(grpc.insecure_channel(run.admin))
        engine = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(victim.address))
        _freeze_coordinator_calls(stub, engine, victim.address, run)
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait()
        deadline = time.monotonic() + 10
        while True:  # its broken calls tell the coordinator at once
            now = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
            if not any(s.address == victim.address and s.healthy for s in now.servers):
                break
            assert time.monotonic() < deadline, f"{victim.address} still reported healthy"
        run.wait()
        gone = fleetrl(run, "status", check=False)  # the finished coordinator's admin API is gone: exit 3
        assert gone.returncode == 3 and "cannot reach the coordinator admin API" in gone.stderr
    finally:
        run.stop()
    assert_every_slot_once_within_the_bound(pushed_groups(redis_server.url), steps * b, run.start_version, b, k=1)
    final = coordinator_reports(redis_server.url)[-1].values
    assert final["groups_pushed"] == steps * b and final["redispatches"] >= 1
    assert "re-dispatching" in run.log("coordinator")
