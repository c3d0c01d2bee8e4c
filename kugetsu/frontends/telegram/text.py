"""What the bot says, as Telegram HTML: listings, task details, notifications.

Pure functions of tasks, config and a clock (no python-telegram-bot, no I/O), so the
wording is testable without a bot. Every user-supplied string (names, sources, reasons,
log lines) goes through `esc` (HTML-escaped, controls shown escaped); every message stays under Telegram's 4096 characters.
"""

from __future__ import annotations

import html
import re
from datetime import datetime

from kugetsu.frontends import render
from kugetsu.frontends.text import printable
from kugetsu.config.keys import mask_secrets
from kugetsu.config.model import Config
from kugetsu.config.units import format_duration
from kugetsu.core.models import Event, Task
from kugetsu.core.selection import Capacity, QueueView
from kugetsu.core.step import Measured

LIMIT = 4096
_ROOM = LIMIT - 96  # headroom for the "... and N more" line and closing tags
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def esc(text: object) -> str:
    """Anyone's text as Telegram HTML: as written, its controls and bidi overrides (a chat
    client reorders at a U+202E too) shown escaped (frontends/text.printable)."""
    return html.escape(printable(str(text)), quote=False)


def fit(lines: list[str], more: str = "... and {n} more") -> str:
    """Join lines, cutting the listing with "... and N more" before Telegram's limit."""
    out: list[str] = []
    size = 0
    for i, line in enumerate(lines):
        if size + len(line) + 1 > _ROOM:
            out.append(more.format(n=len(lines) - i))
            break
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


def pre(text: str, room: int = _ROOM) -> str:
    """`text` in a <pre> block, shortened (from the front: the end of a log matters most)
    so that the escaped result fits in `room`."""
    text = _ANSI.sub("", text)
    keep = len(text)
    while keep > 0:
        body = esc(text if keep == len(text) else "..." + text[-keep:])
        if len(body) + 11 <= room:
            return f"<pre>{body}</pre>"
        keep = keep * 3 // 4
    return ""


def plain(html_text: str) -> str:
    """Telegram HTML as plain text: for places without parse mode (button answers, fallbacks)."""
    return html.unescape(re.sub(r"<[^>]+>", "", html_text))


def task_ref(task: Task | Event) -> str:
    return f"<b>{esc(task.name)}</b> (#{task.task if isinstance(task, Event) else task.id})"


# ---- listings ----------------------------------------------------------------------------


def queue(view: QueueView, now: datetime, measured: dict[int, Measured] | None = None) -> str:
    """`/queue`: capacity, running tasks with elapsed time, their preset (a fallback's, as
    `kugetsu queue` words it) and memory (`measured`: as the service last measured it),
    queued ones with position, waiting time, time left before expiry, and why they wait when
    it is not their turn."""
    lines = [f"<b>{esc(render.summary(view.capacity))}</b>"]
    if view.running:
        lines.append("\n<b>Running</b>")
        for t in view.running:
            stopping = " · stopping" if t.run.stop else ""
            agent = f" · {esc(render.agent_text(t.agent, t.fallback_from))}" if t.agent else ""
            m = (measured or {}).get(t.id)
            memory = f" · {esc(render.memory_cell(t, m))}" if m or t.memory else ""
            lines.append(
                f"slot {t.run.slot or '-'} · {task_ref(t)} · {render.since(t.started_at, now)} · {esc(t.source)}"
                f"{agent}{memory}{stopping}"
            )
    if view.queued:
        lines.append("\n<b>Queued</b>")
        for t in view.queued:
            why = view.waiting_for.get(t.id)
            lines.append(
                f"{view.positions.get(t.id, '-')}. {task_ref(t)} · waiting {render.since(t.created_at, now)}"
                f" · expires in {render.until(t.expires_at, now)} · {esc(t.source)}"
                + (f" · waiting for: {esc(why)}" if why else "")
            )
    if not view.running and not view.queued:
        lines.append("Nothing running, nothing queued.")
    return fit(lines)


def capacity(cap: Capacity) -> str:
    return esc(render.summary(cap))


def status(task_obj: dict[str, object]) -> str:
    """`/status`: the same fields `kugetsu status` prints."""
    return pre(render.task_lines(task_obj))


# ---- notifications -------------------------------------------------------------------------


def notification(event: Event, task: Task | None, cfg: Config, log_tail: str | None) -> str:
    """The message for one event. `task` (from the index, if still there) adds durations."""
    ref = task_ref(event)
    kind = event.type
    took = _took(task)
    if kind == "queued":
        pos = f", position {event.position}" if event.position else (f", {esc(event.reason)}" if event.reason else "")
        return f"🕒 queued {ref}{pos} · {esc(event.source or '-')}"
    if kind == "started":
        return f"▶️ started {ref}, slot {event.slot}/{cfg.max_agents} · {esc(event.source or '-')}"
    if kind == "succeeded":
        return f"✅ {ref} succeeded" + (f" after {took}" if took else "")
    if kind == "failed":
        head = f"❌ {ref} failed" + (f" after {took}" if took else "")
        reason = event.reason or ""
        code = f"exit code {event.exit_code}"
        detail = reason if code in reason or event.exit_code is None else f"{code}, {reason}" if reason else code
        return _with_log(f"{head}: {esc(detail)}" if detail else head, log_tail)
    if kind == "cancelled":
        reason = event.reason or "cancelled"
        return f"🚫 {ref} " + esc(reason if reason.startswith("cancelled") else f"cancelled: {reason}")
    if kind == "expired":
        # "issue-16 expired after 1d00h in the queue": pm words the reason.
        return f"⌛ <b>{esc(event.name)}</b> {esc(event.reason or 'expired in the queue')}"
    if kind == "lost":
        return _with_log(f"❓ {ref} lost: {esc(event.reason or 'its process vanished')}", log_tail)
    if kind == "config":
        # masked again: an event recorded by an older kugetsu may hold a URL's password
        return f"⚙️ config {esc(event.key)} = {esc(mask_secrets(event.value, event.key or ''))}"
    if kind == "held":  # "claude usage limit: 4 tasks held until 15:00" (pm words it)
        return f"⏸️ {esc(event.reason or 'an agent preset is held')}"
    if kind == "released":
        return f"⏯️ {esc(event.reason or 'an agent preset is released')}"
    if kind == "requeued":  # a retry, or its provider's limit: back in the queue, not failed
        return f"🔁 {ref}: {esc(event.reason or 'back in the queue')}"
    if kind == "worktree":  # what became of a task's worktree, or a prune
        what = esc(event.reason or f"worktree {event.worktree_state or 'changed'}")
        return f"🌿 {ref}: {what}" if event.task is not None else f"🌿 {what}"
    if kind == "schedule":  # a recurring schedule: added, paused, what a firing did (docs/scheduling.md)
        return f"🗓️ schedule <b>{esc(event.name)}</b>: {esc(event.reason or '')}"
    return f"{esc(kind)} {ref}"


def events_missed(first: int, last: int, max_size: str | None) -> str:
    """The chat's feed found events `first`..`last` gone from the event log before they were
    sent (rotated out twice while the bot could not keep up, or while it was away)."""
    count = last - first + 1
    what = f"event #{first}" if count == 1 else f"{count} events (#{first} to #{last})"
    fix = f"; raise events_max_size (now {esc(max_size)}) if this repeats" if max_size else ""
    return (f"⚠️ {what} left the event log before they could be sent here{fix}."
            " <code>kugetsu queue --all</code> shows where every task stands.")


def wanted(event: Event, kinds: list[str]) -> bool:
    """Is `event` one to send to a chat that asked for `kinds` (telegram.events)? A task's
    worktree kept (or anything else worth saying about it at its end) follows the task's
    final state: it used to be part of that event's reason, before the worktree was closed
    after the task ended; a clean removal is nothing to say."""
    if event.type in kinds:
        return True
    return event.type == "worktree" and event.state in kinds and bool(event.reason)


def _took(task: Task | None) -> str | None:
    if task is None or task.started_at is None or task.finished_at is None:
        return None
    return format_duration((task.finished_at - task.started_at).total_seconds())


def _with_log(head: str, log_tail: str | None) -> str:
    if not log_tail or not log_tail.strip():
        return head
    return f"{head}\n{pre(log_tail.rstrip(), _ROOM - len(head))}"


def tail_lines(data: bytes, count: int = 8, width: int = 300) -> str:
    """The last `count` non-empty lines of a log, each cut to `width` characters."""
    lines = [ln[:width] for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return "\n".join(lines[-count:])


def schedules(rows: list[dict[str, object]], now: datetime) -> str:
    """/schedules: the CLI's `schedule list` table, as preformatted text."""
    from kugetsu.frontends import render

    return pre(render.schedules_table(rows, now))  # type: ignore[arg-type]


def help_text(allow_delegate: bool) -> str:
    lines = [
        "<b>kugetsu</b>: the agent queue on this machine.",
        "",
        "/queue: running and queued tasks, with Cancel buttons",
        "/status TASK: one task in full (TASK = id or name)",
        "/capacity: slots and queue in one line",
        "/cancel TASK...: cancel queued or running tasks",
        "/schedules: the recurring schedules, their next firing and last task",
        "/pause, /resume: stop starting queued tasks, and start again",
        "/pause TASK, /resume TASK: stop a running task's processes, and let them go on",
    ]
    if allow_delegate:
        lines.append("/delegate NAME PROMPT: run the default agent on PROMPT")
        lines.append("/retry TASK: run a finished task again, as a new task")
    lines.append("/help: this text")
    return "\n".join(lines)


COMMANDS = [
    ("queue", "running and queued tasks"),
    ("status", "one task in full: /status TASK"),
    ("capacity", "slots and queue"),
    ("cancel", "cancel tasks: /cancel TASK"),
    ("pause", "pause the queue, or a task: /pause [TASK]"),
    ("resume", "resume the queue, or a task: /resume [TASK]"),
    ("delegate", "start an agent: /delegate NAME PROMPT"),
    ("schedules", "recurring schedules"),
    ("retry", "run a finished task again: /retry TASK"),
    ("help", "what this bot does"),
]


def fix(err: Exception) -> str:
    """How to fix an error, in the bot's terms (pm's errors name no CLI flag)."""
    from kugetsu import errors as E

    if isinstance(err, E.NeedsPrompt):
        return ": send /delegate NAME PROMPT"
    if isinstance(err, E.NoSuchTask):
        return "; /queue lists the tasks"
    if isinstance(err, E.QueueFull):
        return " (/capacity)"
    if isinstance(err, E.CommandNotFound):
        return ": install it where the service runs, or set the preset's command to its full path"
    return ""
