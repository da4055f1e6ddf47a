"""The coordinator's plain parts in-process: admission arithmetic, the fleet watcher, eval scheduling and pinning
rules, run-time settings (dataset tasks: test_dataset_tasks.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from channels.trajectory_stream import TrajectoryStreamWriter
from channels.version_board import AsyncVersionBoard, VersionBoard
from coordinator.evaluation import EvalRunner, eval_versions, pass_at_k, spans_match
from coordinator.fleet import Fleet, FleetWatcher
from coordinator.rollout_client import RolloutClient, SampleResult
from coordinator.runtime_config import FixedSetting, UnknownSetting, apply_setting
from coordinator.scheduler import RunState, Scheduler
from coordinator.tasks import EchoTask, build_task
from protos.config import load_run_config
from protos.records import ReportStatus, VersionReport, WeightManifest
from protos.redis_keys import RedisKeys
from tests.coordinator.task_files import write_plain
from tests.waiting import wait_until_async

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_scheduler(start_version: int = 0, total_groups: int = 40, overrides: tuple[str, ...] = ()) -> Scheduler:
    config = load_run_config(overrides=["groups_per_step=4", "max_staleness=1", *overrides])
    queue = TrajectoryStreamWriter(aioredis.Redis.from_url("redis://127.0.0.1:1"), RedisKeys("unit"))  # never used here
    return Scheduler(config, Fleet([]), queue, EchoTask(), total_groups, start_version)


def admit_all(scheduler: Scheduler) -> int:
    count = 0
    while scheduler.can_admit():
        scheduler.admit()
        count += 1
    return count


def test_admission_allows_k_plus_one_steps_of_slots_counted_from_the_start_version():
    scheduler = make_scheduler(start_version=5)
    assert admit_all(scheduler) == (0 + 1 + 1) * 4  # v_t - v_0 = 0, k = 1, B = 4
    assert scheduler.version_floor(0) == 4 and scheduler.version_floor(7) == 5
    assert scheduler.train_version(7) == 6
    scheduler.set_trainer_version(6)
    assert admit_all(scheduler) == 4
    scheduler.set_trainer_version(3)  # an older report never moves the version back
    assert scheduler.trainer_version == 6 and not scheduler.can_admit()


def test_versions_skipped_by_a_restarted_trainer_shift_the_slot_arithmetic_and_the_eval_schedule():
    from coordinator.__main__ import Pipeline, follow_version_offset

    scheduler = make_scheduler(start_version=0, overrides=("coordinator.eval.datasets=[a.jsonl]",))
    evals = EvalRunner(scheduler.run, scheduler.fleet, [], scorer=None)
    evals.schedule([4])
    pipeline = Pipeline(scheduler, evals, executor=None)
    scheduler.set_trainer_version(2)
    assert admit_all(scheduler) == (2 + 1 + 1) * 4
    # The trainer dies after publishing v3, restarts from its step-1 checkpoint and publishes that as v4:
    # 3 versions skipped; the groups of steps 2.. are trained again, each 3 versions later than planned.
    follow_version_offset(pipeline, 3)
    scheduler.set_trainer_version(4)
    assert scheduler.train_version(4) == 3 + 1  # slot 4 (step 2) now trains at v4, as the restarted trainer does
    assert scheduler.version_floor(8) == 3 + 2 - 1
    assert scheduler.admission_limit() == (4 - 3 + 1 + 1) * 4  # counted in steps, not in raw versions
    assert evals.pending == [7]  # the round after 4 steps
    follow_version_offset(pipeline, 3)  # the same total again changes nothing
    assert scheduler.start_version == 3 and evals.pending == [7]


def test_on_policy_admission_goes_on_after_steps_that_published_nothing():
    from coordinator.__main__ import Pipeline, follow_version_offset

    scheduler = make_scheduler(start_version=5, overrides=("max_staleness=0", "coordinator.eval.datasets=[a.jsonl]"))
    evals = EvalRunner(scheduler.run, scheduler.fleet, [], scorer=None)
    evals.schedule([7])  # the round after 2 steps
    pipeline = Pipeline(scheduler, evals, executor=None)
    assert admit_all(scheduler) == 4  # k = 0: one step's slots
    # The trainer takes step 1 on those 4 groups, its update is not finite: no version, version - steps = -1.
    follow_version_offset(pipeline, -1)
    assert admit_all(scheduler) == 4  # step 2's slots, trained at v5 as well
    assert scheduler.train_version(4) == 5 and scheduler.version_floor(4) == 5  # dispatched to servers at v5
    assert evals.pending == [6]  # after 2 steps the trainer is at v6
    follow_version_offset(pipeline, -2)  # step 2 published nothing either
    assert admit_all(scheduler) == 4 and scheduler.train_version(8) == 5


def test_a_restarted_coordinator_counts_the_groups_still_queued_and_produces_only_the_rest(redis_server):
    from coordinator.restart import remaining_groups
    from protos.records import Array, TrajectoryGroup

    config = load_run_config(overrides=["groups_per_step=4", "max_staleness=1", "num_steps=10"])
    keys = RedisKeys("restart-unit")

    async def scenario():
        client = aioredis.Redis.from_url(redis_server.url)
        queue = TrajectoryStreamWriter(client, keys)
        assert remaining_groups(config, await queue.pushed_total(), steps_trained=0) == (40, 0)  # a fresh run
        empty = Array.from_numpy(np.zeros(1, np.int32))
        for index in range(14):  # the first coordinator pushed 14 groups, then died
            await queue.push(TrajectoryGroup(f"g{index}", "p", empty, [], "unit", index, 0, 0.0))
        # the trainer has trained 2 steps (8 groups)
        found = remaining_groups(config, await queue.pushed_total(), steps_trained=2)
        await client.aclose()
        return found

    total, queued = asyncio.run(scenario())
    assert (total, queued) == (40 - 14, 14 - 8)
    scheduler = Scheduler(
        make_scheduler().run,
        Fleet([]),
        make_scheduler().queue,
        EchoTask(),
        total,
        start_version=2,
        queued_at_start=queued,
    )
    # 6 queued groups: steps 3 and (half of) 4 are theirs; this coordinator's slot 0 completes step 4's batch
    assert scheduler.train_version(0) == 2 + (0 + 6) // 4 and scheduler.train_version(2) == 2 + (2 + 6) // 4
    assert admit_all(scheduler) == (0 + 1 + 1) * 4 - 6  # the bound counts the queued groups too


@pytest.mark.parametrize("kind", ["echo", "dataset"])
def test_a_restarted_coordinator_continues_the_prompts_after_the_groups_it_pushed(
    kind, redis_server, tiny_tokenizer, tmp_path
):
    from coordinator.restart import resume_prompts
    from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan

    keys = RedisKeys(f"cursor-{kind}")
    overrides = ["groups_per_step=4", "max_staleness=1", "coordinator.seed=7"]
    if kind == "dataset":
        path = write_plain(tmp_path / "d.jsonl", [(f"q{i}", str(i)) for i in range(5)])  # 5: draws cross epochs
        overrides += [f"coordinator.task={path}", "coordinator.prompt_template='{problem}'"]
    run = load_run_config(overrides=overrides)
    config = run.coordinator

    def group(slot: int) -> TrajectoryGroup:
        sample = Sample(
            Array.from_numpy(np.zeros(1, np.int32)),
            Array.from_numpy(np.zeros(1, np.float32)),
            [VersionSpan(0, 0, 1)],
            FinishReason.STOP,
            1.0,
        )
        return TrajectoryGroup(f"g{slot}", "p", Array.from_numpy(np.zeros(1, np.int32)), [sample], "unit", slot, 0, 0.0)

    async def scenario():
        client = aioredis.Redis.from_url(redis_server.url)
        await client.delete(keys.trajectories, keys.prompt_cursor)
        queue = TrajectoryStreamWriter(client, keys)
        first = Scheduler(run, Fleet([]), queue, build_task(config, 256, tiny_tokenizer, None), 40)
        drawn = [first.admit()[1].prompt_id for _ in range(7)]  # slots 0-6 admitted
        for slot in (2, 0, 1, 5, 4):  # finished out of order: 0, 1, 2 pushed; 4 and 5 wait for 3
            await first.complete(slot, group(slot))
        assert first.stats.groups_pushed == 3
        restarted = build_task(config, 256, tiny_tokenizer, None)  # the first coordinator died here
        await resume_prompts(restarted, queue)
        fresh = build_task(config, 256, tiny_tokenizer, None)
        await client.delete(keys.prompt_cursor)  # no cursor (a run of an older coordinator): from the top
        await resume_prompts(fresh, queue)
        await client.aclose()
        return drawn, [restarted.next_prompt().prompt_id for _ in range(6)], fresh.next_prompt().prompt_id

    drawn, resumed, from_the_top = asyncio.run(scenario())
    # Slots 3-6 were admitted but not pushed: their prompts come again, in order, then new ones.
    assert resumed[:4] == drawn[3:7] and len(set(resumed)) == 6 and not set(resumed) & set(drawn[:3])
    assert from_the_top == drawn[0]


def test_admission_stops_at_the_run_total():
    scheduler = make_scheduler(total_groups=6)
    scheduler.set_trainer_version(10)
    assert admit_all(scheduler) == 6


def test_pause_stops_admission_resume_restarts_it_and_drain_is_final():
    scheduler = make_scheduler()
    scheduler.pause()
    assert scheduler.state == RunState.PAUSED and not scheduler.can_admit()
    scheduler.resume()
    assert scheduler.can_admit()
    scheduler.admit()
    scheduler.drain()
    assert scheduler.state == RunState.DRAINING and not scheduler.can_admit()  # slot 0 still in flight
    scheduler.in_flight.clear()
    scheduler.update_state()
    assert scheduler.state == RunState.DRAINED
    with pytest.raises(ValueError, match="drain"):
        scheduler.resume()


def test_the_fleet_watcher_takes_a_servers_new_version_when_it_reports_not_at_its_next_poll(redis_url):
    """On-policy, a step's groups wait for a server on the new version: a poll would leave it idle meanwhile."""
    keys = RedisKeys("watch")

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        server = RolloutClient("127.0.0.1:1")  # never generates here; the watcher only reads its reports
        versions: list[int] = []
        watcher = FleetWatcher(Fleet([server]), versions.append, client, keys, interval_s=300.0)
        task = asyncio.create_task(watcher.run(asyncio.Event()))
        try:
            await wait_until_async(lambda: versions, "the watcher's first refresh", 10, poll_s=0.01)
            board = AsyncVersionBoard(client, keys)
            await board.report_version(VersionReport("r0", "127.0.0.1:1", 3, ReportStatus.OK, "", time.time()))
            await wait_until_async(
                lambda: server.policy_version == 3, "the report of v3 to reach the fleet (poll: 300 s)", 10, poll_s=0.01
            )
            sync_client = redis.Redis.from_url(redis_url)
            manifest = WeightManifest(4, [], [], "127.0.0.1:1", "tcp", 0.0)
            await asyncio.to_thread(VersionBoard(sync_client, keys).publish_manifest, manifest)  # the trainer's publish
            sync_client.close()
            await wait_until_async(
                lambda: versions[-1] == 4, "the announcement of v4 to reach admission (poll: 300 s)", 10, poll_s=0.01
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.close()
            await client.aclose()

    asyncio.run(scenario())


def test_eval_versions_every_interval_steps_and_at_start():
    config = load_run_config(
        overrides=[
            "coordinator.eval.datasets=[a.jsonl]",
            "coordinator.eval.interval_steps=3",
            "coordinator.eval.at_start=true",
        ]
    ).coordinator
    assert eval_versions(config.eval, start_version=2, num_steps=10) == [2, 5, 8, 11]
    # A coordinator restarted after 4 steps (trainer at v6): the rounds after steps 6 and 9 only, at their versions.
    assert eval_versions(config.eval, start_version=6, num_steps=10, steps_done=4) == [8, 11]
    # Restarted at step 3, an eval step: its round again unless an earlier coordinator reported it.
    assert eval_versions(config.eval, start_version=5, num_steps=10, steps_done=3) == [5, 8, 11]
    assert eval_versions(config.eval, start_version=5, num_steps=10, steps_done=3, evaluated={2, 5}) == [8, 11]
    config.eval.datasets = []
    assert eval_versions(config.eval, 0, 10) == []


def test_a_restarted_coordinator_finds_the_eval_rounds_reported_before(redis_server):
    from channels.metrics_stream import AsyncMetricsStreamWriter
    from coordinator.metrics import reported_eval_versions
    from protos.records import MetricsReport

    keys = RedisKeys("eval-reports")

    async def scenario():
        client = aioredis.Redis.from_url(redis_server.url)
        await client.delete(keys.metrics("coordinator"))
        for version, values in (
            (2, {"groups_pushed": 4.0}),
            (5, {"eval/aime/pass@1": 0.5, "eval/version": 5.0}),
            (6, {"groups_pushed": 20.0}),
        ):
            assert await AsyncMetricsStreamWriter(client, keys).post(
                MetricsReport("coordinator", 0, version, 0.0, values)
            )
        found = await reported_eval_versions(client, keys)
        await client.aclose()
        return found

    assert asyncio.run(scenario()) == {5}


def test_eval_holds_admission_at_its_version_until_the_round_ran():
    scheduler = make_scheduler(start_version=5, overrides=("coordinator.eval.datasets=[a.jsonl]",))
    evals = EvalRunner(scheduler.run, scheduler.fleet, [], scorer=None)
    evals.schedule([5, 7])
    assert evals.due(scheduler) == 5  # at_start: the trainer is there already
    assert scheduler.admission_limit() == 0  # held while the round runs
    assert evals.due(scheduler) is None  # round done: the hold moves to v7
    assert scheduler.eval_hold_version == 7
    scheduler.set_trainer_version(6)
    assert admit_all(scheduler) == (7 - 5) * 4  # not (6 - 5 + 2) * 4 = 12
    scheduler.set_trainer_version(7)
    assert evals.due(scheduler) == 7
    assert evals.due(scheduler) is None and scheduler.eval_hold_version is None


def test_an_eval_version_the_trainer_already_passed_is_skipped_and_counted():
    scheduler = make_scheduler(overrides=("coordinator.eval.datasets=[a.jsonl]",))
    evals = EvalRunner(scheduler.run, scheduler.fleet, [], scorer=None)
    evals.schedule([2, 4])
    scheduler.set_trainer_version(3)
    assert evals.due(scheduler) is None
    assert evals.rounds_skipped == 1 and evals.pending == [4] and scheduler.eval_hold_version == 4


def test_an_eval_the_trainer_never_reaches_is_given_up_only_when_it_alone_holds_the_run():
    scheduler = make_scheduler(overrides=("coordinator.eval.datasets=[a.jsonl]", "coordinator.eval.timeout_s=0.05"))
    evals = EvalRunner(scheduler.run, scheduler.fleet, [], scorer=None)
    evals.schedule([2])
    scheduler.pause()  # slots before v2 not admitted yet: the coordinator, not the trainer, holds the run
    now = time.monotonic()
    for tick in range(3):  # each call 0.06 s later: past the timeout, were the trainer alone holding the run
        assert evals.due(scheduler, now + 0.06 * tick) is None
    assert evals.pending == [2]
    scheduler.resume()
    assert admit_all(scheduler) == 2 * 4
    scheduler.in_flight.clear()  # all pushed; the trainer never publishes v1 or v2
    assert evals.due(scheduler, now + 0.13) is None and evals.pending == [2]  # the trainer holds it from here
    assert evals.due(scheduler, now + 0.2) is None and evals.rounds_skipped == 1 and scheduler.eval_hold_version is None


def test_eval_accepts_only_samples_whose_every_span_is_the_pinned_version():
    assert spans_match(SampleResult(token_ids=[1, 2], version_spans=[(3, 0, 2)]), 3)
    assert not spans_match(SampleResult(token_ids=[1, 2], version_spans=[(3, 0, 1), (4, 1, 2)]), 3)
    assert not spans_match(SampleResult(token_ids=[1], version_spans=[(2, 0, 1)]), 3)
    assert pass_at_k([[False, True], [False, False]]) == (0.25, 0.5)


def test_set_changes_the_live_config_after_validating_the_whole_run_config():
    run = load_run_config()
    live = run.coordinator
    assert apply_setting(run, "max_staleness", "2") == ("max_staleness", 1, 2)  # top-level keys as they are
    assert apply_setting(run, "temperature", "0.8")[2] == pytest.approx(0.8)
    assert apply_setting(run, "sampling.top_p", "0.9") == ("coordinator.sampling.top_p", 1.0, 0.9)  # the section's
    with pytest.raises(UnknownSetting, match=r"coordinator.sampling.temperature \(temperature is a top-level key"):
        apply_setting(run, "coordinator.sampling.temperature", "0.7")
    assert apply_setting(run, "temperature", "0.7")[0] == "temperature"
    assert run.max_staleness == 2 and run.temperature == pytest.approx(0.7) and live.sampling.top_p == 0.9
    assert run.coordinator is live and run.training_sampling().temperature == pytest.approx(0.7)
    with pytest.raises(UnknownSetting, match="unknown key coordinator.max_stalenes;.*settable.*max_staleness"):
        apply_setting(run, "max_stalenes", "2")
    with pytest.raises(FixedSetting, match="coordinator.group_size is fixed at start"):
        apply_setting(run, "group_size", "4")
    with pytest.raises(FixedSetting, match="num_steps is fixed at start"):
        apply_setting(run, "num_steps", "4")
    with pytest.raises(ValueError, match="temperature"):
        apply_setting(run, "temperature", "hot")
    with pytest.raises(ValueError, match="max_model_len"):  # a cross-section rule of RunConfig
        apply_setting(run, "sampling.max_tokens", str(run.rollout.max_model_len))
    with pytest.raises(ValueError, match="buffer"):
        apply_setting(run, "overlong.buffer_len", "100")
        apply_setting(run, "overlong.enabled", "true")
    assert live.sampling.max_tokens == 8 and run.max_staleness == 2  # refused changes left nothing behind


class FlakyQueue:
    """A queue whose first push fails as a Redis outage past the retry policy does; it records the pushes."""

    def __init__(self):
        self.pushed: list[str] = []
        self.failures_left = 1

    async def push(self, group, cursor=None) -> str:
        if self.failures_left:
            self.failures_left -= 1
            raise ConnectionError("Redis unreachable past the retry policy")
        self.pushed.append(group.group_id)
        return "1-0"


def _finished_group(slot: int):
    import numpy as np

    from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan

    sample = Sample(
        Array.from_numpy(np.array([5, 6], np.int32)),
        Array.from_numpy(np.zeros(2, np.float32)),
        [VersionSpan(0, 0, 2)],
        FinishReason.LENGTH,
        1.0,
    )
    prompt = Array.from_numpy(np.array([1], np.int32))
    return TrajectoryGroup(f"g{slot}", "p", prompt, [sample], "echo", slot, 0, 0.0)


def test_a_group_whose_push_failed_stays_buffered_and_goes_first_at_the_next_push():
    scheduler = make_scheduler()
    scheduler.queue = FlakyQueue()
    assert admit_all(scheduler) >= 2

    async def scenario():
        with pytest.raises(ConnectionError):
            await scheduler.complete(0, _finished_group(0))
        assert scheduler.stats.groups_pushed == 0
        await scheduler.complete(1, _finished_group(1))  # the outage is over: slot 0 goes first, then slot 1

    asyncio.run(scenario())
    assert scheduler.queue.pushed == ["g0", "g1"]
    assert scheduler.stats.groups_pushed == 2
