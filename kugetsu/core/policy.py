"""Scheduling policies: who may start next, and why the others wait. Pure, like pm.

Everything goes through one selection, `Board.pick`: the scheduler asks it which queued
tasks start now (selection.plan_starts), and positions come from playing it forward on a copy of
the state (`Board.drain`) with slots freeing one at a time and nothing new arriving. So a
position is the truth for every strategy and limit: there is no second ordering to drift.

A Board groups queued tasks into lanes by (source, group, agent preset, start time): every
limit applies to a whole source, group or preset (its max_agents, a hold on its provider),
and a start time (a retry's delay, `delegate --at`) to that task alone, so within a lane only the head can be next, and a
pick looks at one task per lane instead of the whole queue.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from datetime import datetime, timedelta
from operator import attrgetter
from typing import Any

import msgspec

from kugetsu.core import budgets
from kugetsu.core.times import clock
from kugetsu.config.model import Config
from kugetsu.config.units import format_duration, format_size
from kugetsu.core.look import Look, by_id
from kugetsu.core.models import PRIORITIES, Index, Task

# source, group, route (the presets it may start on, in order; () for a bare command),
# not_before, and whether that wait is a start time asked for (`delegate --at`, a task that
# never ran) rather than a retry's delay: only the words differ.
Lane = tuple[str, str | None, tuple[str, ...], datetime | None, bool]

RANK = {p: i for i, p in enumerate(PRIORITIES)}
NEVER = -1  # the start counter of a source that never started: oldest of all under `fair`


class Resources(msgspec.Struct, frozen=True):
    """Machine readings, measured by the caller (the service, the CLI) and passed in. (A
    Struct, not a dataclass: importing dataclasses costs every CLI command 1 ms.)"""

    available_memory: int | None = None  # bytes
    load_per_cpu: float | None = None  # 1-minute load average / CPUs


def guard_hold(cfg: Config, res: Resources | None) -> str | None:
    """Why the resource guard holds every start now, or None."""
    g = cfg.resource_guard
    if res is None or not g.enabled:
        return None
    need = g.min_available_memory_bytes
    if need is not None and res.available_memory is not None and res.available_memory < need:
        return f"held: {format_size(res.available_memory)} available, need {format_size(need)}"
    top = g.max_load_per_cpu
    if top is not None and res.load_per_cpu is not None and res.load_per_cpu > top:
        return f"held: load {res.load_per_cpu:.2f} per CPU, max {top:g}"
    return None


def memory_of(cfg: Config, task: Task) -> int:
    """The memory a task declared (bytes; 0: none), counted against the machine's budget: its
    own (delegate --memory, its preset's, fixed at admission), else resources.default_memory."""
    if task.memory is not None:
        return task.memory
    return cfg.resources.default_memory_bytes or 0


def accounts(index: Index, cfg: Config, look: Look | None = None) -> bool:
    """Does any live task take more than one slot or declare memory? Else the selection
    counts tasks alone, as it always did (and the short cuts that assume it hold)."""
    if cfg.resources.default_memory is not None:
        return True
    # the queue in C's steps (asked several times a promotion, of the whole queue); the
    # running tasks are few
    look = Look.of(index, look)
    return (any(map(_MEMORY, index.active)) or any(map((1).__ne__, map(_SLOTS, index.active)))
            or look.memory or look.slots)


def short_size(size: float) -> str:
    """A size as `waiting for: memory (6.0G of 8.0G in use)` says it."""
    for unit, scale in (("T", 1024**4), ("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if size >= scale:
            return f"{size / scale:.1f}{unit}"
    return f"{int(size)}B"


def task_key(cfg: Config, task: Task) -> tuple[int, int, int]:
    """Order within a lane. `next TASK` puts a task before all (the latest first); then
    priority (not under fifo); then ids, the admission sequence: they never repeat or go
    back, where timestamps can tie."""
    return (-task.first, 0 if cfg.strategy == "fifo" else RANK[task.priority], task.id)


_MEMORY, _SLOTS = (attrgetter(name) for name in ("memory", "slots"))


def order_key(index: Index, cfg: Config, look: Look | None = None) -> Callable[[Task], Any]:
    """task_key as a key for sorting `index.queued`: under fifo with no task put first
    (`next`), the usual case, the id alone, the same order, compared in C (a drain at 20,000
    queued spent 2.7 s of its 13 in 10 million task_key calls: three passes a promotion)."""
    if cfg.strategy == "fifo" and not Look.of(index, look).first:
        return by_id
    return lambda t: task_key(cfg, t)


def simple_order(index: Index, cfg: Config, waits: bool = True, look: Look | None = None) -> bool:
    """True when no limit can hold one queued task while another passes it: then every pick
    takes the smallest key of all heads, and the start order is a plain sort (fifo, priority).
    `waits=False`: tasks that wait for their time (a retry's delay, `delegate --at`) are left
    out of the question (selection.successor bounds its promise by their times instead)."""
    return (
        cfg.strategy in ("fifo", "priority")
        and cfg.max_active_per_source is None
        and cfg.min_start_interval_s is None
        and not index.holds
        and not cfg.budgets.enabled
        and not any(p.max_agents is not None or p.limit.window is not None for p in cfg.agents.values())
        # passes over the queue in C, not a Python step a task: delegate asks this of a long
        # queue on every call (issue 26: one admission at 20,000 queued). A group first: its
        # pass ends at the first task in one (a queue held in a group: each tick after an
        # expiry asks it again, and read the whole queue twice before it).
        and not (cfg.groups and any(map(cfg.groups.__contains__, map(_GROUP, index.queued))))
        and not (look := Look.of(index, look)).after
        and not (waits and look.timed)
        and not look.stashed
    )


_GROUP = attrgetter("group")


def may_release(index: Index, cfg: Config, look: Look | None = None) -> bool:
    """Could Board.next_release find a time? Only what its branches read holds a queued task
    until later: a rate limit, a preset's hold, a window quota, a daily budget, a task waiting
    for its time. Asked before a Board is built (a tick with a free slot at 10,000 queued laid
    the whole queue into lanes to find nothing)."""
    return bool(cfg.min_start_interval_s or index.holds or cfg.budgets.enabled
                or any(p.limit.window is not None for p in cfg.agents.values())
                or Look.of(index, look).timed)


def groups_full(index: Index, cfg: Config) -> bool:
    """Is every queued task in a group that is full or paused? Then Board.free refuses every
    lane (its group's branch: a task takes at least one slot) and Board.pick starts nothing
    until a running task ends, the config changes or the queue changes. Asked before a Board
    is built: a deadline's tick at 10,000 queued behind a full group laid the whole queue
    into lanes to start nothing (25 ms a tick: expiries and run timeouts fired that much later).
    One pass in C over the queue (its set of groups); the running tasks are few."""
    if not cfg.groups:
        return False
    groups = set(map(_GROUP, index.queued))
    if None in groups or not groups <= cfg.groups.keys():
        return False  # a task outside every group (or in one removed from the config) may start
    taken: Counter[str] = Counter()
    for t in index.active:
        if t.group in groups:
            taken[t.group] += t.slots
    paused = index.paused_groups
    return all(g in paused or taken[g] >= cfg.groups[g].max_agents for g in groups)


def route_of(task: Task) -> tuple[str, ...]:
    """The presets a queued task may start on, in order (README, "Provider limits"): its
    failover order, except that a run interrupted with a session to resume (its command is the
    resume) stays with its preset unless the task allows a fresh start elsewhere."""
    if task.agent is None:
        return ()
    if not task.route or (task.first_command is not None and not task.fallback_fresh):
        return (task.agent,)
    return tuple(task.route)


class Board:
    """What the selection needs from an Index, in a form cheap to play forward."""

    def __init__(self, index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
                 lanes: bool = True, host: str | None = None, budget: int | None = None, look: Look | None = None):
        self.cfg = cfg
        self.now = now
        self.hold = guard_hold(cfg, resources)
        self.available = resources.available_memory if resources is not None else None
        # Capacity (fits): slots taken (a task may take several) and, once any task declares
        # memory, the memory declared by the running tasks of this machine (`host` in a
        # cluster, whose `budget` is its own) against its budget.
        self.slots_used = sum(t.slots for t in index.active)
        self.budget: int | None = None
        if accounts(index, cfg, look):
            self.budget = budget if budget is not None else cfg.memory_budget
        self.blocked: tuple[Task, str] | None = None  # the task the last pick would start, and why it does not fit
        # `kugetsu pause`: like the guard, it holds every start alike (see drain).
        self.pause: str | None = "paused" if index.paused else None
        self.paused_groups = frozenset(index.paused_groups)
        self.fair = cfg.strategy == "fair"
        self.source_limit = cfg.max_active_per_source
        self.caps = {name: g.max_agents for name, g in cfg.groups.items()}
        # Per-preset caps, and presets held (their provider's limit, or by hand) until when.
        self.agent_caps = {name: p.max_agents for name, p in cfg.agents.items() if p.max_agents is not None}
        self.holds = dict(index.holds)
        # Daily budgets (budgets.*): what was spent today, against which a source or a preset
        # over its budget starts nothing more until midnight (budget_why).
        self.spend = index.spend if cfg.budgets.enabled else None
        # Window quotas (limit.window): each preset's window so far, a copy that take() counts in.
        self.window_presets = frozenset(n for n, p in cfg.agents.items() if p.limit.window is not None)
        self.windows = {a: msgspec.structs.replace(w) for a, w in index.windows.items()} if self.window_presets else {}
        interval = cfg.min_start_interval_s
        self.interval = timedelta(seconds=interval) if interval else None
        self.starts = index.starts
        self.mark = {s: m.n for s, m in index.last_start.items()}  # fair: the start counter
        # rate limit: when each source may start again
        self.ready = {s: m.at + self.interval for s, m in index.last_start.items()} if self.interval else {}
        # Running tasks in start order (lifecycle.start appends to index.active): when the
        # simulation frees a slot, the oldest ends first.
        self.running: deque[tuple[str, str | None, str | None, int, int]] = deque(
            (t.source, self.group_of(t), t.agent, t.slots,
             memory_of(cfg, t) if self.budget is not None and (host is None or t.host == host) else 0)
            for t in index.active)
        self.mem_used = sum(m for _, _, _, _, m in self.running)
        self.by_source = Counter(s for s, _, _, _, _ in self.running)
        self.by_group: Counter[str] = Counter()  # slots taken in each group
        for _, g, _, n, _ in self.running:
            if g is not None:
                self.by_group[g] += n
        self.by_agent = Counter(a for _, _, a, _, _ in self.running if a is not None)
        # `delegate --after`: a task whose dependencies are still live is parked outside the
        # lanes (it must not hold up the tasks behind it in its lane) until they have ended.
        # lanes=False: a Board for `why` alone, which needs only the counts (selection.waiting_for_one).
        self.running_ids: deque[int] = deque(t.id for t in index.active)
        self.parked: dict[int, tuple[Task, set[int]]] = {}
        live = {t.id for t in index.live()} if lanes and any(t.after for t in index.queued) else set()
        queued: dict[Lane, list[tuple[tuple[int, int], Task]]] = {}
        for t in index.queued if lanes else ():
            if t.stashed_at is not None:  # `stash`: set aside, out of every lane until unstashed
                continue
            if t.after and (waits := {d for d in t.after if d in live}):
                self.parked[t.id] = (t, waits)
                continue
            queued.setdefault(self.lane_of(t), []).append((task_key(cfg, t), t))
        # Lanes are never empty: a lane leaves the dict with its last task.
        self.lanes = {k: deque(sorted(v, key=lambda kt: kt[0])) for k, v in queued.items()}

    def lane_of(self, task: Task) -> Lane:
        return (task.source, self.group_of(task), route_of(task), task.not_before,
                task.not_before is not None and not task.attempts)

    # ---- presets: holds, caps, failover --------------------------------------------------

    def held_until(self, agent: str | None) -> datetime | None:
        """The end of a hold on this preset that holds it now (datetime.max: by hand, no end)."""
        hold = self.holds.get(agent) if agent is not None else None
        if hold is None:
            return None
        if hold.until is None:
            return datetime.max.replace(tzinfo=self.now.tzinfo)
        return hold.until if hold.until > self.now else None

    def budget_why(self, kind: str, name: str) -> str | None:
        """`budget pm 20.00/20.00 USD, resets 00:00` when the source (kind "sources") or
        preset ("agents") has spent its daily budget today, else None."""
        if self.spend is None or self.spend.day != budgets.day_of(self.now):
            return None
        budget = getattr(self.cfg.budgets, kind).get(name)
        return budgets.daily_over(name, budget, getattr(self.spend, kind).get(name), self.now) if budget else None

    def window_why(self, agent: str) -> str | None:
        """`claude window quota 12/12 starts, resets 17:00` (or a probe under way), else None."""
        if agent not in self.window_presets:
            return None
        return budgets.window_why(self.cfg, agent, self.windows.get(agent), self.now, self.running_ids)

    def preset_held(self, agent: str) -> str | None:
        """Why this preset refuses every start now (a hold: its provider's limit, by hand; its
        daily budget spent), or None. A failover order passes over such a preset; a preset
        merely full is waited for."""
        until = self.held_until(agent)
        if until is None:
            return self.budget_why("agents", agent) or self.window_why(agent)
        hold = self.holds[agent]
        if hold.until is None:
            return hold.reason
        # A limit's tasks are retried then; a hold by hand is simply over then.
        return (f"{hold.reason} until {clock(until, self.now)}" if hold.reason.endswith("by hand")
                else f"{hold.reason}, retry at {clock(until, self.now)}")

    def preset_full(self, agent: str) -> str | None:
        if agent in self.agent_caps and self.by_agent[agent] >= self.agent_caps[agent]:
            return f"agent {agent} full ({self.by_agent[agent]}/{self.agent_caps[agent]} running)"
        return None

    def preset_for(self, route: tuple[str, ...]) -> str | None:
        """The preset a task of this route starts on now (failover): the first not held, if
        it has room; None when that one is full (its turn comes) or all are held."""
        for agent in route:
            if self.preset_held(agent) is None:
                return agent if self.preset_full(agent) is None else None
        return None

    def route_why(self, route: tuple[str, ...]) -> str | None:
        """Why no preset of the route takes a task now: each one's reason, up to the one waited for."""
        reasons = []
        for agent in route:
            held = self.preset_held(agent)
            reasons.append(held or self.preset_full(agent))
            if held is None:
                break
        return "; ".join(r for r in reasons if r) or None

    def group_of(self, task: Task) -> str | None:
        # A group removed from the config no longer limits the tasks that named it.
        return task.group if task.group is not None and task.group in self.cfg.groups else None

    # ---- the rules --------------------------------------------------------------------

    def free(self, source: str, group: str | None, route: tuple[str, ...] = (), not_before: datetime | None = None,
             asked: bool = False, slots: int = 1) -> bool:
        """May a task of this lane start now, given a free global slot? (`why` in words.)"""
        if self.source_limit is not None and self.by_source[source] >= self.source_limit:
            return False
        if self.interval is not None and source in self.ready and self.ready[source] > self.now:
            return False
        if route and self.preset_for(route) is None:
            return False
        if self.budget_why("sources", source) is not None:
            return False
        if not_before is not None and not_before > self.now:
            return False
        if group is not None and group in self.paused_groups:
            return False
        return group is None or self.by_group[group] + slots <= self.caps[group]

    def why(self, source: str, group: str | None, route: tuple[str, ...] = (), not_before: datetime | None = None,
            asked: bool = False, slots: int = 1) -> str | None:
        """Why a task of this lane may not start now even with a free global slot, or None.
        A failover order that has no preset with room names each preset's reason."""
        if route and self.preset_for(route) is None:
            return self.route_why(route)
        if not_before is not None and not_before > self.now:
            return f"{'starts' if asked else 'retry'} at {clock(not_before, self.now)}"
        limit = self.source_limit
        if limit is not None and self.by_source[source] >= limit:
            return f"source {source} has {self.by_source[source]} running (limit {limit})"
        if self.interval is not None and source in self.ready and self.ready[source] > self.now:
            wait = math.ceil((self.ready[source] - self.now).total_seconds())
            return f"rate limit: source {source} may start again in {format_duration(wait)}"
        spent = self.budget_why("sources", source)
        if spent is not None:
            return spent
        if group is not None and group in self.paused_groups:
            return f"group {group} paused"
        if group is not None and self.by_group[group] + slots > self.caps[group]:
            took = f", it takes {slots}" if slots > 1 else ""
            return f"group {group} full ({self.by_group[group]}/{self.caps[group]} running{took})"
        return None

    def fits(self, task: Task) -> str | None:
        """THE capacity check: does `task` fit what the machine has left now — its slots of
        max_agents, its declared memory within the budget, and the pressure the readings show
        (the resource guard; available memory below what it declares)? None: it fits; else
        why not, in words. Unlike a lane's limits, a task that does not fit holds the tasks
        behind it (no backfill): a big task is not passed by small ones for ever, and the
        start order stays the sort."""
        if self.hold is not None:
            return self.hold
        if self.slots_used + task.slots > self.cfg.max_agents:
            return f"slots ({self.slots_used} of {self.cfg.max_agents} in use, it takes {task.slots})"
        if self.budget is None:
            return None
        need = memory_of(self.cfg, task)
        if need and self.mem_used + need > self.budget:
            return f"memory ({short_size(self.mem_used)} of {short_size(self.budget)} in use, it needs {short_size(need)})"
        if need and self.available is not None and need > self.available:
            return f"memory ({short_size(self.available)} available, it needs {short_size(need)})"
        return None

    def never(self, task: Task) -> str | None:
        """Why `task` can never start here (its declaration is beyond the whole machine, after
        a lowering of max_agents or max_memory since it was admitted): its lane stands aside
        rather than hold every task behind it."""
        if task.slots > self.cfg.max_agents:
            return f"it takes {task.slots} slots, more than max_agents ({self.cfg.max_agents}): it can never start"
        need = memory_of(self.cfg, task) if self.budget is not None else 0
        if self.budget is not None and need > self.budget:
            return f"it needs {short_size(need)}, more than max_memory ({short_size(self.budget)}): it can never start"
        return None

    def pick(self) -> Task | None:
        """THE selection: the queued task that starts next now, or None.

        fifo and priority: the smallest task key among the lanes that may start; fair: the
        same, after the source whose last start is oldest (round-robin)."""
        self.blocked = None
        if self.hold is not None or self.pause is not None or self.slots_used >= self.cfg.max_agents:
            return None
        best: Task | None = None
        best_key: tuple = ()
        fair, mark = self.fair, self.mark
        for lane_id, lane in self.lanes.items():
            source = lane_id[0]
            key: tuple = lane[0][0]
            task = lane[0][1]
            if fair:  # `next TASK` comes before every source's turn
                key = (NEVER - 1 if key[0] else mark.get(source, NEVER), key)
            if best is not None and key >= best_key:
                continue
            if self.free(*lane_id, task.slots) and self.never(task) is None:
                best, best_key = task, key
        if best is not None and (why := self.fits(best)) is not None:
            self.blocked = (best, why)
            return None
        return best

    def take(self, task: Task) -> str | None:
        """Record `task` as started now, as lifecycle.start does on the Index; returns the preset
        it starts on (its failover order's first with room)."""
        lane_id = self.lane_of(task)
        group = lane_id[1]
        agent = self.preset_for(lane_id[2]) if lane_id[2] else task.agent
        lane = self.lanes[lane_id]
        if lane[0][1] is not task:
            raise ValueError(f"task #{task.id} is not the head of its lane: only pick() chooses what starts")
        lane.popleft()
        if not lane:
            del self.lanes[lane_id]
        memory = memory_of(self.cfg, task) if self.budget is not None else 0
        self.running.append((task.source, group, agent, task.slots, memory))
        self.running_ids.append(task.id)
        if agent in self.window_presets:
            budgets.window_start(self.cfg, self.windows, agent, task.id, self.now)
        self.slots_used += task.slots
        self.mem_used += memory
        self.by_source[task.source] += 1
        if group is not None:
            self.by_group[group] += task.slots
        if agent is not None:
            self.by_agent[agent] += 1
        self.starts += 1
        self.mark[task.source] = self.starts
        if self.interval is not None:
            self.ready[task.source] = self.now + self.interval
        return agent

    def finish_oldest(self) -> None:
        """The oldest running task ends (as a success: a forecast cannot know better)."""
        source, group, agent, slots, memory = self.running.popleft()
        self.slots_used -= slots
        self.mem_used -= memory
        self.by_source[source] -= 1
        if group is not None:
            self.by_group[group] -= slots
        if agent is not None:
            self.by_agent[agent] -= 1
        done = self.running_ids.popleft()
        for tid, (task, waits) in list(self.parked.items()):
            waits.discard(done)
            if not waits:  # its dependencies have all ended: it joins its lane
                del self.parked[tid]
                key = task_key(self.cfg, task)
                lane = self.lanes.setdefault(self.lane_of(task), deque())
                lane.insert(next((i for i, (k, _) in enumerate(lane) if k > key), len(lane)), (key, task))

    def next_release(self) -> datetime | None:
        """The earliest moment a rate limit, a hold on a preset or a retry's delay that holds
        a queued task runs out."""
        times = []
        for source, _, route, not_before, _ in self.lanes:
            if self.interval is not None and source in self.ready and self.ready[source] > self.now:
                times.append(self.ready[source])
            for agent in route:
                hold = self.holds.get(agent)
                if hold is not None and hold.until is not None and hold.until > self.now:
                    times.append(hold.until)
                window = self.windows.get(agent)
                if window is not None and self.window_why(agent) is not None:
                    times.append(budgets.window_end(self.cfg, agent, window))  # type: ignore[arg-type]
            if not_before is not None and not_before > self.now:
                times.append(not_before)
            if self.spend is not None and (self.budget_why("sources", source) is not None
                                           or any(self.budget_why("agents", a) is not None for a in route)):
                times.append(budgets.midnight_after(self.now))  # daily budgets start over
        return min(times, default=None)

    def queued_left(self) -> bool:
        return bool(self.lanes) or bool(self.parked)

    # ---- playing forward ----------------------------------------------------------------

    def drain(self, first: int | None = None) -> list[Task]:
        """Every queued task in the order it starts if nothing new arrives, taking slots as
        soon as they are free; when none is free the oldest running task ends; when one is
        free but every waiting task is held by a rate limit, time moves on to its end.
        The resource guard holds every task alike, so it changes when, never the order: a
        Board for positions is built without readings; a global pause likewise is lifted here.
        A paused group holds its tasks while others pass them: they come last. `first`: stop
        once that many are in order (each pick depends on those before it, never on those
        after: the warm wrappers' first 100 of a 10,000-task queue in a group played all
        10,000 forward, 30 ms of every tick with every slot busy)."""
        self.pause = None
        order: list[Task] = []
        while self.queued_left() and (first is None or len(order) < first):
            task = self.pick()
            if task is not None:
                self.take(task)
                order.append(task)
                continue
            release = self.next_release() if self.slots_used < self.cfg.max_agents else None
            if release is not None:
                self.now = release
            elif self.running:
                self.finish_oldest()
            elif any(h.until is None for h in self.holds.values()):
                # Only holds by hand are left, which no time ends: the order is theirs once released.
                self.holds = {a: h for a, h in self.holds.items() if h.until is not None}
            else:  # nothing can ever free them: a paused group's tasks, and those after them
                parked = [(task_key(self.cfg, t), t) for t, _ in self.parked.values()]
                return order + [t for _, t in sorted([kt for lane in self.lanes.values() for kt in lane] + parked,
                                                     key=lambda kt: kt[0])]
        return order
