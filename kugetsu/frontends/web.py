"""`kugetsu dashboard --web`: the same dashboard in a browser, served by textual-serve.

Each browser tab gets its own `kugetsu dashboard` process (textual-serve runs the command
with Textual's web driver and relays it over a websocket), so the web page is the terminal
dashboard itself: same keys, same actions, same code.

The dashboard can cancel tasks, change max_agents and delegate commands that run as the
user, and any local user can connect to a port on 127.0.0.1, so nothing is served without
a secret (kugetsu/frontends/guard.py says why each check):
- a token made at each start (256 random bits), printed on stdout in the address to open,
  and kept only in this process's memory: never in a child's argv or environment, never
  logged (the access log is off: it would write the first request's query);
- the first request carrying it gets an HttpOnly, SameSite=Strict cookie and a redirect to
  the same address without it, so the token leaves the address bar; every other request,
  the websocket's upgrade included, needs the cookie (a program may send `?token=` instead);
- Host must be a loopback name with our port (DNS rebinding); Origin, when a browser sends
  one, must be our own (a page on another site, or another port of 127.0.0.1, cannot open
  the socket even though the browser would send it the cookie); no page may frame it;
- 127.0.0.1 unless `--allow-remote` (then any Host, the token still required).

A tab's process ends with its socket and with the server, whatever the browser does: a
socket gone (closed, reset, or a client that stalled and vanished) asks the tab to quit and
kills it if it has not within TAB_GRACE; the server's end (Ctrl+C, SIGTERM) ends every tab
the same way; and a tab whose server is gone (its pipes hang up, even after a SIGKILL of
the server) ends itself (`guard_tab`), as it does at SIGTERM even when its output is stuck.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from typing import Any

from kugetsu.frontends import guard
from kugetsu.config.model import is_loopback, parse_address
from kugetsu.errors import OK, UsageError
from kugetsu.paths import Home

DEFAULT_BIND = "127.0.0.1:8000"
TAB_ENV = "KUGETSU_WEB_TAB"  # set for the tabs' processes: they guard themselves (guard_tab)
TAB_GRACE = 2.0  # seconds a tab has to quit when asked before it is killed
COOKIE = "kugetsu_dashboard_{port}"  # one per port: two dashboards (two homes) keep their own
REFUSED = ("kugetsu: open the address `kugetsu dashboard --web` printed when it started (it carries the token;"
           " a restart makes a new one)\n")
# Every answer: no page elsewhere may frame the dashboard (keys typed into a disguised
# frame would drive it), nor learn its address from a Referer.
HEADERS = {"X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'",
           "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}


def check_bind(bind: str, allow_remote: bool) -> tuple[str, int]:
    try:
        host, port = parse_address(bind, "--bind", DEFAULT_BIND)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not allow_remote and not is_loopback(host):
        raise UsageError(f"--bind {bind}: not a loopback address, so anyone who reaches it could cancel tasks and"
                         " run commands from the dashboard; add --allow-remote if that is what you want"
                         " (and put it behind TLS: the token travels in every request)")
    return host, port


def serve(home: Home, bind: str, allow_remote: bool) -> int:
    host, port = check_bind(bind, allow_remote)
    try:
        from aiohttp import web
        from textual_serve.server import Server
    except ImportError:
        raise UsageError("--web needs textual-serve: pip install 'kugetsu[web]'") from None
    import asyncio
    import signal

    from textual_serve import server as textual_server
    from textual_serve.app_service import AppService

    class Tab(AppService):
        """One tab's `kugetsu dashboard`, which never outlives its socket or the server."""

        live: set[asyncio.subprocess.Process] = set()

        async def _open_app_process(self, width: int = 80, height: int = 24) -> asyncio.subprocess.Process:
            process = await super()._open_app_process(width, height)
            Tab.live.add(process)
            return process

        async def stop(self) -> None:
            # textual-serve asks the tab to quit and waits for its output to end: a tab whose
            # output is stuck (a client that stopped reading) would never be waited out.
            try:
                await asyncio.wait_for(super().stop(), TAB_GRACE)
            except (asyncio.TimeoutError, OSError):
                pass
            finally:
                if self._process is not None:
                    await end_tab(self._process)

    async def end_tab(process: asyncio.subprocess.Process) -> None:
        if process.returncode is None:
            try:
                process.terminate()  # it quits at once (guard_tab), stuck output or not
                await asyncio.wait_for(process.wait(), TAB_GRACE)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
            except ProcessLookupError:
                pass
        Tab.live.discard(process)

    # textual-serve's websocket handler makes its AppService by this module global name.
    textual_server.AppService = Tab  # type: ignore[misc]

    sock = guard.listen(host, port, "--bind")
    port = sock.getsockname()[1]
    token = guard.new_token()
    cookie = COOKIE.format(port=port)
    remote = allow_remote and not is_loopback(host)

    @web.middleware
    async def gate(request: web.Request, handler: Any) -> Any:
        if not guard.host_ok(request.host, port, remote):
            return web.Response(status=403, text="kugetsu: this dashboard answers only to the address it printed\n")
        if not guard.origin_ok(request.headers.get("Origin"), request.host):
            return web.Response(status=403, text="kugetsu: a page from another origin may not use this dashboard\n")
        given = request.query.get("token")
        if given is not None:
            if not guard.same(given, token):
                return web.Response(status=401, text=REFUSED)
            if request.headers.get("Upgrade", "").lower() == "websocket":
                return await handler(request)  # a program's socket: it keeps no cookie
            # A browser: the token becomes a cookie its scripts cannot read and other sites'
            # requests do not carry, and leaves the address bar (and the history's next entry).
            clean = request.rel_url.with_query([(k, v) for k, v in request.query.items() if k != "token"])
            answer = web.Response(status=303, headers={"Location": str(clean), "Cache-Control": "no-store"})
            answer.set_cookie(cookie, token, httponly=True, samesite="Strict", path="/")
            return answer
        if not guard.same(request.cookies.get(cookie), token):
            return web.Response(status=401, text=REFUSED)
        return await handler(request)

    async def secure_headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(HEADERS)

    class DashboardServer(Server):
        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            app.middlewares.append(gate)
            app.on_response_prepare.append(secure_headers)
            return app

        async def handle_index(self, request: web.Request) -> Any:
            # The page's websocket and static URLs, by the name the browser used (textual-serve
            # would write the bind address, which a browser elsewhere cannot use).
            self.public_url = f"{request.scheme}://{request.host}"
            return await super().handle_index(request)

        async def on_startup(self, app: web.Application) -> None:
            shown = f"[{host}]" if ":" in host else host
            # stdout only, to the user who started it: the one place the token is written.
            print(f"kugetsu dashboard for {home.root} on http://{shown}:{port}/?token={token} (Ctrl+C stops it)",
                  flush=True)

        async def on_shutdown(self, app: web.Application) -> None:
            # Before aiohttp waits for the open sockets: every tab ends with the server.
            await asyncio.gather(*(end_tab(p) for p in list(Tab.live)))

        def initialize_logging(self) -> None:
            # textual-serve's logs errors with each frame's locals, which would print the
            # token (a request's query, this module's closure): plain tracebacks instead.
            logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
            logging.getLogger("aiohttp.server").addFilter(malformed_in_one_line)

        def serve(self, debug: bool = False) -> None:
            # textual-serve's serve(), on our socket and without the access log.
            self.initialize_logging()
            loop = asyncio.new_event_loop()
            loop.add_signal_handler(signal.SIGINT, self.request_exit)
            loop.add_signal_handler(signal.SIGTERM, self.request_exit)
            web.run_app(self._make_app(), sock=sock, handle_signals=False, loop=loop, access_log=None,
                        print=lambda *args: None, shutdown_timeout=TAB_GRACE)

    # Every browser tab runs this command; it reads the same home.
    os.environ["KUGETSU_HOME"] = str(home.root)
    os.environ[TAB_ENV] = "1"
    # exec: the tab is the server's own child (no shell between), so that ending it ends it.
    command = f"exec {shlex.quote(sys.executable)} -m kugetsu dashboard"
    DashboardServer(command, host=host, port=port, title=f"kugetsu · {home.root}").serve()
    return OK


def malformed_in_one_line(record: logging.LogRecord) -> bool:
    """aiohttp logs a request it cannot parse as an error with its traceback: any local user
    could fill the terminal of whoever serves the dashboard with them, one per connection.
    Such a request is the client's fault: one warning line saying what was wrong, without
    the offending bytes (a request line may carry a token)."""
    from aiohttp.http_exceptions import HttpProcessingError

    err = record.exc_info[1] if record.exc_info else None
    if isinstance(err, HttpProcessingError):
        what = (err.message.splitlines() or [""])[0].rstrip(":") or f"status {err.code}"
        record.msg, record.args = f"{record.getMessage()}: refused a malformed request ({what})", ()
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def guard_tab() -> None:
    """In a tab's `kugetsu dashboard` (TAB_ENV): end when the server is gone. Its pipes are the
    server's: a hang-up of standard input or an error on standard output (the server closed
    them, or died, even by SIGKILL) ends the process at once, from a thread that reads
    nothing (Textual's own reader keeps its input)."""
    import select
    import threading

    def watch() -> None:
        poll = select.poll()
        for fd in (0, 1):
            poll.register(fd, 0)  # no events asked: a hang-up and an error are always told
        while True:
            try:
                if poll.poll():
                    os._exit(0)
            except InterruptedError:
                continue

    threading.Thread(target=watch, name="kugetsu-tab-guard", daemon=True).start()
