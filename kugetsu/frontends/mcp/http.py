"""`kugetsu mcp --http`: the same server over streamable HTTP, behind a bearer token."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import TYPE_CHECKING, Any

import anyio
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kugetsu.frontends import guard

if TYPE_CHECKING:
    from mcp.server import MCPServer

    from kugetsu.frontends.mcp.server import Follow


class BearerAuth:
    """ASGI wrapper: an HTTP request without `Authorization: Bearer <token>` gets 401 and
    never reaches MCP. Compared in constant time."""

    def __init__(self, app: Any, token: str):
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self._authorized(scope):
            body = json.dumps({"error": "unauthorized",
                               "error_description": "send the header Authorization: Bearer <mcp.token>"}).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="kugetsu"')]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                return scheme.lower() == b"bearer" and guard.same(credentials.strip(), self.token)
        return False


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, with guard.HEADER_TIMEOUT for each request's head to arrive
    whole. uvicorn times out only the idle time between two requests of a kept-alive
    connection: one that never sends a whole head (nothing at all, or a byte at a time) was
    kept open for ever, any local user could hold as many as they liked."""

    head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's head

    def send_400_response(self, msg: str) -> None:
        super().send_400_response(msg)
        # uvicorn answered a request whose head was whole but whose body it could not read
        # (bad chunking), while the app already handles that head: what the app sends now
        # (the token check's 401) has no response left to be. uvicorn would send it anyway,
        # and h11's refusal was a traceback on stderr, one per such request anyone sends.
        if self.cycle is not None:
            self.cycle.disconnected = True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(guard.HEADER_TIMEOUT, self._overdue)

    def _overdue(self) -> None:
        waiting = self.cycle is None or self.cycle.response_complete  # no request under way: its head is late
        if waiting and not self.transport.is_closing():
            self.transport.close()


async def serve(server: MCPServer, follow: Follow, address: tuple[str, int], token: str) -> None:
    host, port = address
    sock = guard.listen(host, port, "--http")  # bound before the banner: a client that reads it can connect at once
    shown = f"[{host}]" if ":" in host else host
    app = BearerAuth(server.streamable_http_app(host=host), token)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=HeadDeadline)
    print(f"kugetsu mcp: serving streamable HTTP at http://{shown}:{sock.getsockname()[1]}/mcp"
          " (requests need Authorization: Bearer <mcp.token>)", file=sys.stderr, flush=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(follow.run)
        await uvicorn.Server(config).serve(sockets=[sock])
        tg.cancel_scope.cancel()
