"""`kugetsu dashboard --web` opened in a real headless browser (Debian's chromium, driven by
playwright with executable_path; never `playwright install`), and its refusals."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from conftest import wait_for

from kugetsu import web
from kugetsu.errors import UsageError

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--no-first-run", "--disable-dev-shm-usage"]  # (a container's /dev/shm is often 64 MiB)
# The page draws the terminal on a canvas: what the dashboard sent it over the websocket is
# collected as text, beside xterm.js, which draws the very same bytes.
TAP = """
(() => {
  window.__kugetsu_screen = "";
  const Real = window.WebSocket;
  function Tapped(...args) {
    const ws = new Real(...args);
    const text = new TextDecoder();
    ws.addEventListener("message", (e) => {
      if (typeof e.data !== "string") window.__kugetsu_screen += text.decode(new Uint8Array(e.data), {stream: true});
    });
    return ws;
  }
  Tapped.prototype = Real.prototype;
  Object.assign(Tapped, Real);
  window.WebSocket = Tapped;
})();
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(kg, tmp_path):
    """The dashboard served on a free loopback port; stopped (SIGTERM, as Ctrl+C) afterwards."""
    pytest.importorskip("textual_serve", reason="the `web` extra (textual-serve) is not installed")
    port = free_port()
    out = open(tmp_path / "web.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kugetsu", "dashboard", "--web", "--bind", f"127.0.0.1:{port}"],
                            env=kg.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "web.out").read_text()
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(up, 30, "the web dashboard to listen")
        yield f"http://127.0.0.1:{port}/", proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the dashboards it started for the page
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        out.close()


def test_a_browser_shows_the_running_task(kg, served):
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (as root: apt-get install chromium)")
    url, _ = served
    kg.config(max_agents=1, default_agent="sim", agents={"sim": {"command": ["sh", "-c", "echo working; sleep 600"]}})
    kg.ok("delegate", "webshown", "--prompt", "x")
    kg.wait_state("webshown", "running")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 700})
            # Only this machine: the page's web fonts (an outside address) are not fetched.
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(url)
                       or route.request.url.startswith(url.replace("http", "ws", 1)) else route.abort())
            page.add_init_script(TAP)
            page.goto(url)
            page.wait_for_function("() => window.__kugetsu_screen.includes('webshown')", timeout=60_000)
            # xterm.js has drawn what came (textual-serve's page marks the first bytes written).
            page.wait_for_function("() => document.body.classList.contains('-first-byte')", timeout=30_000)
            screen = page.evaluate("() => window.__kugetsu_screen")
            assert "1/1 running" in screen and "Running" in screen
        finally:
            browser.close()


def test_only_loopback_names_are_answered(served):
    url, _ = served
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200 and "textual" in r.read().decode().lower()
    # A page elsewhere whose own name points at 127.0.0.1 (DNS rebinding) gets nothing.
    request = urllib.request.Request(url, headers={"Host": "rebound.example:80"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 403


@pytest.mark.parametrize("args, message", [
    (["--web", "--bind", "0.0.0.0:8000"], "not a loopback address"),
    (["--web", "--bind", "[::]:8000"], "not a loopback address"),
    (["--web", "--bind", "8000"], "is not HOST:PORT, e.g. 127.0.0.1:8000"),
    (["--bind", "127.0.0.1:8000"], "--bind and --allow-remote go with --web"),
])
def test_bad_binds_are_refused(kg, args, message):
    r = kg.run("dashboard", *args, timeout=30)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not kg.home.root.exists()


def test_the_checks_of_a_bind():
    assert web.check_bind("0.0.0.0:8000", allow_remote=True) == ("0.0.0.0", 8000)  # asked for explicitly
    assert web.check_bind("[::1]:8000", allow_remote=False) == ("::1", 8000)
    with pytest.raises(UsageError, match="--allow-remote"):
        web.check_bind("example.org:8000", allow_remote=False)
    assert web.host_allowed("127.0.0.1:8000", "127.0.0.1") and web.host_allowed("localhost", "127.0.0.1")
    assert web.host_allowed("[::1]:8000", "::1") and not web.host_allowed("evil.example:8000", "127.0.0.1")


def test_without_textual_serve_it_says_what_to_install(kg, monkeypatch):
    monkeypatch.setitem(sys.modules, "textual_serve", None)  # as if the extra were not installed
    monkeypatch.setitem(sys.modules, "textual_serve.server", None)
    with pytest.raises(UsageError, match=r"pip install 'kugetsu\[web\]'"):
        web.serve(kg.home, "127.0.0.1:0", allow_remote=False)
