"""What the dashboard shows, as plain rows of text: pure functions of an Index, a Config and a
clock, so the layout code stays small and the wording is testable without a terminal.

Order and positions always come from pm (the scheduler's own order), never from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, tzinfo

from kugetsu.core import policy, selection, step
from kugetsu.config.keys import mask_secrets
from kugetsu.core.models import Event, Index, Task
from kugetsu.frontends.render import agent_text, since, until

FINISHED_SHOWN = 50


@dataclass(frozen=True)
class Row:
    key: str
    style: str  # a state name, or "stopping"; the table colours the row by it
    cells: tuple[str, ...]


RUNNING_COLUMNS = (("id", "ID"), ("name", "NAME"), ("source", "SOURCE"), ("agent", "AGENT"),
                   ("started", "STARTED"), ("elapsed", "ELAPSED"), ("pid", "PID"), ("state", "STATE"))
QUEUE_COLUMNS = (("pos", "POS"), ("id", "ID"), ("name", "NAME"), ("priority", "PRIORITY"),
                 ("source", "SOURCE"), ("group", "GROUP"), ("waiting", "WAITING"), ("expires", "EXPIRES"),
                 ("why", "WAITING FOR"))
FINISHED_COLUMNS = (("id", "ID"), ("name", "NAME"), ("state", "STATE"), ("exit", "EXIT"),
                    ("ended", "ENDED"), ("reason", "REASON"))
EVENT_COLUMNS = (("time", "TIME"), ("type", "EVENT"), ("task", "TASK"), ("reason", "DETAIL"))


def clock_time(t: datetime | None, now: datetime, tz: tzinfo | None) -> str:
    """HH:MM:SS today, else the date too: a start time a person can place."""
    if t is None:
        return "-"
    try:
        local, today = t.astimezone(tz), now.astimezone(tz)
    except (OverflowError, ValueError):  # a recorded time at the end of what the zone holds
        return t.isoformat()
    return local.strftime("%H:%M:%S" if local.date() == today.date() else "%m-%d %H:%M")


def task_style(task: Task) -> str:
    if task.state.final:
        return task.state.value
    run = task.run
    if run is None:
        return task.state.value
    return "stopping" if run.stop is not None else "paused" if run.paused_at is not None else task.state.value


def running_rows(queue: selection.QueueView, now: datetime, tz: tzinfo | None) -> list[Row]:
    return [
        Row(str(t.id), task_style(t), (str(t.id), t.name, t.source, agent_text(t.agent, t.fallback_from), clock_time(t.started_at, now, tz),
                                       since(t.started_at, now), str(t.run.pid) if t.run.pid else "starting",
                                       task_style(t)))
        for t in queue.running
    ]


def queue_rows(queue: selection.QueueView, now: datetime) -> list[Row]:
    """WAITING: how long it has waited; WAITING FOR: why, when it is not simply behind others
    (`starts at 02:00`, its dependencies, a group full), as `queue`'s WAITING FOR says."""
    return [
        Row(str(t.id), t.state.value, (str(queue.positions.get(t.id, "-")), str(t.id), t.name, t.priority, t.source,
                                       t.group or "-", since(t.created_at, now),
                                       "-" if t.stashed_at else until(t.expires_at, now),
                                       queue.waiting_for.get(t.id, "")))
        for t in queue.queued
    ]


def finished_rows(index: Index, now: datetime) -> list[Row]:
    return [
        Row(str(t.id), t.state.value, (str(t.id), t.name, t.state.value, "-" if t.exit_code is None else str(t.exit_code),
                                       since(t.finished_at, now) + " ago", t.reason or ""))
        for t in reversed(index.finished[-FINISHED_SHOWN:])
    ]


def event_rows(events: list[Event], now: datetime, tz: tzinfo | None) -> list[Row]:
    return [Row(str(e.seq), e.type, (clock_time(e.at, now, tz), e.type, _event_task(e), _event_detail(e))) for e in events]


def _event_task(e: Event) -> str:
    if e.task is None:
        return "-"
    # A schedule's event names the schedule, not its task (the detail names the task).
    return f"#{e.task} {e.name}" if e.name and e.type != "schedule" else f"#{e.task}"


def _event_detail(e: Event) -> str:
    if e.type == "config":  # masked again: an event recorded by an older kugetsu may hold a URL's password
        return f"{e.key} = {mask_secrets(e.value, e.key or '')}"
    if e.type == "queued" and e.position is not None:
        return f"position {e.position}"
    if e.type == "started" and e.slot is not None:
        return f"slot {e.slot}"
    if e.type in ("paused", "resumed"):  # `kugetsu pause` / `resume`: of a group, or of every start
        return f"group {e.value}" if e.value else "every start"
    if e.type == "edited" and e.key:
        return f"changed {e.key.replace(',', ', ')}"
    if e.type == "schedule":  # added, paused, a firing's outcome (delegated, skipped, not delegated)
        return f"{e.name}: {e.reason}"
    if e.type == "worktree" and not e.reason and e.worktree_state:
        return f"worktree {e.worktree_state}"
    return e.reason or ""


def summary(cap: selection.Capacity, service_pid: int | None, measured: dict[int, step.Measured] | None = None) -> str:
    service = f"service running (pid {service_pid})" if service_pid else "service not running"
    from kugetsu.frontends.render import budgets_line, holds_line, paused_note

    text = (f"{cap.active}/{cap.max_agents} running · {cap.queued} queued · max queue {cap.max_queue}"
            f"{paused_note(cap)} · {service}")
    if cap.max_memory:  # once a task declares memory: what is declared of the budget
        text += f" · memory {policy.short_size(cap.memory_used or 0)} of {policy.short_size(cap.max_memory)} declared"
    if measured:  # what the running tasks use, as last measured
        text += f" · using {policy.short_size(sum(m.memory for m in measured.values()))}"
    if cap.holds:  # a provider's limit, or a hold by hand: its tasks wait, and for how long
        text += " · " + holds_line(cap)
    if any(b.over for b in cap.budgets):  # a daily budget spent: its tasks wait until midnight
        text += " · " + budgets_line(cap)
    return text


def task_title(task: Task | None, measured: dict[int, step.Measured] | None = None) -> str:
    """The Output pane's title: whose output, and how that task stands (running: its memory
    now and at its peak, as last measured; final: its peak, on its record)."""
    if task is None:
        return "Output"
    state = task_style(task)
    if task.state.final and task.reason:
        state = f"{state}: {task.reason}"
    m = (measured or {}).get(task.id) if not task.state.final else None
    if m is not None:
        from kugetsu.frontends.render import memory_cell

        state += f" · {memory_cell(task, m)}"
    elif task.state.final and task.peak_memory:
        state += f" · peak {policy.short_size(task.peak_memory)}"
    return f"Output · {task.name} (#{task.id}) · {state}"
