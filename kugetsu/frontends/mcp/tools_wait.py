"""The wait tool: block until tasks are final, with progress notifications as their states
and positions change (app.waiting's looks, in a worker thread)."""

from __future__ import annotations

from typing import Annotated, Any

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.types import CallToolResult
from pydantic import Field

from kugetsu.app import control, reading, transaction, waiting
from kugetsu.config.model import Config
from kugetsu.config.units import format_duration
from kugetsu.core import selection
from kugetsu.core.models import Index, Task, TaskState
from kugetsu.errors import UsageError
from kugetsu.frontends.mcp.models import WaitOut
from kugetsu.frontends.mcp.tooling import READ_ONLY, answers, duration, in_thread, reply
from kugetsu.paths import Home


def register(server: MCPServer, home: Home) -> None:
    answered = answers(home)

    @server.tool(annotations=READ_ONLY)
    @answered
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
        seconds = duration(timeout, "timeout")
        if bool(tasks) == (group is not None):
            raise UsageError("name the tasks to wait for (ids or names), or a group (not both)")
        cfg, index = await in_thread(reading.read, home)
        await in_thread(control.ensure_service, home, cfg, index)
        ids = [selection.find(index, ref).id for ref in tasks] or [t.id for t in index.live() if t.group == group]
        stop = waiting.Stop()
        looks = waiting.looks(home, ids, seconds, settle=True, stop=stop)
        shown: list[tuple[Any, ...]] | None = None
        step = 0
        try:
            while (seen := await in_thread(next, looks, None)) is not None:
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
        return reply("\n".join(lines), {"done": done, "all_succeeded": ok, "advice": advice,
                                         "tasks": [reading.task_json(t, p, prompts=reading.prompts(home, [t])) for t, p in _awaited(cfg, index, ids)]})


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

