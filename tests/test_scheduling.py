"""Scheduled work through the real CLI and service (docs/scheduling.md): `delegate --at /
--delay` (a task that starts at a time, keeping its place), and recurring schedules
(`kugetsu schedule`). Agents record their own start; times are compared with what was
asked, within the deadline budget plus a process start."""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from test_worktrees import git, repo  # noqa: F401  (a fixture: a real git repository)

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
    kg.ok("edit", "nightly", "--at", "03:30")
    moved = datetime.fromisoformat(kg.task("nightly")["not_before"].replace("Z", "+00:00")).astimezone()
    assert (moved.hour, moved.minute) == (3, 30) and "03:30" in kg.task("nightly")["waiting_for"]
    kg.ok("edit", "nightly", "--delay", "1h")
    assert abs(_iso(kg.task("nightly")["not_before"]) - time.time() - 3600) < 60
    bad = kg.run("delegate", "x", "--at", "soonish", "--", "true")
    assert bad.returncode == 2 and "--at 'soonish' is neither a time" in bad.stderr and "Traceback" not in bad.stderr
    far = kg.run("delegate", "x", "--at", "9999-12-31T00:00Z", "--", "true")  # no date could follow it
    assert far.returncode == 2 and "too far ahead: at most 3650d" in far.stderr and "Traceback" not in far.stderr
    assert [t["name"] for t in kg.index()["queued"]] == ["nightly"]  # nothing written
    assert "started" in kg.ok("edit", "nightly", "--delay", "0")  # at once (a slot is free), as docs/scheduling.md says
    assert kg.task("nightly")["not_before"] is None


def _starts(kg, name: str) -> list[float]:
    """The start times the firings' agents recorded (one line each)."""
    try:
        return [float(x) for x in (kg.rec / name).read_text().split()]
    except FileNotFoundError:
        return []


def _recorder(kg, name: str, seconds: float = 0) -> list[str]:
    return ["sh", "-c", f'date +%s.%N >> "$0"; sleep {seconds}', str(kg.rec / name)]


def _schedule(kg, name: str) -> dict:
    return next(s for s in json.loads(kg.ok("schedule", "list", "--json")) if s["name"] == name)


def test_every_and_cron_with_seconds_fire_on_time(kg):
    kg.config(max_agents=4)
    kg.ok("schedule", "add", "tick", "--every", "2s", "--", *_recorder(kg, "tick"))
    created = _iso(_schedule(kg, "tick")["created_at"])
    kg.ok("schedule", "add", "sec", "--cron", "*/2 * * * * *", "--tz", "UTC", "--", *_recorder(kg, "sec"))
    kg.ok("queue")  # starts the service
    wait_for(lambda: len(_starts(kg, "tick")) >= 3 and len(_starts(kg, "sec")) >= 3, 15, "three firings of each")
    for start in _starts(kg, "tick"):  # every 2 s from its creation
        late = (start - created) % 2.0
        assert late < 0.5, (start, created, late)
    for start in _starts(kg, "sec"):  # at even seconds of the clock
        assert start % 2.0 < 0.5, start
    row = _schedule(kg, "tick")
    assert row["fired"] >= 3 and row["last_task_name"].startswith("tick-") and row["next_fire"]
    names = [t["name"] for t in kg.index()["finished"] + kg.index()["active"] if t["name"].startswith("tick-")]
    assert len(names) == len(set(names))
    assert "tick" in kg.ok("schedule", "list")


@pytest.mark.parametrize("missed", ["one", "skip"])
def test_restart_coalesces_missed_firings_into_one_or_skips_them(kg, missed):
    kg.config(max_agents=4, schedule_missed=missed)
    kg.ok("schedule", "add", "r", "--every", "1s", "--", *_recorder(kg, "r"))
    kg.ok("queue")
    wait_for(lambda: len(_starts(kg, "r")) >= 2, 10, "two firings")
    kg.ok("shutdown")
    wait_for(lambda: kg.service_pid() is None, 10, "the service to stop")
    before = len(_starts(kg, "r"))
    down = time.time()
    time.sleep(4.2)  # four firings missed while down
    assert len(_starts(kg, "r")) == before
    up = time.time()
    kg.ok("queue")  # back up: a schedule is work, the service is started for it
    wait_for(lambda: len(_starts(kg, "r")) > before, 10, "a firing after the restart")
    assert _starts(kg, "r")[before] - up < 2
    wait_for(lambda: len(_starts(kg, "r")) >= before + 3, 10, "regular firings after it")
    # Each firing's event holds its scheduled time: of the four missed while down, one ran
    # (the last, coalesced) or none (skip); no scheduled time ran twice.
    tasks = [t["name"] for t in kg.index()["finished"] + kg.index()["active"] if t["name"].startswith("r-")]
    assert len(set(tasks)) == len(tasks) == len(_starts(kg, "r"))
    scheduled = [_iso(e["value"]) for e in kg.events("schedule") if e.get("task") and e["name"] == "r"]
    assert len(set(scheduled)) == len(scheduled) == len(tasks)
    # Up to when the service, back, took stock of what it missed (its log says when): the
    # time the CLI started it is earlier, and a firing due in between is a missed one too.
    # The last such line: a first service slow to its first tick (a loaded machine) may have
    # found a firing missed already, and said so too.
    line = [ln for ln in kg.home.service_log.read_text().splitlines() if "schedule r: missed firings" in ln][-1]
    synced = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
    missed_run = [t for t in scheduled if down < t <= synced]
    assert len(missed_run) == (1 if missed == "one" else 0), (down, up, synced, scheduled)


def test_overlap_is_skipped_and_said(kg):
    kg.config(max_agents=4)
    kg.ok("schedule", "add", "long", "--every", "1s", "--", *_recorder(kg, "long", 6))  # long enough to be seen running on a loaded machine
    kg.ok("queue")
    wait_for(lambda: _schedule(kg, "long")["skipped"] >= 2, 15, "firings skipped while its task runs")
    row = _schedule(kg, "long")
    assert "still running" in (row["last_note"] or "") or row["skipped"] >= 2
    assert row["last_outcome"] == "running"
    listed = kg.ok("schedule", "list")  # (a slow machine may have ended it since)
    assert f"{row['last_task_name']} running" in listed or f"{row['last_task_name']} succeeded" in listed
    assert len(_starts(kg, "long")) == 1  # never two at once
    kg.ok("schedule", "pause", "long")  # no new task: the last one stays its last
    kg.wait_state(_schedule(kg, "long")["last_task_name"], "succeeded", timeout=15)
    assert _schedule(kg, "long")["last_outcome"] == "succeeded"  # how its last task ended
    assert "still running" in "".join(e.get("reason") or "" for e in kg.events("schedule"))


def test_full_queue_is_recorded_on_the_schedule(kg):
    kg.config(max_agents=1, max_queue=0)
    kg.delegate("blocker", 30)
    kg.ok("schedule", "add", "full", "--cron", "0 2 * * 1-5", "--", "true")
    r = kg.run("schedule", "run", "full")
    assert r.returncode == 1 and "not delegated: queue full" in r.stdout, r
    row = _schedule(kg, "full")
    assert row["last_note"].startswith("not delegated: queue full") and row["skipped"] == 1 and row["fired"] == 0
    assert "queue full" in kg.ok("schedule", "list")
    assert [e["reason"] for e in kg.events("schedule")][-1].startswith("not delegated: queue full")
    # The service's own firings alike: each refusal recorded with its scheduled time.
    kg.ok("schedule", "add", "tick", "--every", "1s", "--", "true")
    wait_for(lambda: _schedule(kg, "tick")["skipped"] >= 2, 15, "the service's firings refused")
    row = _schedule(kg, "tick")
    assert row["fired"] == 0 and row["last_fire"] and row["last_note"].startswith("not delegated: queue full")


def test_schedule_bad_input_and_pause_resume_remove(kg):
    kg.config(autostart=False)
    for args, words in ((["--cron", "0 25 * * *"], "higher than the maximum"),
                        (["--cron", "0 2 * *"], "give 5 fields"),
                        (["--cron", "0 2 * * 1-9"], "day of week '9'"),
                        (["--cron", "0 2 * * *", "--tz", "Mars/Base"], "unknown time zone 'Mars/Base'"),
                        (["--every", "0.5s"], "too short"),
                        (["--every", "1h", "--at", "02:00"], "unrecognized arguments: --at 02:00")):
        r = kg.run("schedule", "add", "bad", *args, "--", "true")
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert kg.run("schedule", "list", "--json").stdout.strip() == "[]"  # nothing written
    kg.ok("schedule", "add", "wk", "--cron", "0 2 * * 1-5", "--tz", "Europe/Paris", "--", "true")
    nxt = datetime.fromisoformat(_schedule(kg, "wk")["next_fire"].replace("Z", "+00:00"))
    from zoneinfo import ZoneInfo

    local = nxt.astimezone(ZoneInfo("Europe/Paris"))
    assert (local.hour, local.minute) == (2, 0) and local.weekday() < 5  # crontab's 1-5: Monday to Friday
    assert "paused schedule wk" in kg.ok("schedule", "pause", "wk")
    assert _schedule(kg, "wk")["paused"] and _schedule(kg, "wk")["next_fire"] is None
    kg.ok("schedule", "resume", "wk")
    assert "removed schedule wk" in kg.ok("schedule", "remove", "wk")
    r = kg.run("schedule", "remove", "wk")
    assert r.returncode == 1 and "no schedule 'wk'" in r.stderr
    # Without --tz, the adding machine's zone is kept with it (another service fires it alike).
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "kugetsu", "schedule", "add", "loc", "--cron", "0 9 * * *", "--", "true"],
                   env={**kg.env, "TZ": "Asia/Tokyo"}, check=True, capture_output=True)
    assert _schedule(kg, "loc")["tz"] == "Asia/Tokyo"
    local = datetime.fromisoformat(_schedule(kg, "loc")["next_fire"].replace("Z", "+00:00")).astimezone(ZoneInfo("Asia/Tokyo"))
    assert (local.hour, local.minute) == (9, 0)


async def test_mcp_delegate_at_delay_and_the_schedules_tool(kg):
    from test_mcp import connect, text

    kg.config(autostart=False, max_agents=1)
    kg.ok("schedule", "add", "nightly", "--cron", "0 2 * * 1-5", "--", "true")
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"name": "hold", "command": ["sleep", "30"]})
        r = await c.call_tool("delegate", {"name": "later", "command": ["true"], "delay": "1h"})
        assert "waiting for: starts at" in text(r) and r.structured_content["task"]["not_before"]
        r = await c.call_tool("delegate", {"name": "both", "command": ["true"], "delay": "1h", "at": "02:00"})
        assert r.is_error and "give at or delay, not both" in text(r)
        r = await c.call_tool("status", {"task": "later"})
        assert r.structured_content["waiting_for"].startswith("starts at")
        r = await c.call_tool("schedules", {})
        assert not r.is_error and r.structured_content["schedules"] == json.loads(kg.ok("schedule", "list", "--json"))
        assert "nightly" in text(r) and "02:00" in text(r)


def test_the_bot_lists_schedules_and_shows_a_start_time(kg):
    from fakebot import FakeBotAPI
    from test_telegram_bot import ME, bot_up, reply, setup

    api = FakeBotAPI().start()
    try:
        setup(kg, api, max_agents=1)
        kg.ok("schedule", "add", "nightly", "--cron", "0 2 * * 1-5", "--", "true")
        bot_up(kg, api)
        kg.delegate("busy", 30)
        kg.ok("delegate", "later", "--delay", "1h", "--", "true")
        api.message(ME, "/schedules")
        listing = reply(api, ME, "nightly")
        assert "cron 0 2 * * 1-5" in listing and "02:00" in listing
        api.message(ME, "/queue")
        assert "waiting for: starts at" in reply(api, ME, "later")
    finally:
        api.close()


async def test_the_dashboard_shows_the_schedules(kg):
    from dashboard_data import until

    from kugetsu.frontends.tui.app import make_app
    from kugetsu.frontends.tui.screens import SchedulesScreen

    kg.config(autostart=False)
    kg.ok("schedule", "add", "nightly", "--cron", "0 2 * * 1-5", "--", "true")
    app = make_app(kg.home, cwd="/")
    async with app.run_test() as pilot:
        await pilot.press("w")
        assert isinstance(app.screen, SchedulesScreen)
        shown = app.screen.query_one("#schedules")
        await until(pilot, lambda: "nightly" in str(shown.render()), what="the schedule listed")
        assert "cron 0 2 * * 1-5" in str(shown.render())
        kg.ok("schedule", "pause", "nightly")  # refreshed with the poll
        await until(pilot, lambda: "paused" in str(shown.render()), what="the pause shown")
        await pilot.press("escape")
        assert not isinstance(app.screen, SchedulesScreen)
        events = app.query_one("#events")  # the schedule's events, named after it
        await until(pilot, lambda: "nightly: paused" in " ".join(str(c) for r in range(events.row_count)
                                                                  for c in events.get_row_at(r)), what="its event")


async def test_the_dashboard_shows_a_start_time(kg):
    from dashboard_data import until

    from kugetsu.frontends.tui.app import make_app
    from kugetsu.frontends.tui.widgets import TaskTable

    kg.config(autostart=False, max_agents=1)
    kg.ok("delegate", "busy", "--", "sleep", "30")
    kg.ok("delegate", "nightly", "--at", "02:00", "--", "true")
    app = make_app(kg.home, cwd="/")
    async with app.run_test(size=(160, 40)) as pilot:
        queue = app.query_one("#queue", TaskTable)
        await until(pilot, lambda: queue.row_count == 1, what="the queued task")
        row = " ".join(str(c) for c in queue.get_row_at(0))  # 02:00 of another day says its date
        assert "starts at " in row and "02:00" in row, row


def test_a_worktree_schedule_branches_from_the_head_of_each_firing(kg, repo):
    kg.config(autostart=False, max_agents=1)
    kg.ok("schedule", "add", "wt", "--cron", "0 2 * * *", "--overlap", "--worktree", "--cwd", str(repo), "--", "true")
    assert "base" not in _schedule(kg, "wt")["request"]  # nothing pinned when it was added
    kg.ok("schedule", "run", "wt")
    git(repo, "commit", "-q", "--allow-empty", "-m", "two")
    kg.ok("schedule", "run", "wt")
    first, second = sorted(kg.index()["queued"] + kg.index()["active"], key=lambda t: t["id"])
    assert first["base"] != second["base"] == git(repo, "rev-parse", "HEAD")


def test_a_resumed_schedule_does_not_catch_up_what_its_pause_skipped(kg):
    kg.config(max_agents=4)
    kg.ok("schedule", "add", "p", "--every", "1s", "--", *_recorder(kg, "p"))
    kg.ok("queue")
    wait_for(lambda: len(_starts(kg, "p")) >= 1, 10, "a firing")
    kg.ok("schedule", "pause", "p")
    paused = len(_starts(kg, "p"))
    time.sleep(2.5)  # two firings skipped by the pause
    assert len(_starts(kg, "p")) <= paused + 1  # (one may have been under way at the pause)
    resumed = time.time()
    kg.ok("schedule", "resume", "p")
    wait_for(lambda: len(_starts(kg, "p")) >= paused + 2, 10, "firings after the resume")
    scheduled = [_iso(e["value"]) for e in kg.events("schedule") if e.get("task") and e["name"] == "p"]
    assert not [t for t in scheduled if resumed - 2.4 < t < resumed - 0.05], scheduled  # none of the pause's


def test_schedule_events_can_be_notified():
    from datetime import timezone

    from kugetsu.config.model import Config
    from kugetsu.core.models import Event
    from kugetsu.frontends.telegram.text import notification, wanted

    e = Event(type="schedule", at=datetime.now(timezone.utc), name="nightly", task=12,
              reason="not delegated: queue full: 50/50 waiting")
    assert wanted(e, ["schedule"]) and not wanted(e, ["started", "failed"])  # opt-in, not by default
    assert notification(e, None, Config(), None) == (
        "🗓️ schedule <b>nightly</b>: not delegated: queue full: 50/50 waiting")
    Config(telegram={"events": ["schedule"]})  # a known type: the config takes it
