"""What several rules ask of the whole queue (is any task put first, waiting for its time,
stashed, ...; its first tasks in an order), answered once per state of the queue, and carried
from one state to the next where the change says the answer still holds.

A `Look` answers for one state of one queue: whoever makes one holds that queue unchanged while
it passes it around (the service after a commit: the successor, the warm wrappers' start order
and the next expiry asked the same questions of the whole queue, 20 passes a promotion at
10,000 queued where 10 do). Every rule takes `look=None` and makes its own then (`Look.of`), so
each question is written here once, whoever asks it.

A long-lived caller (the service) also keeps a `Chain`: each Look it makes follows the one made
before, and carries what the change between the two states cannot have made false. A drain
takes a task from the queue's head per promotion and nothing else changes: a question nobody's
answer was yes to stays no, and the first tasks in id order are the ones before less the one
gone. What changed is known without looking at every task: the queue is compared with the one
before in C (the tasks gone from its head, those added at its end), and the tasks assigned to
meanwhile come from `Assignments` (store/tracking.py's log, which the stores' own shortcuts
trust). Anything else (a task gone from the middle, the log cut, a task assigned to that sorts
among the first) asks afresh. The service runs its tests with every carried answer checked
against the fresh one (`Chain.verify`). At 10,000 queued a drain asked ~17 passes of the whole
queue a promotion, ~0.7 ms each.
"""

from __future__ import annotations

import heapq
from math import isqrt
from bisect import insort
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from operator import attrgetter
from typing import Any, Protocol

from kugetsu.core.models import Index, Task, TaskState

_ID, _FIRST, _AFTER, _MEMORY, _SLOTS, _ROUTE, _NOT_BEFORE, _STASHED_AT, _EXPIRES_AT = (
    attrgetter(name) for name in ("id", "first", "after", "memory", "slots", "route", "not_before", "stashed_at",
                                  "expires_at"))

# The order of ids (admission's): policy.order_key's under fifo with no task put first, the usual
# case, and one a Chain carries (the same object: an attrgetter equals only itself).
by_id = _ID

_NEVER = datetime.max.replace(tzinfo=timezone.utc)


def _expiry(task: Task) -> tuple[datetime, int]:
    """The order of the earliest expiries (a task that never expires last; ids break ties)."""
    return (task.expires_at or _NEVER, task.id)


def _any_set(tasks: list[Task], field: attrgetter[Any]) -> bool:
    """Whether one of `tasks` has `field` other than None (list.count compares to None by
    identity first: 1.5x the speed of all(map(operator.is_, ...)))."""
    return list(map(field, tasks)).count(None) != len(tasks)


# Each yes-or-no question, asked of a list of tasks: the whole queue, or what changed in it.
# Passes in C's steps: the service asks them after every promotion, of the whole queue.
_QUESTIONS: dict[str, Callable[[list[Task]], bool]] = {
    "first": lambda q: any(map(_FIRST, q)),  # a task put first (`next`)
    "after": lambda q: any(map(_AFTER, q)),  # a task waiting for others to end (`delegate --after`)
    "timed": lambda q: _any_set(q, _NOT_BEFORE),  # a task waiting for its time (a retry's delay, `--at`)
    "stashed": lambda q: _any_set(q, _STASHED_AT),
    "memory": lambda q: any(map(_MEMORY, q)),  # a task declaring memory
    "slots": lambda q: list(map(_SLOTS, q)).count(1) != len(q),  # other than one slot (count: 2x any's speed)
    "routed": lambda q: any(map(_ROUTE, q)),  # a failover order: it may start on another preset
}

# The orders whose first tasks a Chain carries: a task's place in them changes only when it is
# assigned to (an id never does). An order made per call (policy.order_key's task_key) is not.
_CARRIED_ORDERS = (by_id, _expiry)
_EXPIRY_FIRST = 48  # a drain takes one at a time (each recount is a Python step a task)
# The most first tasks a Look carries in one order. A queue short enough to be kept whole, that
# then grows one admission at a time, would otherwise be carried whole to any length: a Python
# step a task at every Look (a 10,000-task queue delegated one by one into a service or an MCP
# server: ~2 ms a transaction). Cut to its first ones, it is no longer whole, and still right:
# every task that sorts before the last kept is among them.
_CARRIED_MOST = 256


class Assignments(Protocol):
    """Which tasks were assigned to (any field) since the last `take` (the service's: a cursor in
    store/tracking.py's log). None: it cannot tell."""

    def take(self) -> Mapping[int, Task] | None: ...

    def watch(self, tasks: list[Task]) -> None:
        """From now on, an assignment to one of `tasks` is in `take`'s answer."""


class Look:
    """The questions of one state of the queue, each answered by one pass in C the first time
    it is asked and kept for the Look's life (never stored past it, but by a Chain)."""

    __slots__ = ("queued", "_facts", "_firsts", "_chain", "_snapshot")

    def __init__(self, queued: list[Task], chain: Chain | None = None, snapshot: list[Task] | None = None):
        self.queued = queued
        self._facts: dict[str, bool] = {}
        # order -> (its first tasks, whole: they are the whole queue); else every queued task that
        # sorts before the last of them is among them
        self._firsts: dict[Callable[[Task], Any], tuple[list[Task], bool]] = {}
        self._chain = chain
        # The queue as it was (a Chain's Looks): the one before's, moved on in place when the
        # change is one the next Look carries across (a copy of 50,000 references, and its
        # freeing, touch every task: ~1 ms a promotion)
        self._snapshot = snapshot if snapshot is not None else list(queued) if chain is not None else None

    @staticmethod
    def of(index: Index, look: Look | None) -> Look:
        """`look` when it is of this very queue (the same list), else a fresh one."""
        return look if look is not None and look.queued is index.queued else Look(index.queued)

    def following(self, queued: list[Task]) -> Look:
        """A Look of `queued`, a later state of this Look's queue: its Chain's next (what still
        holds carried), or a fresh one."""
        chain = self._chain
        if chain is None or chain.last is not self:
            return Look(queued)
        return chain.of(queued)

    def _ask(self, name: str) -> bool:
        facts = self._facts
        if name not in facts:
            facts[name] = _QUESTIONS[name](self.queued)
        return facts[name]

    @property
    def first(self) -> bool:
        """Was a task put first (`next`)?"""
        return self._ask("first")

    @property
    def after(self) -> bool:
        """Does a task wait for others to end (`delegate --after`)?"""
        return self._ask("after")

    @property
    def timed(self) -> bool:
        """Does a task wait for its time (a retry's delay, `delegate --at`)?"""
        return self._ask("timed")

    @property
    def stashed(self) -> bool:
        return self._ask("stashed")

    @property
    def memory(self) -> bool:
        """Does a task declare memory?"""
        return self._ask("memory")

    @property
    def slots(self) -> bool:
        """Does a task take other than one slot?"""
        return self._ask("slots")

    @property
    def routed(self) -> bool:
        """Does a task have a failover order (it may start on another preset than its command's)?"""
        return self._ask("routed")

    def smallest(self, n: int, key: Callable[[Task], Any]) -> list[Task]:
        """heapq.nsmallest(n, queue, key), which is sorted(queue, key)[:n]: a prefix of a
        longer answer for the same key (the successor is the first of the warm wrappers'
        first 100, when the order is a sort)."""
        kept = self._firsts.get(key)
        if kept is not None and (kept[1] or len(kept[0]) >= n):
            return kept[0][:n]
        most = n
        if self._chain is not None and key in _CARRIED_ORDERS:
            # More than asked, for the Looks that follow to carry: a drain asks afresh (a pass
            # with a Python key: ~15 ms at 50,000 queued) once it has taken what was kept
            # beyond n, and carries each kept task at every promotion (a step, ~0.06 µs).
            # About sqrt(5 x the queue) balances the two: at 50,000 queued 96 made it one
            # pass every 48 promotions, 0.3 ms of each (a 4-slot drain's service CPU a task:
            # 1.8 ms there, 1.1 at 1,000); a short queue keeps what it kept.
            most = max(n * 2, n + 32, min(_CARRIED_MOST, isqrt(5 * len(self.queued))))
        firsts = heapq.nsmallest(most, self.queued, key=key)
        if len(self._firsts) > 4:  # orders made per call (task_key's) are not kept for long
            self._firsts.clear()
        self._firsts[key] = (firsts, len(firsts) < most)
        return firsts[:n]

    def earliest_expiry(self) -> datetime | None:
        """The earliest expiry of a queued task that is not stashed (a stashed one does not
        expire). Without a Chain one pass in C; with one, from the first tasks in order of
        expiry, which a drain carries from one promotion to the next."""
        if self._chain is None:
            if not self.stashed:
                return min(filter(None, map(_EXPIRES_AT, self.queued)), default=None)
            return min((t.expires_at for t in self.queued if t.expires_at is not None and t.stashed_at is None),
                       default=None)
        firsts = self.smallest(_EXPIRY_FIRST, _expiry)
        for task in firsts:
            if task.expires_at is None:
                return None  # in order: none after it expires either
            if task.stashed_at is None:
                return task.expires_at
        if len(firsts) < _EXPIRY_FIRST:
            return None
        return min((t.expires_at for t in self.queued if t.expires_at is not None and t.stashed_at is None),
                   default=None)

    def _carried(self, now: list[Task], changed: Mapping[int, Task], watch: Callable[[list[Task]], None]) -> Look | None:
        """A Look of `now`, a later state of this queue, with the answers the change cannot have
        made false; None for a change it does not carry (this Look is then spent). Only for a
        queue that lost tasks at its head and gained some at its end, the rest the same tasks (C
        compares the lists); `changed`: every task assigned to in between. Its snapshot becomes
        the new Look's, moved on in place."""
        before = self._snapshot
        assert before is not None
        was = len(before)
        gone_tasks = follow(before, now)
        if gone_tasks is None:
            return None
        new = Look(now, self._chain, before)
        gone = len(gone_tasks)
        added = now[was - gone:]
        if added:
            watch(added)  # appended and not yet committed: not Tracked until then
        queued = [t for t in changed.values() if t.state is TaskState.QUEUED]
        # Those changed may not be in this queue (the log is the process's): a yes they give is
        # one more pass later, never a wrong no.
        fresh = added + queued
        if not (gone or fresh):
            new._facts = dict(self._facts)  # the same tasks, none assigned to: every answer holds
        else:
            for name, yes in self._facts.items():
                if not yes:  # no task had it: only a task new or changed can have it now
                    new._facts[name] = _QUESTIONS[name](fresh) if fresh else False
        out = set(map(id, gone_tasks))
        out.update(changed)
        for key, (firsts, whole) in self._firsts.items():
            if key not in _CARRIED_ORDERS or not (firsts or whole):
                continue
            bound = None if whole else key(firsts[-1])
            if any(whole or key(t) <= bound for t in queued):
                continue  # a task assigned to may sort among them now (and may not be queued here)
            if whole and len(added) > 64:
                continue  # asked afresh rather than sorted in one at a time
            kept = [t for t in firsts if id(t) not in out]
            for task in added:
                if whole or key(task) <= bound:
                    insort(kept, task, key=key)
            if len(kept) > _CARRIED_MOST:
                del kept[_CARRIED_MOST:]
                whole = False
            if kept or whole:
                new._firsts[key] = (kept, whole)
        return new

    def verify(self) -> None:
        """Every answer kept against the one asked afresh (Chain.verify: the tests' services)."""
        for name, yes in self._facts.items():
            if yes != _QUESTIONS[name](self.queued):
                raise AssertionError(f"a carried Look says {name}={yes} of a queue where it is not")
        for key, (firsts, whole) in self._firsts.items():
            if firsts != heapq.nsmallest(len(self.queued) if whole else len(firsts), self.queued, key=key):
                raise AssertionError(f"a carried Look's first tasks in {key} are not the queue's")


class Chain:
    """The Looks a long-lived caller makes, each following the one before (module docstring).
    `verify`: check each carried answer against a fresh pass (tests)."""

    __slots__ = ("assigned", "verify", "last")

    def __init__(self, assigned: Assignments, verify: bool = False):
        self.assigned = assigned
        self.verify = verify
        self.last: Look | None = None

    def latest(self, queued: list[Task]) -> Look:
        """The last Look made (the first: of `queued`), for a rule that follows it to the queue
        as it is at once (step.settle): asked of the queue here as well, the same compare and
        the same take would be done twice."""
        return self.last if self.last is not None else self.of(queued)

    def of(self, queued: list[Task]) -> Look:
        """The Look of this state of the queue, carrying what holds from the last one."""
        last = self.last
        changed = self.assigned.take()
        if last is not None and changed is not None and not changed and last.queued is queued \
                and last._snapshot == queued:
            return last  # the same list, the same tasks, none assigned to
        new = last._carried(queued, changed, self.assigned.watch) if last is not None and changed is not None else None
        if new is None:
            new = Look(queued, self)
            if last is None or changed is None:
                self.assigned.watch(queued)  # a chain's first look, or the log cut: each assignment seen from here
        elif self.verify:
            new.verify()
        self.last = new
        return new


_AHEAD = 16  # tasks gone from the queue's head between two states that follow looks for


def follow(before: list[Task], now: list[Task]) -> list[Task] | None:
    """Whether `now` is `before` less at most _AHEAD tasks gone from its head, with all the
    others in order, the same objects or equal ones, and tasks added after them or not: then
    `before` is made `now` in place, and the tasks gone are returned. None for any other change,
    `before` left as it was. The compare is a list's == in C, which takes an item that is the
    same object for equal without calling its __eq__ and touches no task (30x the speed of
    `all(map(is_, ...))`); the move deletes the gone ones (a move of pointers) and appends the
    added: no copy of the queue, whose 50,000 references and their freeing touch every task
    (~1 ms a promotion). Equal is enough for the file store (store/files.py): a task that is
    another object of the same value is written as it is now, and should it change later
    (unseen by the log of assignments, which follows the objects the store knows), it no
    longer equals the one it kept, and the next commit looks up every task's place. A Chain's
    Look carries answers of the same value; nothing in kugetsu puts a copy in a queue's place."""
    for gone in range(min(len(before), _AHEAD) + 1):
        kept = len(before) - gone
        if not kept:
            head = before[:]
            before[:] = now
            return head
        if len(now) >= kept and now[0] is before[gone]:
            head = before[:gone]
            del before[:gone]
            if before == (now if len(now) == kept else now[:kept]):
                before += now[kept:]
                return head
            before[:0] = head
            return None
    return None
