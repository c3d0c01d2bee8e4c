"""`kugetsu dashboard --web`: the same dashboard in a browser, served by textual-serve.

Each browser tab gets its own `kugetsu dashboard` process (textual-serve runs the command
with Textual's web driver and relays it over a websocket), so the web page is the terminal
dashboard itself: same keys, same actions, same code.

The dashboard can cancel tasks and delegate commands, so it is served on 127.0.0.1 unless
`--allow-remote` says otherwise, and on a loopback address it answers only requests that
name a loopback host: a web page elsewhere that points a name of its own at 127.0.0.1 (DNS
rebinding) is refused, so it cannot drive the dashboard from the user's browser.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

from kugetsu.config import is_loopback, parse_address
from kugetsu.errors import OK, UsageError
from kugetsu.paths import Home

DEFAULT_BIND = "127.0.0.1:8000"
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def check_bind(bind: str, allow_remote: bool) -> tuple[str, int]:
    try:
        host, port = parse_address(bind, "--bind", DEFAULT_BIND)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not allow_remote and not is_loopback(host):
        raise UsageError(f"--bind {bind}: not a loopback address, so anyone who reaches it could cancel tasks and"
                         " run commands from the dashboard; add --allow-remote if that is what you want"
                         " (and put it behind an authenticating proxy)")
    return host, port


def host_allowed(header: str, bind_host: str) -> bool:
    """Is a request's Host header one of this machine's names for a loopback bind?"""
    name = header.rsplit(":", 1)[0] if not header.endswith("]") else header
    name = name.strip("[]")
    return name in (*_LOOPBACK_NAMES, bind_host) or is_loopback(name)


def serve(home: Home, bind: str, allow_remote: bool) -> int:
    host, port = check_bind(bind, allow_remote)
    try:
        from aiohttp import web
        from textual_serve.server import Server
    except ImportError:
        raise UsageError("--web needs textual-serve: pip install 'kugetsu[web]'") from None

    class DashboardServer(Server):
        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            if not allow_remote:
                app.middlewares.append(guard)
            return app

        async def handle_index(self, request: web.Request) -> Any:
            # The page's websocket and static URLs, by the name the browser used (textual-serve
            # would write the bind address, which a browser elsewhere cannot use).
            self.public_url = f"{request.scheme}://{request.host}"
            return await super().handle_index(request)

        async def on_startup(self, app: web.Application) -> None:
            shown = f"[{host}]" if ":" in host else host
            print(f"kugetsu dashboard for {home.root} on http://{shown}:{port}/ (Ctrl+C stops it)", flush=True)

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> Any:
        if not host_allowed(request.host, host):
            raise web.HTTPForbidden(text="kugetsu: this dashboard answers only to this machine's loopback names\n")
        return await handler(request)

    # Every browser tab runs this command; it reads the same home.
    os.environ["KUGETSU_HOME"] = str(home.root)
    command = f"{shlex.quote(sys.executable)} -m kugetsu dashboard"
    DashboardServer(command, host=host, port=port, title=f"kugetsu · {home.root}").serve()
    return OK
