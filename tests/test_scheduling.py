"""Scheduled work through the real CLI and service (docs/scheduling.md): `delegate --at /
--delay` (a task that starts at a time, keeping its place), and recurring schedules
(`kugetsu schedule`). Agents record their own start; times are compared with what was
asked, within the deadline budget plus a process start."""

from __future__ import annotations

import json
import time
from datetime import datetime

from conftest import wait_for


def _iso(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_delay_starts_on_time_and_keeps_its_place(kg):
    kg.config(max_agents=1)
    out = kg.delegate("later", 0, 0, "--delay", "2s")
    assert "waiting for: starts at" in out
    asked = _iso(kg.task("later")["not_before"])
    now = kg.delegate("now", 0)  # due: it passes the one that waits for its time
    assert "started" in now
    queue = kg.ok("queue")
    assert "WAITING FOR" in queue or "later" not in queue  # (it may have started already on a slow machine)
    kg.wait_state("later", "succeeded", timeout=15)
    started = kg.times("later")["start"]
    assert asked <= started < asked + 1.0, (asked, started)
    assert kg.times("now")["start"] < asked


def test_at_is_shown_everywhere_and_edit_moves_it(kg):
    kg.config(max_agents=1, autostart=False)
    kg.ok("delegate", "nightly", "--at", "02:00", "--", "true")
    status = kg.ok("status", "nightly")
    assert "waiting_for     starts at 02:00" in status or "starts at" in status and "02:00" in status
    queued = json.loads(kg.ok("queue", "--json"))["queued"]
    assert queued[0]["waiting_for"].startswith("starts at") and "02:00" in queued[0]["waiting_for"]
    kg.ok("edit", "nightly", "--delay", "1h")
    assert kg.task("nightly")["waiting_for"].startswith("starts at")
    bad = kg.run("delegate", "x", "--at", "soonish", "--", "true")
    assert bad.returncode == 2 and "--at 'soonish' is neither a time" in bad.stderr and "Traceback" not in bad.stderr
    assert [t["name"] for t in kg.index()["queued"]] == ["nightly"]  # nothing written
