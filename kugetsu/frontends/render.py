"""Human-readable text for tasks and queues, shared by the CLI and the demo."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from kugetsu.config.units import format_duration, format_size
from kugetsu.service import runner
from kugetsu.core.models import Task
from kugetsu.core.policy import short_size
from kugetsu.core.selection import Capacity
from kugetsu.core.step import Measured
from kugetsu.frontends.text import printable

if TYPE_CHECKING:  # render shows what ops lists; ops does not need render
    from kugetsu.app.reading import Listing


def table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:  # type: ignore[assignment]
    rows = [[printable(c, lines=False) for c in r] for r in rows]  # one line a row, measured as shown
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def cut(text: str, width: int) -> str:
    """`text` in at most `width` characters, a cut one ending in "…" (it says there is more:
    `status TASK` shows it whole)."""
    return text if len(text) <= width else text[: width - 1] + "…"


def since(t: datetime | None, now: datetime | None) -> str:
    return format_duration((now - t).total_seconds()) if t and now else "-"


def until(t: datetime | None, now: datetime) -> str:
    if t is None:
        return "never"
    return format_duration((t - now).total_seconds()) if t > now else "due"


def summary(cap: Capacity) -> str:
    text = (f"{cap.active}/{cap.max_agents} running, {cap.free} free, {cap.queued} queued (max {cap.max_queue})"
            + paused_note(cap))
    if cap.max_memory:
        text += f", memory {short_size(cap.memory_used or 0)} of {short_size(cap.max_memory)} declared"
    return text + ("\n" + holds_line(cap) if cap.holds else "") + ("\n" + budgets_line(cap) if cap.budgets else "")


def budgets_line(cap: Capacity) -> str:
    """The daily budgets: `budgets today: pm 12.40/20.00 USD · claude 30,000/1,000,000 tokens (over)`."""
    parts = []
    for b in cap.budgets:
        figures = []
        if b.usd is not None:
            figures.append(f"{b.spent_usd or 0:.2f}/{b.usd:.2f} USD")
        if b.tokens is not None:
            figures.append(f"{b.spent_tokens:,}/{b.tokens:,} tokens")
        parts.append(f"{b.name} {', '.join(figures)}" + (" (over: none starts until 00:00)" if b.over else ""))
    return "budgets today: " + " · ".join(parts)


def holds_line(cap: Capacity) -> str:
    """Presets held now: `held: claude usage limit until 15:00, 4 tasks waiting` (a hold's
    reason names its preset)."""
    from kugetsu.core.times import clock

    # A hold's end is shown with its date when it is more than a day after the hold began
    # (so more than a day from now, too).
    parts = [f"{h.reason} " + (f"until {clock(h.until, h.since)}" if h.until else "until released")
             + f", {h.queued} task{'' if h.queued == 1 else 's'} waiting" for h in cap.holds.values()]
    return "held: " + " · ".join(parts)


def paused_note(cap: Capacity) -> str:
    """` · paused ...` when `kugetsu pause` holds starts (every front end's summary says it)."""
    if cap.paused:
        return " · paused: no queued task starts"
    if cap.paused_groups:
        return f" · paused: group {', '.join(cap.paused_groups)}"
    return ""


def agent_text(agent: str | None, fallback_from: str | None) -> str:
    """A task's preset as shown: `codex (fallback from claude)` when its failover order moved it."""
    if agent is None:
        return "-"
    return f"{agent} (fallback from {fallback_from})" if fallback_from else agent


def memory_cell(task: Task, m: Measured | None) -> str:
    """A running task's memory as the queue shows it: now, its peak, of what it declared."""
    limit = f" of {short_size(task.memory)}" if task.memory else ""
    if m is None:
        return f"-{limit}" if limit else "-"
    return f"{short_size(m.memory)} (peak {short_size(max(m.peak, task.peak_memory or 0))}){limit}"


def run_state(task: Task) -> str:
    """A running task's STATE column: `stopping` while its processes end, `paused` while they
    are stopped (`pause TASK`), else `running`."""
    return "stopping" if task.run.stop else "paused" if task.run.paused_at else "running"


COMMAND_WIDTH = 40  # the queue's last column: enough to tell tasks apart; `status` shows it whole


def running_table(tasks: list[Task], now: datetime, here: str | None = None,
                  measured: dict[int, Measured] | None = None) -> str:
    """`here`: this machine, in a cluster: another machine's agents are shown by their
    wrapper's pid there (this machine's /proc knows nothing of them). `measured`: their use,
    as the service last measured it (a MEM column)."""
    rows = [
        [str(t.run.slot or "-"), str(t.id), t.name, t.source, agent_text(t.agent, t.fallback_from), since(t.started_at, now),
         str((runner.agent_pid(t.run.pid, t.run.pid_start) if t.host in (None, here) else None) or t.run.pid or "starting"),
         run_state(t), command_text(t, COMMAND_WIDTH)]
        for t in tasks
    ]
    headers = ["SLOT", "ID", "NAME", "SOURCE", "AGENT", "ELAPSED", "PID", "STATE", "COMMAND"]
    if any(t.host for t in tasks):  # a cluster: which machine runs it
        headers.insert(1, "HOST")
        for row, t in zip(rows, tasks):
            row.insert(1, t.host or "-")
    if any(t.branch for t in tasks):  # worktree tasks: where their work goes
        headers.insert(-2, "BRANCH")
        for row, t in zip(rows, tasks):
            row.insert(-2, t.branch or "-")
    if measured or any(t.memory for t in tasks):
        headers.insert(-2, "MEM")
        for row, t in zip(rows, tasks):
            row.insert(-2, memory_cell(t, (measured or {}).get(t.id)))
    return table(headers, rows, right={0, 1})


def queued_table(
    tasks: list[Task], positions: dict[int, int], now: datetime, waiting_for: dict[int, str] | None = None
) -> str:
    """`waiting_for`: why a task waits when it is not simply behind others (selection.waiting_for)."""
    why = waiting_for or {}
    grouped = any(t.group for t in tasks)
    rows = [
        [str(positions.get(t.id, "-")), str(t.id), t.name, t.priority, t.source]
        + ([t.group or "-"] if grouped else [])
        + [since(t.created_at, now), "-" if t.stashed_at else until(t.expires_at, now)]  # a stash does not expire
        + ([why.get(t.id, "")] if why else [])
        + [command_text(t, COMMAND_WIDTH)]
        for t in tasks
    ]
    headers = ["POS", "ID", "NAME", "PRIORITY", "SOURCE"] + (["GROUP"] if grouped else [])
    headers += ["WAITING", "EXPIRES IN"] + (["WAITING FOR"] if why else []) + ["COMMAND"]
    return table(headers, rows, right={0, 1})


def groups_line(usage: dict[str, dict[str, int]]) -> str:
    """Per-group usage under the summary: `groups: gpu 1/1 running, 2 queued · cpu 0/4 ...`."""
    parts = [f"{name} {u['active']}/{u['max_agents']} running, {u['queued']} queued" for name, u in usage.items()]
    return "groups: " + " · ".join(parts)


def finished_table(tasks: list[Task], now: datetime) -> str:
    rows = [
        [str(t.id), t.name, t.state.value, "-" if t.exit_code is None else str(t.exit_code),
         since(t.started_at, t.finished_at) if t.started_at and t.finished_at else "-",
         since(t.finished_at, now) + " ago", cut(t.reason or "", 60)]
        for t in tasks
    ]
    headers = ["ID", "NAME", "STATE", "EXIT", "RAN", "ENDED", "REASON"]
    if any(t.branch for t in tasks):
        headers.insert(-1, "WORKTREE")
        for row, t in zip(rows, tasks):
            row.insert(-1, f"{t.worktree_state} {t.branch}" if t.worktree_state else (t.branch or "-"))
            row[-1] = cut(t.reason or "", 90)  # "work kept on branch ..." is worth the width
    return table(headers, rows, right={0})


def worktrees_table(rows: list[dict[str, Any]], now: datetime) -> str:
    from datetime import datetime as dt

    out = [
        [str(r["task"] or "-"), r["name"] or "(no task)", r["state"] or "-", r["branch"] or "-",
         format_size(r["size"]), since(dt.fromisoformat(r["created_at"]), now), r["path"]]
        for r in rows
    ]
    return table(["ID", "TASK", "STATE", "BRANCH", "SIZE", "AGE", "PATH"], out, right={0, 4})



def queue_text(listed: Listing, service_running: bool = True) -> str:
    """`kugetsu queue`, from an reading.Listing (its selection.QueueView and the finished tasks)."""
    view, now = listed.view, listed.now
    parts = [summary(view.capacity) + ("" if service_running else " · service not running")]
    if view.groups:
        parts.append(groups_line(view.groups))
    if view.running:
        parts.append("\nRUNNING\n" + running_table(view.running, now, listed.here, listed.measured))
    if view.queued:
        parts.append("\nQUEUED\n" + queued_table(view.queued, view.positions, now, view.waiting_for))
    if view.more:
        parts.append(f"... and {view.more:,} more queued (`queue` without --limit lists them all)")
    if listed.finished:
        parts.append("\nFINISHED (latest first)\n" + finished_table(listed.finished, now))
    return "\n".join(parts)


def admitted(task: Task, position: int | None, queued: int, max_agents: int, waiting_for: str | None) -> str:
    """What `kugetsu delegate` says: started in a slot, or queued at a position."""
    branch = f", worktree on branch {task.branch}" if task.branch else ""
    if position is None:
        return f"started {task.name} (#{task.id}), slot {task.run.slot}/{max_agents}{branch}"
    return (f"queued {task.name} (#{task.id}), position {position} of {queued}{branch}"
            + (f"; waiting for: {waiting_for}" if waiting_for else ""))


def priority_changed(task: Task, position: int | None) -> str:
    if position is None:  # it started as part of the change
        return f"{task.name} (#{task.id}) priority {task.priority}, started"
    return f"{task.name} (#{task.id}) priority {task.priority}, position {position}"


def cancelled(tasks: list[Task]) -> str:
    """What `kugetsu cancel` says, a line a task."""
    if not tasks:
        return "nothing to cancel"
    return "\n".join(f"{t.state.value} {t.name} (#{t.id})" + ("" if t.state.final else " (still stopping)") for t in tasks)


_QUIET_AT_DEFAULT = frozenset(("fallback_fresh", "paused_s"))  # False, 0.0: nothing happened


def task_lines(task: dict[str, Any]) -> str:
    """`kugetsu status`: one field a line, the command as a list. The prompt is shown once
    (the command names it `{prompt}`), its further lines indented under its first; a
    deadline to start (expires_at) only while the task can still expire."""
    width = max(len(k) for k in task)
    prompt = task.get("prompt") or None
    out = []
    for key, value in task.items():
        # What a field says when it says nothing: left out (`status --json` has every field).
        if value is None or value == {} or value == [] or (key in _QUIET_AT_DEFAULT and not value):
            continue
        if key == "expires_at" and task.get("state") not in ("queued", "expired"):
            continue
        if key == "attempts":  # the runs before this one: how each ended
            value = "; ".join(f"#{i} exit {a.get('exit_code', '-')}" + (f" ({a['reason']})" if a.get("reason") else "")
                              for i, a in enumerate(value, 1))
        elif key == "agent":
            value = agent_text(value, task.get("fallback_from"))
        elif key in ("usage", "run_usage"):  # all its runs, as its agent reported (README, "Agents")
            from kugetsu.agents.report import Usage, describe

            value = describe(Usage(**value))
        elif key in ("memory", "peak_memory", "rss"):
            value = short_size(value)
        elif key == "slots" and value == 1:
            continue
        elif key == "after":  # task ids, as `status #3` takes them
            value = " ".join(f"#{v}" for v in value)
        elif isinstance(value, list):
            value = " ".join("{prompt}" if v == "{prompt}" or (prompt and v == prompt) else _quote(str(v)) for v in value)
        text = str(value).replace("\n", "\n" + " " * (width + 2))
        out.append(f"{key.ljust(width)}  {text}")
    return "\n".join(out)


def command_text(task: Task, width: int | None = None) -> str:
    """A task's command as a shell would read it, its prompt shown as `{prompt}` (the queue's
    COMMAND column, `status`); cut to `width` with "…" when given."""
    text = " ".join("{prompt}" if v == "{prompt}" or (task.prompt and v == task.prompt) else _quote(v)
                    for v in task.command)
    return text if width is None else cut(text, width)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def attempt_header(task: Task) -> str | None:
    """The line a run after the first begins its part of the log with (`logs` shows the
    attempts apart): `--- kugetsu: attempt 2 of issue-7 (attempt 1: exit code 3) ---`. None
    for a first run."""
    if task.attempt <= 1 or not task.attempts:
        return None
    last = task.attempts[-1]  # its reason names its exit ("exit code 3", "... limit (exit code 1)")
    why = last.reason or ("no exit status" if last.exit_code is None else f"exit code {last.exit_code}")
    return printable(f"--- kugetsu: attempt {task.attempt} of {task.name} (attempt {task.attempt - 1}: {why}) ---",
                     lines=False)


def config_lines(shown: dict[str, Any], help: dict[str, str]) -> str:
    """`kugetsu config show`: one `key = value` line a setting, an object's settings by their
    dotted keys (`agents.claude.command = [...]`, what `config get/set` take), lists and other
    values as one line of JSON, a string as it is; a top-level key's help as a comment."""
    import json

    out: list[str] = []

    def walk(key: str, value: Any, note: str | None) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{key}.{k}", v, None)
            return
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        out.append(f"{key} = {text}" + (f"    # {note}" if note else ""))

    for key, value in shown.items():
        walk(key, value, help.get(key))
    return "\n".join(out)


def hosts_table(rows: list[dict[str, Any]]) -> str:
    """`kugetsu hosts`: one row per machine."""
    body = [[r["name"] + (" *" if r["this"] else ""), r["state"], f"{r['running']}/{r['max_agents']}",
             format_duration(r["heartbeat_age"]) + " ago", ", ".join(r["tasks"]) or "-"] for r in rows]
    return table(["HOST", "STATE", "RUNNING", "HEARTBEAT", "TASKS"], body)


def when(iso: str | None, now: datetime | None = None) -> str:
    """A JSON time (`schedule list --json`) as people read it here: 02:00, Nov 27 02:00."""
    if iso is None:
        return "-"
    from kugetsu.core.times import clock

    at = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return clock(at, now or at)


def schedules_table(rows: list[dict[str, Any]], now: datetime) -> str:
    """`kugetsu schedule list`, the bot's /schedules and the dashboard's pane: each schedule,
    when it fires next, its last task and how it ended (or why its last firing did nothing)."""
    if not rows:
        return "no schedules (`kugetsu schedule add NAME --cron LINE | --every DUR -- CMD`)"
    out = []
    for r in rows:
        rule = f"cron {r['cron']}" + (f" ({r['tz']})" if r["tz"] else "") if r["cron"] else \
            f"every {format_duration(r['every'])}"
        last = r["last_task_name"] or (f"#{r['last_task']}" if r["last_task"] else "-")
        if r["last_outcome"]:
            last += f" {r['last_outcome']}"
        note = r["last_note"] if r["last_note"] and not r["last_note"].startswith("delegated") else ""
        out.append([r["name"], rule, "paused" if r["paused"] else when(r["next_fire"], now), last, note])
    return table(["NAME", "WHEN", "NEXT", "LAST TASK", "NOTE"], out)
