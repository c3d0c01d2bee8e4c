"""The MCP server: kugetsu's operations as tools for the agents that delegate (docs/architecture.md §11).

`build` wires the tool groups (tools_read: capacity, queue, status, logs, schedules, stats;
tools_tasks: delegate, cancel, priority; tools_wait: wait), each registering its tools, the
resources and the followers (Follow). Every tool is the CLI's command through the same code
(app, core, render): its structured content is the JSON the CLI prints with --json, its
text what the CLI prints without. A bad argument, an unknown task or a failure is a tool error (isError) whose text
says what to fix; a refusal by admission (queue full, a per-source limit: the CLI's exit 3)
is a normal result that says to back off and try again later.

One long-lived process: the SDK, pydantic and kugetsu are imported once; config and index
are read per call, as the CLI reads them, so nothing here can be stale (the admissions' store,
tools_tasks.Admitter, keeps the index it committed last, and uses it only while index.json and
index.journal are as it left them).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError
from mcp.server.subscriptions import InMemorySubscriptionBus, ResourceUpdated
from mcp.types import SubscribeRequestParams, UnsubscribeRequestParams
from pydantic import ValidationError

import kugetsu
from kugetsu.app import delegation, reading
from kugetsu.core import admission, selection
from kugetsu.core.models import TaskState
from kugetsu.errors import KugetsuError, Nested
from kugetsu.frontends.mcp import tools_read, tools_tasks, tools_wait
from kugetsu.frontends.mcp.identity import INSTRUCTIONS, NAME, TITLE, differs
from kugetsu.frontends.mcp.tooling import dumps, reply
from kugetsu.paths import Home
from kugetsu.store.files import open_store
from kugetsu.store.protocol import StoreProtocol

QUEUE_URI = "kugetsu://queue"
TASK_URI = "kugetsu://task/"


class Follow:
    """Who follows which resource, and the watcher that tells them when it changes.

    Two kinds of followers: `resources/subscribe` (protocol 2025-11-25 and before, what
    Claude Code and opencode speak) per connection and URI, and `subscriptions/listen`
    streams (2026-07-28), which the SDK's bus serves. While anyone follows, the watcher
    looks at the store's stamp once a second (index.json's, or the cluster's queue row's);
    when it changed, it renders every resource and notifies those whose content differs
    from the last look."""

    def __init__(self, home: Home):
        self.home = home
        self.sessions: dict[str, dict[int, Any]] = {}  # uri -> {connection key: session}
        self.listeners = 0
        self.seen: dict[str, bytes] | None = None  # uri -> content at the last look
        self.stamp: object = None
        self.store: StoreProtocol | None = None  # made in a worker thread, at the first follower
        self.prompts: dict[int, str] = {}  # the tasks' stored prompts, as last read (look)
        self.bus = _CountingBus(self)
        self.someone: anyio.Event | None = None  # set when a first follower comes (made in run's loop)

    def following(self) -> bool:
        return bool(self.listeners or any(self.sessions.values()))

    def look(self) -> dict[str, bytes]:
        """Every resource's content now (a worker thread: it reads and renders the index)."""
        cfg, index = reading.read(self.home)
        view = reading.listing(cfg, index)
        tasks = index.finished + index.live()
        # Only a queued task's prompt can change (edit): the others' are read once.
        fresh = [t for t in tasks if t.id not in self.prompts or t.state is TaskState.QUEUED]
        self.prompts = {**{t.id: self.prompts[t.id] for t in tasks if t.id in self.prompts},
                        **reading.prompts(self.home, fresh)}
        shown = msgspec.structs.replace(view, view=selection.limit_view(view.view, tools_read.QUEUE_LIMIT))  # as queue_resource
        out = {QUEUE_URI: dumps(reading.queue_json(shown, known=self.prompts))}
        by_name: dict[str, bytes] = {}
        for task in tasks:  # a name means its live task, else its latest finished one
            body = dumps(reading.task_json(task, view.positions.get(task.id), prompts=self.prompts))
            out[f"{TASK_URI}{task.id}"] = by_name[task.name] = body
        out.update((f"{TASK_URI}{name}", body) for name, body in by_name.items())
        return out

    def baseline(self) -> None:
        """On a first follower: the contents that changes are told against (a few ms of
        reading, once). Then `wake`, from the loop's thread."""
        if self.seen is None:
            self.stamp = self._stamp()
            self.seen = self.look()

    def _stamp(self) -> object:
        self.store = self.store or open_store(self.home)
        return self.store.stamp()

    def wake(self) -> None:
        if self.someone is not None:
            self.someone.set()

    async def run(self) -> None:
        while True:
            if not self.following():
                self.seen, self.someone = None, anyio.Event()
                await self.someone.wait()  # nobody follows: no looks, no wake-ups
            await anyio.sleep(1.0)
            if not self.following():
                continue
            try:
                stamp = await anyio.to_thread.run_sync(self._stamp)
                if stamp == self.stamp and self.seen is not None:
                    continue
                now = await anyio.to_thread.run_sync(self.look)
            except (KugetsuError, OSError):
                continue  # a damaged index: the tools say so; look again after the next change
            self.stamp, before, self.seen = stamp, self.seen, now
            if before is None:
                continue
            changed = [uri for uri, body in now.items() if before.get(uri) != body]
            changed += [uri for uri in before if uri not in now]  # cleaned away
            await self.notify(changed)

    async def notify(self, uris: list[str]) -> None:
        for uri in uris:
            for key, session in list(self.sessions.get(uri, {}).items()):
                try:
                    await session.send_resource_updated(uri)
                except Exception:  # the connection is gone: so is its subscription
                    self.sessions[uri].pop(key, None)
            if self.listeners:
                await self.bus.publish(ResourceUpdated(uri=uri))

    async def subscribe(self, ctx: Any, params: SubscribeRequestParams) -> dict[str, Any]:
        uri = str(params.uri)
        if uri != QUEUE_URI and not uri.startswith(TASK_URI):
            raise ValueError(f"no resource {uri}; kugetsu has {QUEUE_URI} and {TASK_URI}{{id}}")
        self.sessions.setdefault(uri, {})[_connection_key(ctx.session)] = ctx.session
        await anyio.to_thread.run_sync(self.baseline)
        self.wake()
        return {}

    async def unsubscribe(self, ctx: Any, params: UnsubscribeRequestParams) -> dict[str, Any]:
        self.sessions.get(str(params.uri), {}).pop(_connection_key(ctx.session), None)
        return {}


class _CountingBus(InMemorySubscriptionBus):
    """The SDK's in-process bus, counting the open listen streams so the watcher knows
    whether anyone listens."""

    def __init__(self, follow: Follow):
        super().__init__()
        self._follow = follow

    def subscribe(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        self._follow.listeners += 1
        self._follow.baseline()  # once, on the first follower: a few ms of reading on the loop
        self._follow.wake()
        inner = super().subscribe(listener)
        done = False

        def unsubscribe() -> None:
            nonlocal done
            if not done:
                done = True
                self._follow.listeners -= 1
                inner()

        return unsubscribe


def _connection_key(session: Any) -> int:
    # A ServerSession is built per request; what identifies the client is its connection.
    return id(getattr(session, "_connection", session))


def build(home: Home) -> tuple[MCPServer, Follow]:
    """The server with its tools and resources, and the follower registry (whose `run`
    the caller runs beside the transport)."""
    follow = Follow(home)
    server = _Server(
        NAME,
        title=TITLE,
        instructions=INSTRUCTIONS,
        version=kugetsu.__version__,
        log_level="WARNING",
        subscriptions=follow.bus,
    )
    # The legacy subscribe methods (2025-11-25 and before): MCPServer serves only the
    # 2026-07-28 `subscriptions/listen`, and these are what today's clients send.
    low = server._lowlevel_server  # noqa: SLF001 (MCPServer has no public hook for them)
    low.add_request_handler("resources/subscribe", SubscribeRequestParams, follow.subscribe)
    low.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, follow.unsubscribe)

    # A module per tool group, each registering its tools on the server.
    tools_read.register(server, home)
    tools_tasks.register(server, home)
    tools_wait.register(server, home)

    # ---- resources -----------------------------------------------------------------------

    @server.resource(QUEUE_URI, name="queue", mime_type="application/json",
                     description="The queue tool's JSON: running and queued tasks, positions. Subscribe to be told"
                     " when it changes.")
    def queue_resource() -> str:
        cfg, index = reading.read(home)
        listed = reading.listing(cfg, index, home=home, limit=tools_read.QUEUE_LIMIT)  # as the queue tool's default
        return dumps(reading.queue_json(listed, home)).decode()

    @server.resource(TASK_URI + "{task}", name="task", mime_type="application/json",
                     description="One task's JSON (the status tool's), by id or name. Subscribe to be told when it"
                     " changes (state, position, exit).")
    def task_resource(task: str) -> str:
        cfg, index = reading.read(home)
        try:
            found = selection.find(index, task)
        except KugetsuError as err:
            raise ResourceNotFoundError(str(err)) from None
        return dumps(reading.status_json(home, index, cfg, found)).decode()  # the status tool's, measured use included

    for tool in server._tool_manager.list_tools():  # noqa: SLF001 (no public hook for the published schema)
        if tool.fn_metadata.output_schema is not None:
            tool.fn_metadata.output_schema = null_first(tool.fn_metadata.output_schema)
    server.refuse_writers(_nesting_refusal(home))
    return server, follow


def null_first(schema: Any) -> Any:
    """`schema` with each nullable value's branches as {"anyOf": [{"type": "null"}, S]}: the same
    schema (anyOf has no order), which a client's validator checks faster. It tries the
    branches in order, and most of a task's fields are null: with S first, each null field cost
    a failed branch and its error object (the SDK's own client validates every result against
    the output schema: 0.9 ms a delegate result, 90 ms a batch of 100, more than the admission;
    null first halves it). Output schemas only: the server validates arguments itself."""
    if isinstance(schema, list):
        return [null_first(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: null_first(v) for k, v in schema.items()}
    branches = out.get("anyOf")
    if isinstance(branches, list) and {"type": "null"} in branches[1:]:
        out["anyOf"] = [{"type": "null"}, *(b for b in branches if b != {"type": "null"})]
    return out


WRITERS = ("delegate", "cancel", "priority")  # the tools that change the queue (the others only read)


def _nesting_refusal(home: Home) -> str | None:
    """Why this server may not change the queue: it runs for an agent inside a task whose
    preset allows no (more) nesting (admission.check_nesting). None: it may."""
    ref = delegation.caller_task()
    if ref is None:
        return None
    try:
        _cfg, index = reading.read(home)
        admission.check_nesting(admission.parent_task(index, ref))
    except Nested as err:
        return str(err)
    except (KugetsuError, OSError):
        return None  # unreadable now: admission checks it again on each delegate
    return None


class _Server(MCPServer):
    """MCPServer whose tools answer a bad argument with one line in kugetsu's words (not the
    SDK's pydantic report), refuse unknown arguments naming the known ones, take a task id
    given as a number, and, for an agent that may not delegate, serve only the readers."""

    refusal: str | None = None

    def refuse_writers(self, refusal: str | None) -> None:
        self.refusal = refusal
        if refusal is not None:
            for name in WRITERS:
                self._tool_manager.remove_tool(name)

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        tool = self._tool_manager.get_tool(name)
        if tool is None and name in WRITERS and self.refusal is not None:
            return reply(f"{name}: kugetsu's tools only read here: {self.refusal}", error=True)
        if tool is None:
            return await super().call_tool(name, arguments, context)
        props: dict[str, Any] = tool.parameters.get("properties", {})
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return reply(f"{name}: {_unknown(unknown, list(props))}", error=True)
        arguments = {k: _as_refs(v, props[k]) for k, v in arguments.items()}
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as err:
            if not isinstance(err.__cause__, ValidationError):
                raise
            return reply(f"{name}: {_invalid(err.__cause__, props, tool.parameters.get('$defs'))}", error=True)


def _unknown(unknown: list[str], known: list[str]) -> str:
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]}?)" if close else ""))
    s = "s" if len(unknown) > 1 else ""
    return f"unknown argument{s} {', '.join(parts)}; it takes: {', '.join(known) or 'none'}"


def _as_refs(value: Any, schema: dict[str, Any]) -> Any:
    """A task id given as a number (every result gives ids as numbers) where the schema
    takes a task reference, a string: its digits."""
    def number(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if schema.get("type") == "string" and number(value):
        return str(value)
    if schema.get("type") == "array" and schema.get("items", {}).get("type") == "string" and isinstance(value, list):
        return [str(v) if number(v) else v for v in value]
    return value


# What a value must be, by the validator's error type (kugetsu's words; the field's schema
# fills in the choices and bounds).
_MUST = {
    "string_type": "a string", "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "list_type": "a list", "dict_type": "an object",
}
_NOUNS = {"task": "a task id or name (7, #7 or issue-16)", "tasks": "a list of task ids or names"}


def _item_props(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The properties of a list argument's items when they are objects (delegate's tasks)."""
    for branch in [schema, *schema.get("anyOf", [])]:
        ref = branch.get("items", {}).get("$ref", "")
        if ref.startswith("#/$defs/"):
            return defs.get(ref.removeprefix("#/$defs/"), {}).get("properties", {})
    return {}


def _non_null(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional value's schema ({anyOf: [S, null]}) as S, with the description."""
    some = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
    return {**some[0], **{k: v for k, v in schema.items() if k != "anyOf"}} if len(some) == 1 else schema


def _invalid(err: ValidationError, props: dict[str, Any], defs: dict[str, Any] | None = None) -> str:
    """One line for the arguments the validator refused: which, and what they must be. In a
    list of objects (delegate's tasks) the item and its key: tasks[2].priority."""
    by_field: dict[str, list[dict[str, Any]]] = {}
    schemas: dict[str, dict[str, Any]] = {}
    for e in err.errors():
        loc = e["loc"]
        key = str(loc[0]) if loc else ""
        item = _item_props(props.get(key, {}), defs or {}) if len(loc) >= 2 and isinstance(loc[1], int) else {}
        if item and e["type"] == "extra_forbidden":
            by_field.setdefault(f"{key}[{loc[1]}]", []).append({**e, "known": list(item)})
            continue
        if item and len(loc) >= 3 and isinstance(loc[2], str):
            key, e = f"{key}[{loc[1]}].{loc[2]}", {**e, "loc": (key, *loc[3:])}
            schemas[key] = _non_null(item.get(loc[2], {}))
        by_field.setdefault(key, []).append(e)
    parts = []
    for field, errors in by_field.items():
        e = errors[0]
        schema = schemas.get(field, props.get(field, {}))
        if e["type"] == "missing":
            parts.append(f"argument {field} is missing")
            continue
        if e["type"] == "extra_forbidden":
            parts.append(f"argument {field}: {_unknown([str(x['loc'][-1]) for x in errors], e['known'])}")
            continue
        where = field + "".join(f"[{p}]" for p in e["loc"][1:] if isinstance(p, int))
        ctx = e.get("ctx") or {}
        if len(errors) > 1 or e["type"] not in (*_MUST, "literal_error", "greater_than_equal", "less_than_equal",
                                                "too_short", "too_long", "greater_than", "less_than"):
            must = "a valid value" + (f" ({schema['description']})" if schema.get("description") else "")
        elif e["type"] == "literal_error":
            must = f"one of {', '.join(str(v) for v in schema.get('enum', []))}"
        elif e["type"] in ("greater_than_equal", "greater_than"):
            must = f"{ctx.get('ge', ctx.get('gt'))} or more" if "ge" in ctx else f"more than {ctx.get('gt')}"
        elif e["type"] in ("less_than_equal", "less_than"):
            must = f"{ctx.get('le', ctx.get('lt'))} or less" if "le" in ctx else f"less than {ctx.get('lt')}"
        elif e["type"] == "too_short":
            must = f"a list of at least {ctx.get('min_length')}"
        elif e["type"] == "too_long":
            must = f"a list of at most {ctx.get('max_length')}"
        elif where == field and field in _NOUNS:
            must = _NOUNS[field]
        else:
            must = _MUST[e["type"]]
        got = json.dumps(e.get("input"), default=str)
        parts.append(f"argument {where}: must be {must} (got {got[:40]}{'...' if len(got) > 40 else ''})")
    return "; ".join(parts).replace("\n", " ") + "; see the tool's input schema"


async def serve_stdio(server: MCPServer, follow: Follow, first: bytes, early: dict[str, Any] | None) -> None:
    """The SDK's stdio transport, after kugetsu.frontends.mcp.handshake read the client's first line
    (and perhaps answered it): that line is handed to the SDK first, and the SDK's answer to
    an `initialize` answered already is dropped, not sent twice."""
    from mcp.server.stdio import stdio_server
    from mcp.shared.message import SessionMessage
    from mcp_types import jsonrpc_message_adapter

    low = server._lowlevel_server  # noqa: SLF001 (the transport's streams are ours to wire)
    async with stdio_server() as (read, write):
        to_sdk, from_client = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        from_sdk, to_client = anyio.create_memory_object_stream[SessionMessage](0)

        async def client_in() -> None:
            async with to_sdk:
                if first.strip():
                    try:
                        await to_sdk.send(SessionMessage(jsonrpc_message_adapter.validate_json(first, by_name=False)))
                    except ValueError as err:  # as the SDK's reader hands on a line it cannot read
                        await to_sdk.send(err)
                async for message in read:
                    await to_sdk.send(message)

        async def client_out() -> None:
            pending = early
            async with to_client, write:  # closing `write` ends the transport's writer
                async for message in to_client:
                    if pending is not None and getattr(message.message, "id", None) == pending["id"]:
                        differs(pending, json.loads(message.message.model_dump_json(by_alias=True, exclude_unset=True)))
                        pending = None
                        continue
                    await write.send(message)

        async with anyio.create_task_group() as tg:
            tg.start_soon(follow.run)
            tg.start_soon(client_in)
            tg.start_soon(client_out)
            await low.run(from_client, from_sdk, low.create_initialization_options())  # until the client closes stdin
            tg.cancel_scope.cancel()
