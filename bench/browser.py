"""Headless Chromium driven over the DevTools protocol: open a page, run JS in it, take a screenshot.

Used by tests/test_monitor_browser.py and bench/monitor.py. Nothing is downloaded: it runs
the system's `chromium` (Debian's package; `.ci/run` installs it) with
``--remote-debugging-port=0`` and reads the port it picked from ``DevToolsActivePort``.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect
from websockets.sync.connection import Connection  # what `with connect(...)` yields

CHROMIUM = "chromium"


def chromium_path() -> str | None:
    return shutil.which(CHROMIUM)


class Page:
    """One tab, over its DevTools websocket."""

    def __init__(self, ws: Connection) -> None:
        self.ws = ws
        self._ids = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._ids += 1
        sent = self._ids
        self.ws.send(json.dumps({"id": sent, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == sent:  # events (no id) are not needed here
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result

    def evaluate(self, expression: str) -> Any:
        """The value of a JS expression in the page (promises awaited)."""
        got = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in got:
            raise RuntimeError(f"JS failed: {got['exceptionDetails'].get('exception', got['exceptionDetails'])}")
        return got["result"].get("value")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def wait_for(self, expression: str, timeout: float = 60.0, interval: float = 0.05) -> Any:
        """Poll a JS expression until it is truthy; its value. TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout:.0f} s: {expression}")
            time.sleep(interval)

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (not just the viewport)."""
        size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        self.call("Emulation.setDeviceMetricsOverride", width=max(size[0], 1280), height=min(size[1], 4000),
                  deviceScaleFactor=1, mobile=False)
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path


@contextmanager
def chromium(width: int = 1400, height: int = 1000, timeout: float = 60.0) -> Iterator[Page]:
    """A headless Chromium with one blank page; stopped (and its profile removed) on exit."""
    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    profile = Path(tempfile.mkdtemp(prefix="ignis-chromium-"))
    proc = subprocess.Popen(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", f"--user-data-dir={profile}",
         "--remote-debugging-port=0", "--remote-allow-origins=*", f"--window-size={width},{height}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode} before opening its DevTools port")
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not open its DevTools port")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page_ws = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
        with connect(page_ws, max_size=64 << 20, open_timeout=timeout) as ws:
            page = Page(ws)
            page.call("Page.enable")
            page.call("Runtime.enable")
            yield page
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
