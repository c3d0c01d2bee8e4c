"""The capacity manager: every scheduling rule, as functions of an Index, a Config and a clock.

No I/O, no processes, no time.time(): the caller passes `now` and performs the effects
(spawn, signal) that these functions decide. Functions that change state change only the
Index they are given and return the Events that describe the change.

Who starts next is decided in exactly one place, `policy.Board.pick`; the scheduler
(plan_starts), positions, admission feedback and the reasons tasks wait all derive from it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec
from datetime import datetime, timedelta

from kugetsu.core import budgets, limits, placement
from kugetsu.config.load import cluster_host
from kugetsu.config.model import Config
from kugetsu.config.units import format_duration, format_size, MAX_DURATION, parse_duration, parse_size
from kugetsu.errors import (AmbiguousName, EmptyPrompt, InvalidHost, NeedsPrompt, Nested, NoSuchTask, NotClustered, NotFound,
                            QueueFull, Rejected, UnknownDependency, UnknownGroup, UsageError)
from kugetsu.agents.report import Usage
from kugetsu.core.models import (PRIORITIES, Attempt, ClockError, Event, Hold, Index, LimitHit, SourceMark, Task, TaskState,
                            valid_host, valid_name)
from kugetsu.core.placement import Here, ours, starts_anywhere
# Resources, guard_hold and clock are also used by the front ends, through pm.
from kugetsu.core.policy import (Board, Resources, accounts, clock, guard_hold, memory_of, short_size,  # noqa: F401
                            simple_order, task_key)

# ---- who runs next ---------------------------------------------------------------------


def slots_used(index: Index) -> int:
    """Slots the running tasks take (`delegate --slots`: a task may take more than one)."""
    return sum(t.slots for t in index.active)


def free_slots(index: Index, cfg: Config) -> int:
    return max(0, cfg.max_agents - slots_used(index))


def plan_starts(index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
                here: Here | None = None) -> list[Task]:
    """Every queued task that may start now, in order, without changing the index.
    `resources`: the machine's readings for the resource guard (None: no guard check).
    `here`: in a cluster, the machine deciding: only what can run there, within its slots."""
    if not starts_anywhere(cfg, here):
        return []
    if slots_used(index) >= cfg.max_agents or index.paused or guard_hold(cfg, resources) is not None:
        return []  # what Board.pick says at once, without sorting the whole queue into lanes
    room = None
    if here is not None:
        room = placement.room(index, here)
        index = placement.candidates(index, here)
    return [t for t, _ in _plan(index, cfg, now, resources, room, here)]


def _plan(index: Index, cfg: Config, now: datetime, resources: Resources | None, room: int | None,
          here: Here | None = None) -> list[tuple[Task, str | None]]:
    """plan_starts with the preset each task starts on (its failover order's choice).
    `room`: this machine's own free slots (a cluster), which a task may take several of."""
    if here is not None:
        board = Board(index, cfg, now, resources, host=here.name, budget=here.max_memory)
    else:
        board = Board(index, cfg, now, resources)
    started: list[tuple[Task, str | None]] = []
    while (task := board.pick()) is not None:
        if room is not None:  # this machine's own slots: the next task waits for them, as for the cluster's
            if task.slots > room:
                break
            room -= task.slots
        started.append((task, board.take(task)))
    return started


def starts_now(index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
               here: Here | None = None) -> list[tuple[Task, str | None]]:
    """plan_starts, each task with the preset it starts on (pm.start's `agent`)."""
    tasks = plan_starts(index, cfg, now, resources, here)
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


def successor(index: Index, cfg: Config) -> Successor | None:
    """The queued task that the next slot to free goes to, whichever running task frees it,
    as long as the index, the config and `until` hold: what plan_starts will pick in the
    transaction that records the exit. The service lets it go the moment an agent exits,
    ahead of that transaction. None wherever the answer could depend on which task ends, on
    the clock or on the machine (source, group and rate limits, fair, the resource guard),
    or when one exit frees no slot (more running than max_agents after a lowering). A task
    waiting for its time that sorts before it bounds `until`."""
    if (
        not index.queued
        or cfg.store is not None  # a cluster: the next slot may free on another machine
        or index.paused
        or len(index.active) != cfg.max_agents
        or cfg.resource_guard.enabled
        or accounts(index, cfg)  # slots and memory: one exit may not make room for the next
        or not simple_order(index, cfg, waits=False)
        or any(may_requeue(cfg, t) for t in index.active)  # it would come back ahead of the successor
        or any(t.route for t in index.queued)  # it may start on another preset than its command's
    ):
        return None
    due = [t for t in index.queued if t.not_before is None]  # simple_order: none is stashed
    if not due:
        return None
    first = min(due, key=lambda t: task_key(cfg, t))
    key = task_key(cfg, first)
    # A task waiting for its time (a retry's delay, `delegate --at`) that sorts before it
    # would take the slot once that time has come: the promise holds until then.
    waits = [t.not_before for t in index.queued if t.not_before is not None and task_key(cfg, t) < key]
    return Successor(first, min(filter(None, [first.expires_at, *waits]), default=None))


def start_order(index: Index, cfg: Config, now: datetime) -> list[Task]:
    """Queued tasks in the order they will really start if nothing new arrives: the same
    selection as plan_starts, played forward on a copy (policy.Board.drain)."""
    if simple_order(index, cfg):  # the same order, as a sort (property-tested against drain)
        return sorted(index.queued, key=lambda t: task_key(cfg, t))
    return Board(index, cfg, now).drain()


def positions(index: Index, cfg: Config, now: datetime) -> dict[int, int]:
    """Task id -> 1-based position in start order. Position 1 starts next."""
    return {t.id: i for i, t in enumerate(start_order(index, cfg, now), 1)}


def position(index: Index, cfg: Config, now: datetime, task: Task) -> int | None:
    """positions(...).get(task.id), for one task: without sorting the queue when the start
    order is a plain sort (a count of the tasks that sort before it)."""
    if task.state is not TaskState.QUEUED or task.stashed_at is not None:
        return None
    if simple_order(index, cfg):
        key = task_key(cfg, task)
        return 1 + sum(1 for t in index.queued if task_key(cfg, t) < key)
    return positions(index, cfg, now).get(task.id)


def waiting_for_one(index: Index, cfg: Config, now: datetime, task: Task, resources: Resources | None = None) -> str | None:
    """waiting_for(...).get(task.id), for one queued task: the reason of its lane only."""
    # its dependencies, by name; what fits (slots, memory); its stash: the full look
    if task.after or task.stashed_at is not None or accounts(index, cfg):
        return waiting_for(index, cfg, now, resources).get(task.id)
    board = Board(index, cfg, now, resources, lanes=False)
    return board.pause or board.hold or board.why(*board.lane_of(task))


def waiting_for(index: Index, cfg: Config, now: datetime, resources: Resources | None = None) -> dict[int, str]:
    """Task id -> why that queued task waits, when it is not simply behind others (a source
    or group limit, a rate limit, the resource guard, a pause, its dependencies, a stash).
    Tasks without a reason are left out."""
    quick = Board(index, cfg, now, resources, lanes=False)  # the counts only, no order
    if (quick.pause is None and quick.hold is None and quick.source_limit is None and quick.interval is None
            and not quick.caps and not quick.agent_caps and not quick.holds and quick.spend is None
            and not quick.window_presets and quick.budget is None
            and not any(t.after or t.not_before or t.slots != 1 or t.stashed_at for t in index.queued)):
        return {}  # nothing that could hold a task
    board = Board(index, cfg, now, resources)
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


def capacity(index: Index, cfg: Config, now: datetime | None = None) -> Capacity:
    """Counts only: cheap at any queue length (no order is computed). While `pause` holds
    every start, no slot is free to a new task: free is 0, so that "free > 0: a task delegated
    now starts at once" (the PM instructions) holds."""
    memory = {}
    if accounts(index, cfg):
        here = cluster_host(cfg)  # in a cluster, this machine's tasks against its own budget
        memory = {"max_memory": cfg.memory_budget,
                  "memory_used": sum(memory_of(cfg, t) for t in index.active if here is None or t.host == here)}
    return Capacity(max_agents=cfg.max_agents, active=len(index.active), queued=len(index.queued),
                    free=0 if index.paused else free_slots(index, cfg), max_queue=cfg.max_queue, paused=index.paused,
                    paused_groups=sorted(index.paused_groups), holds=holds_view(index, now),
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
    if task.stop is not None:
        raise UsageError(f"task {task.name} (#{task.id}) is being stopped ({task.reason}): it cannot be {what}", code=1)
    if task.pid is None:
        raise UsageError(f"task {task.name} (#{task.id}) is starting (its agent has no process yet): try again in a"
                         " moment", code=1)


def unpause(task: Task, now: datetime) -> None:
    """The paused time so far joins `paused_s` (its timeout moves by as much)."""
    if task.paused_at is not None:
        task.paused_s += max(0.0, (now - task.paused_at).total_seconds())
        task.paused_at = None


def pause_task(task: Task, now: datetime, on: bool, by: str = "cli") -> list[Event]:
    """`pause TASK` (on) / `resume TASK`: its processes stop (SIGSTOP) or go on (SIGCONT): the
    caller signals them after the commit. Its slot stays taken; its timeout's clock stops too.
    No event when nothing changes."""
    _controllable(task, "paused" if on else "resumed")
    if (task.paused_at is not None) == on:
        return []
    if on:
        task.paused_at = now
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


def holds_view(index: Index, now: datetime | None) -> dict[str, HoldView]:
    """The holds in force at `now` (every recorded one when now is None), with their tasks."""
    if not index.holds:
        return {}
    return {agent: HoldView(until=h.until, reason=h.reason, since=h.since,
                            queued=sum(1 for t in index.queued if t.agent == agent))
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


def queue_view(index: Index, cfg: Config, now: datetime, resources: Resources | None = None) -> QueueView:
    order = start_order(index, cfg, now)
    stashed = [t for t in index.queued if t.stashed_at is not None] if len(order) != len(index.queued) else []
    return QueueView(
        running=sorted(index.active, key=lambda t: (t.slot or 0, t.id)),
        queued=order + stashed,  # stashed ones last, without a position
        positions={t.id: i for i, t in enumerate(order, 1)},
        waiting_for=waiting_for(index, cfg, now, resources) if index.queued else {},
        capacity=capacity(index, cfg, now),
        groups=group_usage(index, cfg),
    )


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
    """When a rate limit that holds a queued task runs out (the service wakes then)."""
    return Board(index, cfg, now).next_release()


def group_usage(index: Index, cfg: Config) -> dict[str, dict[str, int]]:
    """Per configured group: its slots, running and queued tasks."""
    usage = {name: {"max_agents": g.max_agents, "active": 0, "queued": 0} for name, g in cfg.groups.items()}
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
    used = {t.slot for t in index.active}
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


# ---- admission -------------------------------------------------------------------------


class Request(msgspec.Struct, kw_only=True):
    """What a delegator asks for. `command` is an explicit argv; without it the agent preset runs."""

    cwd: str
    name: str | None = None
    command: list[str] | None = None
    prompt: str | None = None
    agent: str | None = None
    source: str = "cli"
    priority: str = "normal"
    group: str | None = None
    expire_after: float | None = None  # seconds; None: config queue_timeout
    timeout: float | None = None  # seconds; None: config run_timeout
    retries: int = 0  # failed or lost runs run again, as the same task
    retry_delay: float | None = None  # seconds between a failed run and the next
    retry_of: int | None = None  # `kugetsu retry`: the finished task this one runs again
    # `delegate --at/--delay`: it waits in the queue until then (Task.not_before), then
    # competes like any other; its queue expiry counts from then. Past or None: at once.
    start_at: datetime | None = None
    env: dict[str, str] = {}
    # Worktree isolation: None lets the agent preset and config decide (ops does); ops then
    # fills `repo` (the repository's top level) and `base`, which pm records on the task.
    worktree: bool | None = None
    base: str | None = None
    repo: str | None = None
    pinned_host: str | None = None  # cluster mode: the machine it must run on
    token: str | None = None  # the task's process token (runner.new_token); ops makes it
    # Where {prompt_file} points (the caller writes the prompt there: pm does no I/O); only
    # for a preset that uses it (wants_prompt_file).
    prompt_path: str | None = None
    # `command` is a kept task's (`kugetsu retry`): its `{prompt}` takes `prompt` at the start.
    prompted: bool = False
    after: list[str] = []  # tasks (ids or names) that must succeed before this one starts
    # Failover: presets to fall back on, in order, after `agent` (`--agent claude,codex` is
    # read into agent + fallback here, for every front end); None: the preset's `fallback`.
    fallback: list[str] | None = None
    fallback_fresh: bool | None = None  # None: the preset's `fallback_fresh`
    budget_usd: float | None = None
    max_tokens: int | None = None
    # Resources (README, "Resources"); None: the preset's, else the config's defaults.
    memory: int | None = None  # bytes
    max_procs: int | None = None
    slots: int | None = None
    # The task whose agent delegates (id, name), from that agent's environment (ops fills it
    # in: KUGETSU_TASK_ID, KUGETSU_TASK_NAME): None from outside any task.
    parent: tuple[int, str] | None = None

    def __post_init__(self) -> None:
        if self.agent is not None and "," in self.agent:
            names = [a.strip() for a in self.agent.split(",")]
            self.agent, rest = names[0], names[1:]
            self.fallback = rest + [a for a in self.fallback or [] if a not in rest]


def route_request(cfg: Config, req: Request, agent: str | None) -> list[str]:
    """The failover order of a request: its agent then its fallbacks (given, or its preset's);
    [] when it has none. A bare command has no order (nothing to start elsewhere)."""
    if agent is None:
        return []
    preset = cfg.agents.get(agent)
    rest = req.fallback if req.fallback is not None else (preset.fallback if preset and not req.command else [])
    if not rest:
        return []
    if req.command:
        raise UsageError("a fallback runs another preset with the prompt: give a prompt, not an explicit command")
    order = [agent]
    for name in rest:
        if name not in cfg.agents:
            raise UsageError(f"unknown agent preset {name!r} in the fallback order; known: {', '.join(sorted(cfg.agents))}")
        if name not in order:
            order.append(name)
    if any(any(_NEEDS_PROMPT.search(a) for a in cfg.agents[n].command) for n in order) and req.prompt is None:
        raise NeedsPrompt(next(n for n in order if any(_NEEDS_PROMPT.search(a) for a in cfg.agents[n].command)))
    return order if len(order) > 1 else []


_PLACEHOLDER = re.compile(r"\{(prompt|prompt_file|name|id)\}")
_NEEDS_PROMPT = re.compile(r"\{prompt(?:_file)?\}")


def render_command(template: list[str], values: dict[str, str]) -> list[str]:
    """Substitute {prompt} {prompt_file} {name} {id} inside argv elements, in one pass: a
    prompt that itself contains `{name}` is passed verbatim."""
    return [_PLACEHOLDER.sub(lambda m: values[m.group(1)], arg) for arg in template]


PROMPT = "{prompt}"
_KEPT = re.compile(r"\{(prompt|prompt_file)\}")


def render_template(template: list[str], values: dict[str, str]) -> list[str]:
    """render_command with `{prompt}` and `{prompt_file}` left in place: the command a task
    keeps in the index. The prompt's text lives in the store beside it (StoreProtocol.prompts)
    and goes in when the agent starts (`argv`), so the index does not grow with prompts (a
    64 MB prompt made every command cost a second); the prompt file is made where the agent
    starts (in a cluster, the machine that runs it, not the one that admitted it)."""
    return render_command(template, {**values, "prompt": PROMPT, "prompt_file": "{prompt_file}"})


def argv(task: Task, prompt: str | None, prompt_file: str = "") -> list[str]:
    """The argv a task's agent runs with: its command, with the stored prompt in place of each
    `{prompt}` and `prompt_file` (where the caller wrote it) in place of `{prompt_file}`, when
    the command was made from a preset (`prompted`). One pass per element: a prompt that
    itself says `{prompt}` is passed verbatim. A command given at delegation (`-- CMD`) and a
    task from an older index (its prompt inside its command) run as kept."""
    if not task.prompted:
        return task.command
    if prompt is None:  # ValueError: the start fails with this reason (service._spawn)
        raise ValueError("its prompt is missing (not in the store beside the index)")
    values = {"prompt": prompt, "prompt_file": prompt_file}
    return [_KEPT.sub(lambda m: values[m.group(1)], a) for a in task.command]


def wants_file(task: Task) -> bool:
    """Does the task's agent read its prompt from a file ({prompt_file})?"""
    return task.prompted and any("{prompt_file}" in a for a in task.command)


def prompt_of(task: Task, stored: Mapping[int, str]) -> str | None:
    """A task's prompt: the store's copy, or (an index written by an older kugetsu) its own."""
    return stored.get(task.id, task.prompt)


def wants_prompt_file(cfg: Config, req: Request) -> bool:
    """Does the request run a preset that takes its prompt as a file ({prompt_file})?"""
    if req.command:
        return False
    agent = resolve_agent(cfg, req)[0]
    return any("{prompt_file}" in a for name in route_request(cfg, req, agent) or [agent]
               for a in cfg.agents[name].command)


def unused_prompt(cfg: Config, req: Request) -> str | None:
    """Why a prompt given is put nowhere, or None: "command", beside an explicit command and
    no preset (the command runs as given); "preset", its preset's command has neither
    {prompt} nor {prompt_file}. Each front end says so in its own terms."""
    if req.prompt is None:
        return None
    if req.command:
        return "command" if req.agent is None else None
    preset = cfg.agents.get(req.agent or cfg.default_agent)
    if preset is not None and not any(_NEEDS_PROMPT.search(a) for a in preset.command):
        return "preset"
    return None


def unused_prompt_text(cfg: Config, req: Request, command: str) -> str | None:
    """The warning of unused_prompt, `command` naming the explicit command as the front end
    takes it (`the command after --`, `command`)."""
    why = unused_prompt(cfg, req)
    if why == "command":
        return (f"the prompt is not used: {command} runs as given (put the prompt in its arguments, or leave out"
                " the command to run the agent preset)")
    if why == "preset":
        agent = req.agent or cfg.default_agent
        return (f"the prompt is not used: preset {agent!r} has no {{prompt}} or {{prompt_file}} in its command"
                f" (add one to config agents.{agent}.command)")
    return None


def parent_task(index: Index, ref: tuple[int, str] | None) -> Task | None:
    """The task a delegating agent runs in: None from outside any task, or when the id and
    name its environment carries are not a task of this home (another home's agent)."""
    if ref is None:
        return None
    return next((t for t in index.all_tasks() if t.id == ref[0] and t.name == ref[1]), None)


def check_nesting(parent: Task | None) -> None:
    """May the agent of `parent` delegate? (Admission asks, and the MCP server, which serves
    such an agent only the tools that read.)"""
    if parent is None or parent.nesting > 0:
        return
    where = f"this agent runs inside kugetsu task {parent.name} (#{parent.id})"
    if parent.depth > 0:
        raise Nested(f"{where} at depth {parent.depth + 1}, the deepest the preset that began the chain allows"
                     " (its `nesting`): a task's agent delegates no deeper")
    what = f"its preset {parent.agent!r}" if parent.agent else "it runs an explicit command, which"
    raise Nested(f"{where}, and {what} allows no nesting: its agents may not delegate (set the preset's"
                 " `nesting` to 1 or more to let them)")


def nesting_of(index: Index, cfg: Config, req: Request, agent: str | None) -> tuple[int, int]:
    """(depth, nesting) of a task admitted for `req` (see Task); raises Nested when its
    delegator may not delegate."""
    preset = cfg.agents.get(agent) if agent else None
    own = preset.nesting if preset else 0
    parent = parent_task(index, req.parent)
    check_nesting(parent)
    if parent is None:
        return 0, own
    return parent.depth + 1, min(parent.nesting - 1, own)


def resolve_agent(cfg: Config, req: Request) -> tuple[str | None, list[str], dict[str, str]]:
    """(agent name, argv template, env) for a request."""
    if req.command:
        return req.agent, list(req.command), dict(req.env)
    agent = req.agent or cfg.default_agent
    preset = cfg.agents.get(agent)
    if preset is None:
        raise UsageError(f"unknown agent preset {agent!r}; known: {', '.join(sorted(cfg.agents))}")
    if req.prompt is None and any(_NEEDS_PROMPT.search(a) for a in preset.command):
        raise NeedsPrompt(agent)
    return agent, list(preset.command), {**preset.env, **req.env}


def check_prompt(cfg: Config, prompt: str | None) -> None:
    """A prompt given must say something (an agent started with nothing to do is a slot spent
    for nothing), and one over prompt_max_size is refused (a 64 MB prompt made every command
    cost a second and 200 MB). Admission and edit: every front end gets these checks."""
    if prompt is None:
        return
    if not prompt.strip():
        raise EmptyPrompt
    size, cap = len(prompt.encode("utf-8", "surrogateescape")), cfg.prompt_max_bytes
    if size > cap:
        raise UsageError(
            f"the prompt is {format_size(size)}, over prompt_max_size ({format_size(cap)}; each prompt is kept"
            " in index.json): raise it (config prompt_max_size, e.g. 1MiB) and use a preset with {prompt_file},"
            " which hands the agent the prompt as a file (an argument takes at most 128 KiB); or give a short prompt"
            " that names a file in the task's directory for the agent to read")


def _check_text(req: Request) -> None:
    """Everything a task keeps is UTF-8 text. An argument with a byte that is not (a shell's
    $'\\x9b' arrives as a lone surrogate) cannot be stored: refused here, by name, not a
    traceback from the index's encoder after the checks."""
    fields = [("the working directory", req.cwd), ("the prompt", req.prompt), ("the source", req.source),
              ("the agent preset", req.agent), ("the group", req.group)]
    fields += [(f"argument {i} of the command", a) for i, a in enumerate(req.command or [])]
    for what, text in fields:
        try:
            (text or "").encode()
        except UnicodeEncodeError:
            raise UsageError(f"{what} is not UTF-8 text ({text!r}), and a task is kept as text: give it in"
                             " UTF-8 (or, in a command, let the shell make the byte: printf '\\233')") from None


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env(env: dict[str, str]) -> None:
    """`delegate --env K=V`: a name a shell could export, none of kugetsu's own (KUGETSU_*:
    the task's identity, token and home are set for each agent and must not be forged), a
    value the kernel can pass (no NUL) kept as text. Errors name the variable, never its
    value: a value may be a secret (an API key), and an error is printed and logged."""
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise UsageError(f"invalid environment variable name {name!r}: letters, digits and '_', not starting"
                             " with a digit (e.g. API_BASE)")
        if name.upper().startswith("KUGETSU_"):
            raise UsageError(f"environment variable {name} is kugetsu's own (KUGETSU_* variables are set for each"
                             " agent: its task id, name, token and home), and cannot be set for a task")
        if not isinstance(value, str) or "\0" in value:
            raise UsageError(f"the value of environment variable {name} has a NUL byte, which no environment"
                             " variable can hold")
        try:
            value.encode()
        except UnicodeEncodeError:
            raise UsageError(f"the value of environment variable {name} is not UTF-8 text, and a task is kept as"
                             " text") from None


def _check_name(index: Index, name: str) -> None:
    """A new task's name (delegate, edit): valid, not digits only, unique among live tasks."""
    if name.isascii() and name.isdigit():
        raise UsageError(
            f"invalid task name {name!r}: a name of digits only would be read as task #{name};"
            f" add a letter, e.g. issue-{name}"
        )
    if not valid_name(name):
        raise UsageError(
            f"invalid task name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    if any(t.name == name for t in index.live()):
        raise UsageError(f"a task named {name!r} is already queued or running; pick another name")


def admit(index: Index, cfg: Config, now: datetime, req: Request) -> tuple[Task, list[Event]]:
    """Add a task to the queue, or refuse. Raises before changing anything."""
    check_prompt(cfg, req.prompt)
    check_env(req.env)
    if req.name is not None:
        _check_name(index, req.name)
    if req.priority not in PRIORITIES:
        raise UsageError(f"invalid priority {req.priority!r}; choose one of {', '.join(PRIORITIES)}")
    if req.group is not None and req.group not in cfg.groups:
        raise UnknownGroup(req.group, sorted(cfg.groups))
    if req.pinned_host is not None and cfg.store is None:
        raise NotClustered("a task pinned to a host")
    if req.pinned_host is not None and not valid_host(req.pinned_host):
        raise InvalidHost(req.pinned_host)
    if req.retries < 0:
        raise UsageError(f"invalid retries {req.retries}: a task is run again 0 or more times after a failure")
    _check_text(req)
    agent, template, env = resolve_agent(cfg, req)
    route = route_request(cfg, req, agent)
    for what, value in (("a budget in USD", req.budget_usd), ("a token budget", req.max_tokens)):
        if value is not None and not value > 0:
            raise UsageError(f"{what} must be more than 0, got {value}")
    memory, max_procs, slots = declared(cfg, req, agent)
    depth, nesting = nesting_of(index, cfg, req, agent)
    after = dependencies(index, req.after)
    limit = cfg.max_queued_per_source
    if limit is not None:
        mine = sum(1 for t in index.queued if t.source == req.source)
        if mine >= limit:
            raise Rejected(
                f"source {req.source} already has {mine} queued task{'' if mine == 1 else 's'} (limit {limit});"
                " try again when one of them starts"
            )
    waiting_after = len(index.queued) + 1 - free_slots(index, cfg)
    excess = waiting_after - cfg.max_queue
    if excess > 0 and (cfg.on_queue_full != "drop_oldest" or excess > len(index.queued)):
        raise QueueFull(len(index.queued), cfg.max_queue, len(index.active), cfg.max_agents)
    victims = sorted(index.queued, key=lambda t: t.id)[:excess] if excess > 0 else []
    if any(v.id in after for v in victims):  # it would be cancelled at once, its dependency dropped
        raise QueueFull(len(index.queued), cfg.max_queue, len(index.active), cfg.max_agents)
    # Nothing was refused: from here on the index changes.
    events = []
    for victim in victims:  # drop_oldest: the longest-waiting tasks make room, their delegators are told
        events += cancel(index, victim, now, 0.0, "dropped: queue full")
    task_id = index.next_id
    name = req.name or f"task-{task_id}"
    expire_after = req.expire_after if req.expire_after is not None else cfg.queue_timeout_s
    start_at = _start_time(req.start_at, now)
    timeout = req.timeout if req.timeout is not None else cfg.run_timeout_s
    if not req.command and req.prompt_path is None and wants_prompt_file(cfg, req):
        raise ValueError("a {prompt_file} preset needs Request.prompt_path (ops.delegate sets it)")
    values = {"prompt": req.prompt or "", "prompt_file": req.prompt_path or "", "name": name, "id": str(task_id)}
    _check_argv(template if req.command else render_command(template, values), req.cwd)
    prompted = req.prompted if req.command else any(_NEEDS_PROMPT.search(a) for a in template)
    if prompted and req.command:  # `kugetsu retry` of a preset's task: its kept command, with the prompt
        _check_argv([_KEPT.sub(lambda m: values[m.group(1)], a) for a in template], req.cwd)
    command = template if req.command else render_template(template, values)
    task = Task(
        id=task_id,
        name=name,
        priority=req.priority,  # type: ignore[arg-type]
        source=req.source,
        group=req.group,
        agent=agent,
        command=command,
        cwd=req.cwd,
        created_at=now,
        expires_at=(start_at or now) + timedelta(seconds=expire_after) if expire_after else None,
        not_before=start_at,
        prompted=prompted,
        timeout=timeout,
        env=env,
        token=req.token,
        repo=req.repo,
        base=req.base if req.repo else None,
        branch=f"kugetsu/{name}" if req.repo else None,
        pinned_host=req.pinned_host,
        after=after,
        retries=req.retries,
        retry_delay=req.retry_delay,
        retry_of=req.retry_of,
        depth=depth,
        nesting=nesting,
        route=route,
        fallback_fresh=bool(route) and (req.fallback_fresh if req.fallback_fresh is not None
                                        else bool(cfg.agents[agent].fallback_fresh)),  # type: ignore[index]
        budget_usd=req.budget_usd,
        max_tokens=req.max_tokens,
        memory=memory,
        max_procs=max_procs,
        slots=slots,
    )
    index.next_id += 1
    index.queued.append(task)
    return task, events + [_event("queued", task, now, position=position(index, cfg, now, task))]


def declared(cfg: Config, req: Request, agent: str | None) -> tuple[int | None, int | None, int]:
    """(memory, max_procs, slots) a task admitted for `req` declares: the request's, else its
    preset's (memory, max_procs fall back on resources' defaults when it runs). A task that
    could never fit this machine (or the cluster's max_agents, or its group) is refused here
    rather than wait for ever."""
    preset = cfg.agents.get(agent) if agent else None
    memory = req.memory
    if memory is None and preset is not None and preset.memory is not None:
        memory = parse_size(preset.memory)
    max_procs = req.max_procs if req.max_procs is not None else (preset.max_procs if preset else None)
    slots = req.slots if req.slots is not None else (preset.slots if preset else 1)
    if memory is not None and memory <= 0:
        raise UsageError(f"invalid memory {memory}: give a size like 4G or 512M")
    if slots < 1 or (max_procs is not None and max_procs < 1):
        raise UsageError("slots and max-procs are 1 or more")
    if slots > cfg.max_agents:
        raise UsageError(f"a task of {slots} slots could never start: max_agents is {cfg.max_agents}; declare"
                         f" {cfg.max_agents} slots or fewer, or raise max_agents")
    if req.group in cfg.groups and slots > cfg.groups[req.group].max_agents:
        cap = cfg.groups[req.group].max_agents
        raise UsageError(f"a task of {slots} slots could never start in group {req.group}, which has {cap}")
    need = memory if memory is not None else cfg.resources.default_memory_bytes
    if need and cfg.store is None and need > (budget := cfg.memory_budget):
        raise UsageError(f"a task of {short_size(need)} could never start: max_memory is {short_size(budget)};"
                         " declare less memory, or raise max_memory")
    return memory, max_procs, slots


STARTED_AT_ONCE = "started at once"


def started_at_once(events: list[Event], task: Task) -> None:
    """The `queued` event of a task that started in its admission's own transaction: no
    position (it never waited at one), and says so, so that a feed reads `queued · started
    at once`, `started · slot 1`, not a position 1 it never held. The event stays: it is
    the admission (stats count admissions by it)."""
    if task.state is TaskState.RUNNING:
        for e in events:
            if e.type == "queued" and e.task == task.id:
                e.position, e.reason = None, STARTED_AT_ONCE


def dependencies(index: Index, refs: list[str]) -> list[int]:
    """The ids of the tasks named to run after (duplicates dropped). One kugetsu does not
    know, or one that has already ended otherwise than succeeded, is refused: this task
    could never start."""
    ids: list[int] = []
    for ref in refs:
        try:
            dep = find(index, ref)
        except NoSuchTask:
            raise UnknownDependency(ref) from None
        if dep.state.final and dep.state is not TaskState.SUCCEEDED:
            raise UsageError(f"dependency {dep.name} (#{dep.id}) {_stands(dep)}: a task after it could never start")
        if dep.id not in ids:
            ids.append(dep.id)
    return ids


def dependencies_failed(index: Index, now: datetime) -> list[Event]:
    """Queued tasks one of whose dependencies ended otherwise than succeeded are cancelled,
    each with its own event (`dependency issue-16 failed`). In id order: a dependency is
    always older than its dependent, so a whole chain ends in one pass."""
    waiting = [t for t in index.queued if t.after]
    if not waiting:
        return []
    ended = {t.id: t for t in index.finished}
    events = []
    for task in sorted(waiting, key=lambda t: t.id):
        bad = next((ended[d] for d in task.after if d in ended and ended[d].state is not TaskState.SUCCEEDED), None)
        if bad is not None:
            index.queued.remove(task)
            task.reason = f"dependency {bad.name} {bad.state.value}"
            events.append(_close(index, task, TaskState.CANCELLED, now))
            ended[task.id] = task
    return events


def set_priority(index: Index, task: Task, level: str, now: datetime) -> list[Event]:
    """Change a queued task's priority (it moves in the order under `priority` and `fair`)."""
    if level not in PRIORITIES:
        raise UsageError(f"invalid priority {level!r}; choose one of {', '.join(PRIORITIES)}")
    if task.state is not TaskState.QUEUED:
        raise UsageError(
            f"task {task.name} (#{task.id}) {_stands(task)}; only a queued task's priority can change", code=1
        )
    if task.priority == level:
        return []
    task.priority = level  # type: ignore[assignment]
    return [_event("priority", task, now, value=level)]


def _queued_only(task: Task, what: str) -> None:
    if task.state is not TaskState.QUEUED:
        raise UsageError(f"task {task.name} (#{task.id}) {_stands(task)}; only a queued task can be {what}", code=1)


def move_next(index: Index, task: Task, now: datetime, by: str = "cli") -> list[Event]:
    """`next TASK`: it starts before every other queued task that may start (the latest `next`
    first), whatever the strategy; limits still apply (its group's slots, a hold, its
    dependencies), and it never starts beyond max_agents. No event when it is first already."""
    _queued_only(task, "moved")
    if task.stashed_at is not None:
        raise UsageError(f"task {task.name} (#{task.id}) is stashed: unstash it first", code=1)
    top = max((t.first for t in index.queued), default=0)
    if task.first and task.first == top:
        return []
    task.first = top + 1
    return [_event("moved", task, now, reason=f"to the front by {by}")]


def stash(task: Task, now: datetime, on: bool, by: str = "cli") -> list[Event]:
    """`stash TASK` (on) / `unstash TASK`: a queued task set aside: it keeps its place in the
    index but has no position, never starts, holds no one up and does not expire; unstashed,
    it takes its place again and its queue deadline moves by the time it was stashed."""
    _queued_only(task, "stashed" if on else "unstashed")
    if (task.stashed_at is not None) == on:
        return []
    if on:
        task.stashed_at = now
    else:
        if task.expires_at is not None and task.stashed_at is not None:
            task.expires_at += max(timedelta(0), now - task.stashed_at)
        task.stashed_at = None
    return [_event("stashed" if on else "unstashed", task, now, reason=f"{'stashed' if on else 'unstashed'} by {by}")]


class Edit(msgspec.Struct, kw_only=True):
    """What `kugetsu edit` changes of a queued task; None leaves a field as it is."""

    prompt: str | None = None
    priority: str | None = None
    expire_after: float | None = None  # seconds from now; 0: never expires
    timeout: float | None = None  # run timeout in seconds; 0: no limit
    group: str | None = None
    name: str | None = None
    cwd: str | None = None  # absolute; ops checks that it is a directory
    agent: str | None = None  # another preset: its command is made with the task's prompt
    command: list[str] | None = None  # an explicit argv instead (the task's agent stays its label)
    prompt_path: str | None = None  # where a {prompt_file} preset's prompt is (ops knows; pm does no I/O)
    start_at: datetime | None = None  # `edit --at/--delay`: when it may start (now or past: at once)

    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in self.__struct_fields__ if f != "prompt_path")


def edit(index: Index, cfg: Config, task: Task, now: datetime, change: Edit) -> list[Event]:
    """Change a queued task: checks everything first, then changes it, one `edited` event
    naming the fields (the prompt's text stays out of the event log)."""
    if task.state is not TaskState.QUEUED:
        raise UsageError(f"task {task.name} (#{task.id}) {_stands(task)}; only a queued task can be edited", code=1)
    if change.priority is not None and change.priority not in PRIORITIES:
        raise UsageError(f"invalid priority {change.priority!r}; choose one of {', '.join(PRIORITIES)}")
    if change.group is not None and change.group not in cfg.groups:
        raise UnknownGroup(change.group, sorted(cfg.groups))
    if change.group is not None and task.slots > (cap := cfg.groups[change.group].max_agents):
        raise UsageError(f"task {task.name} (#{task.id}) takes {task.slots} slots: it could never start in group"
                         f" {change.group}, which has {cap}")
    for what, value in (("expiry", change.expire_after), ("timeout", change.timeout)):
        if value is not None and value < 0:
            raise UsageError(f"a negative {what} ({value:g}s) makes no sense; 0 means none")
    check_prompt(cfg, change.prompt)
    name = task.name if change.name is None else change.name
    if name != task.name:
        _check_name(index, name)
        if task.repo:
            raise UsageError(f"task {task.name} (#{task.id}) works in a worktree on branch {task.branch}, named"
                             " after it: its name cannot change; cancel it and delegate again", code=1)
    if change.cwd is not None and change.cwd != task.cwd and task.repo:
        raise UsageError(f"task {task.name} (#{task.id}) works in a worktree of {task.repo}: its directory cannot"
                         " change; cancel it and delegate again", code=1)
    agent = task.agent if change.agent is None else change.agent
    new_preset = cfg.agents.get(agent) if agent else None
    if change.agent is not None and new_preset is None:
        raise UsageError(f"unknown agent preset {agent!r}; known: {', '.join(sorted(cfg.agents))}")
    old_preset = cfg.agents.get(task.agent) if task.agent else None
    values = {"prompt": task.prompt or "", "prompt_file": change.prompt_path or "", "name": task.name,
              "id": str(task.id)}
    # Only a command made from its preset's template can be made again (a new prompt, name or
    # preset): one given at delegation (`-- CMD`), or from a preset changed since, cannot. A
    # task keeps `{prompt}` in its command (the text is the store's); one from an older index
    # has its prompt inside its command, so it is rendered whole to compare.
    kept = render_template if task.prompted else render_command
    from_preset = old_preset is not None and kept(old_preset.command, values) == task.command
    # Does the task have a prompt? Its text is the store's (ops passes a new one in `change`).
    has_prompt = change.prompt is not None or task.prompted or task.prompt is not None
    command = change.command
    if command is None and (change.prompt is not None or change.agent is not None) and not from_preset:
        what = "prompt" if change.prompt is not None else "agent preset"
        raise UsageError(f"task {task.name} (#{task.id}) runs a command given at delegation, not its agent preset's"
                         f" with the prompt, so its {what} cannot change; give the new command (or cancel it and"
                         " delegate again)")
    prompted = task.prompted if change.command is None else False
    if command is None and from_preset and new_preset is not None:
        if not has_prompt and any(_NEEDS_PROMPT.search(a) for a in new_preset.command):
            raise NeedsPrompt(agent or "")
        if task.prompt is not None and not task.prompted and change.prompt is None:
            # An older index's task keeps its prompt where it was (inside its command).
            command = render_command(new_preset.command, {**values, "prompt": task.prompt, "name": name})
        else:
            command = render_template(new_preset.command, {**values, "name": name})
            prompted = any(_NEEDS_PROMPT.search(a) for a in new_preset.command)
            _check_argv(render_command(new_preset.command, {**values, "prompt": change.prompt or "", "name": name}),
                        change.cwd or task.cwd)
    env = task.env
    if agent != task.agent and new_preset is not None:  # the task's own variables stay, the preset's change
        own = {k: v for k, v in task.env.items() if old_preset is None or old_preset.env.get(k) != v}
        env = {**new_preset.env, **own}
    if command is not None:
        _check_argv(command, change.cwd or task.cwd)
    changed: dict[str, object] = {}
    if change.prompt is not None:
        # The caller stores the new text (ops.edit: txn.prompts, only when the text differs);
        # the index keeps the template.
        task.prompt = None
        changed["prompt"] = f"{len(change.prompt or '')} characters"
    if name != task.name:
        task.name = changed["name"] = name
    if agent != task.agent:
        task.agent = changed["agent"] = agent
        task.env = env
    if change.cwd is not None and change.cwd != task.cwd:
        task.cwd = changed["cwd"] = change.cwd
    if command is not None and command != task.command:
        task.command = command
        if change.command is not None:  # an argv given: its words are the caller's, not a prompt
            changed["command"] = f"{len(command)} arguments"
    task.prompted = prompted
    if change.priority is not None and change.priority != task.priority:
        task.priority = change.priority  # type: ignore[assignment]
        changed["priority"] = change.priority
    if change.group is not None and change.group != task.group:
        task.group = changed["group"] = change.group
    if change.expire_after is not None:
        task.expires_at = now + timedelta(seconds=change.expire_after) if change.expire_after else None
        changed["expires_at"] = task.expires_at.isoformat() if task.expires_at else None
    if change.timeout is not None and (change.timeout or None) != task.timeout:
        task.timeout = change.timeout or None
        changed["timeout"] = task.timeout
    if change.start_at is not None:
        start = _start_time(change.start_at, now)
        if start != task.not_before:
            # Its queue expiry moves with its start (it counts from then, as at admission),
            # unless an expiry was given in this same edit.
            if task.expires_at is not None and change.expire_after is None:
                task.expires_at += (start or now) - max(task.not_before or now, now)
                changed["expires_at"] = task.expires_at.isoformat()
            task.not_before = start
            changed["not_before"] = start.isoformat() if start else None
    if not changed:
        return []
    return [_event("edited", task, now, key=",".join(changed), value=changed)]


def _start_time(at: datetime | None, now: datetime) -> datetime | None:
    """A start time asked for (`--at`, `--delay`): None when it has come already; at most
    MAX_DURATION ahead, as every duration (a deadline computed from it must stay a date)."""
    if at is None or at <= now:
        return None
    if at - now > timedelta(seconds=MAX_DURATION):
        raise UsageError(f"a start time {at.isoformat()} is too far ahead: at most {MAX_DURATION // 86400}d from now")
    return at


# Linux refuses a single argv element of 32 pages (MAX_ARG_STRLEN) or more at exec.
MAX_ARG_BYTES = 128 * 1024 - 1


def _check_argv(command: list[str], cwd: str) -> None:
    """Refuse at admission an argv that exec could never take, rather than admit a task that
    cannot start (a NUL byte in a prompt file made the service's spawn raise)."""
    if "\0" in cwd:
        raise UsageError("the working directory contains a NUL character")
    for i, arg in enumerate(command):
        if "\0" in arg:
            raise UsageError(
                f"argument {i} of the command (the prompt, if the preset puts it there) contains a NUL"
                " character, which no program can receive in its arguments"
            )
        size = len(arg.encode("utf-8", "surrogateescape"))
        if size > MAX_ARG_BYTES:
            raise UsageError(
                f"argument {i} of the command is {size} bytes; the system allows at most {MAX_ARG_BYTES} in one"
                " argument: if it is the prompt, put {prompt_file} in place of {prompt} in the preset's command"
                " (the agent gets the prompt as a file), or give a short prompt that names a file for the agent to read"
            )


# ---- transitions -----------------------------------------------------------------------


def start(index: Index, task: Task, now: datetime, host: str | None = None, cfg: Config | None = None,
          agent: str | None = None) -> list[Event]:
    """queued -> running in the lowest free slot (on `host`, in a cluster). The caller spawns
    the process and records its pid. `agent`: the preset its failover order starts it on
    (Board.take), when that is not the one it has."""
    if cfg is not None and agent is not None and agent != task.agent:
        switch_preset(cfg, task, agent)
    if cfg is not None:
        budgets.window_start(cfg, index.windows, task.agent, task.id, now)
    index.queued.remove(task)
    task.state = TaskState.RUNNING
    task.host = host
    task.slot = lowest_free_slot(index)
    task.started_at = now
    index.active.append(task)
    index.starts += 1
    index.last_start.pop(task.source, None)  # keeps the dict in start order, oldest first
    index.last_start[task.source] = SourceMark(at=now, n=index.starts)
    _forget_sources(index)
    note = f"fallback from {task.fallback_from}" if task.fallback_from else None
    return [_event("started", task, now, slot=task.slot, host=host, reason=note,
                   value={"agent": task.agent, "fallback_from": task.fallback_from} if note else None)]


def switch_preset(cfg: Config, task: Task, agent: str) -> None:
    """A task of a failover order moves to another of its presets: the command is that
    preset's with the task's prompt (a fresh start: a session belongs to its agent), the env
    that preset's with what the delegator added; `fallback_from` names the first of the order."""
    old = cfg.agents.get(task.agent) if task.agent else None
    new = cfg.agents[agent]
    # `{prompt}` and `{prompt_file}` stay for the start to fill in (argv), as at admission.
    task.command = render_template(new.command, {"name": task.name, "id": str(task.id)})
    task.prompted = any(_NEEDS_PROMPT.search(a) for a in new.command)
    if task.prompted and task.prompt is not None:  # from an older index, which kept it here
        task.command = render_command(new.command, {"prompt": task.prompt, "prompt_file": "", "name": task.name,
                                                    "id": str(task.id)})
        task.prompted = False
    task.first_command = task.session = None
    added = {k: v for k, v in task.env.items() if old is None or old.env.get(k) != v}
    task.env = {**new.env, **added}
    task.agent = agent
    task.fallback_from = task.route[0] if task.route and agent != task.route[0] else None


def record_spawn(index: Index, task: Task, at: datetime) -> None:
    """The task's agent was let go at `at`, which may be later than the decision to start it
    (a CLI's transaction decides, the service spawns): started_at, run timeouts and the
    source's rate limit count from the real start, and so does a window quota it opened."""
    window = index.windows.get(task.agent) if task.agent is not None else None
    if window is not None and window.since == task.started_at and window.since < at:
        window.since = at
    task.started_at = at
    mark = index.last_start.get(task.source)
    if mark is not None and mark.at < at:
        mark.at = at


def agent_ended(task: Task, now: datetime, exit_code: int | None, reason: str | None, grace: float) -> None:
    """The agent has ended but processes it started are still there: the task keeps its slot
    while they go (SIGTERM now, SIGKILL at kill_at; a task already being stopped keeps its
    own kill_at). `finish` follows once none is left."""
    task.ended_at = now
    task.exit_code = exit_code
    if reason and task.stop is None:
        task.reason = reason
    if task.kill_at is None:
        task.kill_at = now + timedelta(seconds=grace)


def leftovers_note(count: int) -> str | None:
    if not count:
        return None
    return f"ended {count} leftover process{'' if count == 1 else 'es'}"


_REMEMBERED_SOURCES = 256


def _forget_sources(index: Index) -> None:
    """Bound `last_start`: forget the least recent sources that have no live task. A
    forgotten source counts as never started, which under `fair` is where it would stand
    anyway; only a rate limit shorter than the time since its last start is lost with it."""
    extra = len(index.last_start) - _REMEMBERED_SOURCES
    if extra <= 0:
        return
    live = {t.source for t in index.live()}
    for source in [s for s in index.last_start if s not in live][:extra]:
        del index.last_start[source]


def finish(index: Index, task: Task, now: datetime, exit_code: int | None, reason: str | None = None) -> list[Event]:
    """running -> final. A stop that was asked for (cancel, timeout) decides the state;
    else the exit code does; no exit code at all means the task is lost. Processes the
    agent left behind and kugetsu ended (task.leftovers) are named in the reason."""
    index.active.remove(task)
    task.ended_at = None
    if task.stop is not None:
        state = task.stop
    elif exit_code is None:
        state = TaskState.LOST
        task.reason = reason or "the process vanished and its exit status could not be recovered"
    elif exit_code == 0:
        state = TaskState.SUCCEEDED
    else:
        state = TaskState.FAILED
        task.reason = reason or describe_exit(exit_code)
    note = leftovers_note(task.leftovers)
    if note:
        task.reason = f"{task.reason}; {note}" if task.reason else note
    return [_close(index, task, state, now, exit_code)]


def describe_exit(code: int) -> str:
    if code > 128:
        import signal

        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    if code == 127:
        return "exit code 127 (command not found)"
    return f"exit code {code}"


def cancel(index: Index, task: Task, now: datetime, grace: float, reason: str = "cancelled") -> list[Event]:
    """queued: cancelled at once. running: marked to stop; the caller sends SIGTERM to its
    process group now and SIGKILL at `kill_at`; it becomes final when its process is gone."""
    if task.state.final:
        raise UsageError(f"task {task.name} (#{task.id}) {_stands(task)}", code=1)
    if task.state is TaskState.QUEUED:
        index.queued.remove(task)
        task.reason = reason
        return [_close(index, task, TaskState.CANCELLED, now)]
    unpause(task, now)  # the caller sends SIGCONT after the SIGTERM: a stopped process must run to end
    _request_stop(task, TaskState.CANCELLED, reason, now, grace)
    return []


def _request_stop(task: Task, state: TaskState, reason: str, now: datetime, grace: float) -> None:
    if task.stop is None:
        task.stop, task.reason = state, reason
        task.kill_at = now + timedelta(seconds=grace)


def expire_due(index: Index, now: datetime) -> list[Event]:
    """Queued tasks whose expires_at has come end as expired."""
    events = []
    for task in [t for t in index.queued if t.expires_at is not None and t.expires_at <= now and t.stashed_at is None]:
        index.queued.remove(task)
        task.reason = f"expired after {format_duration((now - task.created_at).total_seconds())} in the queue"
        events.append(_close(index, task, TaskState.EXPIRED, now))
    return events


def run_deadline(task: Task) -> datetime | None:
    """When a running task's run timeout falls due: its start, plus the timeout, plus the time
    it spent paused (`pause TASK` stops its clock too). None while paused or without a timeout."""
    if not task.timeout or not task.started_at or task.paused_at is not None:
        return None
    return task.started_at + timedelta(seconds=task.timeout + task.paused_s)


def timeouts_due(index: Index, now: datetime, grace: float) -> list[Task]:
    """Running tasks past their run timeout are marked to stop (failed); returns them to signal."""
    due = []
    for task in index.active:
        if task.stop is None and (deadline := run_deadline(task)) is not None and now >= deadline:
            _request_stop(task, TaskState.FAILED, f"timed out after {format_duration(task.timeout or 0)}", now, grace)
            due.append(task)
    return due


def next_deadline(index: Index) -> datetime | None:
    """The earliest moment something falls due: a queued task's expiry, a running task's run
    timeout, the SIGKILL that follows a stop's grace, or the end of a hold on a preset. (The service's one timer is set
    there; what is due then is decided by expire_due, timeouts_due and kills_due.)"""
    times = [t.expires_at for t in index.queued if t.expires_at is not None and t.stashed_at is None]
    times += [h.until for h in index.holds.values() if h.until is not None]  # released at its end
    for task in index.active:
        if task.kill_at is not None:
            times.append(task.kill_at)
        elif task.stop is None and (deadline := run_deadline(task)) is not None:
            times.append(deadline)
    return min(times, default=None)


GUARD_RECHECK = 2.0  # seconds between resource readings while the guard holds queued tasks


def policy_wakeups(index: Index, cfg: Config, now: datetime, resources: Resources | None,
                   before: dict[str, datetime]) -> dict[str, datetime]:
    """Wake-ups the scheduling policies need, beside next_deadline: when a rate limit that
    holds a task runs out (so it starts on time), and a fresh resource reading while the
    guard holds. `before`: what the last call returned."""
    if not index.queued or free_slots(index, cfg) == 0:
        return {}
    jobs = {}
    release = next_release(index, cfg, now)
    if release is not None:
        jobs["rate-limit"] = release
    if guard_hold(cfg, resources) is not None:
        # The re-check already set stands until it has come (else every tick would push
        # it back); once it has, the next one is GUARD_RECHECK later, not at once again.
        recheck = before.get("resource-guard")
        jobs["resource-guard"] = recheck if recheck is not None and recheck > now else now + timedelta(seconds=GUARD_RECHECK)
    return jobs


def kills_due(index: Index, now: datetime) -> list[Task]:
    """Tasks asked to stop whose grace is over: their group gets SIGKILL."""
    return [t for t in index.active if t.kill_at is not None and t.kill_at <= now]


def trim_history(index: Index, limit: int) -> list[Task]:
    """Finished tasks beyond `limit` leave the index (oldest first) and are returned for the archive."""
    if len(index.finished) <= limit:
        return []
    cut = len(index.finished) - limit
    gone, index.finished = index.finished[:cut], index.finished[cut:]
    return gone


def clean(index: Index, now: datetime, older_than: float | None = None, states: frozenset[str] | None = None) -> list[Task]:
    """Drop finished tasks (finished more than `older_than` seconds ago, and in one of
    `states`, if given)."""
    if states is not None and (live := states & {"queued", "running"}):
        raise UsageError(f"state {', '.join(sorted(live))}: clean drops finished tasks only (a live one is"
                         f" cancelled instead)")
    keep, gone = [], []
    for task in index.finished:
        old = older_than is None or (task.finished_at and (now - task.finished_at).total_seconds() >= older_than)
        chosen = states is None or task.state.value in states or "finished" in states
        (gone if old and chosen else keep).append(task)
    index.finished = keep
    return gone


def remove(index: Index, tasks: list[Task]) -> list[Task]:
    """`kugetsu remove TASK...`: finished tasks leave the index (their logs with them, ops).
    A live one is refused, and then none is removed: it would vanish while its agent runs."""
    live = [t for t in tasks if not t.state.final]
    if live:
        t = live[0]
        raise NotFound(f"{t.name} (#{t.id}) is {t.state.value}: only a finished task can be removed; cancel it first"
                       f" (#{t.id}), then remove it")
    ids = {t.id for t in tasks}
    gone = [t for t in index.finished if t.id in ids]
    index.finished = [t for t in index.finished if t.id not in ids]
    return gone


def _close(index: Index, task: Task, state: TaskState, now: datetime, exit_code: int | None = None) -> Event:
    unpause(task, now)
    task.stashed_at = None
    task.state = state
    task.finished_at = now
    task.exit_code = exit_code
    task.kill_at = None
    index.finished.append(task)
    # A worktree task's final event names its worktree: the service closes it just after.
    worktree = task.worktree if task.worktree_state == "active" else None
    return _event(state.value, task, now, exit_code=exit_code, reason=task.reason, worktree=worktree)


def _event(kind: str, task: Task, now: datetime, **detail: object) -> Event:
    detail.setdefault("branch", task.branch)  # worktree tasks: notifications name the branch
    return Event(type=kind, at=now, task=task.id, name=task.name, source=task.source, state=task.state.value, **detail)


# ---- a clock that was wrong ------------------------------------------------------------

# How far a recorded time may lie from the service's clock before it is a clock error. NTP
# slews and steps by seconds; a command run under a wrong clock (faketime, a container's or a
# VM's clock) is off by hours or years. Not configurable: nothing legitimate lies in between.
CLOCK_TOLERANCE = timedelta(minutes=5)


def correct_clock(index: Index, cfg: Config, now: datetime, before: Index | None = None,
                  before_at: datetime | None = None) -> ClockError | None:
    """Times written from a wrong clock, moved to the service's (README, "A wrong clock").

    Ahead: a time that records a moment gone by (a task queued, started, ended; a source's last
    start; a hold's beginning) more than CLOCK_TOLERANCE after `now` is moved back to now, and
    what counts from it (its queue deadline, its kill, a hold's end) with it: a command a year
    ahead must not make a source wait a year. Behind (`before`: the index the service itself
    committed at `before_at`): a task or hold new since then was written after then; stamped
    more than CLOCK_TOLERANCE earlier, it moves forward to now with its deadline: its hour in
    the queue counts from when it was really queued, not from two days ago. Returns the
    largest error found (None: none), for the service's log and doctor."""
    found: list[tuple[float, datetime, str]] = []

    def off(at: datetime, what: str) -> timedelta:
        found.append(((at - now).total_seconds(), at, what))
        return at - now

    ahead = now + CLOCK_TOLERANCE
    grace = timedelta(seconds=cfg.kill_grace_s)
    for task in index.all_tasks():
        who = f"task {task.name} (#{task.id})"
        if task.created_at > ahead:
            d = off(task.created_at, f"{who} was queued at")
            task.created_at -= d
            if task.expires_at is not None:
                task.expires_at -= d
        if task.started_at is not None and task.started_at > ahead:
            task.started_at -= off(task.started_at, f"{who} started at")
        if task.finished_at is not None and task.finished_at > ahead:
            task.finished_at -= off(task.finished_at, f"{who} ended at")
        if task.ended_at is not None and task.ended_at > ahead:
            task.ended_at -= off(task.ended_at, f"{who}'s agent ended at")
        if task.kill_at is not None and task.kill_at > ahead + grace:
            task.kill_at -= off(task.kill_at, f"{who} was to be killed at") - grace  # now + grace
        delay = timedelta(seconds=task.retry_delay or 0)
        # A retry's wait is at most its delay from now; a start time asked for (`delegate
        # --at/--delay`, a task that never ran) may lie anywhere ahead: it is the caller's.
        if task.not_before is not None and task.attempts and task.not_before > ahead + delay:
            task.not_before -= off(task.not_before, f"{who} was to retry at") - delay  # now + delay
        for a in task.attempts:
            if a.ended_at > ahead:
                a.ended_at -= off(a.ended_at, f"{who}'s attempt ended at")
            if a.started_at is not None and a.started_at > ahead:
                a.started_at -= off(a.started_at, f"{who}'s attempt started at")
    for source, mark in index.last_start.items():
        if mark.at > ahead:
            mark.at -= off(mark.at, f"source {source} last started a task at")
    for agent, held in index.holds.items():
        if held.since > ahead:
            d = off(held.since, f"the hold on {agent} began at")
            held.since -= d
            if held.until is not None:
                held.until -= d
    floor = before_at - CLOCK_TOLERANCE if before is not None and before_at is not None else None
    if before is not None and floor is not None:
        for task in index.live():
            if task.id >= before.next_id and task.created_at < floor:
                d = -off(task.created_at, f"task {task.name} (#{task.id}) was queued at")
                task.created_at += d
                if task.expires_at is not None:
                    task.expires_at += d
                if task.started_at is not None and task.started_at < floor:
                    task.started_at += d
        for source, mark in index.last_start.items():
            if mark.n > before.starts and mark.at < floor:
                mark.at -= off(mark.at, f"source {source} last started a task at")
        for agent, held in index.holds.items():
            old = before.holds.get(agent)
            if (old is None or old.since != held.since) and held.since < floor:
                d = -off(held.since, f"the hold on {agent} began at")
                held.since += d
                if held.until is not None:
                    held.until += d
    if not found:
        return None
    seconds, at, what = max(found, key=lambda f: abs(f[0]))
    mark = index.clock  # the last writer: the culprit when its own clock says as much
    by = None
    if mark is not None and ((seconds > 0 and mark.at > ahead) or (seconds < 0 and floor is not None and mark.at < floor)):
        by = mark.by
        mark.at = now  # corrected too: doctor must not read it as this clock being behind
    return ClockError(found_at=now, at=at, off=seconds, what=what, by=by)


def describe_clock_error(err: ClockError) -> str:
    """One line for the service's log and doctor: who wrote what time, how far off."""
    way = "ahead of" if err.off > 0 else "behind"
    who = err.by or "a command"
    return (f"{who} wrote a time from a wrong clock: {err.what} {err.at:%Y-%m-%d %H:%M:%S} UTC, "
            f"{format_duration(abs(err.off))} {way} the service's clock; counted from the service's clock instead")


# ---- the step: what the service does with what it saw ----------------------------------


class Exit(msgspec.Struct, frozen=True):
    """A task's wrapper has ended, as the service saw it."""

    task: int
    code: int | None
    reason: str | None = None
    leftovers: bool = False  # processes the agent started may still run (not ruled out)
    tail: str | None = None  # the end of its log, for presets that read it (limit, session)


class Found(msgspec.Struct, frozen=True):
    """A look for what an ended agent left running: `alive` processes now, `seen` in all."""

    task: int
    alive: int
    seen: int


class Adopted(msgspec.Struct, frozen=True):
    """A task's process that no committed index records: let go before a commit that failed,
    or found after a crash (the task's token proves it is ours), or only its exit status."""

    task: int
    pid: int | None
    pid_start: int | None
    at: datetime  # when it started (as near as is known)
    log: str
    code: int | None = None  # it has ended already, with this status


class Measured(msgspec.Struct, frozen=True, kw_only=True):
    """A running task's use as the service measured it (usage.py): its processes' total RSS
    now and at most so far, CPU seconds, how many, and what the kernel did in its cgroups."""

    task: int
    memory: int
    peak: int
    cpu: float
    procs: int
    oom_kills: int = 0
    forks_refused: int = 0
    attempt: int = 1  # the task's run it measured: a retry's run is not held to its last one's figures


def max_procs_of(cfg: Config, task: Task) -> int | None:
    return task.max_procs if task.max_procs is not None else cfg.resources.max_procs


def over_limits(index: Index, cfg: Config, now: datetime, seen: list[Measured]) -> list[Task]:
    """Record what was measured of each running task (its peak and CPU time stay on its
    record), and stop (failed) those over a limit they declared: their memory, or their
    processes; also those the kernel had to act on in their cgroups (an OOM kill, a fork
    refused), which are over it by definition. Returns the tasks to send SIGTERM to now."""
    tasks = {t.id: t for t in index.active}
    due = []
    for m in seen:
        task = tasks.get(m.task)
        if task is None or m.attempt != task.attempt:
            continue
        task.peak_memory = max(task.peak_memory or 0, m.peak, m.memory) or None
        task.cpu_seconds = max(task.cpu_seconds or 0.0, m.cpu) or None
        why = limit_exceeded(cfg, task, m)
        if why is not None:
            _request_stop(task, TaskState.FAILED, why, now, cfg.kill_grace_s)
            due.append(task)
    return due


def limit_exceeded(cfg: Config, task: Task, m: Measured) -> str | None:
    """Why a running task must be stopped for what was measured of it, or None."""
    if task.stop is not None or task.ended_at is not None or m.attempt != task.attempt:
        return None
    limit, procs = memory_of(cfg, task), max_procs_of(cfg, task)
    if limit and (m.memory > limit or m.oom_kills):
        peak = max(task.peak_memory or 0, m.peak, m.memory)
        kernel = f"; the kernel ended {m.oom_kills} of its processes" if m.oom_kills else ""
        return f"memory limit {short_size(limit)} exceeded (peak {short_size(peak)}){kernel}"
    if procs and (m.procs > procs or m.forks_refused):
        refused = f", {m.forks_refused} forks refused" if m.forks_refused else ""
        return f"process limit {procs} exceeded ({m.procs} processes{refused})"
    return None


class Observations(msgspec.Struct, kw_only=True):
    exits: list[Exit] = []
    measured: list[Measured] = []  # the running tasks' use, as last measured
    found: list[Found] = []
    adopted: list[Adopted] = []
    resources: Resources | None = None  # the machine's readings, for the resource guard
    here: Here | None = None  # in a cluster: the machine this service decides for
    hosts: list[placement.HostSeen] = []  # in a cluster: every machine's lease, as the database has it
    progress: dict[int, Usage] = {}  # running task id -> its run's usage so far, read from its stream


class Plan(msgspec.Struct, kw_only=True):
    """What the step decided; the service carries it out. The index has already changed."""

    events: list[Event] = []
    archive: list[Task] = []  # finished tasks past history_limit, for history.jsonl
    start: list[Task] = []  # running tasks with no process yet: spawn them, in this order
    signal_groups: list[tuple[Task, int]] = []  # a signal for the task's process group
    signal_leftovers: dict[int, int] = {}  # ending task id -> the signal for what it left running
    strays: list[Adopted] = []  # processes let go for tasks that are final by now: end them
    gone: list[str] = []  # in a cluster: machines whose lease ran out (their tasks are lost now)
    set_aside: list[tuple[Task, Exception]] = []  # tasks failed because their handling raised (set_aside)
    wake_at: datetime | None = None  # the next moment something falls due


def tick(index: Index, cfg: Config, now: datetime, obs: Observations) -> Plan:
    """One step of the service, pure: book what was observed (exits, leftovers found, starts
    adopted), then stop what is due, then settle (expiry, who starts, history), and say
    what to do and when to look again. Exits come before adoptions: a start recovered after
    a crash comes after the exit that freed its slot, in the slots and in the events."""
    plan = Plan()
    here = obs.here
    me = here.name if here else None
    live = {t.id: t for t in index.active if ours(t, me)}  # another machine's processes are its own
    holds = dict(index.holds)
    # Limits first: an agent the kernel ended at its cgroup's memory limit exits with SIGKILL's
    # status, and its end is booked as over the limit, not as a plain kill.
    plan.signal_groups += [(t, 15) for t in over_limits(index, cfg, now, obs.measured) if ours(t, me)]
    for e in obs.exits:
        task = live.get(e.task)
        if task is None or task.ended_at is not None:
            continue
        try:
            reason = e.reason or read_output(cfg, task, e.code, e.tail, now, index)
            if e.leftovers:  # it keeps its slot while they are found and ended
                agent_ended(task, now, e.code, reason, cfg.kill_grace_s)
            else:
                plan.events += conclude(index, cfg, task, now, e.code, reason)
        except Exception as err:  # what its agent printed, or its record, defeated us: this task only
            plan.events += set_aside(index, plan, task, now, e.code, err)
    for f in obs.found:
        task = live.get(f.task)
        if task is None or task.ended_at is None:
            continue
        task.leftovers = max(task.leftovers, f.seen)
        if f.alive:
            kill = task.kill_at is not None and now >= task.kill_at
            plan.signal_leftovers[task.id] = 9 if kill else 15  # SIGKILL after the grace, else SIGTERM
        else:
            try:
                plan.events += conclude(index, cfg, task, now, task.exit_code, task.reason if task.exit_code else None)
            except Exception as err:
                plan.events += set_aside(index, plan, task, now, task.exit_code, err)
    for task_id, run in obs.progress.items():
        task = live.get(task_id)
        if task is not None and task.state is TaskState.RUNNING and task.ended_at is None:
            why = progress(index, cfg, task, run, now)
            if why is not None:  # past its budget mid-run: stopped like a timeout, failed
                _request_stop(task, TaskState.FAILED, why, now, cfg.kill_grace_s)
                plan.signal_groups.append((task, 15))
    plan.events += held_events(index, holds, now)
    adopted = adopt(index, now, obs.adopted, cfg, here)
    plan.set_aside += adopted.set_aside
    plan.events += adopted.events
    plan.strays = adopted.strays
    if here is not None:
        plan.gone = placement.gone_hosts(obs.hosts, here, now, cfg.cluster.lease_s)
        for name in plan.gone:
            for task in [t for t in index.active if t.host == name]:
                # lost, or back in the queue when it has retries left (conclude)
                plan.events += conclude(index, cfg, task, now, None, f"host {name} stopped answering (lease expired)")
    plan.signal_groups += [(t, 15) for t in timeouts_due(index, now, cfg.kill_grace_s) if ours(t, me)]
    if here is not None:  # a stop asked for on another machine (cancel there): its SIGTERM is ours to send
        plan.signal_groups += [(t, 15) for t in live.values() if t.stop is not None and t.pid is not None
                               and t.ended_at is None and t.kill_at is not None and now < t.kill_at]
    plan.signal_groups += [(t, 9) for t in kills_due(index, now) if t.ended_at is None and ours(t, me)]
    settled = settle(index, cfg, now, obs.resources, here)
    plan.events += settled.events
    plan.archive = settled.archive
    plan.start = settled.start
    plan.wake_at = min(filter(None, [next_deadline(index), next_release(index, cfg, now)]), default=None)
    return plan


def adopt(index: Index, now: datetime, found: list[Adopted], cfg: Config | None = None,
          here: Here | None = None) -> Plan:
    """Record processes no committed index knew of: a queued task's start, a running task's
    pid; a task that is final by now gets its process ended instead (a stray)."""
    plan = Plan()
    tasks = {t.id: t for t in index.all_tasks()}
    for a in found:
        task = tasks.get(a.task)
        if task is None or task.state.final:
            plan.strays.append(a)
            continue
        try:
            if task.state is TaskState.QUEUED:
                plan.events += start(index, task, now, here.name if here else None)
            if task.pid is None:
                task.pid, task.pid_start, task.log = a.pid, a.pid_start, a.log
                record_spawn(index, task, min(a.at, now))
                if a.code is not None and a.pid is None:
                    plan.events += conclude(index, cfg, task, now, a.code) if cfg else finish(index, task, now, a.code)
        except Exception as err:  # at start-up too: one task's record must not keep the service down
            plan.events += set_aside(index, plan, task, now, a.code, err)
    return plan


def set_aside(index: Index, plan: Plan, task: Task, now: datetime, code: int | None, err: Exception) -> list[Event]:
    """A task whose handling raised (its agent printed what could not be read, or its record
    holds what no rule foresaw): it ends as failed, its reason naming the error, and the step
    goes on for every other task. Whatever the failed handling had half changed of it is
    undone first: it is in exactly one list, the finished. Listed in plan.set_aside, for the
    service's log (once: a final task is not handled again)."""
    for part in (index.active, index.queued, index.finished):
        part[:] = [t for t in part if t.id != task.id]
    task.stop = task.limit = task.ended_at = task.kill_at = task.not_before = None
    task.reason = f"kugetsu could not handle this task's end ({type(err).__name__}: {err}); set aside"[:500]
    plan.set_aside.append((task, err))
    return [_close(index, task, TaskState.FAILED, now, code)]


def settle(index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
           here: Here | None = None) -> Plan:
    """The scheduling every transaction runs: a task cancelled before its process existed
    ends, queued tasks past their deadline expire, free slots go to the next tasks (they are
    `running` from here; the service spawns them), finished tasks past history_limit leave
    the index. `start` lists every running task still without a process."""
    plan = Plan()
    plan.events += release_due(index, now)
    me = here.name if here else None
    for task in [t for t in index.active if t.pid is None and t.stop is not None and ours(t, me)]:
        plan.events += finish(index, task, now, None)
    plan.events += expire_due(index, now)
    plan.events += dependencies_failed(index, now)
    for task, agent in starts_now(index, cfg, now, resources, here):
        plan.events += start(index, task, now, here.name if here else None, cfg, agent)
    plan.archive = trim_history(index, cfg.history_limit)
    plan.start = [t for t in index.active if t.pid is None and t.ended_at is None and ours(t, me)]
    return plan


def start_failed(index: Index, task: Task, now: datetime, code: int, reason: str) -> list[Event]:
    """Its process could not be started (or its worktree made): it ends, and frees its slot."""
    return finish(index, task, now, code, reason)


def _stands(task: Task) -> str:
    """How a task stands, in words: 'is running', 'is already cancelled', 'has already
    succeeded' (not 'is succeeded')."""
    if task.state in (TaskState.SUCCEEDED, TaskState.FAILED):
        return f"has already {task.state.value}"
    return f"is already {task.state.value}" if task.state.final else f"is {task.state.value}"


# ---- provider limits and retries -------------------------------------------------------


def may_requeue(cfg: Config, task: Task) -> bool:
    """Could this running task's end send it back to the queue (a retry, its provider's limit)?"""
    if task.retries > 0:
        return True
    preset = cfg.agents.get(task.agent) if task.agent else None
    return preset is not None and (preset.limit.enabled or preset.output != "text")  # its stream may report a limit


def reads_output(cfg: Config, task: Task) -> bool:
    """Does the task's preset need the end of its log at its exit (limit patterns, session)?"""
    preset = cfg.agents.get(task.agent) if task.agent else None
    return preset is not None and bool(preset.output != "text" or preset.limit.patterns or preset.session_pattern)


def read_output(cfg: Config, task: Task, code: int | None, tail: str | None, now: datetime,
                index: Index | None = None) -> str | None:
    """What the end of an agent's output says: its session id, the tokens it used, whether
    it hit its provider's limit (an exit that is not 0, with one of the preset's limit exit
    codes or patterns, or a limit its structured output reports), and when that resets.
    A preset with a structured `output` is read first (kugetsu/agents); its text patterns
    fill in what the report did not say. A run its agent reports was denied permissions
    fails even on exit 0 (it did not do what it was asked). Returns what the agent said of
    its failure, for the task's reason (None: nothing)."""
    preset = cfg.agents.get(task.agent) if task.agent else None
    if preset is None:
        return None
    report = None
    if preset.output != "text" and tail:
        from kugetsu import agents

        report = agents.read(preset.output, tail, now)
    session = (report.session if report else None) or (limits.session_of(preset.session_pattern, tail) if tail else None)
    if session:
        task.session = session
    _book_run(index, task, report.usage if report is not None else None, now)
    if task.stop is not None:
        return None
    if report is not None and report.denied and not report.limited:
        task.stop, task.reason = TaskState.FAILED, f"{task.agent} was denied permission: {', '.join(report.denied[:5])}"
        return task.reason
    if not code:
        return None
    # The patterns and a reset time in prose are read in the agent's own words about its end
    # when its stream gives them (the stream also holds whatever it read: a file quoting a
    # limit message is not its limit), else in the tail.
    said = (report.limit_text or report.error) if report is not None else None
    words = said if said is not None else tail or ""
    limited = report is not None and report.limited
    if limited or (preset.limit.enabled and (code in preset.limit.exit_codes
                                             or limits.matches(preset.limit.patterns, words))):
        until = report.reset_at if report is not None else None
        task.limit = LimitHit(until=until or limits.reset_time(words, now))
        return None
    return f"{describe_exit(code)}: {said[:300]}" if said else None


def _book_run(index: Index | None, task: Task, run: Usage | None, now: datetime) -> None:
    """A run has ended: what it used (as its agent reported at the end, else as far as its
    stream said mid-run) joins the task's total, and what was not booked yet today's spending."""
    streamed, task.run_usage = task.run_usage, None
    if run is None:
        run = streamed
    if run is None:
        return
    task.usage = run if task.usage is None else task.usage + run
    delta = run - streamed if streamed is not None else run
    if index is not None and (delta.tokens or delta.cost_usd):
        budgets.book(index, task, delta, now)


def progress(index: Index, cfg: Config, task: Task, run: Usage, now: datetime) -> str | None:
    """A running task's agent reported what its run has used so far (Claude Code's per-turn
    usage, read from its stream): booked for today's budgets; returns why it must stop when
    it has passed its own budget (the caller stops it), else None."""
    before = task.run_usage
    delta = run - before if before is not None else run
    if delta.tokens <= 0 and not delta.cost_usd:
        return None
    task.run_usage = run
    budgets.book(index, task, delta, now)
    return budgets.task_over(task) if task.stop is None else None


def conclude(index: Index, cfg: Config, task: Task, now: datetime, code: int | None,
             reason: str | None = None) -> list[Event]:
    """A running task's agent is gone for good: it hit its provider's limit (back to the
    queue in its place, its preset held), or it failed with retries left (back to the queue,
    after its retry delay), or it is final (`finish`). A task past its budget (known only now,
    from an agent that reports usage at the end) does not run again: it fails, saying so."""
    budgets.window_ended(index.windows, task.agent, task.id)
    if task.run_usage is not None:  # its end was not read (no output to read): what its stream said
        _book_run(index, task, None, now)
    over = budgets.task_over(task)
    if over is not None and (task.limit is not None or (code != 0 and task.stop in (None, TaskState.FAILED))):
        if task.stop is None or not (task.reason or "").startswith("budget "):
            task.stop, task.reason = TaskState.FAILED, over
        return finish(index, task, now, code, over)
    if task.stop is None and task.limit is not None and task.agent is not None:
        return _requeue_limited(index, cfg, task, now, code, task.limit)
    retry = task.stop in (None, TaskState.FAILED) and code != 0  # not a cancel; a timeout is a failure
    if retry and task.retries > sum(1 for a in task.attempts if not a.limit):
        return _requeue_retry(index, task, now, code, reason)
    if task.agent is not None and task.agent in index.strikes and code == 0:
        del index.strikes[task.agent]  # its provider served a whole run: the backoff starts over
    return finish(index, task, now, code, reason)


def _requeue(index: Index, task: Task, now: datetime, code: int | None, reason: str | None, limit: bool) -> None:
    """running -> queued again, in its place (its key is its priority and its id), with how
    this run ended kept in `attempts`. A queue deadline is for tasks never started: it goes."""
    index.active.remove(task)
    task.attempts.append(Attempt(started_at=task.started_at, ended_at=now, exit_code=code, reason=reason, limit=limit,
                                 usage=_run_usage(task)))
    task.attempt += 1
    unpause(task, now)
    task.paused_s = 0.0  # the next run's timeout counts afresh
    task.state = TaskState.QUEUED
    task.slot = task.pid = task.pid_start = task.started_at = task.ended_at = task.exit_code = None
    task.kill_at = task.stop = task.limit = task.reason = task.not_before = None
    task.host = None  # in a cluster it may start on any machine again (its pin, if any, stays)
    task.leftovers = 0
    task.expires_at = None
    index.queued.append(task)


def _run_usage(task: Task) -> Usage | None:
    """The usage of the run ending now: the task's total less its earlier attempts'."""
    if task.usage is None:
        return None
    from kugetsu.agents.report import total

    before = total([a.usage for a in task.attempts])
    run = task.usage - before if before is not None else task.usage
    return run if run.tokens or run.cost_usd else None


def _requeue_limited(index: Index, cfg: Config, task: Task, now: datetime, code: int | None, hit: LimitHit) -> list[Event]:
    agent = task.agent
    assert agent is not None
    preset = cfg.agents.get(agent)
    what = f"{agent} usage limit"
    hold = index.holds.get(agent)
    if hit.until is not None and not now < hit.until <= now + limits.MAX_AHEAD:
        hit = LimitHit()  # a reset time gone by, or beyond any provider's limit (a record from a wrong clock)
    if hold is None or (hold.until is not None and hold.until <= now):
        until = hit.until
        if until is None:  # no reset time given: back off, doubling with each hit in a row
            strikes = index.strikes.get(agent, 0)
            first, most = (parse_duration(preset.limit.backoff), parse_duration(preset.limit.max_backoff)) if preset else (60, 3600)
            until = now + timedelta(seconds=limits.backoff(first, most, strikes))
            index.strikes[agent] = strikes + 1
        index.holds[agent] = Hold(until=until, reason=what, since=now)
    elif hold.until is not None and hit.until is not None and hit.until > hold.until:
        hold.until = hit.until  # a later reset time said by another of its agents
    if preset is not None and preset.resume and task.session:
        task.first_command = task.first_command or task.command
        # `{prompt}` stays for the start to fill in from the store (argv), as in `command`;
        # a task from an older index has its prompt with it.
        prompt = task.prompt if task.prompt is not None and not task.prompted else PROMPT
        task.prompted = prompt == PROMPT
        values = {"session": task.session, "prompt": prompt, "name": task.name, "id": str(task.id)}
        task.command = [re.sub(r"\{(session|prompt|name|id)\}", lambda m: values[m.group(1)], a) for a in preset.resume]
    _requeue(index, task, now, code, f"{what} ({describe_exit(code) if code is not None else 'no exit status'})", True)
    until = index.holds[agent].until
    note = f"{what}: back in the queue, held until {clock(until, now)}" if until else f"{what}: back in the queue"
    return [_event("requeued", task, now, exit_code=code, reason=note)]


def _requeue_retry(index: Index, task: Task, now: datetime, code: int | None, reason: str | None) -> list[Event]:
    why = reason or (describe_exit(code) if code is not None else "lost")
    if task.state is TaskState.RUNNING and code is None and reason is None:
        why = "the process vanished and its exit status could not be recovered"
    if task.stop is TaskState.FAILED and task.reason:
        why = task.reason  # e.g. timed out after 10m
    if task.first_command:  # a retry starts afresh, not from the session a limit interrupted
        task.command, task.first_command = task.first_command, None
    _requeue(index, task, now, code, why, False)
    if task.retry_delay:
        task.not_before = now + timedelta(seconds=task.retry_delay)
    failures = sum(1 for a in task.attempts if not a.limit)
    when = f" at {clock(task.not_before, now)}" if task.not_before else ""
    return [_event("requeued", task, now, exit_code=code, reason=f"{why}; retry {failures} of {task.retries}{when}")]


def held_events(index: Index, before: dict[str, Hold], now: datetime) -> list[Event]:
    """One `held` event per preset whose hold began or moved in this step (several of its
    agents hitting the limit together make one notification, with their number)."""
    out = []
    for agent, hold in index.holds.items():
        old = before.get(agent)
        if old is not None and old.until == hold.until and old.since == hold.since:
            continue
        out.append(_hold_event("held", agent, hold, index, now))
    return out


def _hold_event(kind: str, agent: str, hold: Hold, index: Index, now: datetime) -> Event:
    n = sum(1 for t in index.queued if t.agent == agent)
    tasks = f"{n} task{'' if n == 1 else 's'}"
    if kind == "held":
        text = f"{hold.reason}: {tasks} held" + (f" until {clock(hold.until, now)}" if hold.until else " until released")
    else:
        over = f"{agent} released" if hold.reason.endswith("by hand") else f"{hold.reason} over"
        text = f"{over}: {tasks} may start"
    until = hold.until.isoformat() if hold.until else None
    return Event(type=kind, at=now, reason=text, value={"agent": agent, "until": until, "tasks": n})


def release_due(index: Index, now: datetime) -> list[Event]:
    """Holds whose end has come are lifted (their tasks start in this same step)."""
    due = [a for a, h in index.holds.items() if h.until is not None and h.until <= now]
    return [_hold_event("released", a, index.holds.pop(a), index, now) for a in due]


def hold(index: Index, cfg: Config, agent: str, until: datetime | None, now: datetime) -> list[Event]:
    """`kugetsu hold AGENT [--until T]`: none of the preset's tasks starts until then (or
    until released); running ones run on."""
    if agent not in cfg.agents:
        raise UsageError(f"unknown agent preset {agent!r}; known: {', '.join(sorted(cfg.agents))}")
    if until is not None and until <= now:
        raise UsageError(f"a hold until {until.isoformat()} is not in the future; give a later time or a duration like 30m")
    if until is not None and until > now + limits.MAX_AHEAD:
        raise UsageError(f"a hold until {until.isoformat()} is more than a year ahead; give an earlier time, or hold it"
                         " with no end, until released")
    index.holds[agent] = Hold(until=until, reason=f"{agent} held by hand", since=now)
    return [_hold_event("held", agent, index.holds[agent], index, now)]


def release(index: Index, cfg: Config, agent: str, now: datetime) -> list[Event]:
    """`kugetsu release AGENT`: its tasks may start again at once."""
    if agent not in cfg.agents:
        raise UsageError(f"unknown agent preset {agent!r}; known: {', '.join(sorted(cfg.agents))}")
    held = index.holds.pop(agent, None)
    if held is None:
        raise UsageError(f"agent {agent} is not held", code=1)
    return [_hold_event("released", agent, held, index, now)]


def retry_request(index: Index, task: Task, prompt: str | None) -> Request:
    """`kugetsu retry TASK`: a finished task admitted again, as a new task linked to it
    (`prompt`: its prompt, as the store keeps it: prompt_of). It runs after what it ran
    after: each dependency's latest run (`retry impl` then `retry review`: review waits for
    the new impl). One whose latest run ended otherwise than succeeded is refused, with what
    to do: the retry could never start."""
    if not task.state.final:
        raise UsageError(f"task {task.name} (#{task.id}) {_stands(task)}; only a finished task can be retried", code=1)
    after = []
    for dep_id in task.after:
        dep = latest_run(index, dep_id)
        if dep is not None and dep.state.final and dep.state is not TaskState.SUCCEEDED:
            raise UsageError(f"{task.name} (#{task.id}) runs after {dep.name} (#{dep.id}), which {dep.state.value}:"
                             f" retry {dep.name} first, then this one", code=1)
        after.append(f"#{dep.id if dep is not None else dep_id}")
    routed = bool(task.route)  # a failover order: its first preset's command again, with the prompt
    return Request(cwd=task.cwd, name=task.name, command=None if routed else list(task.first_command or task.command),
                   prompt=prompt, prompted=task.prompted and not routed,
                   agent=task.route[0] if routed else task.agent, source=task.source,
                   priority=task.priority, group=task.group, timeout=task.timeout,
                   env={} if routed else dict(task.env), retries=task.retries, retry_delay=task.retry_delay,
                   retry_of=task.id, fallback=task.route[1:] if routed else None,
                   fallback_fresh=task.fallback_fresh if routed else None, budget_usd=task.budget_usd,
                   max_tokens=task.max_tokens, memory=task.memory, max_procs=task.max_procs, slots=task.slots,
                   after=after)


def latest_run(index: Index, task_id: int) -> Task | None:
    """The task `task_id`, or its newest retry (`retry_of` links, followed to the end)."""
    tasks = index.all_tasks()
    found = next((t for t in tasks if t.id == task_id), None)
    while found is not None:
        newer = max((t for t in tasks if t.retry_of == found.id), key=lambda t: t.id, default=None)
        if newer is None:
            return found
        found = newer
    return None
