"""Headless Chromium (the Debian package) driven over the DevTools protocol.

Through ``--remote-debugging-pipe`` (file descriptors 3 and 4, NUL-terminated JSON
messages): no browser download, no driver binary, no websocket library. Used by
the status page's browser test and benchmarks/status_page.py.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
# The flags that work on these machines (no sandbox as root; no network beyond
# loopback: background connections would each be refused).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-pipe",
]


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if shutil.which(CHROMIUM) is None:
        return f"{CHROMIUM} is absent: apt-get install chromium (scripts/test.sh does, as root)"
    return None


def _high(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return moved


class BrowserError(Exception):
    pass


class Chromium:
    """One browser with one page; ``evaluate`` runs script in it."""

    def __init__(self, width: int = 1400, height: int = 900) -> None:
        self._profile = tempfile.mkdtemp(prefix="rdzv-chromium-")
        # Above 4, so that putting one end on 3 cannot close the other before it is moved.
        to_browser_r, self._to_browser = (_high(fd) for fd in os.pipe())
        self._from_browser, from_browser_w = (_high(fd) for fd in os.pipe())

        def fds() -> None:
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),
            # Chromium reads fds 3 and 4; the child only dup2s before exec.
            preexec_fn=fds,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next = 0
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session = ""
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                for q in list(self._replies.values()):
                    q.put({"error": {"message": "the browser exited"}})
                return
            buf += chunk
            *messages, buf = buf.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    q = self._replies.get(message["id"])
                    if q is not None:
                        q.put(message)
                else:
                    self.events.put(message)

    def call(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        with self._lock:
            self._next += 1
            ident = self._next
            q: queue.Queue[dict[str, Any]] = queue.Queue()
            self._replies[ident] = q
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        try:
            reply = q.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"{method}: no answer from Chromium in {timeout:g} s") from None
        finally:
            self._replies.pop(ident, None)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return dict(reply.get("result", {}))

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, what: str, expression: str, timeout: float = 30.0) -> Any:
        """Polls ``expression`` in the page until it is truthy: the page's own state."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.evaluate(expression)
            except BrowserError as exc:  # mid-navigation: the context went away
                last = str(exc)
            else:
                if last:
                    return last
            time.sleep(0.05)  # poll interval, not a synchronisation
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")

    def log_in(self, base: str, token: str) -> None:
        """Present ``token`` through the status page's login form, as a person would."""
        self.navigate(base + "/")
        self.wait_for("the login form", "!!document.querySelector('form[action=\"/login\"]')")
        self.evaluate(
            f"document.getElementById('token').value = {json.dumps(token)};"
            "document.querySelector('form').submit(); true"
        )
        self.wait_for("the page's first update", "document.body.dataset.ready === '1'")

    def accept_dialogs(self) -> None:
        """Confirm every dialog (the Abort button's confirm()) as it opens."""

        def accept() -> None:
            while self.proc.poll() is None:
                try:
                    event = self.events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if event.get("method") == "Page.javascriptDialogOpening":
                    self.call("Page.handleJavaScriptDialog", accept=True)

        threading.Thread(target=accept, daemon=True).start()

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._to_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
