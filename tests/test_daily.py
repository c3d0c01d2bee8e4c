"""Issue 19, daily use: delegate --wait, wait by name, pause/resume, --after, edit and
logs of several tasks, through the real CLI, the real service and real agent processes."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import wait_for


# ---- item 1: waiting for the task that was admitted -------------------------------------


def test_delegate_wait_admits_then_waits_with_waits_exit_codes(kg):
    r = kg.run("delegate", "ok", "--wait", "--", "sh", "-c", "sleep 0.3; echo done")
    assert r.returncode == 0 and r.stdout.startswith("started ok (#1)"), r
    assert kg.task("ok")["state"] == "succeeded"
    r = kg.run("delegate", "bad", "--wait", "--", "sh", "-c", "exit 3")
    assert r.returncode == 1 and "bad (#2) failed: exit code 3" in r.stderr, r
    r = kg.run("delegate", "slow", "--wait", "--json", "--", "true")
    assert r.returncode == 0, r
    assert json.loads(r.stdout)["state"] == "succeeded"  # --json: the task once final


def test_delegate_wait_rejected_is_exit_3_and_waits_for_nothing(kg):
    kg.config(max_agents=1, max_queue=0)
    kg.delegate("busy", 30)
    r = kg.run("delegate", "more", "--wait", "--", "true")
    assert r.returncode == 3 and "queue full" in r.stderr, r


def test_wait_refuses_a_reused_name_that_only_finished_tasks_bear(kg):
    kg.ok("delegate", "issue-16", "--wait", "--", "true")
    # One task ever had the name: waiting for it after it finished still works.
    r = kg.run("wait", "issue-16")
    assert r.returncode == 0, r
    assert "already finished" in r.stderr and "#1" in r.stderr  # said, on stderr
    kg.ok("delegate", "issue-16", "--wait", "--", "true")
    r = kg.run("wait", "issue-16")
    assert r.returncode == 2 and r.stdout == "", r
    assert "ambiguous" in r.stderr and "kugetsu wait #2" in r.stderr, r
    assert kg.run("wait", "#2").returncode == 0
    # A live task of the name is never ambiguous: names are unique among live tasks.
    kg.config(max_agents=1)
    gate = kg.rec / "go"
    kg.delegate("issue-16", 0, gate=gate)
    r = kg.run("wait", "issue-16", "--timeout", "0.5")
    assert r.returncode == 124, r  # it waited for the running one
    gate.touch()


def test_the_readmes_pm_recipe_never_reports_work_that_did_not_run(kg, tmp_path):
    """Issue 19 item 1: queue full and an earlier issue-16 finished: the recipe retries the
    delegate and waits on the id it got, so it reports the new task's outcome."""
    import re
    from conftest import REPO

    text = (REPO / "README.md").read_text()
    recipe = re.search(r"## For PM agents.*?```sh\n(.*?)```", text, re.S).group(1)
    kg.ok("delegate", "issue-16", "--wait", "--", "true")  # the earlier one: succeeded
    kg.config(max_agents=1, max_queue=0)
    kg.delegate("blocker", 1.5)
    (tmp_path / "issue-16.md").write_text("the new work")
    # The recipe with a fake agent preset that fails, and a short back-off.
    kg.home.config.write_text(json.dumps({
        "max_agents": 1, "max_queue": 0, "default_agent": "fake",
        "agents": {"fake": {"command": ["sh", "-c", "exit 7", "{prompt}"]}}}))
    script = recipe.replace("sleep 60", "sleep 0.5")
    r = subprocess.run(["sh", "-c", script], cwd=tmp_path, env={**kg.env, "PATH": f"{sys.exec_prefix}/bin:"
                       + kg.env["PATH"]}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)  # the new issue-16 failed: said so
    assert kg.task("#3")["state"] == "failed"
