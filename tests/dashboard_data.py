"""Fixture homes for the dashboard tests: a fixed clock and an index written by hand, so the
screenshots show the same thing on every machine (no real pids, no temp paths, UTC)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import msgspec

from kugetsu.core.models import Event, Index, Run, Task, TaskState
from kugetsu.paths import Home, atomic_write
from kugetsu.store.files import Store
from kugetsu.store.protocol import encode_index

NOW = datetime(2025, 3, 14, 12, 0, 0, tzinfo=timezone.utc)
UTC = timezone.utc


def clock() -> datetime:
    return NOW


class _Ago:
    """Times relative to the fixture's `now`: the fixed NOW for screenshots, the real clock for
    tests whose actions run ops (which expires queued tasks by the real clock)."""

    now = NOW

    def __call__(self, **kw: float) -> datetime:
        return self.now - timedelta(**kw)


ago = _Ago()


def write_config(home: Home, **values: object) -> None:
    # No autostart: an action in a test must not spawn a service that would adopt fake pids.
    cfg = {"autostart": False, "default_agent": "sim",
           "agents": {"sim": {"command": ["sh", "-c", "echo {prompt}"]}}, **values}
    home.ensure()
    home.config.write_text(json.dumps(cfg))


def empty_home(root: Path, **config: object) -> Home:
    home = Home(root)
    write_config(home, **config)
    return home


def _task(id: int, name: str, state: TaskState, **kw: object) -> Task:
    kw.setdefault("created_at", ago(minutes=60 - id))
    return Task(id=id, name=name, state=state, command=["sim"], cwd="/work/project", **kw)  # type: ignore[arg-type]


def busy_index() -> Index:
    def expiry(t: datetime) -> datetime:
        return t + timedelta(hours=24)

    finished = [
        _task(1, "fix-typo", TaskState.SUCCEEDED, source="pm", agent="opencode", started_at=ago(minutes=58),
              finished_at=ago(minutes=50), exit_code=0),
        _task(2, "refactor-db", TaskState.FAILED, source="pm", agent="claude", started_at=ago(minutes=57),
              finished_at=ago(minutes=31), exit_code=1, reason="exit code 1"),
        _task(3, "docs-pass", TaskState.CANCELLED, source="cli", agent="codex", finished_at=ago(minutes=20),
              reason="cancelled by cli"),
    ]
    active = [
        _task(4, "issue-16", TaskState.RUNNING, source="pm", agent="opencode", started_at=ago(minutes=31),
              run=Run(pid=41001, slot=1)),
        _task(5, "issue-17", TaskState.RUNNING, source="pm", agent="claude", started_at=ago(minutes=12, seconds=5),
              run=Run(pid=41002, slot=2)),
        _task(6, "bot-fix", TaskState.RUNNING, source="telegram:42", agent="codex", started_at=ago(seconds=40),
              run=Run(pid=41003, slot=3)),
    ]
    queued = []
    for i, (name, prio, source, minutes) in enumerate([
        ("issue-18", "normal", "pm", 25), ("issue-19", "high", "pm", 18), ("lint-all", "normal", "cli", 9),
        ("issue-20", "low", "pm", 4), ("bot-docs", "normal", "telegram:42", 1),
    ]):
        created = ago(minutes=minutes)
        queued.append(_task(7 + i, name, TaskState.QUEUED, source=source, priority=prio, agent="opencode",
                            created_at=created, expires_at=expiry(created)))
    return Index(next_id=12, next_seq=1, active=active, queued=queued, finished=finished)


def busy_events() -> list[Event]:
    e = [
        Event(type="started", at=ago(minutes=31), task=4, name="issue-16", source="pm", slot=1),
        Event(type="failed", at=ago(minutes=31), task=2, name="refactor-db", source="pm", exit_code=1,
              reason="exit code 1"),
        Event(type="queued", at=ago(minutes=25), task=7, name="issue-18", source="pm", position=1),
        Event(type="cancelled", at=ago(minutes=20), task=3, name="docs-pass", source="cli", reason="cancelled by cli"),
        Event(type="queued", at=ago(minutes=18), task=8, name="issue-19", source="pm", position=2),
        Event(type="started", at=ago(minutes=12, seconds=5), task=5, name="issue-17", source="pm", slot=2),
        Event(type="config", at=ago(minutes=10), key="max_agents", value=3),
        Event(type="queued", at=ago(minutes=9), task=9, name="lint-all", source="cli", position=3),
        Event(type="started", at=ago(seconds=40), task=6, name="bot-fix", source="telegram:42", slot=3),
    ]
    for seq, event in enumerate(e, 1):
        event.seq = seq
    return e


LOGS = {
    2: "connecting to db\nmigrating 14 tables\nTraceback (most recent call last):\n"
       "  File \"migrate.py\", line 88, in <module>\n    run()\n"
       "RuntimeError: column users.email is not unique\n",
    4: "reading issue 16\nplan: 3 steps\nstep 1/3: write the failing test\nstep 2/3: fix the parser\n",
    5: "reading issue 17\n",
}


def held_home(root: Path) -> Home:
    """The busy home with the queue paused, a preset held by hand and a task in a group: the
    header's longest line, and the reasons the WAITING FOR column gives."""
    from kugetsu.core.models import Hold

    home = busy_home(root, groups={"gpu": {"max_agents": 1}})
    index = Store(home).read()
    index.paused = True
    index.holds = {"claude": Hold(reason="held by hand", since=ago(minutes=5))}
    for t in index.queued:
        if t.name == "issue-20":
            t.group = "gpu"
        if t.name == "bot-docs":
            t.agent = "claude"
    atomic_write(home.index, encode_index(index))
    return home


def busy_home(root: Path, now: datetime = NOW, **config: object) -> Home:
    ago.now = now
    home = empty_home(root, **{"max_agents": 3, **config})
    index = busy_index()
    events = busy_events()
    index.next_seq = len(events) + 1
    atomic_write(home.index, encode_index(index))
    home.events.write_bytes(b"".join(msgspec.json.encode(ev) + b"\n" for ev in events))
    for task_id, text in LOGS.items():
        home.log(task_id).write_text(text)
    return home


async def until(pilot, condition, timeout: float = 5.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Let the app run until `condition()` is truthy (Pilot's pause, not a blind sleep)."""
    import time

    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)
    return value


async def settled(pilot) -> None:  # type: ignore[no-untyped-def]
    """Wait for the app's action workers, then for the UI to take in their results."""
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def notes(app) -> list[str]:  # type: ignore[no-untyped-def]
    """Every notification the app has shown, expired or not: on a loaded machine a test can
    take longer than a note's 4 s on screen (CI, once)."""
    return list(getattr(app, "_said", []))


def _record_notifications() -> None:
    """Textual's App.notify, which the dashboard's own notify ends in, also keeps the message."""
    from textual.app import App

    shown = App.notify

    def notify(self, message, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.__dict__.setdefault("_said", []).append(message)
        return shown(self, message, *args, **kwargs)

    App.notify = notify  # type: ignore[method-assign]


_record_notifications()
