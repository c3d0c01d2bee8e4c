"""Issue 27's verbs (pueue's and task-spooler's, for people who run agents), through the real
CLI and the real service: queue filters and its COMMAND column, wait --all/--group, remove,
clean --state, delegate --env, --json where it was missing, control of one task, edit of
more fields, group commands."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import wait_for


def _fast(kg, **more):
    kg.config(max_agents=1, groups={"g": {"max_agents": 1}}, **more)


def test_queue_filters_keep_true_positions_and_show_the_command(kg):
    _fast(kg)
    gate = kg.rec / "gate"
    kg.delegate("a", 0, 0, gate=gate)
    kg.ok("delegate", "b", "--group", "g", "--source", "pm", "--", "echo", "hi there")
    kg.ok("delegate", "c", "--", "true")
    out = kg.ok("queue")
    assert "COMMAND" in out and "echo 'hi there'" in out
    only = kg.ok("queue", "--group", "g")
    assert "b" in only.split() and " c " not in only and "sh -c" not in only
    q = kg.json("queue", "--source", "pm")
    assert [t["name"] for t in q["queued"]] == ["b"] and q["queued"][0]["position"] == 1 and q["active"] == []
    q = kg.json("queue", "--source", "cli")
    assert [t["name"] for t in q["queued"]] == ["c"] and q["queued"][0]["position"] == 2  # its true position
    assert [t["name"] for t in q["active"]] == ["a"]
    q = kg.json("queue", "--state", "running")
    assert q["queued"] == [] and [t["name"] for t in q["active"]] == ["a"]
    r = kg.run("queue", "--state", "bogus")
    assert r.returncode == 2 and "unknown state 'bogus'" in r.stderr and "Traceback" not in r.stderr
    kg.ok("cancel", "c")
    q = kg.json("queue", "--state", "cancelled")
    assert [t["name"] for t in q["finished"]] == ["c"] and q["queued"] == [] and q["active"] == []
    gate.touch()


def test_wait_all_and_group_wait_for_the_live_tasks_of_now(kg):
    kg.config(max_agents=3, groups={"g": {"max_agents": 1}})
    gate = kg.rec / "gate"
    kg.delegate("a", 0, 0, gate=gate)
    kg.delegate("b", 0.5, 0, "--group", "g")
    kg.delegate("c", 0, 1, "--group", "g")
    r = kg.run("wait", "--group", "g", "--json")
    assert r.returncode == 1, r.stderr  # c failed
    done = json.loads(r.stdout)
    assert sorted(t["name"] for t in done) == ["b", "c"] and all(t["state"] != "running" for t in done)
    assert kg.task("a")["state"] == "running"
    r = kg.run("wait", "--all", "--timeout", "0.3")
    assert r.returncode == 124 and r.stdout == ""
    gate.touch()
    r = kg.run("wait", "--all", "--json")
    assert r.returncode == 0, r.stderr
    assert [t["name"] for t in json.loads(r.stdout)] == ["a"]
    r = kg.run("wait", "--all")
    assert r.returncode == 0 and "nothing to wait for" in r.stderr
    r = kg.run("wait")
    assert r.returncode == 2 and "TASK..., --all or --group" in r.stderr


def test_remove_drops_finished_tasks_and_refuses_a_live_one(kg):
    _fast(kg)
    gate = kg.rec / "gate"
    kg.delegate("done", 0, 0)
    kg.wait_state("done", "succeeded")
    kg.delegate("live", 0, 0, gate=gate)
    log = Path(kg.task("done")["log"])
    assert log.exists()
    before = kg.home.index.read_bytes()
    r = kg.run("remove", "done", "live")
    assert r.returncode == 1 and "live (#2) is running" in r.stderr and "kugetsu cancel #2" in r.stderr
    assert kg.home.index.read_bytes() == before  # nothing written, not even the finished one
    r = kg.run("remove", "nosuch")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    out = kg.ok("remove", "done")
    assert "removed 1 finished task from the index: done (#1)" in out
    assert not log.exists() and kg.run("status", "#1").returncode == 1
    gate.touch()


def test_clean_state_drops_only_those_states(kg):
    kg.config(max_agents=3)
    kg.delegate("ok", 0, 0)
    kg.delegate("bad", 0, 3)
    kg.wait_state("bad", "failed")
    kg.wait_state("ok", "succeeded")
    r = kg.run("clean", "--state", "running")
    assert r.returncode == 2 and "finished tasks only" in r.stderr
    gone = json.loads(kg.ok("clean", "--state", "failed", "--json"))
    assert [t["name"] for t in gone] == ["bad"]
    assert kg.task("ok")["state"] == "succeeded" and kg.run("status", "bad").returncode == 1
