"""Waiting for tasks, shared by the CLI (`wait`, `cancel`, `logs --follow`) and the MCP
server's `wait` and `cancel` tools: one implementation of "block until final".

Event-driven: a pidfd per task running on this machine (its exit wakes the wait at once,
then the store is watched for the few ms the service takes to book it), in a cluster the
store's LISTEN (any commit on any machine wakes it), and a look at the index once a second
for the rest. A `Stop` wakes a waiting thread at once (a cancelled MCP call), leaving the
tasks alone.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Iterator

from kugetsu.app import control, transaction, verbs

from kugetsu.service import runner
from kugetsu.core.placement import ours
from kugetsu.config.load import cluster_host, load_config
from kugetsu.errors import Unreachable
from kugetsu.core.models import Index, Task, TaskState
from kugetsu.paths import Home
from kugetsu.store.files import open_store

# Seconds between two looks that commits bring (in a cluster every commit of every machine
from kugetsu.store.protocol import StoreProtocol, Watch
# wakes a wait): a burst of them costs a waiter 20 reads a second at most, not one per commit.
MIN_LOOK = 0.05


class Stop:
    """Tells a wait in another thread to give up, at once: a pipe its select() watches
    beside the pidfds. Only the wait ends; the tasks are not touched."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self.is_set = False

    def set(self) -> None:
        if not self.is_set:
            self.is_set = True
            try:
                os.write(self._write, b"x")
            except OSError:  # full (it was written already) or closed: the flag is enough
                pass

    def fileno(self) -> int:
        return self._read

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass


def looks(home: Home, ids: list[int], timeout: float | None, settle: bool = False,
          stop: Stop | None = None) -> Iterator[Index]:
    """The index, each time the wait looks at it, until every task of `ids` is final, the
    timeout has passed or `stop` is set. A look follows each change that concerns the tasks
    (an exit, a start, a booking) and at least one a second, so a caller can tell positions
    and states as they move. `settle`: also until the worktree of a final task is kept or
    removed (the service closes it just after the task ends), so that its reason says where
    the work is; not when no service is up to do it."""
    store = open_store(home)
    here = cluster_host(load_config(home))
    # In a cluster any commit, on any machine, wakes the wait at once. Made last: from here on
    # a lost connection is retried (Outage).
    watch = store.watch()
    deadline = None if timeout is None else time.monotonic() + timeout
    outage = Outage(deadline)
    try:
        while True:
            try:
                if watch is None and outage.since is not None:
                    watch = store.watch()  # the database is back: listen again
                before = store.stamp()  # before the read: a commit after it is news
                index = store.read()
                looked = time.monotonic()
            except Unreachable as err:
                watch = _closed(watch)
                outage.wait(err, stop)  # raises it once the deadline has passed
                if stop is not None and stop.is_set:
                    return
                continue
            outage.over()
            yield index
            tasks = {t.id: t for t in index.all_tasks()}
            pending = [tasks[i] for i in ids if i in tasks and not tasks[i].state.final]
            closing = [t for i in ids if settle and (t := tasks.get(i)) and t.state.final and t.worktree_state == "active"]
            if closing and not pending and not control.service_holds_lock(home):
                closing = []
            if (not pending and not closing) or (stop is not None and stop.is_set):
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return  # final is what was asked: a slow close is no timeout
            # A close is usually done within a second of the task's end: look closely until then.
            soon = any(t.finished_at and (transaction.now() - t.finished_at).total_seconds() < 1.0 for t in closing)
            try:
                wait_change(home, pending, 1.0 if left is None else min(1.0, left), closing=soon and not pending,
                            stop=stop, store=store, watch=watch, before=before, looked=looked, here=here)
            except Unreachable as err:
                watch = _closed(watch)
                outage.wait(err, stop)
    finally:
        _closed(watch)


class Outage:
    """A cluster's database that cannot be reached while a wait goes on (a restart, a
    failover, a lost connection): the tasks run on, so the wait does too, looking again
    after 0.5 s, doubling to 5 s, until its own deadline, where it says why it could not tell."""

    def __init__(self, deadline: float | None):
        self.deadline = deadline
        self.since: float | None = None
        self.delay = 0.5

    def wait(self, err: Unreachable, stop: Stop | None) -> None:
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise err
        self.since = self.since or now
        pause = self.delay if self.deadline is None else min(self.delay, self.deadline - now)
        if stop is not None:
            select.select([stop.fileno()], [], [], pause)
        else:
            time.sleep(pause)
        self.delay = min(self.delay * 2, 5.0)

    def over(self) -> None:
        self.since, self.delay = None, 0.5


def _closed(watch: Watch | None) -> None:
    if watch is not None:
        watch.close()
    return None


def all_final(index: Index, ids: list[int]) -> bool:
    """Is every task of `ids` that the index still holds final?"""
    tasks = {t.id: t for t in index.all_tasks()}
    return all(tasks[i].state.final for i in ids if i in tasks)


def wait_final(home: Home, ids: list[int], timeout: float | None, settle: bool = False,
               stop: Stop | None = None) -> bool:
    """Block until every task is final; False on timeout (or stop)."""
    index = Index()
    for index in looks(home, ids, timeout, settle, stop):
        pass
    return all_final(index, ids)


def wait_change(home: Home, tasks: list[Task], timeout: float, closing: bool = False, stop: Stop | None = None,
                *, store: StoreProtocol | None = None, watch: Watch | None = None, before: object = None,
                looked: float | None = None, here: str | None = None) -> None:
    """Sleep until one of the tasks' processes exits (then until the index changes), `stop`
    is set, or `timeout`; with a `watch` (a cluster), also until anything is committed.
    `closing` (no process to watch, a worktree about to be booked): until the index changes.
    `before`: the store's stamp when the caller last read, at `looked` (time.monotonic): a
    commit since then ends the wait at once, or MIN_LOOK after that read. `here`: this
    machine's name in a cluster (only its own tasks' processes are watched: a pid of another
    machine's means nothing here)."""
    store = store or open_store(home)
    if before is None:
        before = store.stamp()
    elif watch is None and store.stamp() != before:
        return  # committed since the caller read: look again now
    fds: list[int] = []
    ending = False  # a task of ours whose agent has ended, its end not booked yet
    for t in tasks:
        if ours(t, here) and t.run is not None:  # a queued task has no process yet
            fd = runner.open_pidfd(t.run.pid, t.run.pid_start)
            if fd is not None:
                fds.append(fd)
            elif t.state is TaskState.RUNNING and t.run.ended_at is not None:
                ending = True
    if ending and watch is None:
        # The service is ending what its agent left running (SIGKILL after the grace): no
        # process of the task's to watch, so the store's stamp is watched closely, and the
        # booking is seen within 10 ms, not at the next look a second on.
        for fd in fds:
            os.close(fd)
        end = time.monotonic() + timeout
        while store.stamp() == before and time.monotonic() < end and not (stop and stop.is_set):
            time.sleep(0.01)
        return
    try:
        news = [watch.fileno()] if watch is not None else []
        stops = [stop.fileno()] if stop is not None else []
        if fds or news or (stop is not None and not closing):
            ready = select.select(fds + news + stops, [], [], timeout)[0]
        else:
            ready = []
            if not closing:
                time.sleep(timeout)
        if stop is not None and stop.is_set:
            return
        if watch is not None and news[0] in ready:
            watch.clear()
            rest = 0.0 if looked is None else MIN_LOOK - (time.monotonic() - looked)
            if rest > 0:  # a burst of commits: wait out the rest (an exit or a stop still ends it)
                select.select(fds + stops, [], [], rest)
                watch.clear()
            return  # something was committed: look
        exited = any(fd in fds for fd in ready)
        if watch is not None and exited:  # the service books the exit in ms, and says so
            select.select(news + stops, [], [], 1.0)
            watch.clear()
        elif exited or closing:  # no word from the store: look at its stamp until it changes
            end = time.monotonic() + (1.0 if exited else timeout)
            while store.stamp() == before and time.monotonic() < end and not (stop and stop.is_set):
                time.sleep(0.01)
    finally:
        for fd in fds:
            os.close(fd)


def cancel(home: Home, refs: list[str], *, everything: bool = False, reason: str = "cancelled",
           stop: Stop | None = None) -> list[Task]:
    """Cancel tasks (verbs.cancel) and return them as they are once final: a running task is
    final when its processes are gone (SIGKILL after kill_grace), so this waits for that,
    kill_grace + 5 s at most; one still stopping then is returned as it is."""
    tasks = verbs.cancel(home, refs, everything=everything, reason=reason)
    running = [t.id for t in tasks if t.state is TaskState.RUNNING]
    if running:
        wait_final(home, running, load_config(home).kill_grace_s + 5, stop=stop)
    final = {t.id: t for t in open_store(home).read().all_tasks()}
    return [final.get(t.id, t) for t in tasks]
