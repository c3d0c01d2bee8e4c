"""A clock that was wrong: times recorded from a wrong clock, moved to the service's (README,
"A wrong clock").
"""

from __future__ import annotations

from datetime import datetime, timedelta
from itertools import compress, repeat
from operator import attrgetter, ge

from kugetsu.config.model import Config
from kugetsu.config.units import format_duration
from kugetsu.core.models import ClockError, Index, Task


# ---- a clock that was wrong ------------------------------------------------------------

# How far a recorded time may lie from the service's clock before it is a clock error. NTP
# slews and steps by seconds; a command run under a wrong clock (faketime, a container's or a
# VM's clock) is off by hours or years. Not configurable: nothing legitimate lies in between.
CLOCK_TOLERANCE = timedelta(minutes=5)

_CREATED, _ID = attrgetter("created_at"), attrgetter("id")
# What a queued task may carry besides its creation: a run's times (one that ended, before a
# retry), an attempt's, a retry's wait. Truthy when set (a list that is not empty, a Struct, a
# datetime).
_QUEUED_ALSO = tuple(map(attrgetter, ("attempts", "run", "started_at", "finished_at")))


def _looked_at(index: Index, ahead: datetime) -> list[Task]:
    """The tasks correct_clock must look at one by one: the running and the finished (a few
    hundred at most) and, of the queue, only when one of its tasks was queued ahead or has
    anything but its creation recorded. Asked of the queue in C passes: a Python step a task
    was ~60 ms of a service's first tick at 50,000 queued."""
    queued = index.queued
    if queued and (max(map(_CREATED, queued)) > ahead or any(any(map(get, queued)) for get in _QUEUED_ALSO)):
        return index.all_tasks()
    return index.active + index.finished


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
    for task in _looked_at(index, ahead):
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
        run = task.run
        if run is not None and run.ended_at is not None and run.ended_at > ahead:
            run.ended_at -= off(run.ended_at, f"{who}'s agent ended at")
        if run is not None and run.kill_at is not None and run.kill_at > ahead + grace:
            run.kill_at -= off(run.kill_at, f"{who} was to be killed at") - grace  # now + grace
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
        live = index.live()
        for task in compress(live, map(ge, map(_ID, live), repeat(before.next_id))):  # new since: in C
            if task.created_at < floor:
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
