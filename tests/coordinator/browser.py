"""Headless Chromium driven over the DevTools protocol, for the dashboard's browser tests: load a page, evaluate
JavaScript in it, wait for a condition of its DOM, click and drag with real mouse events, take a screenshot."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
from pathlib import Path

import aiohttp
import pytest

from tests.waiting import wait_until_async

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",  # the port it picks is written to <profile>/DevToolsActivePort
]


def find_chromium() -> str:
    for candidate in (os.environ.get("FLEETRL_CHROMIUM", ""), "/usr/bin/chromium", shutil.which("chromium") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    # `make test` installs it; a missing browser is a broken set-up, not a reason to pass quietly.
    pytest.fail("Chromium not installed: run scripts/install_chromium.sh (or set FLEETRL_CHROMIUM)")


class Browser:
    """One headless Chromium with one page; use ``async with Browser.start(profile_dir, width, height)``."""

    def __init__(self, process: asyncio.subprocess.Process, session: aiohttp.ClientSession, socket):
        self.process = process
        self.session = session
        self.socket = socket
        self._ids = itertools.count(1)

    @classmethod
    async def start(cls, profile_dir: Path, width: int = 1400, height: int = 1300, timeout_s: float = 60) -> Browser:
        process = await asyncio.create_subprocess_exec(
            find_chromium(),
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile_dir}",
            f"--window-size={width},{height}",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # its renderer and GPU helpers live in its process group
        )
        port_file = profile_dir / "DevToolsActivePort"

        def port_written() -> bool:
            assert process.returncode is None, f"Chromium exited with code {process.returncode}"
            return port_file.exists() and bool(port_file.read_text().strip())

        try:
            await wait_until_async(port_written, "Chromium's DevTools port file", timeout_s, poll_s=0.1)
        except AssertionError:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        port = port_file.read_text().split()[0]
        session = aiohttp.ClientSession()
        async with session.get(f"http://127.0.0.1:{port}/json/list") as reply:
            page = next(target for target in await reply.json() if target["type"] == "page")
        socket = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        browser = cls(process, session, socket)
        await browser.call(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
        )
        return browser

    async def __aenter__(self) -> Browser:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.socket.close()
        await self.session.close()
        if self.process.returncode is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()

    async def call(self, method: str, timeout_s: float = 30, **params) -> dict:
        """One DevTools command; returns its result (events arriving meanwhile are skipped)."""
        call_id = next(self._ids)
        await self.socket.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        async with asyncio.timeout(timeout_s):
            while True:
                message = json.loads((await self.socket.receive()).data)
                if message.get("id") == call_id:
                    if "error" in message:
                        raise RuntimeError(f"{method}: {message['error']}")
                    return message["result"]

    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able values)."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, what: str, timeout_s: float = 30):
        """Until ``expression`` is truthy in the page; returns its value. Fails naming ``what`` it waited for."""
        return await wait_until_async(
            lambda: self.evaluate(expression), f"{what} in the page ({expression})", timeout_s, 0.2
        )

    async def drag(self, x0: float, y0: float, x1: float, y1: float, steps: int = 8) -> None:
        """Press the left button at (x0, y0), move to (x1, y1), release: what a user's drag sends."""
        await self.call("Input.dispatchMouseEvent", type="mousePressed", x=x0, y=y0, button="left", clickCount=1)
        for i in range(1, steps + 1):
            x, y = x0 + (x1 - x0) * i / steps, y0 + (y1 - y0) * i / steps
            await self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y, button="left", buttons=1)
        await self.call("Input.dispatchMouseEvent", type="mouseReleased", x=x1, y=y1, button="left", clickCount=1)

    async def screenshot(self, path: Path) -> Path:
        result = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(result["data"]))
        return path
