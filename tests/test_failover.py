"""Failover (issue 30) through the real CLI, the real service and real agent processes: a
preset held (its provider's limit, or by hand) lets the tasks that allow it start on their
next preset; a run with a session to resume waits for its own unless a fresh start is allowed."""

from __future__ import annotations

import json
from datetime import datetime

from conftest import wait_for
from test_limits import preset, runs


def _count(kg, name: str) -> int:
    """How many runs the preset `name` started (test_limits.preset counts them)."""
    path = kg.rec / f"{name}.n"
    return int(path.read_text()) if path.exists() else 0


def test_a_held_preset_fails_over_and_a_session_waits_for_its_own(kg):
    gate = kg.rec / "gate"
    kg.config(max_agents=1, agents={
        "fake": preset(kg, "fake", limited=1, reset=4, gate=gate, fallback=["other"]),
        "other": preset(kg, "other", sleep=2),
    })
    kg.ok("delegate", "a", "--agent", "fake", "--prompt", "do a")
    kg.ok("delegate", "b", "--agent", "fake", "--prompt", "do b")  # the preset's fallback: other
    gate.touch()  # a hits fake's limit: it has a session, so it waits for fake
    wait_for(lambda: runs(kg, "b"), 10, "b to start on other while fake is held")
    b = kg.task("b")
    assert b["agent"] == "other" and b["fallback_from"] == "fake" and b["route"] == ["fake", "other"]
    assert _count(kg, "other") == 1 and runs(kg, "b")[0][1] == ["do", "b"]  # other's command, b's prompt
    assert "agent" in kg.ok("status", "b") and "other (fallback from fake)" in kg.ok("status", "b")
    assert "other (fallback from fake)" in kg.ok("queue")  # while it runs (2 s)
    [started] = [e for e in kg.events("started") if e["name"] == "b"]
    assert started["reason"] == "fallback from fake" and started["value"]["agent"] == "other"
    a = kg.task("a")
    assert a["state"] == "queued" and a["agent"] == "fake" and a["fallback_from"] is None
    assert a["waiting_for"].startswith("fake usage limit, retry at ") if "waiting_for" in a else True
    queued = kg.json("queue")["queued"]
    assert [(t["name"], t["position"]) for t in queued] == [("a", 1)]
    assert queued[0]["waiting_for"].startswith("fake usage limit, retry at ")
    kg.wait_state("a", "succeeded", timeout=20)
    assert [args[:1] for _, args in runs(kg, "a")] == [["do"], ["--resume"]]  # it resumed on fake
    assert kg.task("b")["state"] == "succeeded"


def test_fallback_fresh_lets_an_interrupted_run_start_afresh_elsewhere(kg):
    gate = kg.rec / "gate"
    kg.config(max_agents=1, agents={
        "fake": preset(kg, "fake", limited=1, reset=30, gate=gate),
        "other": preset(kg, "other"),
    })
    kg.ok("delegate", "a", "--agent", "fake,other", "--fallback-fresh", "--prompt", "do a")
    gate.touch()
    kg.wait_state("a", "succeeded", timeout=20)
    a = kg.task("a")
    assert a["agent"] == "other" and a["fallback_from"] == "fake"
    assert [args for _, args in runs(kg, "a")] == [["do", "a"], ["do", "a"]]  # afresh: the prompt, not a resume
    assert _count(kg, "other") == 1
    assert len(a["attempts"]) == 1 and a["attempts"][0]["limit"] is True
    # `kugetsu retry`: the same order again, from its first preset (still held: on other).
    again = json.loads(kg.ok("retry", "a", "--json"))
    assert again["route"] == ["fake", "other"] and again["fallback_fresh"] is True and again["retry_of"] == a["id"]
    done = kg.wait_state(str(again["id"]), "succeeded", timeout=20)
    assert done["agent"] == "other" and done["fallback_from"] == "fake" and done["command"][-1] == "{prompt}"
    assert done["prompt"] == "do a"


def test_positions_and_reasons_with_a_preset_held_by_hand(kg):
    kg.config(max_agents=1, agents={"fake": preset(kg, "fake"), "other": preset(kg, "other", sleep=0.5)})
    kg.ok("hold", "fake")
    kg.ok("delegate", "x", "--agent", "fake", "--prompt", "do x")
    kg.ok("delegate", "y", "--agent", "fake,other", "--prompt", "do y")
    kg.ok("delegate", "z", "--agent", "fake,other", "--prompt", "do z")
    wait_for(lambda: runs(kg, "y"), 10, "y to start on other")
    queued = kg.json("queue")["queued"]
    assert [(t["name"], t["position"]) for t in queued] == [("z", 1), ("x", 2)]
    assert [t["waiting_for"] for t in queued] == [None, "fake held by hand"]
    kg.wait_state("z", "succeeded", timeout=20)
    assert kg.task("x")["state"] == "queued"
    assert runs(kg, "y")[0][0] < runs(kg, "z")[0][0] and _count(kg, "other") == 2
    kg.ok("release", "fake")
    kg.wait_state("x", "succeeded", timeout=20)
    assert kg.task("x")["agent"] == "fake"


def test_bad_fallback_orders_are_refused_with_nothing_written(kg):
    kg.config(agents={"fake": {"command": ["true", "{prompt}"]}})
    out = kg.run("delegate", "--agent", "fake,nope", "--prompt", "x")
    assert out.returncode == 2 and "unknown agent preset 'nope'" in out.stderr and "Traceback" not in out.stderr
    out = kg.run("delegate", "--agent", "fake,claude", "--", "true")
    assert out.returncode == 2 and "a fallback runs another preset" in out.stderr
    kg.config(agents={"fake": {"command": ["true", "{prompt}"]}, "gone": {"command": ["no-such-agent-x", "{prompt}"]}})
    out = kg.run("delegate", "--agent", "fake,gone", "--prompt", "x")  # a fallback that could never start
    assert out.returncode == 2 and "'no-such-agent-x'" in out.stderr and "preset 'gone'" in out.stderr, out.stderr
    kg.config(agents={"fake": {"command": ["true"], "fallback": ["nope"]}})
    out = kg.run("delegate", "--agent", "fake", "--prompt", "x")
    assert out.returncode == 2 and "agents.fake.fallback" in out.stderr
    assert not kg.home.index.exists() or '"queued":[{' not in kg.home.index.read_text()


def test_a_window_quota_stops_starts_before_the_wall_and_lets_one_probe_through(kg):
    kg.config(max_agents=3, agents={"fake": preset(kg, "fake", sleep=1.0,
                                                   limit={"window": "3s", "window_starts": 2})})
    for name in "abcd":
        kg.ok("delegate", name, "--agent", "fake", "--prompt", f"do {name}")
    wait_for(lambda: runs(kg, "a") and runs(kg, "b"), 10, "a and b to start")
    queued = kg.json("queue")["queued"]
    assert [(t["name"], t["position"]) for t in queued] == [("c", 1), ("d", 2)]
    assert all(t["waiting_for"].startswith("fake window quota 2/2 starts, resets ") for t in queued), queued
    # The window turns 3 s after a's start: c goes alone (a probe of the new window), d waits
    # for its end, though a slot is free.
    wait_for(lambda: runs(kg, "c"), 10, "c to probe the new window")
    a, c = (datetime.fromisoformat(kg.task(n)["started_at"]) for n in "ac")
    assert (c - a).total_seconds() >= 3  # the window counts from a's real start
    d = kg.json("queue")["queued"][0]
    assert d["name"] == "d" and d["waiting_for"] == "fake window quota: task #3 probes the new window first"
    kg.wait_state("d", "succeeded", timeout=20)
    c_end = float(next(line.split()[1] for line in (kg.rec / "c").read_text().splitlines() if line.startswith("end")))
    assert runs(kg, "d")[0][0] >= c_end
    assert kg.json("status", "d")["state"] == "succeeded"


def test_window_quota_settings_are_checked(kg):
    kg.config(agents={"fake": {"command": ["true"], "limit": {"window": "5h"}}})
    out = kg.run("queue")
    assert out.returncode == 2 and "limit.window needs limit.window_starts" in out.stderr
    kg.config(agents={"fake": {"command": ["true"], "limit": {"window_tokens": 5}}})
    out = kg.run("queue")
    assert out.returncode == 2 and "need limit.window" in out.stderr
