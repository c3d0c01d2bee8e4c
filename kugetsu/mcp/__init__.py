"""`kugetsu mcp`: kugetsu as Model Context Protocol tools for the agents that delegate
(docs/architecture.md §11; docs/mcp.md).

The MCP SDK (and pydantic, which it brings) is an optional extra, imported only when this
command runs: the everyday commands never pay its ~0.5 s. Without it, the command says how
to install it (exit 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kugetsu.errors import UsageError
from kugetsu.paths import Home

if TYPE_CHECKING:  # the SDK is imported when the server is built, with a clear error if it is missing
    from mcp.server import MCPServer

    from kugetsu.mcp.server import Follow

SDK = "mcp>=2.3,<3"


def run(home: Home, http: str | None = None, allow_remote: bool = False) -> int:
    """Serve over stdio until the client closes it, or over streamable HTTP at `http`."""
    address = None
    if http is not None:  # refuse a bad address or a missing token before the SDK costs its import
        from kugetsu.mcp.address import parse, token

        address = parse(http, allow_remote)
        secret = token(home)
    server, follow = _build(home)
    import anyio

    if address is None:
        anyio.run(_stdio, server, follow)
        return 0
    from kugetsu.mcp.http import serve

    anyio.run(serve, server, follow, address, secret)
    return 0


def _build(home: Home) -> tuple[MCPServer, Follow]:
    try:
        from kugetsu.mcp.server import build
    except ImportError as err:
        if not (err.name or "").split(".")[0] in ("mcp", "mcp_types", "pydantic", "anyio", "starlette", "uvicorn"):
            raise
        raise UsageError(f"kugetsu mcp needs the MCP Python SDK ({SDK}): {_found()}. Install it into the"
                         f" environment kugetsu runs in: pip install '{SDK}' (or, from a checkout of"
                         " kugetsu, pip install '.[mcp]')") from None
    return build(home)


def _found() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"version {version('mcp')} is installed, which lacks what kugetsu uses"
    except PackageNotFoundError:
        return "it is not installed"


async def _stdio(server: MCPServer, follow: Follow) -> None:
    import anyio

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow.run)
        await server.run_stdio_async()  # returns when the client closes stdin
        tg.cancel_scope.cancel()
