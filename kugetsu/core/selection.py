"""Who runs next, as every front end sees it: slots, the start order and positions (from
policy.Board.pick, the one selection function), why a task waits, capacity, the queue view,
pauses, holds and groups; finding tasks by name or id.
"""

from __future__ import annotations

import math
from collections import Counter
from datetime import datetime
from itertools import compress
from operator import attrgetter

import msgspec

from kugetsu.config.load import cluster_host
from kugetsu.config.model import Config
from kugetsu.core import budgets, placement
from kugetsu.core.common import _event, _stands, may_requeue, unpause
from kugetsu.core.models import Event, Index, QueueCounts, Task, TaskState, valid_host
from kugetsu.core.placement import Here, starts_anywhere
from kugetsu.core.policy import (RANK, Board, Look, Resources, accounts, groups_full, guard_hold, may_release,
                                 memory_of, order_key, simple_order, task_key)
from kugetsu.errors import AmbiguousName, NoSuchTask, UnknownGroup, UsageError


# ---- who runs next ---------------------------------------------------------------------


def slots_used(index: Index) -> int:
    """Slots the running tasks take (`delegate --slots`: a task may take more than one)."""
    return sum(t.slots for t in index.active)


_NOT_BEFORE = attrgetter("not_before")


def free_slots(index: Index, cfg: Config) -> int:
    return max(0, cfg.max_agents - slots_used(index))


def plan_starts(index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
                here: Here | None = None, look: Look | None = None) -> list[Task]:
    """Every queued task that may start now, in order, without changing the index.
    `resources`: the machine's readings for the resource guard (None: no guard check).
    `here`: in a cluster, the machine deciding: only what can run there, within its slots.
    `look`: of this queue, when the caller asks more of it (policy.Look)."""
    if not starts_anywhere(cfg, here):
        return []
    if slots_used(index) >= cfg.max_agents or index.paused or guard_hold(cfg, resources) is not None:
        return []  # what Board.pick says at once, without sorting the whole queue into lanes
    if groups_full(index, cfg):
        return []  # what Board.free says of every lane: their groups are full or paused
    room = None
    if here is not None:
        room = placement.room(index, here)
        index = placement.candidates(index, here)
    return [t for t, _ in _plan(index, cfg, now, resources, room, here, look)]


def _heads(index: Index, cfg: Config, look: Look | None = None) -> Index:
    """The index with only the queued tasks that can start now when every pick takes the
    smallest key of all (simple_order) and each takes one slot (no accounts): as many as
    slots are free, found without sorting the rest into lanes (the first tick at 50,000
    queued built a Board of every task: 0.3 s of the service's start). Else the index."""
    free = cfg.max_agents - slots_used(index)
    look = Look.of(index, look)  # accounts, simple_order and order_key ask it of the same queue
    if (free >= len(index.queued) or index.paused_groups or accounts(index, cfg, look)
            or not simple_order(index, cfg, look=look)):
        return index
    return msgspec.structs.replace(index, queued=look.smallest(max(free, 0), order_key(index, cfg, look)))


def _plan(index: Index, cfg: Config, now: datetime, resources: Resources | None, room: int | None,
          here: Here | None = None, look: Look | None = None) -> list[tuple[Task, str | None]]:
    """plan_starts with the preset each task starts on (its failover order's choice).
    `room`: this machine's own free slots (a cluster), which a task may take several of."""
    if here is not None:
        board = Board(index, cfg, now, resources, host=here.name, budget=here.max_memory)
    else:  # _heads and the Board's accounts ask the same of the queue (when _heads keeps it whole)
        look = Look.of(index, look)
        board = Board(_heads(index, cfg, look), cfg, now, resources, look=look)
    started: list[tuple[Task, str | None]] = []
    while (task := board.pick()) is not None:
        if room is not None:  # this machine's own slots: the next task waits for them, as for the cluster's
            if task.slots > room:
                break
            room -= task.slots
        started.append((task, board.take(task)))
    return started


def starts_now(index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
               here: Here | None = None, look: Look | None = None) -> list[tuple[Task, str | None]]:
    """plan_starts, each task with the preset it starts on (lifecycle.start's `agent`)."""
    tasks = plan_starts(index, cfg, now, resources, here, look)
    if not any(t.route for t in tasks):
        return [(t, t.agent) for t in tasks]
    room = None
    if here is not None:
        room = placement.room(index, here)
        index = placement.candidates(index, here)
    return _plan(index, cfg, now, resources, room, here)


def next_to_start(index: Index, cfg: Config, now: datetime, resources: Resources | None = None) -> Task | None:
    board = Board(index, cfg, now, resources)
    return board.pick()


class Successor(msgspec.Struct, frozen=True):
    task: Task
    until: datetime | None  # its queue deadline: from then on it expires instead of starting


def successor(index: Index, cfg: Config, look: Look | None = None) -> Successor | None:
    """The queued task that the next slot to free goes to, whichever running task frees it,
    as long as the index, the config and `until` hold: what plan_starts will pick in the
    transaction that records the exit. The service lets it go the moment an agent exits,
    ahead of that transaction. None wherever the answer could depend on which task ends, on
    the clock or on the machine (source, group and rate limits, fair, the resource guard),
    or when one exit frees no slot (more running than max_agents after a lowering). A task
    waiting for its time that sorts before it bounds `until`. `look`: of this queue, when the
    caller asks more of it (policy.Look)."""
    look = Look.of(index, look)
    if (
        not index.queued
        or cfg.clustered  # a cluster: the next slot may free on another machine
        or index.paused
        or len(index.active) != cfg.max_agents
        or cfg.resource_guard.enabled
        or accounts(index, cfg, look)  # slots and memory: one exit may not make room for the next
        or not simple_order(index, cfg, waits=False, look=look)
        or any(may_requeue(cfg, t) for t in index.active)  # it would come back ahead of the successor
        or look.routed  # it may start on another preset than its command's
    ):
        return None
    # simple_order: none is stashed. Those waiting for their time found in C's steps: the
    # service asks this after every promotion, of the whole queue.
    timed = list(compress(index.queued, map(_NOT_BEFORE, index.queued))) if look.timed else []
    due = [t for t in index.queued if t.not_before is None] if timed else index.queued
    if not due:
        return None
    order = order_key(index, cfg, look)
    first = look.smallest(1, order)[0] if due is index.queued else min(due, key=order)
    key = order(first)
    # A task waiting for its time (a retry's delay, `delegate --at`) that sorts before it
    # would take the slot once that time has come: the promise holds until then.
    waits = [t.not_before for t in timed if order(t) < key]
    return Successor(first, min(filter(None, [first.expires_at, *waits]), default=None))


# The last runs whose length tells the pace of the next promotions (warm_ahead), and how many
# it takes: one run is no pace (a drain's first promotions follow the blocker's long run, whose
# 1 s alone cut the warm wrappers to 30, then grew them back as the quick ones ended: 70
# wrappers dropped and spawned again in the drain, 349 ms against 293 for 100 tasks).
PACE_RUNS = 20
PACE_LEAST = 5


def warm_ahead(index: Index, cfg: Config, most: int, window: float) -> int:
    """How many of the first queued tasks the service keeps warm (service.processes says what
    that is and why): as many as would start within `window` seconds at the pace of the last
    PACE_RUNS runs (max_agents slots, each freed once a median run's length), at least one a
    slot, at most `most`; with fewer than PACE_LEAST runs to go by, `most`. Reads the tail of
    the finished list only: the service asks it at every tick."""
    runs = sorted((t.finished_at - t.started_at).total_seconds() for t in index.finished[-PACE_RUNS:]
                  if t.started_at is not None and t.finished_at is not None)
    if len(runs) < PACE_LEAST:
        return most
    pace = max(runs[len(runs) // 2], 0.001)
    return min(most, max(cfg.max_agents, math.ceil(cfg.max_agents * window / pace)))


def start_order(index: Index, cfg: Config, now: datetime, first: int | None = None,
                look: Look | None = None) -> list[Task]:
    """Queued tasks in the order they will really start if nothing new arrives: the same
    selection as plan_starts, played forward on a copy (policy.Board.drain). `first`: only
    that many, the first ones (a plain sort then picks them without sorting the rest).
    `look`: of this queue, when the caller asks more of it (policy.Look)."""
    look = Look.of(index, look)
    if simple_order(index, cfg, look=look):  # the same order, as a sort (property-tested against drain)
        if first is not None and first < len(index.queued):
            return look.smallest(first, order_key(index, cfg, look))  # = sorted()[:first]
        return sorted(index.queued, key=order_key(index, cfg, look))
    order = Board(index, cfg, now, look=look).drain(first)
    return order if first is None else order[:first]


def positions(index: Index, cfg: Config, now: datetime) -> dict[int, int]:
    """Task id -> 1-based position in start order. Position 1 starts next."""
    return {t.id: i for i, t in enumerate(start_order(index, cfg, now), 1)}


def position(index: Index, cfg: Config, now: datetime, task: Task, look: Look | None = None) -> int | None:
    """positions(...).get(task.id), for one task: without sorting the queue when the start
    order is a plain sort (a count of the tasks that sort before it). `look`: of this queue,
    when the caller asks more of it (policy.Look)."""
    if task.state is not TaskState.QUEUED or task.stashed_at is not None:
        return None
    look = Look.of(index, look)
    if simple_order(index, cfg, look=look):
        # the task admitted last, where admission put it (ids are given in order, once:
        # models.check_index), has a larger id than every other queued task
        newest = bool(index.queued) and index.queued[-1] is task and task.id == index.next_id - 1
        return 1 + _before(look, cfg, task, newest)
    return positions(index, cfg, now).get(task.id)


def _before(look: Look, cfg: Config, task: Task, newest: bool = False) -> int:
    """How many of the queue (`look`'s) sort before `task` (task_key). When no task was put
    first (`next`), the usual case, counted in C passes (admission asks it of a long queue on
    every call): the tasks of a lower rank, and those of its rank with a smaller id. `newest`:
    `task` is in the queue and every other queued task has a smaller id (admission's ask): no
    id need be read."""
    queued = look.queued
    if task.first or look.first:
        key = task_key(cfg, task)
        return sum(1 for t in queued if task_key(cfg, t) < key)
    if newest and cfg.strategy == "fifo":
        return len(queued) - 1
    smaller = map(task.id.__gt__, map(_ID, queued))
    if cfg.strategy == "fifo":
        return sum(smaller)
    rank = RANK[task.priority]
    priorities = list(map(_PRIORITY, queued))
    counts = Counter(priorities)
    if newest:
        return sum(n for p, n in counts.items() if RANK[p] <= rank) - 1  # its rank's, but itself
    return sum(n for p, n in counts.items() if RANK[p] < rank) + sum(compress(smaller, map(task.priority.__eq__, priorities)))


_ID, _PRIORITY = attrgetter("id"), attrgetter("priority")


def waiting_for_one(index: Index, cfg: Config, now: datetime, task: Task, resources: Resources | None = None,
                    look: Look | None = None) -> str | None:
    """waiting_for(...).get(task.id), for one queued task: the reason of its lane only.
    `look`: of this queue, when the caller asks more of it (policy.Look)."""
    # its dependencies, by name; what fits (slots, memory); its stash: the full look
    look = Look.of(index, look)
    if task.after or task.stashed_at is not None or accounts(index, cfg, look):
        return waiting_for(index, cfg, now, resources, look).get(task.id)
    board = Board(index, cfg, now, resources, lanes=False, look=look)
    return board.pause or board.hold or board.why(*board.lane_of(task))


def waiting_for(index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
                look: Look | None = None) -> dict[int, str]:
    """Task id -> why that queued task waits, when it is not simply behind others (a source
    or group limit, a rate limit, the resource guard, a pause, its dependencies, a stash).
    Tasks without a reason are left out. `look`: of this queue, when the caller asks more of
    it (policy.Look)."""
    look = Look.of(index, look)
    quick = Board(index, cfg, now, resources, lanes=False, look=look)  # the counts only, no order
    if (quick.pause is None and quick.hold is None and quick.source_limit is None and quick.interval is None
            and not quick.caps and not quick.agent_caps and not quick.holds and quick.spend is None
            and not quick.window_presets and quick.budget is None
            and not (look.after or look.timed or look.slots or look.stashed)):
        return {}  # nothing that could hold a task
    board = Board(index, cfg, now, resources, look=look)
    out = {t.id: "stashed" for t in index.queued if t.stashed_at is not None}
    for lane_id, lane in board.lanes.items():
        head = lane[0][1]
        reason = board.pause or board.hold or board.why(*lane_id, head.slots) or board.never(head)
        if reason is not None:
            out.update((t.id, reason) for _, t in lane)
    board.pick()
    if board.blocked is not None:  # the task next in line, which does not fit yet: memory, slots
        task, why = board.blocked
        out.setdefault(task.id, why)
    if board.parked:  # `delegate --after`: the dependencies still to end, by name
        names = {t.id: t.name for t in index.live()}
        out.update((t.id, ", ".join(names[d] for d in t.after if d in waits)) for t, waits in board.parked.values())
    return out


class HoldView(msgspec.Struct, frozen=True, kw_only=True):
    """A preset held now, as the front ends show it."""

    until: datetime | None  # None: until released by hand
    reason: str
    since: datetime
    queued: int  # its tasks waiting for it


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """The numbers `kugetsu capacity --json` gives: what a PM agent checks before delegating."""

    max_agents: int
    active: int
    queued: int
    free: int
    max_queue: int
    paused: bool = False  # `kugetsu pause`: no queued task starts until `resume`
    paused_groups: list[str] = []  # `pause --group G`: none of these groups' tasks starts
    holds: dict[str, HoldView] = {}  # presets held (provider limits, by hand): their tasks wait
    budgets: list[BudgetView] = []  # the daily budgets (budgets.*), with today's spending
    # Once a task declares memory: this machine's budget and what its running tasks declared.
    max_memory: int | msgspec.UnsetType = msgspec.UNSET  # UNSET: not in the object
    memory_used: int | msgspec.UnsetType = msgspec.UNSET


class BudgetView(msgspec.Struct, frozen=True, kw_only=True):
    """A daily budget and what was spent of it today, as the front ends show it."""

    kind: str  # "source" or "agent"
    name: str
    usd: float | None  # the budget
    tokens: int | None
    spent_usd: float | None  # today's (None: no agent reported a cost)
    spent_tokens: int
    over: bool  # nothing more of it starts today
    resets_at: datetime


def capacity(index: Index, cfg: Config, now: datetime | None = None, counts: QueueCounts | None = None,
             look: Look | None = None) -> Capacity:
    """Counts only: cheap at any queue length (no order is computed). While `pause` holds
    every start, no slot is free to a new task: free is 0, so that "free > 0: a task delegated
    now starts at once" (the PM instructions) holds. `counts`: the queued tasks' numbers when
    `index.queued` was not decoded (read_head); None: counted from index.queued. `look`: of
    this queue, when the caller asks more of it (policy.Look)."""
    if counts is None:
        look = Look.of(index, look)
        counts = QueueCounts.of(index.queued, index.holds, look.memory or look.slots)
    memory = {}
    if counts.accounting or accounts(index, cfg, look):
        here = cluster_host(cfg)  # in a cluster, this machine's tasks against its own budget
        memory = {"max_memory": cfg.memory_budget,
                  "memory_used": sum(memory_of(cfg, t) for t in index.active if here is None or t.host == here)}
    return Capacity(max_agents=cfg.max_agents, active=len(index.active), queued=counts.queued,
                    free=0 if index.paused else free_slots(index, cfg), max_queue=cfg.max_queue, paused=index.paused,
                    paused_groups=sorted(index.paused_groups), holds=holds_view(index, now, counts.held_agents),
                    budgets=budgets_view(index, cfg, now) if now is not None and cfg.budgets.enabled else [],
                    **memory)


def budgets_view(index: Index, cfg: Config, now: datetime) -> list[BudgetView]:
    spend = budgets.today(index, now)
    out = []
    for kind, ledger_name in (("source", "sources"), ("agent", "agents")):
        for name, budget in getattr(cfg.budgets, ledger_name).items():
            used = getattr(spend, ledger_name).get(name) if spend is not None else None
            out.append(BudgetView(kind=kind, name=name, usd=budget.usd, tokens=budget.tokens,
                                  spent_usd=used.cost_usd if used else None,
                                  spent_tokens=budgets.counted_tokens(used) if used else 0,
                                  over=budgets.daily_over(name, budget, used, now) is not None,
                                  resets_at=budgets.midnight_after(now)))
    return out


def pause(index: Index, cfg: Config, now: datetime, group: str | None, on: bool) -> list[Event]:
    """`pause` (on) / `resume`, of every start or of one group's. Running tasks go on. No
    event when nothing changes (pausing what is paused)."""
    if group is None:
        if index.paused == on:
            return []
        index.paused = on
    else:
        if on and group not in cfg.groups:
            raise UnknownGroup(group, sorted(cfg.groups))
        if (group in index.paused_groups) == on:
            return []
        index.paused_groups = sorted(set(index.paused_groups) | {group}) if on else [
            g for g in index.paused_groups if g != group]
    return [Event(type="paused" if on else "resumed", at=now, value=group)]



def _controllable(task: Task, what: str) -> None:
    """A task whose processes `pause TASK`, `resume TASK` and `kill -s` may signal: running,
    spawned (a pid), not being stopped."""
    if task.state is not TaskState.RUNNING:
        hint = " (pause without a task holds the queue's starts instead)" if what == "paused" else ""
        raise UsageError(f"task {task.name} (#{task.id}) {_stands(task)}: only a running task can be {what}{hint}",
                         code=1)
    if task.run.stop is not None:
        raise UsageError(f"task {task.name} (#{task.id}) is being stopped ({task.reason}): it cannot be {what}", code=1)
    if task.run.pid is None:
        raise UsageError(f"task {task.name} (#{task.id}) is starting (its agent has no process yet): try again in a"
                         " moment", code=1)




def pause_task(task: Task, now: datetime, on: bool, by: str = "cli") -> list[Event]:
    """`pause TASK` (on) / `resume TASK`: its processes stop (SIGSTOP) or go on (SIGCONT): the
    caller signals them after the commit. Its slot stays taken; its timeout's clock stops too.
    No event when nothing changes."""
    _controllable(task, "paused" if on else "resumed")
    if (task.run.paused_at is not None) == on:
        return []
    if on:
        task.run.paused_at = now
    else:
        unpause(task, now)
    return [_event("paused" if on else "resumed", task, now, reason=f"{'paused' if on else 'resumed'} by {by}")]


def signal_task(task: Task, now: datetime, sig: str, by: str = "cli") -> list[Event]:
    """`kill -s SIGNAL TASK`: the caller sends `sig` to its processes after the commit; the
    event records it. SIGSTOP and SIGCONT go through pause and resume, so that the task says
    it is paused and its timeout waits."""
    if sig in ("SIGSTOP", "SIGTSTP", "SIGCONT"):
        verb = "resume" if sig == "SIGCONT" else "pause"
        raise UsageError(f"{sig}: {verb} the task instead, which also records that it is {verb}d (its state and"
                         " its timeout follow)")
    _controllable(task, "signalled")
    return [_event("signalled", task, now, reason=f"{sig} sent by {by}")]


def holds_view(index: Index, now: datetime | None, queued: dict[str, int] | None = None) -> dict[str, HoldView]:
    """The holds in force at `now` (every recorded one when now is None), with their tasks
    (`queued`: each held agent's queued tasks, when already counted)."""
    if not index.holds:
        return {}
    if queued is None:
        queued = QueueCounts.of(index.queued, index.holds).held_agents
    return {agent: HoldView(until=h.until, reason=h.reason, since=h.since, queued=queued.get(agent, 0))
            for agent, h in index.holds.items() if now is None or h.until is None or h.until > now}


class QueueView(msgspec.Struct, frozen=True, kw_only=True):
    """What every front end shows of the queue, computed once per view: the CLI's `queue`,
    `capacity` and `status`, the dashboard and the bot render this and nothing else."""

    running: list[Task]  # by slot
    queued: list[Task]  # in start order
    positions: dict[int, int]  # queued task id -> 1-based position
    waiting_for: dict[int, str]  # queued task id -> why it waits, when not simply behind others
    capacity: Capacity
    groups: dict[str, dict[str, int]]  # per configured group: max_agents, active, queued
    more: int = 0  # queued tasks a limit left out of `queued` (`queue --limit`): the ones after them


def queue_view(index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
               first: int | None = None) -> QueueView:
    """The view of the whole queue; `first`: of its first tasks in start order alone, the rest
    counted in `more` (a plain sort then picks them without sorting the rest: at 50,000
    queued a `queue --limit 20` does not pay for the order of the 49,980 it does not show)."""
    look = Look(index.queued)  # the order, why tasks wait and the counts ask the same of the queue
    order = start_order(index, cfg, now, first, look)
    if first is None:
        stashed = [t for t in index.queued if t.stashed_at is not None] if len(order) != len(index.queued) else []
    else:  # stashed ones come after every task with a position: shown only when those all fit
        stashed = [t for t in index.queued if t.stashed_at is not None][:first - len(order)] if len(order) < first else []
    return QueueView(
        running=sorted(index.active, key=lambda t: (t.run.slot or 0, t.id)),
        queued=order + stashed,  # stashed ones last, without a position
        positions={t.id: i for i, t in enumerate(order, 1)},
        waiting_for=waiting_for(index, cfg, now, resources, look) if index.queued else {},
        capacity=capacity(index, cfg, now, look=look),
        groups=group_usage(index, cfg),
        more=len(index.queued) - len(order) - len(stashed),
    )


def limit_view(view: QueueView, first: int) -> QueueView:
    """The view with its first `first` queued tasks alone (after a filter: the first that match)."""
    if len(view.queued) <= first:
        return view
    return msgspec.structs.replace(view, queued=view.queued[:first], more=view.more + len(view.queued) - first)


def with_placement(view: QueueView, up: set[str]) -> QueueView:
    """A cluster's queue view, where a task pinned to a machine that is not up says so
    (placement.placement_note): it can run nowhere now, whatever its position."""
    notes = {t.id: note for t in view.queued if (note := placement.placement_note(t, up))}
    if not notes:
        return view
    return msgspec.structs.replace(view, waiting_for={**view.waiting_for, **notes})


class TaskFilter(msgspec.Struct, frozen=True, kw_only=True):
    """`queue --group G --state S --source WHO` (and `wait --group G`): which tasks a listing
    keeps. Positions stay the true ones: a filter hides rows, it never reorders the queue."""

    group: str | None = None
    states: frozenset[str] | None = None  # TaskState values; "finished" stands for every final one
    source: str | None = None

    def matches(self, task: Task) -> bool:
        return ((self.group is None or task.group == self.group)
                and (self.source is None or task.source == self.source)
                and (self.states is None or task.state.value in self.states
                     or ("finished" in self.states and task.state.final)))

    @property
    def wants_finished(self) -> bool:
        """A final state was asked for: the listing shows finished tasks without `--all`."""
        return self.states is not None and any(s not in ("queued", "running") for s in self.states)


STATE_NAMES = tuple(s.value for s in TaskState) + ("finished",)


def task_filter(group: str | None = None, states: list[str] | None = None, source: str | None = None) -> TaskFilter:
    """A TaskFilter from what a user typed (`--state failed,cancelled`); an unknown state is refused."""
    wanted = None
    if states:
        wanted = frozenset(s.strip() for v in states for s in v.split(",") if s.strip())
        bad = sorted(wanted - set(STATE_NAMES))
        if bad or not wanted:
            raise UsageError(f"unknown state {', '.join(map(repr, bad)) or repr('')}; one of"
                             f" {', '.join(STATE_NAMES)} (several: failed,cancelled)")
    return TaskFilter(group=group, states=wanted, source=source)


def filter_view(view: QueueView, keep: TaskFilter) -> QueueView:
    """The view with only the tasks `keep` matches, each at its true position."""
    return msgspec.structs.replace(view, running=[t for t in view.running if keep.matches(t)],
                                   queued=[t for t in view.queued if keep.matches(t)])


def next_release(index: Index, cfg: Config, now: datetime) -> datetime | None:
    """When a rate limit that holds a queued task runs out (the service wakes then). None,
    without playing the queue into lanes, where nothing can hold one until later
    (policy.may_release: each tick with a free slot did, at 10,000 queued)."""
    if not may_release(index, cfg):
        return None
    return Board(index, cfg, now).next_release()


def group_usage(index: Index, cfg: Config) -> dict[str, dict[str, int]]:
    """Per configured group: its slots, running and queued tasks."""
    usage = {name: {"max_agents": g.max_agents, "active": 0, "queued": 0} for name, g in cfg.groups.items()}
    if not usage:
        return usage  # no pools: no Python step a task (6 ms of `queue --limit 20` at 50,000 queued)
    for where, tasks in (("active", index.active), ("queued", index.queued)):
        for t in tasks:
            if t.group in usage:
                usage[t.group][where] += 1
    return usage


def check_group_name(cfg: Config, name: str, new: bool) -> None:
    """A pool's name for `group add` (valid, not there yet) or `group remove` (there)."""
    if new and not valid_host(name):
        raise UsageError(f"invalid group name {name!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter"
                         " or digit")
    if new and name in cfg.groups:
        raise UsageError(f"group {name} exists already (max_agents {cfg.groups[name].max_agents}); its slots are"
                         f" config key groups.{name}.max_agents")
    if not new and name not in cfg.groups:
        raise UsageError(f"no group {name!r} to remove (groups: {', '.join(sorted(cfg.groups)) or 'none defined'})")


def check_group_unused(index: Index, name: str) -> None:
    """A pool can go only once no queued or running task is in it."""
    live = [t for t in index.live() if t.group == name]
    if live:
        names = ", ".join(f"{t.name} (#{t.id})" for t in live[:5]) + (", ..." if len(live) > 5 else "")
        raise UsageError(f"group {name} has {len(live)} queued or running task{'' if len(live) == 1 else 's'} ({names}):"
                         " let them finish, cancel them, or move them to another group first", code=1)


def lowest_free_slot(index: Index) -> int:
    used = {t.run.slot for t in index.active}
    return next(n for n in range(1, len(used) + 2) if n not in used)


# ---- finding tasks ---------------------------------------------------------------------


def find(index: Index, ref: str) -> Task:
    """TASK is an id or a name: a live task of that name, else the latest finished one."""
    ref = ref.strip().lstrip("#")
    # Only ASCII digits are an id: str.isdigit() is also true of "²" (which int() refuses)
    # and of "٣" (which int() reads as 3): anything else is a name.
    if ref.isascii() and ref.isdigit():
        for task in index.all_tasks():
            if task.id == int(ref):
                return task
    for task in index.live():
        if task.name == ref:
            return task
    for task in reversed(index.finished):
        if task.name == ref:
            return task
    raise NoSuchTask(ref)


def find_to_wait(index: Index, ref: str) -> Task:
    """`wait TASK`: as find, but a name that no live task bears and more than one finished
    task does is refused (AmbiguousName): the latest of them ended before the wait began,
    and a delegate of that name that was refused (queue full) leaves no trace to tell it
    from a task that really ran. One task of the name is not ambiguous: `delegate x; wait x`
    for a task that ended in between must keep working, and the index cannot tell that
    from a refused re-delegation either; waiting on the id (`delegate --json`) or
    `delegate --wait` names the one task meant (README, "For PM agents")."""
    task = find(index, ref)
    by_id = ref.strip().lstrip("#").isascii() and ref.strip().lstrip("#").isdigit()
    if task.state.final and not by_id:
        same = [t.id for t in index.finished if t.name == task.name]
        if len(same) > 1:
            raise AmbiguousName(task.name, same)
    return task
