"""Scheduling policies: who may start next, and why the others wait. Pure, like pm.

Everything goes through one selection, `Board.pick`: the scheduler asks it which queued
tasks start now (pm.plan_starts), and positions come from playing it forward on a copy of
the state (`Board.drain`) with slots freeing one at a time and nothing new arriving. So a
position is the truth for every strategy and limit: there is no second ordering to drift.

A Board groups queued tasks into lanes by (source, group, agent preset, retry time): every
limit applies to a whole source, group or preset (its max_agents, a hold on its provider),
and a retry's delay to that task alone, so within a lane only the head can be next, and a
pick looks at one task per lane instead of the whole queue.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from datetime import datetime, timedelta

import msgspec

from kugetsu.config import Config, format_duration, format_size
from kugetsu.models import PRIORITIES, Index, Task

Lane = tuple[str, str | None, str | None, datetime | None]  # source, group, agent, not_before

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


def task_key(cfg: Config, task: Task) -> tuple[int, int, int]:
    """Order within a lane. `next TASK` puts a task before all (the latest first); then
    priority (not under fifo); then ids, the admission sequence: they never repeat or go
    back, where timestamps can tie."""
    return (-task.first, 0 if cfg.strategy == "fifo" else RANK[task.priority], task.id)


def simple_order(index: Index, cfg: Config) -> bool:
    """True when no limit can hold one queued task while another passes it: then every pick
    takes the smallest key of all heads, and the start order is a plain sort (fifo, priority)."""
    return (
        cfg.strategy in ("fifo", "priority")
        and cfg.max_active_per_source is None
        and cfg.min_start_interval_s is None
        and not index.holds
        and not any(p.max_agents is not None for p in cfg.agents.values())
        # one pass over the queue (delegate asks this of a long queue on every call)
        and not any(t.after or t.not_before is not None or (t.group is not None and t.group in cfg.groups)
                    or t.stashed_at is not None for t in index.queued)
    )


def clock(at: datetime, now: datetime) -> str:
    """A moment as people read it on this machine: 15:00, or 15:00:12 within the minute; one
    more than a day from `now` with its date: Nov 27 15:00 (a weekly limit's reset must not
    read as today's)."""
    try:
        local = at.astimezone()
    except (OverflowError, ValueError):  # a recorded time at the end of what this zone can hold
        return at.isoformat()
    text = local.strftime("%H:%M:%S" if local.second else "%H:%M")
    if abs(at - now) > timedelta(days=1):
        text = f"{local.strftime('%b')} {local.day} {text}"
    return text


class Board:
    """What the selection needs from an Index, in a form cheap to play forward."""

    def __init__(self, index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
                 lanes: bool = True):
        self.cfg = cfg
        self.now = now
        self.hold = guard_hold(cfg, resources)
        # `kugetsu pause`: like the guard, it holds every start alike (see drain).
        self.pause: str | None = "paused" if index.paused else None
        self.paused_groups = frozenset(index.paused_groups)
        self.fair = cfg.strategy == "fair"
        self.source_limit = cfg.max_active_per_source
        self.caps = {name: g.max_agents for name, g in cfg.groups.items()}
        # Per-preset caps, and presets held (their provider's limit, or by hand) until when.
        self.agent_caps = {name: p.max_agents for name, p in cfg.agents.items() if p.max_agents is not None}
        self.holds = dict(index.holds)
        interval = cfg.min_start_interval_s
        self.interval = timedelta(seconds=interval) if interval else None
        self.starts = index.starts
        self.mark = {s: m.n for s, m in index.last_start.items()}  # fair: the start counter
        # rate limit: when each source may start again
        self.ready = {s: m.at + self.interval for s, m in index.last_start.items()} if self.interval else {}
        # Running tasks in start order (pm.start appends to index.active): when the
        # simulation frees a slot, the oldest ends first.
        self.running: deque[tuple[str, str | None, str | None]] = deque(
            (t.source, self.group_of(t), t.agent) for t in index.active)
        self.by_source = Counter(s for s, _, _ in self.running)
        self.by_group = Counter(g for _, g, _ in self.running if g is not None)
        self.by_agent = Counter(a for _, _, a in self.running if a is not None)
        # `delegate --after`: a task whose dependencies are still live is parked outside the
        # lanes (it must not hold up the tasks behind it in its lane) until they have ended.
        # lanes=False: a Board for `why` alone, which needs only the counts (pm.waiting_for_one).
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
        return (task.source, self.group_of(task), task.agent, task.not_before)

    def held_until(self, agent: str | None) -> datetime | None:
        """The end of a hold on this preset that holds it now (datetime.max: by hand, no end)."""
        hold = self.holds.get(agent) if agent is not None else None
        if hold is None:
            return None
        if hold.until is None:
            return datetime.max.replace(tzinfo=self.now.tzinfo)
        return hold.until if hold.until > self.now else None

    def group_of(self, task: Task) -> str | None:
        # A group removed from the config no longer limits the tasks that named it.
        return task.group if task.group is not None and task.group in self.cfg.groups else None

    # ---- the rules --------------------------------------------------------------------

    def free(self, source: str, group: str | None, agent: str | None = None, not_before: datetime | None = None) -> bool:
        """May a task of this lane start now, given a free global slot? (`why` in words.)"""
        if self.source_limit is not None and self.by_source[source] >= self.source_limit:
            return False
        if self.interval is not None and source in self.ready and self.ready[source] > self.now:
            return False
        if agent is not None and (self.held_until(agent) is not None
                                  or (agent in self.agent_caps and self.by_agent[agent] >= self.agent_caps[agent])):
            return False
        if not_before is not None and not_before > self.now:
            return False
        if group is not None and group in self.paused_groups:
            return False
        return group is None or self.by_group[group] < self.caps[group]

    def why(self, source: str, group: str | None, agent: str | None = None, not_before: datetime | None = None) -> str | None:
        """Why a task of this lane may not start now even with a free global slot, or None."""
        until = self.held_until(agent)
        if until is not None:
            hold = self.holds[agent]  # type: ignore[index]
            return f"{hold.reason}, retry at {clock(until, self.now)}" if hold.until is not None else f"{hold.reason}"
        if agent is not None and agent in self.agent_caps and self.by_agent[agent] >= self.agent_caps[agent]:
            return f"agent {agent} full ({self.by_agent[agent]}/{self.agent_caps[agent]} running)"
        if not_before is not None and not_before > self.now:
            return f"retry at {clock(not_before, self.now)}"
        limit = self.source_limit
        if limit is not None and self.by_source[source] >= limit:
            return f"source {source} has {self.by_source[source]} running (limit {limit})"
        if self.interval is not None and source in self.ready and self.ready[source] > self.now:
            wait = math.ceil((self.ready[source] - self.now).total_seconds())
            return f"rate limit: source {source} may start again in {format_duration(wait)}"
        if group is not None and group in self.paused_groups:
            return f"group {group} paused"
        if group is not None and self.by_group[group] >= self.caps[group]:
            return f"group {group} full ({self.by_group[group]}/{self.caps[group]} running)"
        return None

    def pick(self) -> Task | None:
        """THE selection: the queued task that starts next now, or None.

        fifo and priority: the smallest task key among the lanes that may start; fair: the
        same, after the source whose last start is oldest (round-robin)."""
        if self.hold is not None or self.pause is not None or len(self.running) >= self.cfg.max_agents:
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
            if self.free(*lane_id):
                best, best_key = task, key
        return best

    def take(self, task: Task) -> None:
        """Record `task` as started now, as pm.start does on the Index."""
        lane_id = self.lane_of(task)
        group = lane_id[1]
        lane = self.lanes[lane_id]
        if lane[0][1] is not task:
            raise ValueError(f"task #{task.id} is not the head of its lane: only pick() chooses what starts")
        lane.popleft()
        if not lane:
            del self.lanes[lane_id]
        self.running.append((task.source, group, task.agent))
        self.running_ids.append(task.id)
        self.by_source[task.source] += 1
        if group is not None:
            self.by_group[group] += 1
        if task.agent is not None:
            self.by_agent[task.agent] += 1
        self.starts += 1
        self.mark[task.source] = self.starts
        if self.interval is not None:
            self.ready[task.source] = self.now + self.interval

    def finish_oldest(self) -> None:
        """The oldest running task ends (as a success: a forecast cannot know better)."""
        source, group, agent = self.running.popleft()
        self.by_source[source] -= 1
        if group is not None:
            self.by_group[group] -= 1
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
        for source, _, agent, not_before in self.lanes:
            if self.interval is not None and source in self.ready and self.ready[source] > self.now:
                times.append(self.ready[source])
            hold = self.holds.get(agent) if agent is not None else None
            if hold is not None and hold.until is not None and hold.until > self.now:
                times.append(hold.until)
            if not_before is not None and not_before > self.now:
                times.append(not_before)
        return min(times, default=None)

    def queued_left(self) -> bool:
        return bool(self.lanes) or bool(self.parked)

    # ---- playing forward ----------------------------------------------------------------

    def drain(self) -> list[Task]:
        """Every queued task in the order it starts if nothing new arrives, taking slots as
        soon as they are free; when none is free the oldest running task ends; when one is
        free but every waiting task is held by a rate limit, time moves on to its end.
        The resource guard holds every task alike, so it changes when, never the order: a
        Board for positions is built without readings; a global pause likewise is lifted here.
        A paused group holds its tasks while others pass them: they come last."""
        self.pause = None
        order: list[Task] = []
        while self.queued_left():
            task = self.pick()
            if task is not None:
                self.take(task)
                order.append(task)
                continue
            release = self.next_release() if len(self.running) < self.cfg.max_agents else None
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
