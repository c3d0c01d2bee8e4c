"""`kugetsu mcp --http`: the same server over streamable HTTP, behind a bearer token."""

from __future__ import annotations

import hmac
import json
import sys
from typing import TYPE_CHECKING, Any

import anyio
import uvicorn

from kugetsu.guard import listen

if TYPE_CHECKING:
    from mcp.server import MCPServer

    from kugetsu.mcp.server import Follow


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
                return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token)
        return False


async def serve(server: MCPServer, follow: Follow, address: tuple[str, int], token: str) -> None:
    host, port = address
    sock = listen(host, port, "--http")  # bound before the banner: a client that reads it can connect at once
    shown = f"[{host}]" if ":" in host else host
    app = BearerAuth(server.streamable_http_app(host=host), token)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    print(f"kugetsu mcp: serving streamable HTTP at http://{shown}:{sock.getsockname()[1]}/mcp"
          " (requests need Authorization: Bearer <mcp.token>)", file=sys.stderr, flush=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(follow.run)
        await uvicorn.Server(config).serve(sockets=[sock])
        tg.cancel_scope.cancel()
