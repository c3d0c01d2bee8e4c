"""Property tests of `delegate --at/--delay` (a start time asked for): random queues where
some tasks ask to start later, drained for real with an injected clock, as in
test_policies_props. A task never starts before its time, positions are the real start
order (it keeps a true place among the tasks that are due), and what it waits for is worded
`starts at`, not `retry at`."""

from __future__ import annotations

from datetime import timedelta

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import T0
from test_policies_props import config_st, drain, task_st

from kugetsu.core import admission, selection, step
from kugetsu.config.model import Config
from kugetsu.core.models import Index

# A task and the seconds after its admission it asks to start at (None: at once).
asked_st = st.tuples(task_st, st.none() | st.integers(0, 12))


def build(raw: dict, first: list, later: list, gap: int) -> tuple[Config, Index, object]:
    cfg = msgspec.convert(raw, Config)
    index = Index()
    now = T0
    for batch in (first, later):
        for (source, priority, group, agent), at in batch:
            start = now + timedelta(seconds=at) if at is not None else None
            routed = agent is not None and "," in agent  # a failover order runs presets, with a prompt
            admission.admit(index, cfg, now, admission.Request(cwd="/", command=None if routed else ["true"], source=source,
                                                 priority=priority, group=group, agent=agent, start_at=start,
                                                 prompt="x" if routed else None))
        step.settle(index, cfg, now)
        now = T0 + timedelta(seconds=gap)
    return cfg, index, now


@settings(max_examples=150, deadline=None)
@given(config_st, st.lists(asked_st, max_size=6), st.lists(asked_st, max_size=14), st.integers(0, 6))
def test_a_start_time_holds_the_task_and_positions_stay_true(raw, first, later, gap):
    cfg, index, now = build(raw, first, later, gap)
    for t in index.active:  # started at admission or by settle: its time had come
        assert t.not_before is None or t.not_before <= t.started_at
    predicted = [t.id for t in selection.start_order(index, cfg, now)]
    assert sorted(selection.positions(index, cfg, now).values()) == list(range(1, len(index.queued) + 1))
    why = selection.waiting_for(index, cfg, now)
    for t in index.queued:
        if t.not_before is not None and t.not_before > now and t.id in why:
            assert "retry" not in why[t.id]
    early = []

    def on_pick(index, at, task):
        if task.not_before is not None and task.not_before > at:
            early.append(task.id)

    assert drain(cfg, index, now, on_pick) == predicted
    assert early == []


def test_starts_at_is_the_reason_and_expiry_counts_from_the_start():
    cfg = Config(max_agents=1, queue_timeout="1h")
    index = Index()
    admission.admit(index, cfg, T0, admission.Request(cwd="/", command=["sleep", "9"]))
    step.settle(index, cfg, T0)
    at = T0 + timedelta(hours=5)
    task, _ = admission.admit(index, cfg, T0, admission.Request(cwd="/", name="nightly", command=["true"], start_at=at))
    due, _ = admission.admit(index, cfg, T0, admission.Request(cwd="/", name="now", command=["true"]))
    assert task.not_before == at and task.expires_at == at + timedelta(hours=1)
    assert selection.waiting_for(index, cfg, T0)[task.id].startswith("starts at ")
    # It does not hold up the task behind it, which is due: that one is next.
    assert selection.positions(index, cfg, T0) == {due.id: 1, task.id: 2}
    # Past its time it competes like any other: by id, it is first again.
    later = at + timedelta(seconds=1)
    assert selection.positions(index, cfg, later) == {task.id: 1, due.id: 2}
    assert task.id not in selection.waiting_for(index, cfg, later)
    # edit --at moves it, and its expiry with it; a time already past clears it.
    admission.edit(index, cfg, task, T0, admission.Edit(start_at=T0 + timedelta(hours=6)))
    assert task.not_before == T0 + timedelta(hours=6) and task.expires_at == T0 + timedelta(hours=7)
    admission.edit(index, cfg, task, T0, admission.Edit(start_at=T0))
    assert task.not_before is None and task.expires_at == T0 + timedelta(hours=1)


def test_cron_fires_each_wall_clock_time_once_across_dst_and_never_loops():
    """APScheduler 3.x's CronTrigger returns a time of a fall-back's repeated hour again
    and again (agronholm/apscheduler#1021): schedules.trigger moves on. Every transition of
    a year, in zones with DST (a half-hour one too), each next time is later than the last,
    no wall-clock time fires twice, and a nightly schedule fires every day."""
    from datetime import timezone
    from zoneinfo import ZoneInfo

    from kugetsu.core import schedules
    from kugetsu.core.models import Schedule

    for tz in ("Europe/Paris", "America/New_York", "Australia/Lord_Howe", "UTC"):
        for line in ("30 2 * * *", "0 * * * *", "*/20 * * * *", "15,45 0-3 * * 1-5"):
            trig = schedules.trigger(Schedule(name="x", cron=line, tz=tz, created_at=T0))
            now, prev, walls = T0, None, set()
            for _ in range(24 * 3 * 310 if line == "*/20 * * * *" else 2000):
                nxt = trig.get_next_fire_time(prev, now)
                assert nxt.astimezone(timezone.utc) >= now.astimezone(timezone.utc)
                wall = nxt.astimezone(ZoneInfo(tz)).replace(tzinfo=None)
                assert wall not in walls, (tz, line, nxt)
                walls.add(wall)
                prev, now = nxt, nxt.astimezone(timezone.utc) + timedelta(milliseconds=3)
            if line == "30 2 * * *":  # 2000 days in a row, none missed (a spring-forward's 02:30 too)
                days = sorted({w.date() for w in walls})
                assert len(days) == 2000 and (days[-1] - days[0]).days == 1999
