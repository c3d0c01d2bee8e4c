"""The service's fast path: what makes the gap between one agent's end and the next one's
start a few milliseconds, kept apart from the tick that decides.

- The successor: pm's pick for the next slot to free (selection.successor), whose warm
  wrapper (processes.sync_warm) is let go at an exit before the tick's bookkeeping, while
  the index is the one this service committed (`FastPath.release`); the tick then records
  that very start.
- Held commits: after an exit the transaction stays open, lock and all, for a moment, so
  that the exits that follow in a burst share one commit (`HeldCommit`).

Neither decides anything: who starts is pm's, and a promise that breaks is repaired by
recording what ran (`FastPath.unpicked`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from operator import attrgetter
from datetime import datetime
from typing import Any, TypeVar

from kugetsu.app import transaction
from kugetsu.config.model import Config
from kugetsu.core import policy, selection, step
from kugetsu.core.models import Index
from kugetsu.paths import Home
from kugetsu.service.exits import Exits
from kugetsu.service import processes, runner
from kugetsu.service.processes import Processes
from kugetsu.store.protocol import StoreProtocol, Txn

log = logging.getLogger("kugetsu.service")

T = TypeVar("T")


_ID = attrgetter("id")


class QueueMemo:
    """What the service derives from the whole queue after a commit (the successor, the first
    tasks in start order, the next expiry), kept while the store says the queue committed is
    the one committed before (queue_version) and the rest it was derived from (`key`) is
    the same: the 5 s safety-net tick at 50,000 queued re-sorted and re-scanned the queue
    each time (4-5 % of a core, idle). A version of None (a held transaction, a store that
    cannot tell) keeps nothing."""

    def __init__(self) -> None:
        self._version: int | None = None
        self._values: dict[str, tuple[object, Any]] = {}

    def at(self, version: int | None) -> None:
        """After a commit (None: before it, or unknown): what was kept holds only if unchanged."""
        if version is None or version != self._version:
            self._values.clear()
        self._version = version

    def get(self, name: str, key: object, derive: Callable[[], T]) -> T:
        if self._version is None:
            return derive()
        kept = self._values.get(name)
        if kept is not None and kept[0] == key:
            return kept[1]
        value = derive()
        self._values[name] = (key, value)
        return value


class FastPath:
    """The successor, its early release at an exit, and the warm wrappers it needs."""

    def __init__(self, home: Home, procs: Processes, exits: Exits, memo: QueueMemo):
        self.home = home
        self.procs = procs
        self.exits = exits
        self.memo = memo
        self.successor: selection.Successor | None = None  # pm's pick for the next slot to free
        self.released: int | None = None  # the successor, let go at an exit, until pm records it

    def release(self, txn: Txn) -> None:
        """An agent has exited and nothing changed since this service's last transaction: let
        the task pm named for the next free slot (selection.successor) run its agent now, before the
        bookkeeping of this transaction, which then records that very start. The write to
        the warm wrapper's pipe comes first; reaping, the exit status and the new plan (about
        0.2 ms of Python) after it. Still under the index lock, and only while the index is
        the one this service committed: a cancel or a config change cannot slip in between."""
        succ = self.successor
        if succ is None or (succ.until is not None and txn.now >= succ.until):
            return  # about to expire, or no answer that holds whichever task ended
        warm = self.procs.warm_of(succ.task.id)
        if warm is None or warm.gate is None:
            return
        # Only a slot that is truly free: each task that ended left nothing running (else it
        # keeps its slot while that is ended, and the tick decides).
        ended = [t for t in txn.index.active if self.exits.has_exited(t.id)]
        if not ended:
            # A pidfd that fired late, for an agent a tick already booked (it saw the process
            # gone before the callback ran): no slot is free, and the successor must wait.
            return
        for task in ended:
            if not self.procs.spawned(task.run.pid) or task.run.ended_at is not None:
                return
            self.procs.reap(task)
            if self.exits.leftovers_possible(task):
                return
            self.exits.mark_clean(task.id)
        at = transaction.now()  # before the agent can run (see Service._spawn)
        try:
            runner.release(warm)
        except OSError:  # the wrapper is gone: the tick starts the task afresh
            return
        self.released = succ.task.id
        self.procs.let_go_now(succ.task.id, warm.pid, warm.start, at)

    def is_released(self, task_id: int) -> bool:
        return task_id == self.released

    def start_time(self, task_id: int) -> datetime:
        """When a task's agent is let go: at its early release, else now. Read before the agent
        is let go, never after: it may run (and stamp its own start) before spawn returns, and
        a recorded run must hold all of the agent's."""
        return self.procs.let_go_at(task_id) if self.is_released(task_id) else transaction.now()

    def unpicked(self, txn: Txn) -> step.Plan | None:
        """selection.successor promises that the transaction starts the task let go early. Should
        that promise ever break, its agent runs all the same: the plan that records it as
        running rather than start it a second time later (None: the promise held)."""
        if self.released is None or any(t.id == self.released for t in txn.index.active):
            return None  # started, as promised: a task is queued or running, never both
        ids = list(map(_ID, txn.index.queued))  # in C's steps: asked at every tick of a drain, of the whole queue
        task = txn.index.queued[ids.index(self.released)] if self.released in ids else None
        warm = self.procs.take_warm(self.released) if task is not None else None
        if task is None or warm is None:
            return None
        log.error("%s (#%d) was let go early but not picked to start; recording it as running", task.name, task.id)
        at = self.procs.let_go_at(task.id)
        self.procs.adopt_child(warm.popen)
        return step.adopt(txn.index, txn.now, [step.Adopted(task.id, warm.pid, warm.start, at, str(self.home.log(task.id)))])

    def committed(self, index: Index, cfg: Config, look: policy.Look | None = None) -> None:
        """After a tick (its start of the released task recorded): the next successor. Besides
        the queue it reads the config, whether the queue is paused or presets held, and the
        running tasks' slots, memory and retries (the key of the memo)."""
        self.released = None
        running = tuple((t.id, t.memory, t.slots, t.retries, t.agent) for t in index.active)
        self.successor = self.memo.get("successor", (id(cfg), index.paused, bool(index.holds), running),
                                       lambda: selection.successor(index, cfg, look))
        warm = self.procs.warm_of(self.successor.task.id) if self.successor is not None else None
        if warm is not None and warm.gate is not None:
            # Its start time read now, not between the next exit and its release (~40 µs there).
            # In a drain its wrapper was spawned a promotion or more ago, its exec long done; one
            # spawned by this very tick (the first successor after an idle queue) waits here for
            # its exec (~0.4 ms) once, where the release would have waited for it.
            runner.start_of(warm)

    def warm(self, index: Index, cfg: Config, look: policy.Look | None = None) -> bool:
        """The warm wrappers of the next promotions (one machine: in a cluster the next task
        may start on another). The first ones in start order are kept while the queue is the
        same, when that order is a plain sort (it reads the config and whether presets are
        held, besides the queue); or, with every slot busy, when it is played on a Board
        (groups, limits) and nothing can hold a task until a time (policy.may_release): then
        the play reads no clock, and besides the queue and the config only what `played`
        keys (a run timeout's tick at 10,000 queued in a group played 100 starts on a Board
        of the whole queue, 18 ms). Otherwise it depends on the clock and is played again.
        True: wrappers are left to spawn (Processes.warm_more: one a turn of the loop, once it
        is idle)."""
        key = (id(cfg), bool(index.holds))
        first = None
        ahead = selection.warm_ahead(index, cfg, processes.WARM_AHEAD, processes.WARM_WINDOW)
        if index.queued and self.memo.get("simple", key, lambda: policy.simple_order(index, cfg, look=look)):
            first = self.memo.get("first", (*key, ahead),
                                  lambda: selection.start_order(index, cfg, transaction.now(), ahead, look))
        elif (index.queued and selection.free_slots(index, cfg) == 0
              and not self.memo.get("timed", key, lambda: policy.may_release(index, cfg, look))):
            played = (*key, ahead, tuple(index.paused_groups), index.starts,
                      tuple((source, mark.n) for source, mark in index.last_start.items()),
                      tuple((t.id, t.source, t.group, t.agent, t.slots, t.memory) for t in index.active))
            first = self.memo.get("played", played,
                                  lambda: selection.start_order(index, cfg, transaction.now(), ahead, look))
        return self.procs.sync_warm(index, cfg, ahead, first)


class HeldCommit:
    """One commit for a burst of exits: the transaction an exit opened is kept open until
    `delay` after it. Promotions do not wait for it (the next agent is let go before any
    bookkeeping); what waits is the commit, which is most of the service's work per task:
    with agents that end every few ms, one commit per burst instead of one per exit.
    Meanwhile the lock is held (a CLI command waits at most `delay`), so the index stays this
    service's own."""

    def __init__(self, store: StoreProtocol, loop: Callable[[], asyncio.AbstractEventLoop],
                 on_commit: Callable[[Txn], None], on_failure: Callable[[Exception], None]):
        self.store = store
        self.loop = loop
        self.on_commit = on_commit  # after a held transaction's commit succeeded
        self.on_failure = on_failure  # its commit failed: what it let go is in let_go
        self.txn: Txn | None = None
        self._handle: asyncio.TimerHandle | None = None

    @property
    def holding(self) -> bool:
        return self.txn is not None

    def begin(self) -> Txn:
        """The held transaction, if there is one, else a new one."""
        txn, self.txn = self.txn, None
        if txn is None:
            return self.store.begin()
        txn.now = transaction.now()  # the same transaction, a moment later
        return txn

    def hold(self, txn: Txn, delay: float) -> None:
        txn.unchanged = True
        self.txn = txn
        if self._handle is None:
            self._handle = self.loop().call_later(delay, self.flush)

    def overdue(self) -> bool:
        """Has the held transaction been held for its `delay`? Its flush is a timer, which the
        loop looks at once a turn: a burst of exits each ticked in one turn (200 of them in a
        drain through 4 slots) made it fire 0.2-2.3 s late, the index lock held all along (a
        CLI command waits for it) and nothing committed. The tick then commits instead."""
        return self._handle is not None and self.loop().time() >= self._handle.when()

    def commit(self, txn: Txn) -> None:
        """Commit now (a tick that does not hold): a flush pending is moot."""
        self.cancel()
        self.store.commit(txn)

    def flush(self) -> None:
        """Commit the held transaction."""
        self.cancel()
        txn, self.txn = self.txn, None
        if txn is None:
            return
        try:
            self.store.commit(txn)
        except Exception as err:
            self.on_failure(err)  # what it let go is in let_go; exits are seen again
            return
        self.on_commit(txn)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

