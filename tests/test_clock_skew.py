"""A command that ran with a wrong clock (issue 24, item 6): the times it wrote are a clock
error, corrected by the service and said (service log, doctor), never a year-long wait or an
expiry the moment a task is queued.

The wrong clock is real: the command runs under libfaketime (`faketime`), while the service,
started before it, keeps the machine's clock. .ci/run installs faketime; without it these
tests skip, saying so."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from conftest import wait_for

needs_faketime = pytest.mark.skipif(shutil.which("faketime") is None, reason="faketime is not installed (.ci/run installs it)")


def skewed(kg, offset: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`kugetsu ARGS` with its clock `offset` (faketime's: +365d, -2d) from the machine's."""
    return subprocess.run(["faketime", "-f", offset, sys.executable, "-m", "kugetsu", *args],
                          env=kg.env, capture_output=True, text=True, timeout=60)


def service_log(kg) -> str:
    return kg.home.service_log.read_text(errors="replace") if kg.home.service_log.exists() else ""


def clock_check(kg) -> dict:
    r = kg.run("doctor", "--json")
    assert "Traceback" not in r.stderr, r.stderr
    return next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "clock")


@needs_faketime
def test_a_command_a_year_ahead_does_not_make_its_source_wait_a_year(kg):
    kg.config(max_agents=2, min_start_interval_per_source="2s", queue_timeout="1h")
    kg.ok("serve", "--detach")  # the machine's clock; only the command below is a year ahead
    r = skewed(kg, "+365d", "delegate", "ahead", "--", *kg.agent("ahead"))
    assert r.returncode == 0, r.stderr
    kg.wait_state("ahead", "succeeded")
    # The service took the year-ahead times for what they are: they count from its clock.
    wait_for(lambda: "clock" in service_log(kg) and "ahead" in service_log(kg), 10, "the clock error in service.log")
    logged = next(line for line in service_log(kg).splitlines() if "clock" in line and "ahead" in line)
    assert "kugetsu delegate" in logged, logged
    raw = kg.index()
    now = datetime.now(timezone.utc)
    for t in raw["finished"]:
        for key in ("created_at", "started_at", "finished_at"):
            assert datetime.fromisoformat(t[key]) < now + timedelta(minutes=1), (key, t[key])
    assert all(datetime.fromisoformat(m["at"]) < now + timedelta(minutes=1) for m in raw["last_start"].values())
    # The next task of that source waits its 2 s at most, not 365 days.
    kg.delegate("next")
    kg.wait_state("next", "succeeded", timeout=15)
    # doctor names the command and the time it wrote, and does not call this clock behind.
    check = clock_check(kg)
    assert not check["ok"] and "kugetsu delegate" in check["detail"] and "ahead" in check["detail"], check
    assert "behind the latest time" not in check["detail"], check
    assert str(now.year + 1) in check["detail"], check


@needs_faketime
def test_a_command_two_days_behind_does_not_expire_its_task_at_once(kg):
    gate = kg.rec / "gate"
    kg.config(max_agents=1, queue_timeout="1h")
    kg.ok("serve", "--detach")
    kg.delegate("blocker", gate=gate)  # the slot is taken: the late task queues
    kg.wait_state("blocker", "running")
    r = skewed(kg, "-2d", "delegate", "late", "--", *kg.agent("late"))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: "clock" in service_log(kg) and "behind" in service_log(kg), 10, "the clock error in service.log")
    # The service logs the error inside the transaction that corrects the task: its commit
    # lands a moment later (reading the task at once failed under load, 1 run in a few).
    wait_for(lambda: datetime.fromisoformat(kg.task("late")["expires_at"]) > datetime.now(timezone.utc), 10,
             "the task's expiry to be corrected")
    late = kg.task("late")
    assert late["state"] == "queued", late
    now = datetime.now(timezone.utc)
    # Its hour in the queue counts from when it was really queued (the service's clock).
    expires = datetime.fromisoformat(late["expires_at"])
    assert now + timedelta(minutes=55) < expires < now + timedelta(minutes=61), late["expires_at"]
    assert abs((datetime.fromisoformat(late["created_at"]) - now).total_seconds()) < 60, late["created_at"]
    gate.touch()
    kg.wait_state("late", "succeeded", timeout=15)
    check = clock_check(kg)
    assert not check["ok"] and "kugetsu delegate" in check["detail"] and "behind" in check["detail"], check


def test_correct_clock_moves_only_what_is_beyond_the_tolerance():
    """The rule itself (skew.correct_clock), on an injected clock: what lies within 5 minutes
    stays; a hold begun a year ahead keeps its length; a retry due a year ahead is due after its
    delay; a hold made since the service's last transaction but stamped 2 days before it
    counts from now."""
    from kugetsu.core import skew
    from kugetsu.config.model import Config
    from kugetsu.core.models import Attempt, ClockMark, Hold, Index, SourceMark, Task

    now = datetime(2026, 11, 24, 12, tzinfo=timezone.utc)
    year = timedelta(days=365)
    index = Index(next_id=4, queued=[
        Task(id=1, name="near", command=["true"], cwd="/", created_at=now + timedelta(minutes=4),
             expires_at=now + timedelta(hours=1)),
        Task(id=2, name="retry", command=["true"], cwd="/", created_at=now, retry_delay=60,
             not_before=now + year, attempts=[Attempt(ended_at=now, exit_code=1)]),
        # A start time asked for (`delegate --at`): the caller's, however far ahead.
        Task(id=3, name="asked", command=["true"], cwd="/", created_at=now, not_before=now + year),
    ], last_start={"cli": SourceMark(at=now + year, n=1)},
        holds={"claude": Hold(until=now + year + timedelta(hours=1), reason="claude held by hand", since=now + year)},
        clock=ClockMark(at=now + year, by="kugetsu hold (pid 7)"))
    err = skew.correct_clock(index, Config(), now)
    near, retry, asked = index.queued
    assert near.created_at == now + timedelta(minutes=4) and near.expires_at == now + timedelta(hours=1)
    assert retry.not_before == now + timedelta(seconds=60)
    assert asked.not_before == now + year
    assert index.last_start["cli"].at == now
    assert (index.holds["claude"].since, index.holds["claude"].until) == (now, now + timedelta(hours=1))
    assert err is not None and err.by == "kugetsu hold (pid 7)" and err.off > 364 * 86400
    assert "365d ahead of the service's clock" in skew.describe_clock_error(err)
    assert skew.correct_clock(index, Config(), now) is None  # corrected once: nothing left

    before = Index(next_id=3)
    late = Index(next_id=3, holds={"codex": Hold(until=now - timedelta(days=2) + timedelta(minutes=30),
                                                reason="codex held by hand", since=now - timedelta(days=2))},
                 clock=ClockMark(at=now - timedelta(days=2), by="kugetsu hold (pid 8)"))
    err = skew.correct_clock(late, Config(), now, before, now - timedelta(seconds=3))
    assert (late.holds["codex"].since, late.holds["codex"].until) == (now, now + timedelta(minutes=30))
    assert err is not None and err.off < 0 and err.by == "kugetsu hold (pid 8)"
    assert "2d behind" in skew.describe_clock_error(err)


@pytest.mark.parametrize("field", ["created_at", "started_at", "finished_at", "attempt", "run", "new_behind"])
def test_a_wrong_time_deep_in_a_long_queue_is_found(field):
    """correct_clock asks the queue in C passes whether any of its tasks needs a look (a
    Python step a task was ~60 ms of a first tick at 50,000 queued): one task among 2,000
    that carries a wrong time is found and moved, whichever time it is."""
    import msgspec

    from kugetsu.core import skew
    from kugetsu.config.model import Config
    from kugetsu.core.models import Attempt, Index, Run, Task

    now = datetime(2026, 11, 24, 12, tzinfo=timezone.utc)
    year = timedelta(days=365)
    queued = [Task(id=i, name=f"t{i}", command=["true"], cwd="/", created_at=now - timedelta(seconds=i))
              for i in range(1, 2001)]
    odd = queued[1234]
    changes = {"created_at": {"created_at": now + year}, "started_at": {"started_at": now + year},
               "finished_at": {"finished_at": now + year},
               "attempt": {"attempts": [Attempt(ended_at=now + year, exit_code=1)]},
               "run": {"run": Run(ended_at=now + year)}, "new_behind": {"id": 3000, "created_at": now - 2 * year}}[field]
    queued[1234] = odd = msgspec.structs.replace(odd, **changes)
    index = Index(next_id=3001, queued=queued)
    before = Index(next_id=2001) if field == "new_behind" else None
    err = skew.correct_clock(index, Config(), now, before, now - timedelta(seconds=1) if before else None)
    assert err is not None
    moved = {"created_at": odd.created_at, "started_at": odd.started_at, "finished_at": odd.finished_at,
             "attempt": odd.attempts[0].ended_at if odd.attempts else None,
             "run": odd.run.ended_at if odd.run else None, "new_behind": odd.created_at}[field]
    assert moved == now
    assert all(t.created_at == now - timedelta(seconds=t.id) for t in queued if t is not odd)
