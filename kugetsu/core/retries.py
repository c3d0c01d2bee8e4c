"""Provider limits and retries: reading an ended agent's output, booking its run, requeueing
after a limit or a failure, holds of a preset and their release.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from kugetsu.agents.report import Usage
from kugetsu.config.model import Config
from kugetsu.config.units import parse_duration
from kugetsu.core import budgets, limits
from kugetsu.core.admission import Request
from kugetsu.core.commandline import PROMPT
from kugetsu.core.common import _event, _stands
from kugetsu.core.lifecycle import describe_exit, finish
from kugetsu.core.models import Attempt, Event, Hold, Index, LimitHit, Task, TaskState
from kugetsu.core.times import clock
from kugetsu.errors import UsageError


# ---- provider limits and retries -------------------------------------------------------




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
    if task.run.stop is not None:
        return None
    if report is not None and report.denied and not report.limited:
        task.run.stop, task.reason = TaskState.FAILED, f"{task.agent} was denied permission: {', '.join(report.denied[:5])}"
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
        task.run.limit = LimitHit(until=until or limits.reset_time(words, now))
        return None
    return f"{describe_exit(code)}: {said[:300]}" if said else None


def _book_run(index: Index | None, task: Task, run: Usage | None, now: datetime) -> None:
    """A run has ended: what it used (as its agent reported at the end, else as far as its
    stream said mid-run) joins the task's total, and what was not booked yet today's spending."""
    streamed, task.run.usage = task.run.usage, None
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
    before = task.run.usage
    delta = run - before if before is not None else run
    if delta.tokens <= 0 and not delta.cost_usd:
        return None
    task.run.usage = run
    budgets.book(index, task, delta, now)
    return budgets.task_over(task) if task.run.stop is None else None


def conclude(index: Index, cfg: Config, task: Task, now: datetime, code: int | None,
             reason: str | None = None) -> list[Event]:
    """A running task's agent is gone for good: it hit its provider's limit (back to the
    queue in its place, its preset held), or it failed with retries left (back to the queue,
    after its retry delay), or it is final (`finish`). A task past its budget (known only now,
    from an agent that reports usage at the end) does not run again: it fails, saying so."""
    budgets.window_ended(index.windows, task.agent, task.id)
    if task.run.usage is not None:  # its end was not read (no output to read): what its stream said
        _book_run(index, task, None, now)
    over = budgets.task_over(task)
    if over is not None and (task.run.limit is not None or (code != 0 and task.run.stop in (None, TaskState.FAILED))):
        if task.run.stop is None or not (task.reason or "").startswith("budget "):
            task.run.stop, task.reason = TaskState.FAILED, over
        return finish(index, task, now, code, over)
    if task.run.stop is None and task.run.limit is not None and task.agent is not None:
        return _requeue_limited(index, cfg, task, now, code, task.run.limit)
    retry = task.run.stop in (None, TaskState.FAILED) and code != 0  # not a cancel; a timeout is a failure
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
    task.state = TaskState.QUEUED
    task.run = None  # its slot, process, stop, pauses: the next run starts afresh
    task.started_at = task.exit_code = task.reason = task.not_before = None
    task.host = None  # in a cluster it may start on any machine again (its pin, if any, stays)
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
    if task.run.stop is TaskState.FAILED and task.reason:
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
