"""A rollout server whose vLLM engine core dies: calls fail with UNAVAILABLE and the server exits non-zero.

A supervisor (the launcher, Kubernetes) restarts it, and the coordinator re-dispatches its requests
(tests/coordinator/test_coordinator_run.py); what this proves is that the server neither hangs nor keeps
answering health checks as SERVING with a dead engine.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime

import grpc
import psutil
import pytest

from modeling.tiny_model import init_tiny
from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from tests.rollout_service.server_process import spawn_rollout_server

pytestmark = pytest.mark.integration


def test_dead_engine_core_turns_calls_unavailable_and_stops_the_server(tmp_path):
    model = init_tiny(tmp_path / "tiny")
    log_path = tmp_path / "rollout.log"
    server = spawn_rollout_server(str(model), log_path, "--server-id", "doomed")
    process = server.process
    channel = None
    try:
        channel = grpc.insecure_channel(server.wait_serving(timeout_s=240).address)
        stub = pb_grpc.RolloutServiceStub(channel)
        stub.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP), timeout=30)  # the call below stays in flight
        call = stub.Generate(
            pb.GenerateRequest(prompt_token_ids=[1, 4, 5], sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True)),
            timeout=120,
        )
        engine_cores = [
            p for p in psutil.Process(process.pid).children(recursive=True) if "EngineCore" in " ".join(p.cmdline())
        ]
        assert engine_cores, "no VLLM::EngineCore child found"
        for core in engine_cores:
            os.kill(core.pid, signal.SIGKILL)
        try:
            list(call)
            raise AssertionError("the in-flight call finished although its engine died")
        except grpc.RpcError as error:
            # UNAVAILABLE from the server's mapping, or the transport closing as the server exits
            assert error.code() == grpc.StatusCode.UNAVAILABLE, (error.code(), error.details())
        assert process.wait(timeout=60) == 1  # the watchdog stopped it with an error
        exited_s = time.time()
        log = open(log_path).read()
        assert "engine core died" in log
        # it leaves once the error is logged, without the interpreter's slow teardown: a restart is not held up
        failed = next(line for line in log.splitlines() if "rollout server doomed failed" in line)
        failed_s = datetime.strptime(failed[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        assert exited_s - failed_s < 2.0, f"exited {exited_s - failed_s:.1f}s after it failed"
    finally:
        if channel is not None:
            channel.close()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
