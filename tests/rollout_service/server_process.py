"""A rollout server process for tests: started on port 0, its address read from --address-file.

A port picked by the test before the ~30 s engine start could be taken meanwhile (seen in CI as a
bind failure); the server binds a free port itself and writes host:port once it is serving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.waiting import wait_until


@dataclass
class ServerProcess:
    process: subprocess.Popen
    log_path: Path
    address: str = ""  # host:port, known once the server is serving (wait_serving)

    @property
    def address_file(self) -> Path:
        return self.log_path.with_suffix(".address")

    def wait_serving(self, timeout_s: float = 300) -> ServerProcess:
        """Until the server wrote its address and its gRPC health check says SERVING (it must stay alive)."""
        deadline = time.monotonic() + timeout_s

        def address_written() -> bool:
            self._assert_alive()
            return self.address_file.exists()

        wait_until(address_written, f"rollout server's address file ({self.log_path})", timeout_s, poll_s=0.2)
        self.address = self.address_file.read_text().strip()
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                self._assert_alive()
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            wait_until(serving, f"rollout server {self.address} SERVING", deadline - time.monotonic(), poll_s=0.5)
        return self

    def _assert_alive(self) -> None:
        assert self.process.poll() is None, (
            f"rollout server exited ({self.process.returncode}): {self.log_path.read_text(errors='replace')[-3000:]}"
        )


def spawn_rollout_server(model: str, log_path: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """``fleetrl rollout serve --model MODEL --port 0 ARGS`` (the CLI, as a user starts it) in its own session (not
    waited for)."""
    address_file = log_path.with_suffix(".address")  # ServerProcess.address_file
    address_file.unlink(missing_ok=True)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "rollout",
            "serve",
            "--model",
            str(model),
            "--port",
            "0",
            "--address-file",
            str(address_file),
            *args,
        ],
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    return ServerProcess(process, log_path)


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM a process started in its own session (its whole group), SIGKILL it after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
