"""Recurring schedules (`kugetsu schedule`, docs/scheduling.md): the rules, pure like pm.

A schedule is kept in the Index (models.Schedule). Each firing delegates its request through
admission.admit, as a task named after the schedule and the time, unless its last task still lives
(no overlap by default) or admission refuses (a full queue): either is recorded on the
schedule (`last_note`), never lost in silence. A firing at or before the schedule's
`last_fire` is never run again, whoever asks: a service restarted, a second machine of a
cluster. When the trigger fires is APScheduler's (the service's jobs, `trigger`); everything
else here is a function of an Index, a Config and a clock.
"""

from __future__ import annotations

from datetime import datetime, timedelta, tzinfo
from typing import Any

import msgspec

from kugetsu.core import admission
from kugetsu.errors import KugetsuError, NotFound, UsageError
from kugetsu.core.models import Event, Index, Schedule, TaskState, valid_name

NAME_MAX = 40  # + "-YYYYmmdd-HHMMSS": a task name of at most 64
MIN_EVERY = 1.0  # seconds


class NoSuchSchedule(NotFound):
    def __init__(self, name: str):
        super().__init__(f"no schedule {name!r} (`kugetsu schedule list`)")
        self.name = name


# ---- crontab lines -------------------------------------------------------------------------

_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


def _day(text: str, line: str) -> int:
    text = text.lower()
    if text[:3] in _DAYS and len(text) == 3:
        return _DAYS.index(text)
    if text.isascii() and text.isdigit() and int(text) <= 7:
        return int(text) % 7
    raise UsageError(f"cron {line!r}: day of week {text!r} is not 0-7 or sun-sat")


def _weekdays(field: str, line: str) -> str:
    """A crontab day-of-week field (0 or 7 = Sunday, 1 = Monday, names, ranges, steps) as
    APScheduler 3.x reads it. Its CronTrigger takes 0 as Monday (a mismatch its docs warn
    of, kept in 3.x): so the days are spelled out by name (`1-5` -> mon,tue,wed,thu,fri)."""
    if field == "*":
        return "*"
    days: set[int] = set()
    for item in field.split(","):
        part, _, step_text = item.partition("/")
        step = 1
        if step_text:
            if not (step_text.isascii() and step_text.isdigit()) or int(step_text) == 0:
                raise UsageError(f"cron {line!r}: step {step_text!r} is not a positive whole number")
            step = int(step_text)
        if part == "*":
            lo, hi = 0, 6
        elif "-" in part:
            a, b = part.split("-", 1)
            lo, hi = _day(a, line), _day(b, line)
            if b.strip() == "7":
                hi = 7  # 5-7: Friday to Sunday
            if hi < lo:
                raise UsageError(f"cron {line!r}: day range {part!r} runs backwards")
        else:
            lo = hi = _day(part, line)
        days.update(d % 7 for d in range(lo, hi + 1, step))
    return ",".join(_DAYS[d] for d in sorted(days, key=lambda d: (d - 1) % 7))  # mon first, as APScheduler


def cron_fields(line: str) -> dict[str, str]:
    """A crontab line (`0 2 * * 1-5`, or 6 fields with seconds first: `*/2 * * * * *`) as
    CronTrigger's keyword arguments, in crontab's meaning."""
    fields = line.split()
    if len(fields) not in (5, 6):
        raise UsageError(f"cron {line!r}: give 5 fields (minute hour day month weekday), or 6 with seconds first")
    if len(fields) == 5:
        fields = ["0", *fields]
    second, minute, hour, day, month, dow = fields
    return {"second": second, "minute": minute, "hour": hour, "day": day, "month": month,
            "day_of_week": _weekdays(dow, line)}


def zone(name: str | None) -> tzinfo:
    """A schedule's time zone: an IANA name, or the machine's local zone."""
    if name is None:
        from tzlocal import get_localzone

        return get_localzone()
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise UsageError(f"unknown time zone {name!r}: give an IANA name such as Europe/Paris or UTC") from None


def local_zone_name() -> str | None:
    """This machine's IANA zone (TZ, /etc/localtime), or None when it has no name."""
    from tzlocal import get_localzone_name

    try:
        return get_localzone_name()  # type: ignore[no-any-return]
    except Exception:  # no zone configured, or one tzlocal cannot name
        return None


def trigger(sched: Schedule) -> Any:
    """Its APScheduler trigger (imported here only: the service and `kugetsu schedule`).
    Cron in its zone (DST as APScheduler's CronTrigger: docs/scheduling.md); `every` counts
    from its creation."""
    if sched.cron is not None:
        try:
            return _cron_class()(timezone=zone(sched.tz), **cron_fields(sched.cron))
        except ValueError as err:
            raise UsageError(f"cron {sched.cron!r}: {err}") from None
    from apscheduler.triggers.interval import IntervalTrigger

    return IntervalTrigger(seconds=sched.every or 0, start_date=sched.created_at, timezone=zone("UTC"))


_CRON: type | None = None


def _cron_class() -> type:
    """APScheduler 3.x's CronTrigger, made to move on across a DST fall-back.

    In the hour a fall-back repeats, 3.x (3.11.3, with zoneinfo) gives a time of that hour
    again as the next fire time, the same instant over and over once past it
    (agronholm/apscheduler#1021, open): the scheduler's `_get_run_times` would loop on it.
    Here a next time whose wall-clock time is not after the previous firing's is passed
    over, and the search starts again after it in the repeated hour: each wall-clock time
    fires once, at its first occurrence (as Vixie cron does), and the schedule goes on."""
    global _CRON
    if _CRON is None:
        from apscheduler.triggers.cron import CronTrigger

        class Cron(CronTrigger):  # type: ignore[misc]
            def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime | None:
                nxt = super().get_next_fire_time(previous_fire_time, now)
                for _ in range(10):  # two passes at most in practice
                    if nxt is None or previous_fire_time is None:
                        return nxt  # type: ignore[no-any-return]
                    wall = previous_fire_time.astimezone(self.timezone).replace(tzinfo=None)
                    if nxt.astimezone(self.timezone).replace(tzinfo=None) > wall:
                        return nxt  # type: ignore[no-any-return]
                    after = (wall + timedelta(microseconds=1)).replace(tzinfo=self.timezone, fold=1)
                    nxt = super().get_next_fire_time(None, max(after, now))
                raise RuntimeError(f"cron trigger {self} makes no progress after {previous_fire_time}")

        _CRON = Cron
    return _CRON


def next_fire(sched: Schedule, now: datetime) -> datetime | None:
    """When it fires next (None while paused)."""
    if sched.paused:
        return None
    return trigger(sched).get_next_fire_time(None, now)  # type: ignore[no-any-return]


def missed(sched: Schedule, now: datetime) -> datetime | None:
    """The first firing missed (due after its last firing, or its creation, and before now),
    or None: what a service that was down finds at its start."""
    if sched.paused:
        return None
    since = max(filter(None, [sched.last_fire, sched.created_at]))
    first = trigger(sched).get_next_fire_time(None, since + timedelta(microseconds=1))
    return first if first is not None and first <= now else None


# ---- the rules -------------------------------------------------------------------------------


def check_name(name: str) -> None:
    if not valid_name(name) or len(name) > NAME_MAX:
        raise UsageError(f"invalid schedule name {name!r}: 1-{NAME_MAX} letters, digits, '.', '_' or '-', starting"
                         " with a letter or digit, not digits only")


def add(index: Index, now: datetime, name: str, *, cron: str | None, every: float | None, tz: str | None,
        request: admission.Request, overlap: bool = False) -> tuple[Schedule, list[Event]]:
    """A new schedule; the caller has checked the request as delegate does (ops)."""
    check_name(name)
    if name in index.schedules:
        raise UsageError(f"a schedule named {name!r} exists; `kugetsu schedule remove {name}` first")
    if (cron is None) == (every is None):
        raise UsageError("give --cron \"0 2 * * 1-5\" or --every DUR (e.g. 6h)")
    if every is not None and every < MIN_EVERY:
        raise UsageError(f"--every {every:g}s is too short: at least {MIN_EVERY:g}s")
    if every is not None and tz is not None:
        raise UsageError("--tz is for --cron: --every counts time, whatever the zone")
    raw = msgspec.to_builtins(request)
    for key in ("name", "token", "parent", "prompt_path", "retry_of", "start_at"):
        raw.pop(key, None)
    raw = {k: v for k, v in raw.items() if v is not None and v != [] and v != {}}
    sched = Schedule(name=name, cron=cron, every=every, tz=tz, request=raw, created_at=now, overlap=overlap)
    trigger(sched)  # a bad cron field or zone is refused here, not at the first firing
    index.schedules[name] = sched
    return sched, [Event(type="schedule", at=now, name=name, reason="added",
                         value=cron if cron is not None else f"every {every:g}s")]


def find(index: Index, name: str) -> Schedule:
    sched = index.schedules.get(name)
    if sched is None:
        raise NoSuchSchedule(name)
    return sched


def set_paused(index: Index, now: datetime, name: str, on: bool) -> list[Event]:
    sched = find(index, name)
    if sched.paused == on:
        return []
    sched.paused = on
    return [Event(type="schedule", at=now, name=name, reason="paused" if on else "resumed")]


def remove(index: Index, now: datetime, name: str) -> list[Event]:
    find(index, name)
    del index.schedules[name]
    return [Event(type="schedule", at=now, name=name, reason="removed")]


def task_name(sched: Schedule, at: datetime) -> str:
    """The firing's task: the schedule's name and the time, in the schedule's zone."""
    local = at.astimezone(zone(sched.tz) if sched.cron is not None else None)
    return f"{sched.name}-{local.strftime('%Y%m%d-%H%M%S')}"


def free_name(index: Index, name: str) -> str:
    """`name`, or `name-2`, `name-3`... when a live task has it (two firings in one second:
    `schedule run` twice, `--every 1s --overlap`)."""
    live = {t.name for t in index.live()}
    n, out = 1, name
    while out in live:
        n += 1
        out = f"{name}-{n}"
    return out


def request(sched: Schedule, at: datetime) -> admission.Request:
    return msgspec.convert({**sched.request, "name": task_name(sched, at)}, admission.Request)


def live_task(index: Index, sched: Schedule) -> str | None:
    """Its last task, when still queued or running (then it does not fire again): named."""
    if sched.last_task is None or sched.overlap:
        return None
    task = next((t for t in index.live() if t.id == sched.last_task), None)
    return None if task is None else f"{task.name} (#{task.id}) is still {task.state.value}"


def should_fire(index: Index, sched: Schedule, at: datetime, by_hand: bool) -> str | None:
    """Why this firing delegates nothing, or None. A firing at or before its last one has
    already happened (a restart, another machine): skipped without a note."""
    if not by_hand and sched.last_fire is not None and at <= sched.last_fire:
        return "already fired"
    if not by_hand and sched.paused:
        return "paused"
    still = live_task(index, sched)
    return f"skipped: {still}" if still else None


def record(index: Index, sched: Schedule, at: datetime, now: datetime, by_hand: bool,
           task_id: int | None, note: str) -> list[Event]:
    """The outcome of one firing, on the schedule and as an event."""
    if not by_hand:
        sched.last_fire = at
    sched.last_at, sched.last_note = now, note
    if task_id is not None:
        sched.last_task = task_id
        sched.fired += 1
    else:
        sched.skipped += 1
    # value: the firing's scheduled time (None: by hand)
    return [Event(type="schedule", at=now, name=sched.name, task=task_id, reason=note,
                  value=None if by_hand else msgspec.to_builtins(at))]


def outcome(index: Index, sched: Schedule) -> str | None:
    """Its last task's state (or how it ended), when the index still holds it."""
    if sched.last_task is None:
        return None
    task = next((t for t in index.all_tasks() if t.id == sched.last_task), None)
    if task is None:
        return None
    if task.state is TaskState.QUEUED or task.state is TaskState.RUNNING:
        return task.state.value
    return task.state.value + (f" ({task.reason})" if task.reason and task.state is not TaskState.SUCCEEDED else "")


def refused(err: KugetsuError) -> str:
    return f"not delegated: {err}"
