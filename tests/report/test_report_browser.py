"""report.html in headless Chromium: no console errors, plots decoded, inspector works, screenshot.

Chromium is driven through the DevTools protocol over `--remote-debugging-pipe` (fd 3: commands
in, fd 4: replies and events out, each message JSON + NUL), so no Python dependency is needed.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless-browser test needs the Debian package `chromium` (installed by .ci/run; "
           "apt-get install -y chromium)")

TIMEOUT_S = 30.0


class Chromium:
    """Headless Chromium with one page, spoken to over the DevTools pipe."""

    def __init__(self, profile_dir: Path) -> None:
        cmd_r, self._cmd_w = os.pipe()   # we write commands, chromium reads fd 3
        self._out_r, out_w = os.pipe()   # chromium writes fd 4, we read

        def child_fds() -> None:  # runs in the child before exec: put the pipes on fds 3 and 4
            r, w = os.dup(cmd_r), os.dup(out_w)  # fresh numbers, so neither dup2 clobbers the other
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--hide-scrollbars", "--remote-debugging-pipe", f"--user-data-dir={profile_dir}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=child_fds, pass_fds=(3, 4))
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        attached = self.call("Target.attachToTarget", targetId=target, flatten=True)
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def _read_message(self) -> dict:
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._out_r], [], [], TIMEOUT_S)
            if not ready:
                raise TimeoutError("chromium did not answer within 30 s")
            chunk = os.read(self._out_r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe (exit code {self.proc.poll()})")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, *, session: bool = False, **params) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._read_message())

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def js(self, expression: str):
        res = self.call("Runtime.evaluate", session=True, expression=expression,
                        returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def errors(self) -> list[str]:
        """Uncaught exceptions, console.error/assert calls and error log entries so far."""
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(d.get("exception", {}).get("description") or d.get("text", ""))
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(p["entry"]["text"])
        return out

    def requested_urls(self) -> list[str]:
        return [ev["params"]["request"]["url"] for ev in self.events
                if ev.get("method") == "Network.requestWillBeSent"]

    def screenshot(self, path: Path, width: int = 1280, max_height: int = 8000) -> None:
        def resize(height: int) -> None:
            self.call("Emulation.setDeviceMetricsOverride", session=True, width=width,
                      height=height, deviceScaleFactor=1, mobile=False)

        resize(800)  # lay out at the final width first, then fit the height to the content
        resize(min(int(self.js("document.documentElement.scrollHeight")), max_height))
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        for fd in (self._cmd_w, self._out_r):
            os.close(fd)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def browser(tmp_path):
    b = Chromium(tmp_path / "chromium-profile")
    yield b
    b.close()


def test_error_detection_works(browser, tmp_path):
    """Control: the console-error check does catch a script error and console.error."""
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>console.error('boom');</script>"
                    "<script>undefinedFunction();</script></body></html>")
    browser.open(page.as_uri())
    errors = browser.errors()
    assert any("boom" in e for e in errors), errors
    assert any("undefinedFunction" in e for e in errors), errors


def test_report_in_headless_chromium(browser, fake_report, tmp_path):
    report = fake_report
    browser.open(report.as_uri())
    assert browser.errors() == []
    # Self-contained: the only request is the page itself (images are data: URIs).
    assert [u for u in browser.requested_urls() if not u.startswith("data:")] == [report.as_uri()]

    n_imgs, n_decoded = browser.js(
        "[document.images.length, Array.from(document.images).filter(i => i.complete && "
        "i.naturalWidth > 0 && i.src.startsWith('data:image/png;base64,')).length]")
    assert n_imgs >= 10 and n_decoded == n_imgs
    assert browser.js("document.querySelectorAll('#eval-table tbody tr').length") == 3

    # Inspector: two steps offered, only the selected step's panel visible, 2 groups x 4 rows.
    assert browser.js("Array.from(document.querySelectorAll('#step-select option'))"
                      ".map(o => o.value)") == ["0", "4"]
    visible = ("Array.from(document.querySelectorAll('.step-panel'))"
               ".filter(p => !p.hidden).map(p => p.dataset.step)")
    assert browser.js(visible) == ["0"]
    assert browser.js("document.querySelectorAll('.step-panel:not([hidden]) table.inspector "
                      "tbody tr').length") == 8
    # Model text is escaped: the prompt's '<script>' is text, not an element.
    assert browser.js("document.querySelectorAll('script').length") == 1
    assert "<script>" in browser.js("document.querySelector('pre.prompt').textContent")

    # Clicking the 'advantage' header sorts the rows ascending, clicking again descending.
    adv_col = ("(() => { const t = document.querySelector('table.inspector');"
               " const i = Array.from(t.tHead.rows[0].cells).findIndex("
               "  c => c.textContent.startsWith('advantage'));"
               " t.tHead.rows[0].cells[i].click();"
               " return Array.from(t.tBodies[0].rows).map(r => parseFloat(r.cells[i].dataset.v));"
               "})()")
    assert browser.js(adv_col) == [-1.1, -0.6, 0.3, 1.4]
    assert browser.js(adv_col) == [1.4, 0.3, -0.6, -1.1]

    # Switching the <select> shows the other step.
    browser.js("(() => { const s = document.getElementById('step-select'); s.value = '4';"
               " s.dispatchEvent(new Event('change')); })()")
    assert browser.js(visible) == ["4"]
    browser.js("(() => { const s = document.getElementById('step-select'); s.value = '0';"
               " s.dispatchEvent(new Event('change')); })()")

    shot = tmp_path / "report.png"
    browser.screenshot(shot)
    assert browser.errors() == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
    shutil.copy(shot, "/tmp/report_screenshot.png")
