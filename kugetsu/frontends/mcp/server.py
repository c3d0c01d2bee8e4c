"""The MCP server: kugetsu's operations as tools for the agents that delegate (docs/architecture.md §11).

Every tool is the CLI's command through the same code (ops, pm, waiting, render): its
structured content is the JSON the CLI prints with --json, its text what the CLI prints
without. A bad argument, an unknown task or a failure is a tool error (isError) whose text
says what to fix; a refusal by admission (queue full, a per-source limit: the CLI's exit 3)
is a normal result that says to back off and try again later.

One long-lived process: the SDK, pydantic and kugetsu are imported once; config and index
are read per call, as the CLI reads them, so nothing here can be stale.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import os
from collections.abc import Callable
from typing import Annotated, Any

import anyio
import anyio.to_thread
import msgspec
from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError
from mcp.server.subscriptions import InMemorySubscriptionBus, ResourceUpdated
from mcp.types import CallToolResult, SubscribeRequestParams, TextContent, ToolAnnotations, UnsubscribeRequestParams
from pydantic import Field, ValidationError

import kugetsu
from kugetsu.app import control, delegation, machines, reading, recurring, transaction, verbs, waiting
from kugetsu.core import admission, selection
from kugetsu.frontends import render
from kugetsu.config.load import load_config
from kugetsu.config.model import Config
from kugetsu.config.units import format_duration, parse_duration, parse_size
from kugetsu.errors import KugetsuError, Nested, Rejected, UsageError
from kugetsu.frontends.mcp.identity import INSTRUCTIONS, NAME, TITLE, differs
from kugetsu.frontends.mcp.models import (
    CancelOut,
    CapacityOut,
    DelegateOut,
    Level,
    LogsOut,
    QueueOut,
    SchedulesOut,
    TaskOut,
    WaitOut,
)
from kugetsu.core.models import Index, Task, TaskState
from kugetsu.paths import Home, explain
from kugetsu.store.files import open_store
from kugetsu.store.protocol import StoreProtocol

BACK_OFF_S = 60  # what a rejected delegate suggests: "try again in a minute"
LOG_BYTES = 16 * 1024  # the logs tool's default cap
LOG_BYTES_MAX = 1024 * 1024
QUEUE_URI = "kugetsu://queue"
TASK_URI = "kugetsu://task/"

Duration = Annotated[
    str | float | None,
    Field(description="90s, 15m, 2h, 1d, or plain seconds; null: the config's default"),
]
TaskRef = Annotated[str, Field(description="a task id (7 or #7) or name (issue-16)")]


def _text(text: str, structured: dict[str, Any] | None = None, error: bool = False) -> CallToolResult:
    if structured is not None:
        structured = msgspec.to_builtins(structured)  # reading.queue_json's tasks are structs
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=structured, is_error=error)


def _duration(value: str | float | None, what: str) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value, what)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _size(value: str | int | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value, "memory")
    except ValueError as err:
        raise UsageError(str(err)) from None


def _task_json(home: Home, cfg: Any, index: Index, task: Task) -> dict[str, Any]:
    return reading.task_json(task, selection.positions(index, cfg, transaction.now()).get(task.id), prompts=reading.prompts(home, [task]))


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
        out = {QUEUE_URI: _dumps(reading.queue_json(view, known=self.prompts))}
        by_name: dict[str, bytes] = {}
        for task in tasks:  # a name means its live task, else its latest finished one
            body = _dumps(reading.task_json(task, view.positions.get(task.id), prompts=self.prompts))
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


def _dumps(obj: Any) -> bytes:
    return json.dumps(msgspec.to_builtins(obj), indent=2, ensure_ascii=False).encode()


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

    def answers(fn: Callable[..., Any]) -> Callable[..., Any]:
        """A KugetsuError (bad input, no such task, a damaged file) or a system error becomes
        a tool error whose text says what to fix, as the CLI's one line on stderr. The
        docstring, the tool's description, loses its indentation (tokens for nothing)."""

        def failed(err: Exception) -> CallToolResult:
            message = str(err) if isinstance(err, KugetsuError) else str(explain(home, err))  # type: ignore[arg-type]
            return _text(message, error=True)

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

    admitter = Admitter(home)
    read_only = ToolAnnotations(read_only_hint=True, open_world_hint=False)

    # ---- tools ---------------------------------------------------------------------------

    @server.tool(annotations=read_only)
    @answers
    def capacity() -> Annotated[CallToolResult, CapacityOut]:
        """Slots and queue now: how many agents run (active), how many slots are free, how many
        tasks wait (queued) and the queue's limit (max_queue). Call it before delegating a batch:
        with free > 0 the next task starts at once; when queued reaches max_queue, delegate is
        rejected, so send fewer or wait."""
        cfg, index = reading.read(home)
        control.ensure_service(home, cfg, index)
        return _text(render.summary(selection.capacity(index, cfg, transaction.now())), reading.capacity_json(cfg, index))

    @server.tool(annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=False, open_world_hint=True))
    @answers
    async def delegate(
        prompt: Annotated[str | None, Field(description="the instructions for the agent preset (the worker agent)")] = None,
        name: Annotated[str | None, Field(description="the task's name, e.g. your issue id (issue-16): 1-64 letters,"
                                          " digits, '.', '_', '-'; unique among queued and running tasks")] = None,
        source: Annotated[str, Field(description="who delegates (e.g. pm): shown everywhere, used by fair"
                                     " scheduling and per-source limits")] = "mcp",
        command: Annotated[list[str] | None, Field(min_length=1, description="run this argv instead of an agent"
                                                   " preset (no shell: one list element per argument)")] = None,
        agent: Annotated[str | None, Field(description="agent preset (config `agents`: opencode, claude, codex,"
                                           " ...); default: the config's default_agent")] = None,
        cwd: Annotated[str | None, Field(description="working directory (absolute); default: where the MCP"
                                         " server runs")] = None,
        priority: Annotated[Level, Field(description="matters under the priority and fair strategies")] = "normal",
        group: Annotated[str | None, Field(description="a pool (config `groups`) it must also have a slot in")] = None,
        expire_after: Duration = None,
        timeout: Annotated[str | float | None, Field(description="stop the agent after it ran this long (90s, 15m,"
                                                     " 2h, 1d or seconds); null: the config's run_timeout")] = None,
        worktree: Annotated[bool | None, Field(description="run in its own git worktree on branch kugetsu/NAME;"
                                               " null: as the preset and config say")] = None,
        base: Annotated[str | None, Field(description="with worktree: the git ref it starts from")] = None,
        retries: Annotated[int, Field(ge=0, le=100, description="run it again, as the same task, up to this many"
                                      " times when it fails or is lost (not when cancelled)")] = 0,
        retry_delay: Annotated[str | float | None, Field(description="wait this long before each retry (90s,"
                                                         " 15m or seconds)")] = None,
        fallback: Annotated[list[str] | None, Field(description="presets to start it on, in order, while `agent`"
                                                    " is held (its usage limit, its budget); null: the preset's"
                                                    " `fallback`")] = None,
        fallback_fresh: Annotated[bool | None, Field(description="a run interrupted with a session may start"
                                                     " afresh on a fallback (default: it waits to resume)")] = None,
        budget_usd: Annotated[float | None, Field(gt=0, description="stop it once its runs cost more (US dollars)")] = None,
        max_tokens: Annotated[int | None, Field(gt=0, description="stop it once its runs used more tokens (in + out)")] = None,
        memory: Annotated[str | int | None, Field(description="memory it may use (4G, 512M or bytes): it starts"
                                                  " when that fits the machine's max_memory; over it, it is"
                                                  " stopped. null: the preset's, else none")] = None,
        max_procs: Annotated[int | None, Field(ge=1, description="its processes at most (a fork storm is"
                                               " stopped); null: the preset's or the config's")] = None,
        slots: Annotated[int | None, Field(ge=1, le=64, description="slots of max_agents (and of its group) it"
                                           " takes; null: the preset's (1)")] = None,
        at: Annotated[str | None, Field(description="start no earlier than this time (02:00, 3pm, ISO 8601: the"
                                        " next one to come); it waits in the queue until then")] = None,
        delay: Annotated[str | float | None, Field(description="start no earlier than this long from now (30m, 2h"
                                                   " or seconds)")] = None,
        env: Annotated[dict[str, str] | None, Field(description="extra environment variables for the agent"
                                                    " (NAME: value; not KUGETSU_*). Only their names are ever shown"
                                                    " (env_names)")] = None,
    ) -> Annotated[CallToolResult, DelegateOut]:
        """Hand one piece of work (one issue) to a worker agent. kugetsu starts it at once in a
        free slot or queues it, and says which: "started NAME (#ID), slot 2/3" or "queued NAME
        (#ID), position 4 of 4". Give `prompt` (the agent preset runs with it) or `command`.
        Name it after your issue and set `source` so you can refer to it later (status, wait,
        logs take the name).
        When the queue is full (or your source hit its limit) the result is "rejected" with
        admitted=false: nothing was queued. That is back-pressure, not an error: do not retry
        at once; wait about a minute (or `wait` for one of your running tasks) and delegate again.
        A tool error means a bad argument (name taken or invalid, unknown preset, bad duration,
        cwd missing): fix it and call again."""
        req = admission.Request(
            cwd=os.path.abspath(cwd or os.getcwd()), name=name, command=command, prompt=prompt, agent=agent,
            source=source, priority=priority, group=group, expire_after=_duration(expire_after, "expire_after"),
            timeout=_duration(timeout, "timeout"), worktree=worktree, base=base, retries=retries,
            retry_delay=_duration(retry_delay, "retry_delay"), fallback=fallback, fallback_fresh=fallback_fresh,
            budget_usd=budget_usd, max_tokens=max_tokens, memory=_size(memory), max_procs=max_procs, slots=slots,
            start_at=delegation.start_time(at, _duration(delay, "delay"), "at"), env=dict(env or {}),
        )
        try:
            adm = await admitter.admit(req)
        except Rejected as err:
            line = f"rejected: {err}"
            advice = (f"Nothing was queued. Back off: try again in about {BACK_OFF_S}s (or after one of your"
                      " tasks ends); do not retry at once.")
            return _text(f"{line}. {advice}", {"admitted": False, "task": None, "rejected": str(err),
                                              "retry_after": BACK_OFF_S, "message": line, "advice": advice})
        line = render.admitted(adm.task, adm.position, adm.queued, adm.max_agents, adm.waiting_for)
        task = reading.task_json(adm.task, adm.position, prompts=reading.prompts(home, [adm.task]))
        advice = (f"It runs on its own; call wait with {adm.task.name!r} (or {adm.task.id}) when you need its"
                  " result, then logs if it did not succeed.")
        text = line
        unused = admission.unused_prompt_text(load_config(home), req, "`command`")  # as the CLI warns
        if unused:
            warning = f"warning: {unused}"
            text, advice = f"{line}\n{warning}", f"{warning}. {advice}"
        return _text(text, {"admitted": True, "task": task, "rejected": None, "retry_after": None,
                            "message": line, "advice": advice})

    @server.tool(annotations=read_only)
    @answers
    def queue(
        finished: Annotated[bool, Field(description="also the 20 latest finished tasks")] = False,
        group: Annotated[str | None, Field(description="only the tasks of this pool")] = None,
        state: Annotated[list[str] | None, Field(description="only tasks in these states (queued, running, a final"
                                                 " state, or finished for any final one)")] = None,
        source: Annotated[str | None, Field(description="only the tasks this source delegated (e.g. your"
                                            " own)")] = None,
    ) -> Annotated[CallToolResult, QueueOut]:
        """Every running task (slot, pid, elapsed time) and every queued one in the order they
        will start: position 1 starts next, and `waiting_for` says why a task waits when it is
        not simply behind others (a per-source or group limit, a rate limit, the resource guard).
        group, state and source keep only the tasks that match, at their true positions."""
        cfg, index = reading.read(home)
        control.ensure_service(home, cfg, index)
        keep = selection.task_filter(group, state, source)
        view = reading.listing(cfg, index, finished=finished, home=home, keep=None if keep == selection.TaskFilter() else keep)
        return _text(render.queue_text(view, control.service_pid(home) is not None), reading.queue_json(view, home))

    @server.tool(annotations=read_only)
    @answers
    def status(task: TaskRef) -> Annotated[CallToolResult, TaskOut]:
        """One task in full: state (queued, running, succeeded, failed, cancelled, expired, lost),
        its position while queued, exit code and the reason it ended, its log file, its worktree
        branch."""
        cfg, index = reading.read(home)
        control.ensure_service(home, cfg, index)
        obj = reading.status_json(home, index, cfg, selection.find(index, task))
        return _text(render.task_lines(obj), obj)

    @server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=False, open_world_hint=False))
    @answers
    async def cancel(
        tasks: Annotated[list[str], Field(description="task ids or names")] = [],  # noqa: B006 (pydantic copies it)
        all: Annotated[bool, Field(description="every queued and running task (of every source)")] = False,
    ) -> Annotated[CallToolResult, CancelOut]:
        """Cancel tasks you no longer want. A queued task is removed from the queue at once; a
        running one gets SIGTERM to its whole process group (SIGKILL after kill_grace), and this
        returns once it is final, its slot handed to the next task. To stop waiting for a task,
        do not cancel it: cancel the `wait` call instead."""
        if not tasks and not all:
            raise UsageError("name the tasks to cancel (ids or names), or set all: true")
        stop = waiting.Stop()
        try:
            out = await _in_thread(functools.partial(
                waiting.cancel, home, tasks, everything=all, reason="cancelled by mcp", stop=stop))
        finally:
            stop.set()
        return _text(render.cancelled(out), {"tasks": reading.tasks_json(out, prompts=reading.prompts(home, out))})

    @server.tool(annotations=read_only)
    @answers
    async def wait(
        ctx: Context,
        tasks: Annotated[list[str], Field(description="task ids or names")] = [],  # noqa: B006 (pydantic copies it)
        group: Annotated[str | None, Field(description="instead of tasks: every task of this pool queued or"
                                           " running now (e.g. a batch you delegated with group)")] = None,
        timeout: Annotated[str | float | None, Field(description="give up waiting after this long (90s, 15m,"
                                                     " 2h or seconds); null: until they are final")] = None,
    ) -> Annotated[CallToolResult, WaitOut]:
        """Block until the tasks are final (succeeded, failed, cancelled, expired or lost) or the
        timeout passes, sending progress notifications as their states and queue positions
        change. The result gives each task's final state; all_succeeded is true only if every
        one succeeded: read `logs` of the others. done=false means the timeout came first: the
        tasks go on, call wait again. If your client limits how long a tool call may take, pass
        a timeout below that limit (e.g. 10m). Cancelling this call only stops the waiting;
        the tasks are never touched."""
        seconds = _duration(timeout, "timeout")
        if bool(tasks) == (group is not None):
            raise UsageError("name the tasks to wait for (ids or names), or a group (not both)")
        cfg, index = await _in_thread(reading.read, home)
        await _in_thread(control.ensure_service, home, cfg, index)
        ids = [selection.find(index, ref).id for ref in tasks] or [t.id for t in index.live() if t.group == group]
        stop = waiting.Stop()
        looks = waiting.looks(home, ids, seconds, settle=True, stop=stop)
        shown: list[tuple[Any, ...]] | None = None
        step = 0
        try:
            while (seen := await _in_thread(next, looks, None)) is not None:
                index = seen
                now = [_where(t, p) for t, p in _awaited(cfg, index, ids)]
                if now != shown:
                    shown, step = now, step + 1
                    await ctx.report_progress(step, None, _progress(now))
        finally:
            stop.set()
        found = {t.id: t for t in index.all_tasks()}
        out = [found[i] for i in ids if i in found]
        done = waiting.all_final(index, ids)
        ok = done and all(t.state is TaskState.SUCCEEDED for t in out)
        lines = [_final_line(t) for t in out]
        advice = None
        if not done:
            advice = f"timed out after {format_duration(seconds or 0)} while they go on: call wait again to keep waiting"
            lines.append(advice)
        elif not ok:
            failed = ", ".join(t.name for t in out if t.state is not TaskState.SUCCEEDED)
            advice = f"not all succeeded: read logs (and status, for the reason) of {failed} before you retry or report"
        return _text("\n".join(lines), {"done": done, "all_succeeded": ok, "advice": advice,
                                        "tasks": [reading.task_json(t, p, prompts=reading.prompts(home, [t])) for t, p in _awaited(cfg, index, ids)]})

    @server.tool(annotations=read_only)
    @answers
    def logs(
        task: TaskRef,
        lines: Annotated[int | None, Field(ge=0, description="only the last N lines (default: as much as"
                                           " max_bytes allows)")] = None,
        max_bytes: Annotated[int, Field(ge=1, le=LOG_BYTES_MAX, description="read at most this many bytes from"
                                        " the end of the log")] = LOG_BYTES,
        raw: Annotated[bool, Field(description="the agent's structured output (JSON lines) as it is, not as"
                                   " text")] = False,
    ) -> Annotated[CallToolResult, LogsOut]:
        """The end of a task's output (its agent's stdout and stderr), bounded: the last `lines`
        lines within the last `max_bytes` bytes (16 KiB by default). Read it when a task
        failed, before you retry it or fix the issue yourself. A queued task has no output yet."""
        cfg, index = reading.read(home)
        found = selection.find(index, task)
        obj = machines.log_json(home, cfg, found, lines, max_bytes, raw)
        shown = obj["text"] if obj["size"] else f"(no output yet: {found.name} is {found.state.value})"
        return _text(shown, obj)

    @server.tool(annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=True, open_world_hint=False))
    @answers
    def priority(
        task: TaskRef,
        level: Annotated[Level, Field(description="urgent > high > normal > low")],
    ) -> Annotated[CallToolResult, TaskOut]:
        """Change a queued task's priority. It moves ahead under the priority and fair
        strategies (not under fifo); the result gives its new position."""
        changed, position = verbs.set_priority(home, task, level)
        return _text(render.priority_changed(changed, position), reading.task_json(changed, position, prompts=reading.prompts(home, [changed])))

    @server.tool(annotations=read_only)
    @answers
    def schedules() -> Annotated[CallToolResult, SchedulesOut]:
        """The recurring schedules (`kugetsu schedule add`): each one's rule (cron or every),
        when it fires next, the task its last firing delegated and how that task stands or
        ended, and what its last firing did (skipped while its task still ran, not delegated
        because the queue was full). Each firing delegates a task named NAME-YYYYmmdd-HHMMSS."""
        cfg, index = reading.read(home)
        rows = recurring.schedules_json(cfg, index)
        return _text(render.schedules_table(rows, transaction.now()), {"schedules": rows})

    # ---- resources -----------------------------------------------------------------------

    @server.resource(QUEUE_URI, name="queue", mime_type="application/json",
                     description="The queue tool's JSON: running and queued tasks, positions. Subscribe to be told"
                     " when it changes.")
    def queue_resource() -> str:
        cfg, index = reading.read(home)
        return _dumps(reading.queue_json(reading.listing(cfg, index), home)).decode()

    @server.resource(TASK_URI + "{task}", name="task", mime_type="application/json",
                     description="One task's JSON (the status tool's), by id or name. Subscribe to be told when it"
                     " changes (state, position, exit).")
    def task_resource(task: str) -> str:
        cfg, index = reading.read(home)
        try:
            found = selection.find(index, task)
        except KugetsuError as err:
            raise ResourceNotFoundError(str(err)) from None
        return _dumps(_task_json(home, cfg, index, found)).decode()

    server.refuse_writers(_nesting_refusal(home))
    return server, follow


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
            return _text(f"{name}: kugetsu's tools only read here: {self.refusal}", error=True)
        if tool is None:
            return await super().call_tool(name, arguments, context)
        props: dict[str, Any] = tool.parameters.get("properties", {})
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return _text(f"{name}: {_unknown(unknown, list(props))}", error=True)
        arguments = {k: _as_refs(v, props[k]) for k, v in arguments.items()}
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as err:
            if not isinstance(err.__cause__, ValidationError):
                raise
            return _text(f"{name}: {_invalid(err.__cause__, props)}", error=True)


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


def _invalid(err: ValidationError, props: dict[str, Any]) -> str:
    """One line for the arguments the validator refused: which, and what they must be."""
    by_field: dict[str, list[dict[str, Any]]] = {}
    for e in err.errors():
        by_field.setdefault(str(e["loc"][0]) if e["loc"] else "", []).append(e)
    parts = []
    for field, errors in by_field.items():
        e = errors[0]
        schema = props.get(field, {})
        if e["type"] == "missing":
            parts.append(f"argument {field} is missing")
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


class Admitter:
    """Concurrent delegate calls share transactions: while one batch is being admitted (a
    locked, fsync'd write), the calls that arrive wait, then go in together as the next
    batch (delegation.delegate_many: each as if alone, in order of arrival). A lone call is a batch
    of one, with no delay; a client with calls in flight pays one write per batch instead of
    one per task, which only a long-lived process can offer."""

    def __init__(self, home: Home):
        self.home = home
        self.pending: list[_Entry] = []
        self.lock = anyio.Lock()

    async def admit(self, req: admission.Request) -> delegation.Admission:
        entry = _Entry(req)
        self.pending.append(entry)
        try:
            async with self.lock:
                if not entry.done:  # not taken by the batch before: lead the next one
                    batch, self.pending = self.pending, []
                    with anyio.CancelScope(shield=True):  # a batch, once begun, hands out every result
                        try:
                            results = await anyio.to_thread.run_sync(self._admit, [e.req for e in batch])
                        except Exception as err:  # a failure of the whole transaction: everyone's
                            results = [err] * len(batch)
                        for e, result in zip(batch, results):
                            e.result, e.done = result, True
        except anyio.get_cancelled_exc_class():
            if entry in self.pending:  # cancelled before its batch began: it is not admitted
                self.pending.remove(entry)
            raise
        if isinstance(entry.result, Exception):
            raise entry.result
        return entry.result

    def _admit(self, reqs: list[admission.Request]) -> list[Any]:
        return delegation.delegate_many(self.home, load_config(self.home), reqs)


class _Entry:
    def __init__(self, req: admission.Request):
        self.req = req
        self.done = False
        self.result: Any = None


# Waits hold a worker thread for up to a second between looks: their own pool, so a few
# dozen waiting calls never starve the other tools of threads.
_WAITS = anyio.CapacityLimiter(256)


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread; a cancelled call returns at once (the thread ends on
    its own, the waits at once since their Stop is set)."""
    return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=_WAITS)


def _awaited(cfg: Config, index: Index, ids: list[int]) -> list[tuple[Task, int | None]]:
    found = {t.id: t for t in index.all_tasks()}
    positions = selection.positions(index, cfg, transaction.now()) if index.queued else {}
    return [(found[i], positions.get(i)) for i in ids if i in found]


def _where(task: Task, position: int | None) -> tuple[Any, ...]:
    return task.id, task.name, task.state.value, position, task.run.slot if task.run else None


def _progress(rows: list[tuple[Any, ...]]) -> str:
    """`2 of 3 final: issue-1 succeeded; issue-2 running (slot 1); issue-3 queued, position 1`."""
    final = sum(1 for r in rows if TaskState(r[2]).final)
    parts = []
    for _id, name, state, position, slot in rows[:20]:
        where = f", position {position}" if state == "queued" else f" (slot {slot})" if state == "running" else ""
        parts.append(f"{name} {state}{where}")
    more = f"; and {len(rows) - 20} more" if len(rows) > 20 else ""
    return f"{final} of {len(rows)} final: " + "; ".join(parts) + more


def _final_line(t: Task) -> str:
    line = f"{t.name} (#{t.id}) {t.state.value}" + (f": {t.reason}" if t.reason else "")
    if t.state.final and t.state is not TaskState.SUCCEEDED:
        line += " (read its logs)"
    return line


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
