"""The service's step: from what it observed (exits, leftovers found, starts to adopt, measured
use) to a Plan (events, processes to spawn, signals, the next wake-up); settle, which every
transaction runs.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

import msgspec

from kugetsu.agents.report import Usage
from kugetsu.config.model import Config
from kugetsu.core import placement
from kugetsu.core.admission import dependencies_failed
from kugetsu.core.common import _close, _request_stop
from kugetsu.core.lifecycle import agent_ended, expire_due, finish, kills_due, record_spawn, start, timeouts_due, trim_history
from kugetsu.core.models import Event, Index, Task, TaskState
from kugetsu.core.placement import Here, ours
from kugetsu.core.policy import Look, Resources, memory_of, short_size
from kugetsu.core.retries import conclude, held_events, progress, read_output, release_due
from kugetsu.core.selection import free_slots, next_release, starts_now


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


def over_limits(index: Index, cfg: Config, now: datetime, seen: list[Measured], ending: Collection[int] = (),
                every: bool = False) -> list[Task]:
    """Stop (failed) the running tasks over a limit they declared: their memory, or their
    processes; also those the kernel had to act on in their cgroups (an OOM kill, a fork
    refused), which are over it by definition. Returns the tasks to send SIGTERM to now.

    What was measured of a task (its peak and CPU time) is booked on its record when it is
    final for its run: the run ends now (`ending`: its exit, the look that found its leftovers
    gone; before `conclude`, which may start its next attempt) or it is stopped over a limit;
    with `every` (a cluster, where the record is how the other machines see a running task's
    use), at every tick. While it runs alone, its use now is the service's (usage.json, which
    `queue`, `status`, the dashboard, metrics and the bot read): booked at every tick, each
    measurement made the transaction a write of the whole index, 14 MB at 50,000 queued
    (issue 31)."""
    tasks = {t.id: t for t in index.active}
    due = []
    for m in seen:
        task = tasks.get(m.task)
        if task is None or m.attempt != task.attempt:
            continue
        why = limit_exceeded(cfg, task, m)
        if every or why is not None or task.id in ending:
            book_measured(task, m)
        if why is not None:
            _request_stop(task, TaskState.FAILED, why, now, cfg.kill_grace_s)
            due.append(task)
    return due


def book_measured(task: Task, m: Measured) -> None:
    """Its record keeps the largest of what was measured of it (a retry's run included)."""
    task.peak_memory = max(task.peak_memory or 0, m.peak, m.memory) or None
    task.cpu_seconds = max(task.cpu_seconds or 0.0, m.cpu) or None


def use_so_far(task: Task, m: Measured | None) -> tuple[int | None, float | None]:
    """A task's peak memory and CPU time so far: its record's (booked when a run ends), with
    what was measured of the run under way (`m`, usage.json's) while it runs."""
    if m is None or m.attempt != task.attempt:
        return task.peak_memory, task.cpu_seconds
    return max(task.peak_memory or 0, m.peak) or None, max(task.cpu_seconds or 0.0, m.cpu) or None


def book_all(index: Index, seen: list[Measured]) -> None:
    """Book what was measured of every running task (the service stops: the next one does
    not know it)."""
    tasks = {t.id: t for t in index.active}
    for m in seen:
        if (task := tasks.get(m.task)) is not None and m.attempt == task.attempt:
            book_measured(task, m)


def limit_exceeded(cfg: Config, task: Task, m: Measured) -> str | None:
    """Why a running task must be stopped for what was measured of it, or None."""
    if task.run.stop is not None or task.run.ended_at is not None or m.attempt != task.attempt:
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
    release_at: datetime | None = None  # when a policy that holds a task that could start lets go (release_at)


def tick(index: Index, cfg: Config, now: datetime, obs: Observations, look: Look | None = None) -> Plan:
    """One step of the service, pure: book what was observed (exits, leftovers found, starts
    adopted), then stop what is due, then settle (expiry, who starts, history), and say
    what to do and when to look again. Exits come before adoptions: a start recovered after
    a crash comes after the exit that freed its slot, in the slots and in the events.
    `look`: of this queue or an earlier state of it (a service's Chain: settle's Looks follow it)."""
    plan = Plan()
    here = obs.here
    me = here.name if here else None
    live = {t.id: t for t in index.active if ours(t, me)}  # another machine's processes are its own
    holds = dict(index.holds)
    # Limits first: an agent the kernel ended at its cgroup's memory limit exits with SIGKILL's
    # status, and its end is booked as over the limit, not as a plain kill. The runs that end
    # in this tick get their measured use on their records here (over_limits).
    ending = {e.task for e in obs.exits} | {f.task for f in obs.found if not f.alive}
    ending |= {a.task for a in obs.adopted if a.code is not None}
    over = over_limits(index, cfg, now, obs.measured, ending, every=here is not None)
    plan.signal_groups += [(t, 15) for t in over if ours(t, me)]
    for e in obs.exits:
        task = live.get(e.task)
        if task is None or task.run.ended_at is not None:
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
        if task is None or task.run.ended_at is None:
            continue
        task.run.leftovers = max(task.run.leftovers, f.seen)
        if f.alive:
            kill = task.run.kill_at is not None and now >= task.run.kill_at
            plan.signal_leftovers[task.id] = 9 if kill else 15  # SIGKILL after the grace, else SIGTERM
        else:
            try:
                plan.events += conclude(index, cfg, task, now, task.exit_code, task.reason if task.exit_code else None)
            except Exception as err:
                plan.events += set_aside(index, plan, task, now, task.exit_code, err)
    for task_id, run in obs.progress.items():
        task = live.get(task_id)
        if task is not None and task.state is TaskState.RUNNING and task.run.ended_at is None:
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
    # A stop asked for by another process (a cancel, here or on another machine): its SIGTERM
    # is the service's to send, once (the service remembers what it signalled).
    # (`live` was read before the exits above: a task sent back to the queue since has no run.)
    plan.signal_groups += [(t, 15) for t in live.values() if t.run is not None and t.run.stop is not None
                           and t.run.pid is not None and t.run.ended_at is None and t.run.kill_at is not None
                           and now < t.run.kill_at]
    plan.signal_groups += [(t, 9) for t in kills_due(index, now) if t.run.ended_at is None and ours(t, me)]
    settled = settle(index, cfg, now, obs.resources, here, look)
    plan.events += settled.events
    plan.archive = settled.archive
    plan.start = settled.start
    plan.release_at = release_at(index, cfg, now)
    return plan


def release_at(index: Index, cfg: Config, now: datetime) -> datetime | None:
    """When a rate limit, a hold or a start time that holds a queued task runs out, while a
    slot is free for it (with none free, the exit that frees one ticks anyway): the queue is
    played into lanes (policy.Board) only then, not at every tick of a busy service."""
    if not index.queued or free_slots(index, cfg) == 0:
        return None
    return next_release(index, cfg, now)


def adopt(index: Index, now: datetime, found: list[Adopted], cfg: Config | None = None,
          here: Here | None = None) -> Plan:
    """Record processes no committed index knew of: a queued task's start, a running task's
    pid; a task that is final by now gets its process ended instead (a stray)."""
    plan = Plan()
    if not found:
        return plan  # the common case: no map of every task (a tick at 50,000 queued)
    tasks = {t.id: t for t in index.all_tasks()}
    for a in found:
        task = tasks.get(a.task)
        if task is None or task.state.final:
            plan.strays.append(a)
            continue
        try:
            if task.state is TaskState.QUEUED:
                plan.events += start(index, task, now, here.name if here else None)
            if task.run.pid is None:
                task.run.pid, task.run.pid_start, task.log = a.pid, a.pid_start, a.log
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
    if task.run is not None:
        task.run.stop = task.run.limit = task.run.ended_at = task.run.kill_at = None
    task.not_before = None
    task.reason = f"kugetsu could not handle this task's end ({type(err).__name__}: {err}); set aside"[:500]
    plan.set_aside.append((task, err))
    return [_close(index, task, TaskState.FAILED, now, code)]


def settle(index: Index, cfg: Config, now: datetime, resources: Resources | None = None,
           here: Here | None = None, look: Look | None = None) -> Plan:
    """The scheduling every transaction runs: a task cancelled before its process existed
    ends, queued tasks past their deadline expire, free slots go to the next tasks (they are
    `running` from here; the service spawns them), finished tasks past history_limit leave
    the index. `start` lists every running task still without a process. `look`: of this
    queue or an earlier state of it (a service's Chain carries what still holds; core/look.py)."""
    plan = Plan()
    plan.events += release_due(index, now)
    me = here.name if here else None
    for task in [t for t in index.active if t.run.pid is None and t.run.stop is not None and ours(t, me)]:
        plan.events += finish(index, task, now, None)
    # expire_due, dependencies_failed and the starts ask the same questions of the queue; each
    # of the first two may change it (the same list), and the Look that follows is of what is left
    look = look.following(index.queued) if look is not None else Look(index.queued)
    expired = expire_due(index, now, look)
    plan.events += expired
    if expired:
        look = look.following(index.queued)
    failed = dependencies_failed(index, now, look)
    plan.events += failed
    if failed:
        look = look.following(index.queued)
    for task, agent in starts_now(index, cfg, now, resources, here, look):
        plan.events += start(index, task, now, here.name if here else None, cfg, agent)
    plan.archive = trim_history(index, cfg.history_limit)
    plan.start = [t for t in index.active if t.run.pid is None and t.run.ended_at is None and ours(t, me)]
    return plan


def start_failed(index: Index, task: Task, now: datetime, code: int, reason: str) -> list[Event]:
    """Its process could not be started (or its worktree made): it ends, and frees its slot."""
    return finish(index, task, now, code, reason)
