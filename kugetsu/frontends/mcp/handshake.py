"""`kugetsu mcp` over stdio answers the client's `initialize` before the SDK is loaded.

Importing the MCP SDK (its two protocol eras of pydantic models) takes about a second on a
loaded 2-core machine, and a client waits for the handshake before its first model turn
(Claude Code once started one with the server still pending). This module imports nothing
heavy: it reads the first line from stdin, answers an `initialize` it knows how to answer
with what the SDK would say, and meanwhile a thread imports the SDK and builds the server.
The `initialize` is then replayed to the SDK, so its session is set up as usual, and its own
answer is dropped (compared with ours first: a difference is said on stderr, so an SDK
upgrade that changes the handshake cannot go unnoticed; tests/test_mcp.py holds it to none).
Anything else first (a 2026-07-28 request, an unknown protocol version, a malformed line) is
left to the SDK, as before.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import kugetsu
from kugetsu.errors import UsageError
from kugetsu.frontends.mcp.identity import INSTRUCTIONS, NAME, TITLE
from kugetsu.paths import Home

# The handshake versions the SDK (mcp 2.x) serves; it answers the one asked for among them.
VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
# What the SDK's MCPServer announces for kugetsu's server (tools, resources it lets clients
# subscribe to, no prompts).
CAPABILITIES = {"prompts": {"listChanged": False}, "resources": {"listChanged": False, "subscribe": True},
                "tools": {"listChanged": False}}
SDK = "mcp>=2.3,<3"
_NEEDS = ("mcp", "mcp_types", "pydantic", "anyio", "starlette", "uvicorn")


def answer(line: bytes) -> dict[str, Any] | None:
    """The response to `line` if it is an `initialize` request this module can answer as the
    SDK would; None leaves the line to the SDK."""
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0" or msg.get("method") != "initialize":
        return None
    params, ident = msg.get("params"), msg.get("id")
    if not isinstance(ident, (int, str)) or isinstance(ident, bool) or not isinstance(params, dict):
        return None
    info = params.get("clientInfo")
    if (params.get("protocolVersion") not in VERSIONS or not isinstance(params.get("capabilities"), dict)
            or not isinstance(info, dict) or not isinstance(info.get("name"), str)
            or not isinstance(info.get("version"), str)):
        return None  # the SDK's answer (or its error) for anything less plain
    return {"jsonrpc": "2.0", "id": ident, "result": {
        "capabilities": CAPABILITIES, "instructions": INSTRUCTIONS, "protocolVersion": params["protocolVersion"],
        "serverInfo": {"name": NAME, "title": TITLE, "version": kugetsu.__version__}}}


def check_sdk() -> None:
    """Say how to install the SDK when it is missing, before a client is told anything (a
    lookup, not an import)."""
    from importlib.util import find_spec

    for name in _NEEDS:
        try:
            found = find_spec(name) is not None
        except (ImportError, ValueError):  # a module set to None (hidden), or a broken one
            found = False
        if not found:
            raise sdk_missing()


def sdk_missing() -> UsageError:
    return UsageError(f"kugetsu mcp needs the MCP Python SDK ({SDK}): {_found()}. Install it into the"
                      f" environment kugetsu runs in: pip install '{SDK}' (or, from a checkout of"
                      " kugetsu, pip install '.[mcp]')")


def _found() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"version {version('mcp')} is installed, which lacks what kugetsu uses"
    except PackageNotFoundError:
        return "it is not installed"


def build(home: Home) -> Any:
    """The server (kugetsu.frontends.mcp.server.build), or the SDK's absence as a UsageError."""
    try:
        from kugetsu.frontends.mcp.server import build as build_server
    except ImportError as err:
        if (err.name or "").split(".")[0] not in _NEEDS:
            raise
        raise sdk_missing() from None
    return build_server(home)


class _Loader(threading.Thread):
    """Imports the SDK and builds the server while the main thread answers the handshake."""

    def __init__(self, home: Home):
        super().__init__(name="kugetsu-mcp-load", daemon=True)
        self.home = home
        self.built: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.built = build(self.home)
        except BaseException as err:  # handed to the main thread, which raises it
            self.error = err


def first_line(fd: int = 0) -> bytes:
    """The client's first message, read a byte at a time: nothing beyond its newline leaves
    the pipe, so the SDK's reader finds the rest where the client put it."""
    out = bytearray()
    while not out.endswith(b"\n"):
        try:
            byte = os.read(fd, 1)
        except InterruptedError:
            continue
        if not byte:
            break
        out += byte
    return bytes(out)


def stdio(home: Home) -> int:
    """Serve over stdio until the client closes it."""
    check_sdk()
    loader = _Loader(home)
    loader.start()
    first = first_line()
    early = answer(first)
    if early is not None:
        data = memoryview(json.dumps(early, separators=(",", ":")).encode() + b"\n")
        while data:
            data = data[os.write(1, data):]
    loader.join()
    if loader.error is not None:
        raise loader.error
    import anyio

    from kugetsu.frontends.mcp.server import serve_stdio

    server, follow = loader.built
    anyio.run(serve_stdio, server, follow, first, early)
    return 0
