"""Everything the service does at a time, on APScheduler 3.x (docs/scheduling.md).

Two kinds of jobs on one AsyncIOScheduler, on the service's loop:

- `deadline`: ONE date job at the earliest moment anything falls due: queue expiry, run
  timeouts, SIGKILL after the grace, the end of a hold on a preset, a retry's delay and a
  start time asked for (`not_before`), rate limits and resource-guard re-checks. The service
  sets it after every tick (pm.next_deadline and the policies' wake-ups); when it fires,
  the tick that follows asks pm what is due and does ALL of it (expire_due, timeouts_due,
  kills_due, release_due, settle take everything due at `now`), then sets the next one.
- `schedule:NAME`: one cron or interval job per recurring schedule (kugetsu/schedules.py);
  the service gives the firing to ops.

Used as APScheduler's documentation and source intend, which the asyncio timer that stood
here before worked around (an earlier use skipped the one job for good):

- A date job leaves the job store when it is submitted, and `max_instances` (1) counts a
  job id until its run's done-callback (`_run_job_success`) has run. A job that re-adds its
  own id already due while it runs is refused at the next `_process_jobs`
  (MaxInstancesReachedError) and, being a date job, dropped. So the handler never re-arms
  itself: what it asks for is kept, and armed from the EVENT_JOB_EXECUTED | EVENT_JOB_ERROR
  listener, which runs after the count went down; an EVENT_JOB_MAX_INSTANCES listener
  re-arms too, as a net.
- `misfire_grace_time=None`: a deadline late by any amount (a busy loop, a suspended
  machine) still fires, never silently dropped (the default grace is 1 s); `coalesce=True`:
  runs missed together fire once (a recurring schedule's missed runs coalesce into one).
- A fixed id with `replace_existing=True`: setting the deadline again replaces it.
- Job functions are coroutines: AsyncIOExecutor runs them on the loop (a plain function
  would run in a thread pool, and the service's state is the loop's alone).

Only the service imports this module (and `kugetsu schedule` the triggers): the CLI's
other commands never load APScheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, EVENT_JOB_MAX_INSTANCES, JobEvent
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.date import DateTrigger

log = logging.getLogger("kugetsu.deadlines")

DEADLINE = "deadline"
JOB_DEFAULTS = {"misfire_grace_time": None, "coalesce": True, "max_instances": 1}


def new_scheduler() -> AsyncIOScheduler:
    """The service's scheduler: in UTC (deadlines are UTC; a schedule's trigger carries its
    own zone), with the job defaults above. Started on the running loop by the caller."""
    return AsyncIOScheduler(timezone=timezone.utc, job_defaults=dict(JOB_DEFAULTS))


class DeadlineTimer:
    """The `deadline` job: set (by every tick) to the next moment something falls due."""

    def __init__(self, scheduler: AsyncIOScheduler, on_due: Callable[[], None]):
        self.scheduler, self.on_due = scheduler, on_due
        self.due: datetime | None = None  # when it is to fire: what the last tick asked for
        self._armed: datetime | None = None  # what the job store holds now
        self._running = False  # the job runs: what it asks for is armed by the listener
        scheduler.add_listener(self._after, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MAX_INSTANCES)

    def set(self, due: datetime | None, now: datetime | None = None) -> None:
        self.due = due
        if not self._running:
            self._arm()

    def cancel(self) -> None:
        self.due = None
        self._arm()

    def _arm(self) -> None:
        if self.due == self._armed:
            return  # already set for that moment (a promotion mostly leaves it so)
        if self.due is None:
            if self.scheduler.get_job(DEADLINE) is not None:
                self.scheduler.remove_job(DEADLINE)
        else:
            self.scheduler.add_job(self._fire, DateTrigger(run_date=self.due), id=DEADLINE, replace_existing=True,
                                   name="kugetsu deadline", **JOB_DEFAULTS)
        self._armed = self.due

    async def _fire(self) -> None:
        self._armed = None  # a date job leaves the store when submitted
        self._running = True
        try:
            self.on_due()  # the tick: everything due at its `now`, and set() of the next one
        finally:
            self._running = False

    def _after(self, event: JobEvent) -> None:
        if event.job_id != DEADLINE:
            return
        if event.code == EVENT_JOB_MAX_INSTANCES:  # not expected (see above); never lose it
            log.warning("deadline job was skipped by APScheduler (max instances); armed again")
            self._armed = None
        self._arm()


def job_ids(scheduler: AsyncIOScheduler, prefix: str) -> set[str]:
    return {job.id for job in scheduler.get_jobs() if job.id.startswith(prefix)}


def add_recurring(scheduler: AsyncIOScheduler, job_id: str, trigger: Any, func: Callable[..., Any],
                  args: tuple[Any, ...] = ()) -> None:
    """A schedule's job: replaced whole when it changes (fixed id, replace_existing)."""
    scheduler.add_job(func, trigger, args=args, id=job_id, replace_existing=True, name=job_id, **JOB_DEFAULTS)
