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

pytestmark = pytest.mark.skipif(shutil.which("faketime") is None, reason="faketime is not installed (.ci/run installs it)")


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


def test_a_command_two_days_behind_does_not_expire_its_task_at_once(kg):
    gate = kg.rec / "gate"
    kg.config(max_agents=1, queue_timeout="1h")
    kg.ok("serve", "--detach")
    kg.delegate("blocker", gate=gate)  # the slot is taken: the late task queues
    kg.wait_state("blocker", "running")
    r = skewed(kg, "-2d", "delegate", "late", "--", *kg.agent("late"))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: "clock" in service_log(kg) and "behind" in service_log(kg), 10, "the clock error in service.log")
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
