"""Waiting for tasks: until they are final, or until something about them changes. Shared
by every front end that blocks on a task (`kugetsu wait`, `cancel`, `logs --follow`, the MCP
server). Event-driven: a pidfd per running task wakes it the moment an agent exits, and the
index's identity (a new inode on every commit) tells when the service has booked it; what has
no process to watch is looked at once a second.
"""

from __future__ import annotations

import os
import time

from kugetsu import control, runner
from kugetsu.models import Task
from kugetsu.ops import now
from kugetsu.paths import Home


def wait_final(home: Home, ids: list[int], timeout: float | None, settle: bool = False) -> bool:
    """Block until every task is final; False on timeout. Event-driven: a pidfd per running
    task, and a look at the index once a second for the rest. `settle`: also until the
    worktree of a final task is kept or removed (the service closes it just after the task
    ends), so that its reason says where the work is; not when no service is up to do it."""
    from kugetsu.store import Store

    store = Store(home)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        tasks = {t.id: t for t in store.read().all_tasks()}
        pending = [tasks[i] for i in ids if i in tasks and not tasks[i].state.final]
        closing = [t for i in ids if settle and (t := tasks.get(i)) and t.state.final and t.worktree_state == "active"]
        if closing and not pending and not control.service_holds_lock(home):
            closing = []
        if not pending and not closing:
            return True
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return not pending  # final is what was asked: a slow close is no timeout
        # A close is usually done within a second of the task's end: look closely until then.
        soon = any(t.finished_at and (now() - t.finished_at).total_seconds() < 1.0 for t in closing)
        wait_change(home, pending, 1.0 if left is None else min(1.0, left), closing=soon and not pending)


def wait_change(home: Home, tasks: list[Task], timeout: float, closing: bool = False) -> None:
    """Sleep until one of the tasks' processes exits (then until the index changes) or `timeout`.
    `closing` (no process to watch, a worktree about to be booked): until the index changes."""
    import select

    fds = [fd for t in tasks if (fd := runner.open_pidfd(t.pid, t.pid_start)) is not None]
    try:
        before = _index_stamp(home)
        if fds:
            ready, _, _ = select.select(fds, [], [], timeout)
        else:
            ready = []
            if not closing:
                time.sleep(timeout)
        if ready or closing:  # an agent ended, or its worktree closes: the service books it in ms
            end = time.monotonic() + (1.0 if ready else timeout)
            while _index_stamp(home) == before and time.monotonic() < end:
                time.sleep(0.01)
    finally:
        for fd in fds:
            os.close(fd)


def _index_stamp(home: Home) -> tuple[int, int]:
    try:
        st = os.stat(home.index)
        return st.st_ino, st.st_mtime_ns
    except FileNotFoundError:
        return 0, 0
