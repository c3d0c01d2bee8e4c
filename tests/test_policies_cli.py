"""Scheduling policies through the real CLI, the real service and real agent processes."""

from __future__ import annotations

import json
import time
from datetime import datetime

from conftest import wait_for

from kugetsu.core import lifecycle


def queued(kg) -> list[dict]:
    return kg.json("queue")["queued"]


def started_at(kg, name: str) -> float:
    return datetime.fromisoformat(kg.task(name)["started_at"]).timestamp()


def start_order(kg, names: list[str]) -> list[str]:
    wait_for(lambda: all("end" in kg.times(n) for n in names), 20, f"{names} to run")
    return sorted(names, key=lambda n: kg.times(n)["start"])


def test_priority_order_and_the_priority_command(kg):
    kg.config(max_agents=1, strategy="priority")
    kg.delegate("blocker", 30)
    for name, level in [("l", "low"), ("n", "normal"), ("u", "urgent"), ("h", "high")]:
        kg.delegate(name, 0, 0, "--priority", level)
    assert [t["name"] for t in queued(kg)] == ["u", "h", "n", "l"]
    # n becomes urgent: among urgent tasks admission order decides, and n came before u.
    assert kg.ok("priority", "n", "urgent").strip() == "n (#3) priority urgent, position 1"
    assert [(t["name"], t["position"]) for t in queued(kg)] == [("n", 1), ("u", 2), ("h", 3), ("l", 4)]
    r = kg.run("priority", "blocker", "low")
    assert r.returncode == 1 and "only a queued task's priority can change" in r.stderr
    kg.ok("cancel", "blocker")
    assert start_order(kg, ["n", "u", "h", "l"]) == ["n", "u", "h", "l"]


def test_fair_round_robin_across_sources(kg):
    kg.config(max_agents=1, strategy="fair")
    names = ["a1", "a2", "a3", "b1", "b2", "c1"]
    for name in names:
        kg.delegate(name, 30 if name == "a1" else 0, 0, "--source", name[0])
    assert [t["name"] for t in queued(kg)] == ["b1", "c1", "a2", "b2", "a3"]
    kg.ok("cancel", "a1")
    order = start_order(kg, names[1:])
    assert [n[0] for n in ["a1"] + order] == list("abcaba")


def test_per_source_limits(kg):
    kg.config(max_agents=3, max_active_per_source=1, max_queued_per_source=1)
    kg.delegate("a1", 30, 0, "--source", "a")
    assert kg.delegate("a2", 0, 0, "--source", "a").strip() == (
        "queued a2 (#2), position 1 of 1; waiting for: source a has 1 running (limit 1)"
    )
    assert kg.delegate("b1", 30, 0, "--source", "b").startswith("started b1")  # passes a2
    [a2] = queued(kg)
    assert a2["waiting_for"] == "source a has 1 running (limit 1)"
    assert "source a has 1 running (limit 1)" in kg.ok("queue")
    before = kg.index()["next_id"]
    r = kg.run("delegate", "a3", "--source", "a", "--", "true")
    assert r.returncode == 3
    assert "source a already has 1 queued task (limit 1)" in r.stderr
    assert kg.index()["next_id"] == before
    kg.ok("cancel", "a1")
    kg.wait_state("a2", "succeeded")


def test_rate_limit_starts_on_time_and_delays_no_other_source(kg):
    kg.config(max_agents=3, min_start_interval_per_source="2s")
    kg.delegate("a1", 0, 0, "--source", "a")
    assert kg.delegate("a2", 0, 0, "--source", "a").startswith("queued a2")
    assert kg.delegate("b1", 0, 0, "--source", "b").startswith("started b1")
    waiting = queued(kg)
    assert waiting and waiting[0]["waiting_for"].startswith("rate limit: source a may start again in")
    # Waiting on the agent's own record, not the CLI: a CLI command wakes the service, which
    # would hide a missing wake-up (lifecycle.policy_wakeups).
    wait_for(lambda: "end" in kg.times("a2"), 10, "a2 to run")
    gap = started_at(kg, "a2") - started_at(kg, "a1")
    assert 2.0 <= gap < 3.0, gap  # not before the limit, and on time (a job, not the 5 s reconcile)
    assert kg.times("b1")["start"] - kg.times("a1")["start"] < 1.5


def test_resource_guard_holds_until_the_bound_is_met(kg):
    kg.config(resource_guard={"min_available_memory": "1TiB"})  # far above this machine's RAM
    assert kg.delegate("x", 0).startswith("queued x (#1), position 1 of 1")
    [x] = queued(kg)
    assert x["waiting_for"].startswith("held: ") and x["waiting_for"].endswith("available, need 1 TiB")
    assert "held: " in kg.ok("queue")
    kg.ok("config", "set", "resource_guard.min_available_memory", "1MiB")
    kg.wait_state("x", "succeeded", timeout=5)


def test_resource_guard_rechecks_by_itself(kg):
    kg.config(resource_guard={"min_available_memory": "1024TiB"})
    kg.delegate("x", 0)
    assert kg.task("x")["state"] == "queued"
    # Relax the bound behind the service's back (no wake-up): its own re-check starts x.
    relaxed = time.time()
    kg.home.config.write_text(json.dumps({"resource_guard": {"min_available_memory": "1MiB"}}))
    # At its own re-check (lifecycle.GUARD_RECHECK), not at the 5 s reconcile. Waiting on the agent's
    # own record, not the CLI: a CLI command wakes the service, which would hide a missing one.
    wait_for(lambda: "start" in kg.times("x"), 6, "x to start")
    assert kg.times("x")["start"] - relaxed < lifecycle.GUARD_RECHECK + 1.5


def test_groups_need_a_slot_in_the_group(kg):
    kg.config(max_agents=3, groups={"gpu": {"max_agents": 1}})
    kg.delegate("g1", 30, 0, "--group", "gpu")
    assert kg.delegate("g2", 0, 0, "--group", "gpu").startswith("queued g2")
    assert kg.delegate("c1", 0).startswith("started c1")
    out = kg.json("queue")
    assert out["groups"] == {"gpu": {"max_agents": 1, "active": 1, "queued": 1}}
    assert out["queued"][0]["waiting_for"] == "group gpu full (1/1 running)"
    assert out["queued"][0]["group"] == "gpu"
    assert "groups: gpu 1/1 running, 1 queued" in kg.ok("queue")
    r = kg.run("delegate", "t", "--group", "tpu", "--", "true")
    assert r.returncode == 2 and "unknown group 'tpu'" in r.stderr
    kg.ok("cancel", "g1")
    kg.wait_state("g2", "succeeded")


def test_drop_oldest_cancels_the_oldest_and_tells(kg):
    kg.config(max_agents=1, max_queue=1, on_queue_full="drop_oldest")
    kg.delegate("r", 30)
    kg.delegate("q1", 0)
    assert kg.delegate("q2", 0).startswith("queued q2")
    q1 = kg.task("q1")
    assert (q1["state"], q1["reason"]) == ("cancelled", "dropped: queue full")
    assert any(e.get("name") == "q1" and e.get("reason") == "dropped: queue full" for e in kg.events("cancelled"))


def test_policy_config_keys(kg):
    kg.ok("config", "set", "groups.gpu.max_agents", "2")
    kg.ok("config", "set", "resource_guard.min_available_memory", "2GiB")
    shown = kg.json("config", "show")
    assert shown["groups"] == {"gpu": {"max_agents": 2}}
    assert shown["resource_guard"] == {"min_available_memory": "2GiB", "max_load_per_cpu": None}
    r = kg.run("config", "set", "resource_guard.min_available_memory", "lots")
    assert r.returncode == 2 and "is not a size" in r.stderr
