"""Which tasks a transaction changed, without looking at every task: the one mechanism both
stores ask (docs/architecture.md §3 and §10).

A store that keeps the index it last committed (a service's) writes only what changed since:
the file store writes nothing when nothing changed and encodes only the queued tasks that did;
the cluster store writes only the changed task rows. Finding that out by encoding and comparing
every task would cost what the shortcut saves, at a long queue. So the tasks a store keeps are
`Tracked`: each assignment to one of a Tracked task's fields appends the task to one log, for the
whole process. Each store has a `Cursor` in it, moved at its commit (where what it keeps was
last written), and asks it at the next commit for every Tracked task assigned to in between.
The log is process-wide, not per store or per thread: an assignment made by any thread to any
store's task is seen (by other stores too, which then find that task's bytes unchanged: a task
too many costs an encoding, a task too few would be lost state).

What it does not see is a change made in place: a list or dict field changed without assigning
it, a field of the task's `run` record set (`task.run.pid = ...`). The queue's rules change a
queued task by assigning its fields; what changes a task in place changes a running one (its run
record: pid, stop, usage, pauses) or one on its way back to the queue (`retries._requeue`: its
attempts, then assignments, and it is appended to the queue's end), and both stores compare the
running and finished lists whole and encode what was appended. Tests set KUGETSU_PG_VERIFY
(`VERIFY`): both stores then check each shortcut against a full encoding, and a change made in
place to a queued task fails loudly rather than being lost.
"""

from __future__ import annotations

import os
import threading
import weakref

import msgspec

from kugetsu.core.models import Task

# Tests (tests/conftest.py) set KUGETSU_PG_VERIFY: every shortcut taken on what a Cursor says is
# then checked against the full encoding.
VERIFY = bool(os.environ.get("KUGETSU_PG_VERIFY"))


class Tracked(Task):
    """A task as a store keeps it: an assignment to one of its fields is logged (Cursor.take).
    Encoded exactly as a Task."""

    def __setattr__(self, name: str, value: object) -> None:
        _append(self)  # atomic, any thread's (a list append holds the GIL)
        if len(_log) > _MOST:
            _cut(len(_log) // 2)
        _set(self, name, value)


def track(tasks: list[Task]) -> None:
    """Tasks made elsewhere (decoded as plain Tasks, admission's new ones) become Tracked: a later
    assignment to them is seen like any other. No assignment is logged by the change itself.
    Tasks that all are already (the service's chain of Looks watches a queue its Store tracked
    as it loaded it) are told by a pass in C: the loop is a Python step a task (~30 ms at 50,000
    queued, at the service's start)."""
    if list(map(type, tasks)).count(Tracked) == len(tasks):
        return
    for task in tasks:
        if type(task) is not Tracked:
            task.__class__ = Tracked


def mark() -> int:
    """Where the log is now: equal to a Cursor's `at` while nothing was assigned since it moved."""
    with _lock:
        return _dropped + len(_log)


class Cursor:
    """One store's place in the log (it starts at the end): `take` answers which Tracked tasks
    were assigned to since the last `take` or `skip`."""

    __slots__ = ("at", "__weakref__")

    def __init__(self) -> None:
        with _lock:
            self.at = _dropped + len(_log)
            key = id(self)  # its own until it is freed, and the callback runs as it is
            _cursors[key] = weakref.ref(self, lambda _: _cursors.pop(key, None))

    def take(self) -> dict[int, Task] | None:
        """The Tracked tasks assigned to since this cursor last moved, each once (by id(); the
        log holds each task, so no other object takes its id meanwhile); None when the log no
        longer reaches back that far (more than _MOST assignments since): the caller looks at
        every task. The cursor moves to now: an assignment after this call is the next answer's."""
        with _lock:
            end = len(_log)
            start = self.at - _dropped
            self.at = _dropped + end
            tasks = {id(task): task for task in _log[start:end]} if start >= 0 else None
            _passed()
        return tasks

    def skip(self) -> None:
        """Move to now, without looking (what the store kept is encoded or dropped whole)."""
        with _lock:
            self.at = _dropped + len(_log)
            _passed()


class Assignments:
    """core.look.Assignments over this log, for a long-lived caller's chain of Looks (the
    service's): the tasks assigned to since the last `take` (a Cursor of its own), and `watch`,
    which makes tasks Tracked (those appended to a queue and not committed yet)."""

    __slots__ = ("_cursor",)

    def __init__(self) -> None:
        self._cursor = Cursor()

    def take(self) -> dict[int, Task] | None:
        return self._cursor.take()

    def watch(self, tasks: list[Task]) -> None:
        track(tasks)


def _passed() -> None:
    """Cut what every cursor has moved past (under _lock), once that is at least half the log:
    the one cursor of a service is at the end after each commit, and the log empties."""
    end = _dropped + len(_log)
    low = min([c.at for ref in list(_cursors.values()) if (c := ref()) is not None], default=end)
    if (low - _dropped) * 2 >= len(_log) > 0:
        _cut(low - _dropped, locked=True)


def _cut(count: int, locked: bool = False) -> None:
    """The oldest `count` entries go; a cursor further back gets None from `take`. Also when the
    log is past _MOST (a cursor that has not moved for long: a store that commits seldom)."""
    global _dropped
    if not locked:
        with _lock:
            if len(_log) > _MOST:  # not cut by another thread meanwhile
                _cut(count, locked=True)
            return
    del _log[:count]
    _dropped += count


# The log: each Tracked task as it was assigned to, oldest first; `_dropped` entries were cut
# from its start. What every cursor has passed goes (_passed); past _MOST entries the oldest half
# goes all the same (holding a task keeps it alive): a transaction's worth of assignments fits
# many times over.
_log: list[Task] = []
_append = _log.append
_set = msgspec.Struct.__setattr__
_dropped = 0
_MOST = 1 << 16
_cursors: dict[int, weakref.ref[Cursor]] = {}  # every live Cursor, by id()
_lock = threading.Lock()  # the cursors, and a cut (an append needs none)
