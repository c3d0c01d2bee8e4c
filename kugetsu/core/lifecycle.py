"""A task's transitions after admission: start, spawn recorded, exit, cancel, expiry, timeouts
and kills, deadlines, history trimming, clean and remove.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from operator import attrgetter
from types import EllipsisType

from kugetsu.config.model import Config
from kugetsu.config.units import format_duration
from kugetsu.core import budgets
from kugetsu.core.commandline import _NEEDS_PROMPT, render_command, render_template
from kugetsu.core.common import _close, _event, _request_stop, _stands, unpause
from kugetsu.core.models import Event, Index, Run, SourceMark, Task, TaskState
from kugetsu.core.policy import Look, Resources, guard_hold
from kugetsu.core.selection import free_slots, lowest_free_slot, next_release
from kugetsu.errors import NotFound, UsageError


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
    task.run = Run(slot=lowest_free_slot(index))  # this run's record, from its slot on
    task.started_at = now
    index.active.append(task)
    index.starts += 1
    index.last_start.pop(task.source, None)  # keeps the dict in start order, oldest first
    index.last_start[task.source] = SourceMark(at=now, n=index.starts)
    _forget_sources(index)
    note = f"fallback from {task.fallback_from}" if task.fallback_from else None
    return [_event("started", task, now, slot=task.run.slot, host=host, reason=note,
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
    task.run.ended_at = now
    task.exit_code = exit_code
    if reason and task.run.stop is None:
        task.reason = reason
    if task.run.kill_at is None:
        task.run.kill_at = now + timedelta(seconds=grace)


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
    agent left behind and kugetsu ended (task.run.leftovers) are named in the reason."""
    index.active.remove(task)
    task.run.ended_at = None
    if task.run.stop is not None:
        state = task.run.stop
    elif exit_code is None:
        state = TaskState.LOST
        task.reason = reason or "the process vanished and its exit status could not be recovered"
    elif exit_code == 0:
        state = TaskState.SUCCEEDED
    else:
        state = TaskState.FAILED
        task.reason = reason or describe_exit(exit_code)
    note = leftovers_note(task.run.leftovers)
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
    """queued: cancelled at once. running: marked to stop; the service sends SIGTERM to its
    process group (step.tick) and SIGKILL at `kill_at`; it becomes final when its process is gone."""
    if task.state.final:
        raise UsageError(f"task {task.name} (#{task.id}) {_stands(task)}", code=1)
    if task.state is TaskState.QUEUED:
        index.queued.remove(task)
        task.reason = reason
        return [_close(index, task, TaskState.CANCELLED, now)]
    unpause(task, now)  # the service sends SIGCONT after the SIGTERM: a stopped process must run to end
    _request_stop(task, TaskState.CANCELLED, reason, now, grace)
    return []




_EXPIRES_AT = attrgetter("expires_at")


def expire_due(index: Index, now: datetime, look: Look | None = None) -> list[Event]:
    """Queued tasks whose expires_at has come end as expired. Every transaction asks it: the
    earliest expiry is found first (Look.earliest_expiry: C's steps, or what a service's Chain
    carries), and the queue walked in Python only when one has come (a tick at 50,000 queued).
    `look`: of this queue, when the caller asks more of it (policy.Look)."""
    events: list[Event] = []
    earliest = Look.of(index, look).earliest_expiry()
    if earliest is None or earliest > now:
        return events
    for task in [t for t in index.queued if t.expires_at is not None and t.expires_at <= now and t.stashed_at is None]:
        index.queued.remove(task)
        task.reason = f"expired after {format_duration((now - task.created_at).total_seconds())} in the queue"
        events.append(_close(index, task, TaskState.EXPIRED, now))
    return events


def run_deadline(task: Task) -> datetime | None:
    """When a running task's run timeout falls due: its start, plus the timeout, plus the time
    it spent paused (`pause TASK` stops its clock too). None while paused or without a timeout."""
    if not task.timeout or not task.started_at or task.run.paused_at is not None:
        return None
    return task.started_at + timedelta(seconds=task.timeout + task.run.paused_s)


def timeouts_due(index: Index, now: datetime, grace: float) -> list[Task]:
    """Running tasks past their run timeout are marked to stop (failed); returns them to signal."""
    due = []
    for task in index.active:
        if task.run.stop is None and (deadline := run_deadline(task)) is not None and now >= deadline:
            _request_stop(task, TaskState.FAILED, f"timed out after {format_duration(task.timeout or 0)}", now, grace)
            due.append(task)
    return due


def queue_deadline(index: Index, look: Look | None = None) -> datetime | None:
    """The earliest expiry of a queued task (expire_due's), the one part of next_deadline that
    grows with the queue: the service keeps it while the queue is the same, and its Chain's
    Looks carry it across a drain's promotions (Look.earliest_expiry). `look`: of this queue,
    when the caller asks more of it (policy.Look)."""
    return Look.of(index, look).earliest_expiry()


def next_deadline(index: Index, queued: datetime | None | EllipsisType = ...) -> datetime | None:
    """The earliest moment something falls due: a queued task's expiry, a running task's run
    timeout, the SIGKILL that follows a stop's grace, or the end of a hold on a preset. (The service's one timer is set
    there; what is due then is decided by expire_due, timeouts_due and kills_due.) `queued`:
    queue_deadline(index), when the caller has it."""
    expiry = queue_deadline(index) if queued is ... else queued
    times = [expiry] if expiry is not None else []
    times += [h.until for h in index.holds.values() if h.until is not None]  # released at its end
    for task in index.active:
        if task.run.kill_at is not None:
            times.append(task.run.kill_at)
        elif task.run.stop is None and (deadline := run_deadline(task)) is not None:
            times.append(deadline)
    return min(times, default=None)


GUARD_RECHECK = 2.0  # seconds between resource readings while the guard holds queued tasks


def policy_wakeups(index: Index, cfg: Config, now: datetime, resources: Resources | None,
                   before: dict[str, datetime], release: datetime | None | EllipsisType = ...) -> dict[str, datetime]:
    """Wake-ups the scheduling policies need, beside next_deadline: when a rate limit that
    holds a task runs out (so it starts on time), and a fresh resource reading while the
    guard holds. `before`: what the last call returned. `release`: next_release of this
    index, when the caller has it already (step.Plan.release_at: the queue is played into
    lanes once per tick)."""
    if not index.queued or free_slots(index, cfg) == 0:
        return {}
    jobs = {}
    if release is ...:
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
    return [t for t in index.active if t.run.kill_at is not None and t.run.kill_at <= now]


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
