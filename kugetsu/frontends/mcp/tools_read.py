"""The tools that only read: capacity, queue, status, logs, schedules, stats. Each is the CLI's
command through the same code: its structured content the CLI's --json, its text the
CLI's lines."""

from __future__ import annotations

from typing import Annotated, Literal

from mcp.server import MCPServer
from mcp.types import CallToolResult
from pydantic import Field

from kugetsu.app import control, machines, reading, recurring, transaction
from kugetsu.core import selection
from kugetsu.frontends import render
from kugetsu.frontends.mcp.models import CapacityOut, LogsOut, QueueOut, SchedulesOut, StatsOut, TaskOut
from kugetsu.frontends.mcp.tooling import READ_ONLY, Duration, TaskRef, answers, duration, reply
from kugetsu.paths import Home

LOG_BYTES = 16 * 1024  # the logs tool's default cap
LOG_BYTES_MAX = 1024 * 1024
# The queue tool's default `limit`: what an agent reads goes into its context, and 200 tasks
# (~100 KB of JSON) are already more than a PM acts on; the count of the rest is given.
QUEUE_LIMIT = 200


def register(server: MCPServer, home: Home) -> None:
    answered = answers(home)

    @server.tool(annotations=READ_ONLY)
    @answered
    def capacity() -> Annotated[CallToolResult, CapacityOut]:
        """Slots and queue now: how many agents run (active), how many slots are free, how many
        tasks wait (queued) and the queue's limit (max_queue). Call it before delegating a batch:
        with free > 0 the next task starts at once; when queued reaches max_queue, delegate is
        rejected, so send fewer or wait."""
        cfg, index = reading.read(home)
        control.ensure_service(home, cfg, index)
        return reply(render.summary(selection.capacity(index, cfg, transaction.now())), reading.capacity_json(cfg, index))

    @server.tool(annotations=READ_ONLY)
    @answered
    def queue(
        finished: Annotated[bool, Field(description="also the 20 latest finished tasks")] = False,
        group: Annotated[str | None, Field(description="only the tasks of this pool")] = None,
        state: Annotated[list[str] | None, Field(description="only tasks in these states (queued, running, a final"
                                                 " state, or finished for any final one)")] = None,
        source: Annotated[str | None, Field(description="only the tasks this source delegated (e.g. your"
                                            " own)")] = None,
        limit: Annotated[int, Field(ge=1, description="list at most this many queued tasks, the first in start"
                                    " order (the rest are counted in more_queued)")] = QUEUE_LIMIT,
    ) -> Annotated[CallToolResult, QueueOut]:
        """Every running task (slot, pid, elapsed time) and every queued one in the order they
        will start: position 1 starts next, and `waiting_for` says why a task waits when it is
        not simply behind others (a per-source or group limit, a rate limit, the resource guard).
        group, state and source keep only the tasks that match, at their true positions; a
        long queue is listed up to `limit` tasks, with how many more wait after them."""
        cfg, index = reading.read(home)
        control.ensure_service(home, cfg, index)
        keep = selection.task_filter(group, state, source)
        view = reading.listing(cfg, index, finished=finished, home=home, keep=None if keep == selection.TaskFilter() else keep,
                               limit=limit)
        return reply(render.queue_text(view, control.service_pid(home) is not None), reading.queue_json(view, home))

    @server.tool(annotations=READ_ONLY)
    @answered
    def status(task: TaskRef) -> Annotated[CallToolResult, TaskOut]:
        """One task in full: state (queued, running, succeeded, failed, cancelled, expired, lost),
        its position while queued, exit code and the reason it ended, its log file, its worktree
        branch."""
        cfg, index = reading.read(home)
        control.ensure_service(home, cfg, index)
        obj = reading.status_json(home, index, cfg, selection.find(index, task))
        return reply(render.task_lines(obj), obj)

    @server.tool(annotations=READ_ONLY)
    @answered
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
        return reply(shown, obj)

    @server.tool(annotations=READ_ONLY)
    @answered
    def schedules() -> Annotated[CallToolResult, SchedulesOut]:
        """The recurring schedules (`kugetsu schedule add`): each one's rule (cron or every),
        when it fires next, the task its last firing delegated and how that task stands or
        ended, and what its last firing did (skipped while its task still ran, not delegated
        because the queue was full). Each firing delegates a task named NAME-YYYYmmdd-HHMMSS."""
        cfg, index = reading.read(home)
        rows = recurring.schedules_json(cfg, index)
        return reply(render.schedules_table(rows, transaction.now()), {"schedules": rows})

    @server.tool(annotations=READ_ONLY)
    @answered
    def stats(
        by: Annotated[Literal["source", "agent", "group", "host", "day"] | None,
                      Field(description="one row per source, agent, group, host or local day")] = None,
        since: Annotated[Duration, Field(description="the window: the last 90m, 24h, 7d... (default 24h)")] = None,
    ) -> Annotated[CallToolResult, StatsOut]:
        """How it has been doing over a window (the last 24 hours by default): tasks by outcome,
        wait and run times, throughput, utilisation, and what the agents used: tokens in and
        out and cost (as they reported them), runs on a fallback preset, peak memory. Call it
        to see what your tasks cost today (by source or day) before delegating more."""
        from kugetsu.app import stats as history  # only this tool reads the history

        window = duration(since, "since") or history.DEFAULT_WINDOW
        cfg, index = reading.read(home)
        control.ensure_service(home, cfg, index)
        report = history.summarise(history.load(home, cfg, index, window, transaction.now()), by)
        return reply(history.render(report), report)
