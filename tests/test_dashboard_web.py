"""`kugetsu dashboard --web` opened in a real headless browser (Debian's chromium, driven by
playwright with executable_path; never `playwright install`), and its refusals."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest
import rawclient
from conftest import wait_for
from rawclient import upgrade

from kugetsu.frontends import guard, web
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


class Served:
    """A dashboard being served: the URL it printed (carrying its token), the bare address."""

    def __init__(self, url: str, proc: subprocess.Popen, log: pathlib.Path):
        self.url, self.proc, self.log = url, proc, log
        parts = urllib.parse.urlsplit(url)
        self.port = parts.port
        self.base = f"{parts.scheme}://{parts.netloc}/"
        self.token = urllib.parse.parse_qs(parts.query).get("token", [""])[0]

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
        request = urllib.request.Request(self.base.rstrip("/") + path, headers=headers or {})
        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(request, timeout=10) as r:
                return r.status, dict(r.headers), r.read().decode(errors="replace")
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read().decode(errors="replace")


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kw):  # type: ignore[no-untyped-def]
        return None  # the test looks at the redirect itself




@pytest.fixture
def served(kg, tmp_path):
    """The dashboard served on a free loopback port; stopped (SIGTERM, as Ctrl+C) afterwards."""
    pytest.importorskip("textual_serve", reason="the `web` extra (textual-serve) is not installed")
    log = tmp_path / "web.out"
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "kugetsu", "dashboard", "--web", "--bind", "127.0.0.1:0"],
                            env=kg.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def up() -> re.Match | None:  # port 0: the address it printed says which it got
        assert proc.poll() is None, log.read_text()
        return re.search(r" on (http://\S+) ", log.read_text())

    try:
        found = wait_for(up, 30, "the web dashboard to listen and print its address")
        yield Served(found.group(1), proc, log)  # type: ignore[union-attr]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and the dashboards it started for the page
            proc.wait(15)
        except ProcessLookupError:  # the test stopped it already
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        out.close()


def browser(p):  # type: ignore[no-untyped-def]
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (as root: apt-get install chromium)")
    return p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)


def only_this_machine(page, *prefixes: str) -> None:  # type: ignore[no-untyped-def]
    """The page's web fonts (an outside address) are not fetched."""
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(prefixes) else route.abort())


def test_a_browser_shows_the_running_task(kg, served):
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
    kg.config(max_agents=1, default_agent="sim", agents={"sim": {"command": ["sh", "-c", "echo working; sleep 600"]}})
    kg.ok("delegate", "webshown", "--prompt", "x")
    kg.wait_state("webshown", "running")
    assert served.token, "the printed address carries no token"
    with playwright.sync_playwright() as p:
        b = browser(p)
        try:
            page = b.new_page(viewport={"width": 1200, "height": 700})
            only_this_machine(page, served.base, served.base.replace("http", "ws", 1))
            page.add_init_script(TAP)
            page.goto(served.url)  # the printed address, as the user opens it
            # The token became a cookie the page's scripts cannot read, and left the address bar.
            assert page.url == served.base
            (cookie,) = page.context.cookies()
            assert cookie["value"] == served.token and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
            assert "token" not in page.evaluate("() => document.cookie")
            page.wait_for_function("() => window.__kugetsu_screen.includes('webshown')", timeout=60_000)
            # xterm.js has drawn what came (textual-serve's page marks the first bytes written).
            page.wait_for_function("() => document.body.classList.contains('-first-byte')", timeout=30_000)
            screen = page.evaluate("() => window.__kugetsu_screen")
            assert "1/1 running" in screen and "Running" in screen
        finally:
            b.close()


EVIL = """<!doctype html><script>
window.__result = null;
const ws = new WebSocket("ws://127.0.0.1:PORT/ws?width=80&height=24");
ws.onopen = () => { window.__result = "open"; };
ws.onclose = (e) => { window.__result = window.__result || ("closed " + e.code); };
</script>"""


def test_a_page_from_another_origin_cannot_open_the_socket(kg, served):
    """The owner has the dashboard open (so the browser holds its cookie, which it sends to
    every port of 127.0.0.1), then visits a page another local user serves on another port."""
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
    page_text = EVIL.replace("PORT", str(served.port)).encode()

    class Evil(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(page_text)

        def log_message(self, *args: object) -> None:
            pass

    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        with playwright.sync_playwright() as p:
            b = browser(p)
            try:
                page = b.new_page()
                only_this_machine(page, served.base, served.base.replace("http", "ws", 1), "http://127.0.0.1:")
                page.goto(served.url)
                assert page.context.cookies(), "the dashboard set no cookie"
                page.goto("about:blank")  # its dashboard process ends with its socket
                wait_for(lambda: processes_in_group(served.proc.pid) == [served.proc.pid], 30,
                         "the dashboard the page had opened to end")
                page.goto(f"http://127.0.0.1:{evil.server_port}/")
                result = page.wait_for_function("() => window.__result", timeout=30_000).json_value()
                assert result != "open" and result.startswith("closed")
            finally:
                b.close()
    finally:
        evil.shutdown()
        evil.server_close()
    assert processes_in_group(served.proc.pid) == [served.proc.pid]  # no dashboard was started for it


def processes_in_group(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    found.append(int(entry))
            except ProcessLookupError:
                pass
    return found


async def test_a_websocket_client_needs_the_token(served):
    import aiohttp

    ws_url = served.base.replace("http", "ws", 1) + "ws"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(ws_url)
        assert refused.value.status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(ws_url, params={"token": served.token[:-1] + "x"})
        assert refused.value.status == 401
        # With it (a program holds no cookie: the token goes in the query), the dashboard answers.
        async with session.ws_connect(ws_url, params={"token": served.token, "width": "120", "height": "30"}) as ws:
            screen = b""
            while b"Running" not in screen and b"kugetsu" not in screen:
                message = await asyncio.wait_for(ws.receive(), 60)
                assert message.type == aiohttp.WSMsgType.BINARY, message
                screen += message.data


def test_without_the_token_nothing_is_served(served):
    for path in ("/", "/static/js/textual.js", "/download/x", "/ws"):
        status, _, body = served.get(path)
        assert status == 401 and "the address `kugetsu dashboard --web` printed" in body, (path, status, body)
    status, headers, _ = served.get(f"/?token={served.token}x")
    assert status == 401 and "set-cookie" not in {k.lower() for k in headers}
    # The right one: a cookie, and the same address without it.
    status, headers, _ = served.get(f"/?fontsize=18&token={served.token}")
    assert status == 303 and headers["Location"] == "/?fontsize=18"
    cookie = headers["Set-Cookie"]
    assert served.token in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    name = cookie.split("=", 1)[0]
    status, headers, body = served.get("/", {"Cookie": f"{name}={served.token}"})
    assert status == 200 and "textual" in body.lower()
    # No page elsewhere may frame it (keystrokes typed into a disguised frame).
    assert headers["X-Frame-Options"] == "DENY" and "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    # The token is written once: in the address printed for the user, not in a log of requests.
    assert served.log.read_text().count(served.token) == 1


@pytest.mark.parametrize("headers, status", [
    ({}, 101),
    ({"Origin": "http://127.0.0.1:{port}"}, 101),  # the dashboard's own page
    ({"Origin": "https://evil.example"}, 403),
    ({"Origin": "http://127.0.0.1:1"}, 403),  # another port of this machine is another origin
    ({"Origin": "null"}, 403),
    ({"Host": "rebound.example:{port}"}, 403),  # DNS rebinding
    ({"Host": "127.0.0.1:1"}, 403),  # not the port we bound
])
def test_host_and_origin_must_be_ours(served, headers, status):
    headers = {k: v.format(port=served.port) for k, v in headers.items()}
    assert upgrade(served.port, f"/ws?token={served.token}", headers) == status


def test_a_malformed_request_is_one_warning_line_not_a_traceback(served):
    """Any local user can send the dashboard's server bytes it cannot parse; aiohttp logged
    each as an error with its traceback on the terminal of whoever serves the dashboard."""
    for request in (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n",
                    b"GET /?token=" + served.token.encode() + b" HTTP/1.1\r\nHost: \x00\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
            s.sendall(request)
            assert s.recv(4096).split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
    wait_for(lambda: served.log.read_text().count("refused a malformed request") == 2, 10, "two warnings")
    said = served.log.read_text()
    assert "Traceback" not in said and "ERROR" not in said, said
    assert said.count(served.token) == 1  # the address it printed, never the request's bytes
    assert upgrade(served.port, f"/ws?token={served.token}") == 101  # still serving


def test_another_user_is_refused(served):
    """As another uid on the machine: no token, no dashboard; and the token is in no
    process's command line or environment for it to find."""
    if os.geteuid() != 0 or not shutil.which("runuser") or not shutil.which("useradd"):
        pytest.skip("needs root (to add a user and run a client as it)")
    python = shutil.which("python3", path="/usr/bin:/bin")  # one the other user may run (not root's pyenv)
    if python is None:
        pytest.skip("no system python3 for the other user")
    user = "kugetsu-intruder"
    if subprocess.run(["id", user], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", user], check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as where:  # pytest's own are root's alone
        os.chmod(where, 0o755)
        script = shutil.copy(rawclient.__file__, where)
        os.chmod(script, 0o644)
        r = subprocess.run(["runuser", "-u", user, "--", python, "-I", script, str(served.port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ws": 401, "page": 401}
    # The same client with the token (the owner's) is let in: the refusal above is the token's doing.
    assert upgrade(served.port, f"/ws?token={served.token}") == 101
    for pid in processes_in_group(served.proc.pid):
        for name in ("cmdline", "environ"):
            try:
                assert served.token.encode() not in pathlib.Path(f"/proc/{pid}/{name}").read_bytes()
            except (FileNotFoundError, ProcessLookupError):
                pass


def test_only_loopback_names_are_answered(served):
    status, _, body = served.get("/", {"Cookie": "x=y"})
    assert status == 401
    # A page elsewhere whose own name points at 127.0.0.1 (DNS rebinding) gets nothing.
    status, _, _ = served.get(f"/?token={served.token}", {"Host": "rebound.example:80"})
    assert status == 403


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
    assert guard.host_ok("127.0.0.1:8000", 8000, remote=False) and guard.host_ok("localhost:8000", 8000, False)
    assert guard.host_ok("[::1]:8000", 8000, False) and not guard.host_ok("evil.example:8000", 8000, False)
    assert not guard.host_ok("127.0.0.1:8001", 8000, False) and not guard.host_ok("localhost", 8000, False)
    assert guard.host_ok("localhost", 80, False) and not guard.host_ok("127.0.0.1:x", 8000, False)
    assert guard.host_ok("dash.example", 8000, remote=True)  # the token is the guard there
    assert guard.origin_ok(None, "127.0.0.1:8000") and guard.origin_ok("http://127.0.0.1:8000", "127.0.0.1:8000")
    assert not guard.origin_ok("http://127.0.0.1:8001", "127.0.0.1:8000") and not guard.origin_ok("null", "x")


def test_without_textual_serve_it_says_what_to_install(kg, monkeypatch):
    monkeypatch.setitem(sys.modules, "textual_serve", None)  # as if the extra were not installed
    monkeypatch.setitem(sys.modules, "textual_serve.server", None)
    with pytest.raises(UsageError, match=r"pip install 'kugetsu\[web\]'"):
        web.serve(kg.home, "127.0.0.1:0", allow_remote=False)
