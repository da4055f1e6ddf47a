"""A real Prometheus (Debian's) scrapes a real run: one vLLM rollout server, the trainer and the coordinator, each
serving /metrics, with the run's alert rules loaded. The test asks Prometheus's HTTP API for the staleness, queue
depth and throughput series, and checks the Grafana dashboard against what Prometheus actually holds: every metric
name it queries was scraped, and every panel's query returns a series over the run."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from modeling.tiny_model import init_tiny
from protos.redis_keys import RedisKeys
from tests.coordinator.test_grafana_dashboard import DASHBOARD, all_panels, promql_metric_names
from tests.deploy.prometheus_tools import find_tool
from tests.rollout_service.server_process import spawn_rollout_server, stop_process
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

RUN_ID = "prom-e2e"
PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
JOBS = ("rollout", "coordinator", "trainer")


def reserved_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999). The roles bind theirs a minute after Prometheus is told
    them; a port from the ephemeral range could meanwhile go to any outgoing connection (an engine's socket), and the
    role's bind then failed. No connection is given a port from below that range on its own."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


class Prometheus:
    """A Prometheus process scraping ``targets`` (job -> host:port) every second, with the run's alert rules."""

    def __init__(self, workdir: Path, targets: dict[str, str]):
        self.port = reserved_port()
        shutil.copy(PROMETHEUS_DIR / "alerts.yml", workdir / "alerts.yml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [target]}]} for job, target in targets.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        self.process = subprocess.Popen(
            [
                find_tool("prometheus"),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        reply = json.loads(urllib.request.urlopen(url, timeout=30).read())
        assert reply["status"] == "success", reply
        return reply["data"]

    def range_values(self, query: str, start: float, end: float) -> list[float]:
        """Every value of every series of ``query`` over [start, end], one point a second (NaNs dropped)."""
        result = self.api("query_range", query=query, start=start, end=end, step="1")["result"]
        return [float(v) for series in result for _, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]

    def wait_until_up(self, timeout_s: float = 60) -> None:
        def answering() -> bool:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                self.api("status/buildinfo")
                return True
            except OSError:
                return False

        wait_until(answering, f"Prometheus answering on {self.port}", timeout_s, poll_s=0.3)


def _spawn(log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", *args], stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


def _run_config(tmp_path: Path, ports: dict[str, int]) -> Path:
    evalset = tmp_path / "tiny-eval.jsonl"  # an eval round at the start: coordinator_eval_accuracy gets a value
    evalset.write_text("".join(json.dumps({"problem": f"{i}*3", "answer": str(3 * i)}) + "\n" for i in range(2)))
    config = {
        "run_id": RUN_ID,
        "out_dir": str(tmp_path),
        "num_steps": 6,
        "groups_per_step": 2,
        "max_staleness": 1,
        "coordinator": {
            "dashboard": False,
            "admin_port": reserved_port(),
            "metrics_port": ports["coordinator"],
            "group_size": 4,
            "sampling": {"max_tokens": 8},
            "eval": {
                "datasets": [str(evalset)],
                "at_start": True,
                "samples_per_problem": 2,
                "reward_fn": "tests.coordinator.reward_plugins:always_one",
            },
        },
        # batch_timeout_s: the first batch waits for the rollout engine's start too (the trainer starts beside it)
        "trainer": {"metrics_port": ports["trainer"], "geo_mask": None, "batch_timeout_s": 300, "resume": "none"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_prometheus_scrapes_a_run_and_holds_every_series_the_grafana_dashboard_queries(redis_server, tmp_path):
    client = redis.Redis.from_url(redis_server.url)
    keys = RedisKeys(RUN_ID)
    client.delete(keys.trajectories, keys.prompt_cursor, keys.policy_version, *(keys.metrics(j) for j in JOBS))
    model_dir = str(init_tiny(tmp_path / "tiny"))
    ports = {job: reserved_port() for job in JOBS}
    targets = {job: f"127.0.0.1:{port}" for job, port in ports.items()}
    (tmp_path / "prometheus").mkdir()
    prometheus = Prometheus(tmp_path / "prometheus", targets)
    server = spawn_rollout_server(
        model_dir,
        tmp_path / "rollout.log",
        *("--server-id", "rollout-0", "--redis-url", redis_server.url, "--run-id", RUN_ID),
        *("--metrics-port", str(ports["rollout"])),
        env={"OMP_NUM_THREADS": "1"},
    )
    processes = [server.process]
    try:
        config = _run_config(tmp_path, ports)
        common = ["--model", model_dir, "--redis-url", redis_server.url, "--config", str(config)]
        started = time.time()
        # the trainer starts while the server's engine does (as the launcher starts them); it waits for its batches
        trainer = _spawn(tmp_path / "trainer.log", "trainer_service", "train", *common, "--linger-s", "5")
        processes.append(trainer)
        prometheus.wait_until_up()
        server.wait_serving(timeout_s=300)

        def first_version() -> bool:  # the coordinator starts on the trainer's first version
            assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            return client.get(keys.policy_version) is not None

        wait_until(first_version, "the trainer's first version", 180, poll_s=0.2)
        coordinator = _spawn(
            tmp_path / "coordinator.log", "coordinator", "run", "--servers", server.address, "--linger-s", "3", *common
        )
        processes.append(coordinator)
        assert coordinator.wait(timeout=400) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        assert trainer.wait(timeout=120) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        time.sleep(2)  # kept: Prometheus scrapes every second; its last scrapes of the finished run need that time
        check_what_prometheus_holds(prometheus, started, time.time())
    finally:
        stop_process(server.process)  # its engine processes live in its session
        for process in [*processes[1:], prometheus.process]:
            _stop(process)


def check_what_prometheus_holds(prometheus: Prometheus, start: float, end: float) -> None:
    # the staleness, queue depth and throughput series arrived, with values
    assert prometheus.range_values("trainer_staleness_max_steps", start, end), "no staleness series"
    assert max(prometheus.range_values("trainer_staleness_steps_count", start, end)) >= 12  # 6 steps x 2 groups
    assert prometheus.range_values("coordinator_queue_depth", start, end), "no coordinator queue depth"
    assert prometheus.range_values("trainer_queue_depth", start, end), "no trainer queue depth"
    assert max(prometheus.range_values("rate(rollout_generated_tokens_total[5s])", start, end)) > 0
    assert max(prometheus.range_values("rollout_tokens_per_s", start, end)) > 0  # the rate the console shows
    assert max(prometheus.range_values("trainer_samples_trained_total", start, end)) >= 48  # 6 x 2 groups x 4
    assert max(prometheus.range_values("coordinator_groups_pushed_total", start, end)) > 0  # it exits at 12
    # what the alert rules read beyond the dashboard's series
    assert max(prometheus.range_values("trainer_steps_total", start, end)) == 6
    assert max(prometheus.range_values("trainer_max_staleness_steps", start, end)) == 1  # set at each step
    assert min(prometheus.range_values("trainer_last_step_time_s", start, end)) > start - 600  # stamped at start
    assert set(prometheus.range_values("coordinator_groups_per_step", start, end)) == {2.0}
    assert set(prometheus.range_values("rollout_weight_update_failures_total", start, end)) == {0.0}
    assert max(prometheus.range_values("rollout_weight_update_s_count", start, end)) >= 1  # it followed versions
    # every metric the Grafana dashboard queries is one Prometheus scraped, in the job the dashboard expects
    scraped = set(prometheus.api("label/__name__/values", **{"match[]": '{job=~"rollout|coordinator|trainer"}'}))
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in all_panels(dashboard["panels"]) for t in panel.get("targets", [])]
    used = set().union(*(promql_metric_names(expr) for expr in queries))
    assert used <= scraped, f"the dashboard queries metrics Prometheus never scraped: {sorted(used - scraped)}"
    for job in JOBS:
        names = {name for name in used if name.startswith(job + "_")}
        held = prometheus.api("series", **{"match[]": [f'{{__name__=~"{"|".join(names)}", job="{job}"}}']})
        assert {series["__name__"] for series in held} == names, f"{job}: scraped under another job"
    # and every panel's query returns a series over the run, as Grafana would draw it
    for expr in queries:
        query = expr.replace("$__rate_interval", "5s").replace("$__range", f"{int(end - start)}s")
        result = prometheus.api("query_range", query=query, start=start, end=end, step="1")["result"]
        assert result, f"panel query returned no series over the run: {expr}"
    # the alert rules loaded and evaluated without error against the run's series
    rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
    assert len(rules) == 7 and all(rule["health"] == "ok" for rule in rules), rules


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
