"""The demo launcher's monitor (the loop that prints a line per step and writes the summary) rides out a Redis outage:
the roles wait for Redis on their own, so the launcher must too, not end the run. Its Redis is reached through the
fault proxy of tests/redis_faults.py, which cuts every connection while the monitor is blocked reading the metrics.
At the end it waits for the rollout servers that beat to reach the last version, not for a dead one."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from channels.metrics_stream import MetricsStreamWriter
from launcher.demo import DemoLauncher
from launcher.roles import COORDINATOR, RoleSpec
from protos.config import load_run_config
from protos.records import MetricsReport, ReportStatus, RoleDone, VersionReport, encode
from protos.redis_keys import RedisKeys
from tests.redis_faults import redis_proxy
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

RUN_ID = "monitor-outage"
STEP_VALUES = {"reward_mean": 0.5, "staleness_max": 0.0, "queue_depth": 0.0, "samples_trained": 4.0}


def monitor_blocked_in_xread(client: redis.Redis, proxy) -> bool:
    """The monitor, whose connections all pass the proxy, has sent an XREAD (connections left open by earlier tests
    of the session do not count)."""
    return any(e.get("cmd") == "xread" and e.get("addr") in proxy.upstream_addrs for e in client.client_list())


def trainer_through_an_outage(client: redis.Redis, keys: RedisKeys, proxy, failures: list) -> None:
    """What the roles do around the outage: step 1, the cut (once the monitor waits in XREAD; over once it was
    refused a connection), steps 2 and 3, the trainer's end marker; and one rollout server at the last version.
    A failure is recorded for the test to report, and the trainer's end marker is still posted with Redis restored,
    so that the monitor, which waits for it as long as a run lives, ends."""
    metrics = MetricsStreamWriter(client, keys)
    try:
        outage(client, keys, proxy, metrics)
    except Exception as error:  # the test asserts on it once the monitor is back
        failures.append(error)
    finally:
        proxy.restore()
        metrics.post_done(RoleDone("trainer", 3, 3, time.time()))


def outage(client: redis.Redis, keys: RedisKeys, proxy, metrics: MetricsStreamWriter) -> None:
    metrics.post(MetricsReport("trainer", 1, 1, time.time(), STEP_VALUES))
    wait_until(lambda: monitor_blocked_in_xread(client, proxy), "monitor reading the metrics streams", 30)
    proxy.cut()
    wait_until(lambda: proxy.refused > 0, "reconnection attempt by the monitor during the outage", 30)
    proxy.restore()
    for step in (2, 3):
        metrics.post(MetricsReport("trainer", step, step, time.time(), STEP_VALUES))
    report = VersionReport("rollout-0", "127.0.0.1:1", 3, ReportStatus.OK, "", time.time())
    client.hset(keys.fleet, "rollout-0", encode(report))
    # a server killed at v1 whose replacement is still starting: its last beat is a minute old
    dead = VersionReport("rollout-1", "127.0.0.1:2", 1, ReportStatus.OK, "", time.time() - 60)
    client.hset(keys.fleet, "rollout-1", encode(dead))


def test_the_monitor_rides_out_a_redis_outage_and_ends_without_waiting_for_a_dead_server(redis_url, tmp_path, capsys):
    config = load_run_config(None, [f"run_id={RUN_ID}", "num_steps=3", f"model_path={tmp_path}"])
    launcher = DemoLauncher(config, tmp_path)
    # the coordinator's process: the monitor waits for its exit after the trainer's last step
    launcher.spawn(lambda: RoleSpec(COORDINATOR, COORDINATOR, ("-c", "pass")))
    client = redis.Redis.from_url(redis_url)
    with redis_proxy(redis_url) as (proxy_url, proxy):
        failures: list[Exception] = []
        roles = threading.Thread(target=trainer_through_an_outage, args=(client, RedisKeys(RUN_ID), proxy, failures))
        roles.start()
        try:
            started = time.monotonic()
            summary = launcher.monitor(proxy_url)
            monitor_s = time.monotonic() - started
        finally:
            roles.join(timeout=60)
            launcher.stop_all()
    assert not failures, failures
    output = capsys.readouterr().out
    assert "fleetrl: Redis unreachable, waiting for it" in output and "fleetrl: Redis back after" in output
    assert [line.split("|")[0].strip() for line in output.splitlines() if line.startswith("step")] == [
        "step   1/3",
        "step   2/3",
        "step   3/3",
    ]
    assert summary["steps"] == 3 and summary["rollout_server_versions"] == {"rollout-0": 3, "rollout-1": 1}
    # the end of the run waits for the servers that beat, not 30 s for the dead one to reach v3
    assert monitor_s < 15.0, monitor_s
