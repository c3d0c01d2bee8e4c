"""What every tool group shares: a result in the CLI's words (`text`), the arguments' types
and their parsing, `answers` (a KugetsuError as a tool error), and the worker threads that
blocking calls (a wait, a cancel) run in."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Annotated, Any

import anyio
import anyio.to_thread
import msgspec
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field

from kugetsu.config.units import parse_duration, parse_size
from kugetsu.errors import KugetsuError, UsageError
from kugetsu.paths import Home, explain

READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)

Duration = Annotated[
    str | float | None,
    Field(description="90s, 15m, 2h, 1d, or plain seconds; null: the config's default"),
]
TaskRef = Annotated[str, Field(description="a task id (7 or #7) or name (issue-16)")]


def reply(text: str, structured: dict[str, Any] | None = None, error: bool = False) -> CallToolResult:
    if structured is not None:
        structured = msgspec.to_builtins(structured)  # reading.queue_json's tasks are structs
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=structured, is_error=error)


def duration(value: str | float | None, what: str) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value, what)
    except ValueError as err:
        raise UsageError(str(err)) from None


def size(value: str | int | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value, "memory")
    except ValueError as err:
        raise UsageError(str(err)) from None


def dumps(obj: Any) -> bytes:
    return json.dumps(msgspec.to_builtins(obj), indent=2, ensure_ascii=False).encode()


def answers(home: Home) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: a KugetsuError (bad input, no such task, a damaged file) or a system error
    becomes a tool error whose text says what to fix, as the CLI's one line on stderr. The
    docstring, the tool's description, loses its indentation (tokens for nothing)."""

    def failed(err: Exception) -> CallToolResult:
        message = str(err) if isinstance(err, KugetsuError) else str(explain(home, err))  # type: ignore[arg-type]
        return reply(message, error=True)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await fn(*args, **kwargs)
                except (KugetsuError, OSError) as err:
                    return failed(err)

            run_async.__doc__ = inspect.cleandoc(fn.__doc__ or "")
            return run_async

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (KugetsuError, OSError) as err:
                return failed(err)

        run.__doc__ = inspect.cleandoc(fn.__doc__ or "")
        return run

    return wrap


# Waits hold a worker thread for up to a second between looks: their own pool, so a few
# dozen waiting calls never starve the other tools of threads.
_WAITS = anyio.CapacityLimiter(256)


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread; a cancelled call returns at once (the thread ends on
    its own, the waits at once since their Stop is set)."""
    return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=_WAITS)
