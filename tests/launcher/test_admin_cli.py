"""The fleetrl admin verbs through the real CLI against a real admin gRPC server over a coordinator core.

The core here has no rollout servers (the verbs on a live fleet are in test_coordinator_run.py); Redis
is real. A test thread plays the trainer's side of the ``sync`` contract.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from channels.trajectory_stream import TrajectoryStreamWriter
from channels.version_board import VersionBoard
from coordinator.admin import AdminCore, start_admin_server
from coordinator.control import ControlChannel
from coordinator.fleet import Fleet
from coordinator.metrics import MetricsReporter
from coordinator.scheduler import Scheduler
from coordinator.tasks import EchoTask
from launcher.cli import main as fleetrl
from launcher.redis_server import free_port
from protos.config import load_run_config
from protos.records import ControlKind, WeightManifest, decode_control
from protos.redis_keys import RedisKeys

pytestmark = pytest.mark.integration

RUN_ID = "admin-test"


@pytest.fixture
def admin(redis_url):
    """A coordinator core and its admin server on an event loop in a background thread."""
    loop = asyncio.new_event_loop()
    started: dict = {}
    ready = threading.Event()

    async def start() -> None:
        run = load_run_config(overrides=[f"run_id={RUN_ID}", "groups_per_step=2"])
        client, keys = aioredis.Redis.from_url(redis_url), RedisKeys(RUN_ID)
        scheduler = Scheduler(run, Fleet([]), TrajectoryStreamWriter(client, keys), EchoTask(), 20)
        reporter = MetricsReporter(scheduler, None, scheduler.queue, client, keys)
        core = AdminCore(run, scheduler, reporter, ControlChannel(client, keys), None)
        server, port = await start_admin_server(core, "127.0.0.1", 0)
        started.update(core=core, server=server, address=f"127.0.0.1:{port}")
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(10), "admin server did not start"
    yield started
    asyncio.run_coroutine_threadsafe(started["server"].stop(0), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        fleetrl(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_status_shows_state_versions_queue_and_the_server_table(admin, capsys):
    code, out, _ = cli(capsys, "status", "--admin", admin["address"])
    assert code == 0
    assert f"run {RUN_ID} | running | task echo" in out
    assert "slots 0/4 admissible (run: 20)" in out  # (v 0 + k 1 + 1) * B 2
    assert "SERVER" in out and "VERSION" in out and "INFLIGHT" in out
    code, out, _ = cli(capsys, "status", "--json", "--admin", admin["address"])
    assert code == 0 and json.loads(out)["admissionLimit"] == "4"


def test_pause_resume_and_drain_change_the_run_state(admin, capsys):
    address = admin["address"]
    paused = "coordinator paused: admitting no new groups; in-flight groups finish\n"
    assert cli(capsys, "pause", "--admin", address)[:2] == (0, paused)
    assert not admin["core"].scheduler.can_admit()
    assert cli(capsys, "resume", "--admin", address)[1] == "coordinator running\n"
    assert admin["core"].scheduler.can_admit()
    code, out, _ = cli(capsys, "drain", "--wait-s", "5", "--admin", address)
    assert (code, out) == (0, "coordinator drained: 0 groups in flight, 0 pushed\n")
    code, _, err = cli(capsys, "resume", "--admin", address)
    assert code == 2 and "drained; a drain cannot be undone (FAILED_PRECONDITION)" in err


def test_set_changes_a_setting_and_tells_the_trainer_on_the_control_stream(admin, capsys, redis_url):
    code, out, _ = cli(capsys, "set", "max_staleness=0", "--admin", admin["address"])
    assert code == 0 and out.startswith("max_staleness: 1 -> 0 (trainer told: control entry ")
    assert admin["core"].scheduler.run.max_staleness == 0
    assert admin["core"].scheduler.admission_limit() == 2
    entries = redis.Redis.from_url(redis_url).xrange(RedisKeys(RUN_ID).control)
    command = decode_control(entries[-1][1][b"c"])
    assert (command.kind, command.key, command.value_json) == (ControlKind.SET, "max_staleness", "0")
    code, out, _ = cli(capsys, "set", "sampling.top_p=0.9", "--admin", admin["address"])
    assert code == 0 and "trainer told" not in out  # only keys the trainer reads are announced
    assert out.startswith("coordinator.sampling.top_p: 1.0 -> 0.9")


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("max_stalenes=2", "unknown key coordinator.max_stalenes; keys settable at run time: max_staleness, "),
        ("temperature=hot", "temperature='hot' is invalid"),
        ("group_size=2", "coordinator.group_size is fixed at start and cannot change at run time"),
        ("max_staleness", "expected KEY=VALUE (e.g. max_staleness=2), got 'max_staleness'"),
    ],
)
def test_set_of_an_unknown_key_or_bad_value_fails_clearly(admin, capsys, assignment, message):
    code, out, err = cli(capsys, "set", assignment, "--admin", admin["address"])
    assert code == 2 and out == "" and message in err, err
    assert admin["core"].scheduler.run.max_staleness == 1


def test_sync_asks_the_trainer_and_reports_its_publish(admin, capsys, redis_url):
    keys = RedisKeys(RUN_ID)
    client = redis.Redis.from_url(redis_url)
    code, _, err = cli(capsys, "sync", "--wait-s", "1", "--admin", admin["address"])
    assert code == 1 and "no weight publish seen within 1s" in err  # nobody plays the trainer yet

    start_cursor = client.xrevrange(keys.control, count=1)[0][0]  # the trainer starts after old entries

    def trainer_side() -> None:
        """The trainer's contract: between steps, read new control entries; on c=sync publish."""
        cursor = start_cursor
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for _stream, entries in client.xread({keys.control: cursor}, block=200) or []:
                for cursor, fields in entries:  # noqa: B007 - the next read starts after the last entry
                    if decode_control(fields[b"c"]).kind is ControlKind.SYNC:
                        manifest = WeightManifest(7, [], [], "127.0.0.1:0", "tcp", time.time())
                        VersionBoard(client, keys).publish_manifest(manifest)
                        return

    player = threading.Thread(target=trainer_side)
    player.start()
    code, out, _ = cli(capsys, "sync", "--wait-s", "10", "--admin", admin["address"])
    player.join()
    assert code == 0 and out.startswith("trainer published policy version 7 (sync request ")
    assert decode_control(client.xrange(keys.control)[-1][1][b"c"]).kind is ControlKind.SYNC


def test_server_verbs_name_an_unknown_or_unreachable_server(admin, capsys):
    address = f"127.0.0.1:{free_port()}"
    code, _, err = cli(capsys, "servers", "remove", address, "--admin", admin["address"])
    assert code == 2 and f"rollout server {address} is not in the fleet" in err and "NOT_FOUND" in err
    code, _, err = cli(capsys, "servers", "add", address, "--admin", admin["address"])
    assert code == 2 and f"rollout server {address} is not healthy" in err and "FAILED_PRECONDITION" in err


def test_an_unreachable_coordinator_is_a_clear_error_with_a_nonzero_exit():
    address = f"127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "status", "--admin", address, "--timeout-s", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3
    message = f"fleetrl status: cannot reach the coordinator admin API at {address}; is the coordinator running?"
    assert message in result.stderr
