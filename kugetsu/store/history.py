"""The file store's history as `kugetsu stats` reads it: events.jsonl (then events.jsonl.1)
and history.jsonl from their ends backwards, stopping at a window's start, so `--since 1h`
reads the last hour whatever the size of a year of history. The cluster's store answers the
same from its tables (PgStore.since).
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from kugetsu.config.model import Config
from kugetsu.core.models import Event, Task, decode_task
from kugetsu.paths import Home
from kugetsu.store.events import events_newest_first, lines_backwards

# Past the window's start, how far back the reader may look for the max_agents that the
# window's first `config` change replaced (its event records only the new value).
PRIOR_LOOKBACK = 1 << 20


def max_agents_change(e: Event) -> bool:
    return e.type == "config" and e.key == "max_agents"


def max_agents_value(e: Event) -> int:
    value = e.value
    return value if isinstance(value, int) and not isinstance(value, bool) else Config().max_agents  # unset: default


def events_since(home: Home, start: datetime) -> tuple[list[Event], int | None]:
    """The events at or after `start`, oldest first; and, when a `config` event of the window
    changed max_agents, the value in force at `start` if the event before it is found within
    PRIOR_LOOKBACK bytes (else None). Events are appended in seq order and their `at` never
    goes back against seq, so the first older event ends the read."""
    out: list[Event] = []
    changed = False
    beyond: int | None = None  # bytes read past the window's start, looking for that value
    for event, size in events_newest_first(home):
        if beyond is None and event.at >= start:
            out.append(event)
            changed = changed or max_agents_change(event)
            continue
        if not changed:
            return out[::-1], None
        if max_agents_change(event):
            return out[::-1], max_agents_value(event)
        beyond = (beyond or 0) + size
        if beyond > PRIOR_LOOKBACK:
            return out[::-1], None
    return out[::-1], None


def history_since(home: Home, start: datetime) -> list[Task]:
    """Archived tasks (history.jsonl) that finished at or after `start`. Tasks are archived
    in the order they finished, so the first older line ends the read; a line repeated by a
    crash counts once (the last one, as every reader of the archive does)."""
    out: dict[int, Task] = {}
    for line in lines_backwards(home.history):
        try:
            task = decode_task(line)  # a line of either index version
        except (msgspec.DecodeError, RecursionError):
            continue  # a line torn by a crash
        if task.finished_at is not None and task.finished_at < start:
            break
        out.setdefault(task.id, task)
    return list(out.values())
