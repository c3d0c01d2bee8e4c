"""Everything the service does at a time, on APScheduler 3.x (docs/scheduling.md).

Two kinds of jobs on one AsyncIOScheduler, on the service's loop:

- `deadline`: ONE date job at the earliest moment anything falls due: queue expiry, run
  timeouts, SIGKILL after the grace, the end of a hold on a preset, a retry's delay and a
  start time asked for (`not_before`), rate limits and resource-guard re-checks. The service
  sets it after every tick (lifecycle.next_deadline and the policies' wake-ups); when it fires,
  the tick that follows asks pm what is due and does ALL of it (expire_due, timeouts_due,
  kills_due, release_due, settle take everything due at `now`), then sets the next one.
- `schedule:NAME`: one cron or interval job per recurring schedule (kugetsu/core/schedules.py);
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
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

from apscheduler.events import (EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_SUBMITTED,
                                JobEvent, JobSubmissionEvent)
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.date import DateTrigger

from kugetsu.core.models import Schedule

log = logging.getLogger("kugetsu.deadlines")

DEADLINE = "deadline"
JOB_DEFAULTS = {"misfire_grace_time": None, "coalesce": True, "max_instances": 1}


def new_scheduler() -> AsyncIOScheduler:
    """The service's scheduler: in UTC (deadlines are UTC; a schedule's trigger carries its
    own zone), with the job defaults above. Started on the running loop by the caller.
    APScheduler logs each run at INFO (two lines per deadline): only its warnings are kept."""
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
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
        # A date job leaves the store when submitted; and it has fired: only what the tick
        # sets now is armed next (a tick that failed sets nothing: the retry's tick does).
        self._armed = self.due = None
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


PREFIX = "schedule:"


class ScheduleJobs:
    """One job per recurring schedule (`schedule:NAME`), kept in line with the index after
    every tick (`sync`): added, replaced when its rule changes, removed when it is paused or
    gone. A schedule's firings missed while the service was down (schedules.missed) are
    given to APScheduler as the job's first run time, so its coalescing makes them one run
    (config schedule_missed = one); with `skip` the job starts at its next firing.
    `fire(name, at)` gets the firing's scheduled time (the last of the run times coalesced),
    read from the EVENT_JOB_SUBMITTED event that comes just before the run."""

    def __init__(self, scheduler: AsyncIOScheduler, fire: Callable[[str, datetime], Awaitable[None]]):
        self.scheduler, self.fire = scheduler, fire
        self.rules: dict[str, tuple[object, ...]] = {}  # name -> the rule its job was made from
        self._submitted: dict[str, datetime] = {}
        # The next sync registers every schedule with what it missed: at the service's start,
        # and when this machine takes the schedules' lease over (restart). A schedule added or
        # resumed later starts at its next firing (a pause's firings are not caught up).
        self.catch_up = True
        scheduler.add_listener(self._on_submitted, EVENT_JOB_SUBMITTED)

    def restart(self) -> None:
        self.rules.clear()
        self.catch_up = True

    def sync(self, schedules: dict[str, Schedule], now: datetime, missed: str) -> None:
        from kugetsu.core import schedules as rules

        for name in [n for n in self.rules if n not in schedules or schedules[n].paused]:
            del self.rules[name]
            if self.scheduler.get_job(PREFIX + name) is not None:
                self.scheduler.remove_job(PREFIX + name)
        for name, sched in schedules.items():
            rule = (sched.cron, sched.every, sched.tz, sched.created_at)
            if sched.paused or self.rules.get(name) == rule:
                continue
            try:
                trigger = rules.trigger(sched)
            except Exception as err:  # a zone gone from this machine's tzdata: this schedule only
                log.error("schedule %s cannot be registered: %s", name, err)
                self.rules[name] = rule
                continue
            lost = rules.missed(sched, now) if self.catch_up else None
            first = lost if missed == "one" else None
            extra = {"next_run_time": first} if first is not None else {}
            if lost is not None:
                # Said once, at the start: what the service found missed while it was down.
                log.info("schedule %s: missed firings since %s: %s", name, lost.isoformat(timespec="seconds"),
                         "one runs now (schedule_missed one)" if first is not None else "skipped (schedule_missed skip)")
            self.scheduler.add_job(self._run, trigger, args=(name,), id=PREFIX + name, replace_existing=True,
                                   name=PREFIX + name, **JOB_DEFAULTS, **extra)
            self.rules[name] = rule
        self.catch_up = False

    def _on_submitted(self, event: JobSubmissionEvent) -> None:
        if event.job_id.startswith(PREFIX):
            self._submitted[event.job_id] = event.scheduled_run_times[-1]

    async def _run(self, name: str) -> None:
        at = self._submitted.pop(PREFIX + name, None) or datetime.now(timezone.utc)
        await self.fire(name, at)
