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
    assert r.returncode == 0 and r.stderr == "", r  # one task of the name: no doubt, no note
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


# ---- item 9: pause and resume -----------------------------------------------------------


def test_pause_holds_every_start_across_a_restart_and_resume_lets_them_go(kg):
    kg.config(max_agents=2)
    gate = kg.rec / "go"
    kg.delegate("running", 0, gate=gate)
    out = kg.ok("pause")
    assert out.startswith("kugetsu paused: no queued task starts, running ones go on"), out
    assert "was already paused" in kg.ok("pause")
    out = kg.delegate("held", 0)
    assert out.strip() == "queued held (#2), position 1 of 1; waiting for: paused", out
    kg.delegate("held2", 0)
    cap = kg.json("capacity")
    assert cap["paused"] is True and cap["paused_groups"] == [] and cap["free"] == 0  # none to a new task
    q = kg.json("queue")
    assert q["paused"] is True
    assert [(t["name"], t["position"], t["waiting_for"]) for t in q["queued"]] == [
        ("held", 1, "paused"), ("held2", 2, "paused")]
    assert "paused: no queued task starts" in kg.ok("queue").splitlines()[0]
    gate.touch()  # the running one goes on and ends; its slot is not given away
    kg.wait_state("running", "succeeded")
    kg.ok("shutdown")
    kg.ok("serve", "--detach")
    assert kg.task("held")["state"] == "queued" and kg.json("capacity")["paused"] is True
    out = kg.ok("resume")
    assert out.startswith("kugetsu resumed:"), out
    kg.wait_state("held", "succeeded")
    kg.wait_state("held2", "succeeded")
    assert [e["type"] for e in kg.events() if e["type"] in ("paused", "resumed")] == ["paused", "resumed"]


def test_pause_of_a_group_holds_only_its_tasks_and_others_pass_them(kg):
    kg.config(max_agents=2, groups={"gpu": {"max_agents": 1}})
    kg.ok("pause", "--group", "gpu")
    out = kg.ok("delegate", "train", "--group", "gpu", "--", "true")
    assert "waiting for: group gpu paused" in out, out
    kg.delegate("lint", 0)
    kg.wait_state("lint", "succeeded")
    t = kg.task("train")
    assert t["state"] == "queued" and t["position"] == 1
    assert kg.json("capacity")["paused_groups"] == ["gpu"]
    assert "paused: group gpu" in kg.ok("queue")
    r = kg.run("pause", "--group", "nope")
    assert r.returncode == 2 and "unknown group 'nope'" in r.stderr, r
    kg.ok("resume", "--group", "gpu")
    kg.wait_state("train", "succeeded")


# ---- item 10: dependencies --------------------------------------------------------------


def test_after_chains_implement_review_test_and_a_failure_cancels_the_rest(kg):
    kg.config(max_agents=3)
    gate = kg.rec / "go"
    kg.delegate("impl", 0, gate=gate)
    out = kg.delegate("review", 0, 0, "--after", "impl")
    assert out.strip() == "queued review (#2), position 1 of 1; waiting for: impl", out
    kg.delegate("test", 0, 0, "--after", "review,#1")
    q = kg.json("queue")
    assert [(t["name"], t["position"], t["waiting_for"], t["after"]) for t in q["queued"]] == [
        ("review", 1, "impl", [1]), ("test", 2, "review, impl", [2, 1])]
    assert "review, impl" in kg.ok("queue")
    gate.touch()
    kg.wait_state("test", "succeeded")
    starts = [kg.times(n)["start"] for n in ("review", "test")]
    assert kg.times("impl")["end"] <= starts[0] and kg.times("review")["end"] <= starts[1]
    # A failure: what comes after it is cancelled, each with its own event and reason.
    gate2 = kg.rec / "go2"
    kg.delegate("issue-16", 0, 1, gate=gate2)
    kg.delegate("review-16", 0, 0, "--after", "issue-16")
    kg.delegate("test-16", 0, 0, "--after", "review-16")
    gate2.touch()
    assert kg.wait_state("test-16", "cancelled")["reason"] == "dependency review-16 cancelled"
    assert kg.task("review-16")["reason"] == "dependency issue-16 failed"
    cancelled = [(e["name"], e["reason"]) for e in kg.events("cancelled")]
    assert cancelled == [("review-16", "dependency issue-16 failed"), ("test-16", "dependency review-16 cancelled")]
    assert not (kg.rec / "review-16").exists()


def test_after_an_unknown_or_failed_task_is_refused_and_writes_nothing(kg):
    kg.config(autostart=False)
    r = kg.run("delegate", "x", "--after", "nope", "--", "true")
    assert r.returncode == 2 and "unknown dependency 'nope'" in r.stderr and "--after takes ids" in r.stderr, r
    assert r.stderr.count("\n") == 1
    r = kg.run("delegate", "x", "--after", "a,,b", "--", "true")
    assert r.returncode == 2 and "--after: give task ids or names" in r.stderr, r
    assert not kg.home.index.exists() or kg.index()["queued"] == []


# ---- item 11: edit, and logs of several tasks -------------------------------------------


def test_edit_changes_a_queued_task_even_one_whose_wrapper_waits_warm(kg, tmp_path):
    said = kg.rec / "said"
    kg.config(max_agents=1, strategy="priority", groups={"gpu": {"max_agents": 1}}, agents={
        "echo": {"command": ["sh", "-c", 'printf "%s\\n" "$1" >> "$0"', str(said), "{prompt}"]},
        "file": {"command": ["sh", "-c", 'cat "$1" >> "$0"; echo >> "$0"', str(said), "{prompt_file}"]}})
    gate = kg.rec / "go"
    kg.delegate("blocker", 0, gate=gate)
    kg.ok("delegate", "a", "--agent", "echo", "--prompt", "old words")
    kg.ok("delegate", "b", "--agent", "file", "--prompt", "old file words")
    wait_for(lambda: kg.wrappers().get(2), what="a's wrapper to wait warm")
    out = kg.ok("edit", "a", "--prompt", "new words; $(no shell)")
    assert out.strip() == "edited a (#2), position 1", out
    kg.ok("edit", "b", "--prompt", "new file words")
    t = kg.json("edit", "b", "--priority", "urgent", "--timeout", "1h", "--expire-after", "2h")
    assert (t["position"], t["priority"], t["timeout"]) == (1, "urgent", 3600.0)
    assert t["expires_at"] < kg.task("a")["expires_at"]  # 2h from now, not 24h
    assert "unchanged" in kg.ok("edit", "b", "--priority", "urgent")
    edited = [e for e in kg.events("edited")]
    assert [(e["name"], e["key"]) for e in edited] == [("a", "prompt"), ("b", "prompt"),
                                                       ("b", "priority,expires_at,timeout")]
    assert "new" not in json.dumps(edited)  # the prompt's text stays out of the event log
    gate.touch()
    kg.wait_state("a", "succeeded")
    assert said.read_text() == "new file words\nnew words; $(no shell)\n"
    # Refused, and nothing written: a running or finished task, a command's prompt, bad values.
    for args, code, says in [
        (["edit", "a", "--priority", "high"], 1, "task a (#2) has already succeeded; only a queued task"),
        (["edit", "blocker", "--timeout", "1m"], 1, "only a queued task can be edited"),
        (["edit", "nope", "--priority", "high"], 1, "no task 'nope'"),
        (["edit", "a"], 2, "nothing to change"),
    ]:
        r = kg.run(*args)
        assert r.returncode == code and says in r.stderr and r.stderr.count("\n") == 1, r
    kg.delegate("gated", 0, gate=kg.rec / "never")
    kg.delegate("cmd", 0)
    for args, says in [(["--prompt", "x"], "runs a command given at delegation"),
                       (["--group", "cpu"], "unknown group 'cpu'"), (["--prompt", ""], "the prompt is empty")]:
        r = kg.run("edit", "cmd", *args)
        assert r.returncode == 2 and says in r.stderr, r
    before = kg.index()
    assert kg.ok("edit", "cmd", "--group", "gpu").strip() == "edited cmd (#5), position 1"
    assert kg.task("cmd")["group"] == "gpu" and before["next_seq"] < kg.index()["next_seq"]
    kg.ok("cancel", "--all")


def test_logs_of_several_tasks_prefixed_and_followed(kg):
    kg.config(max_agents=2)
    kg.ok("delegate", "one", "--", "sh", "-c", "echo a1; sleep 0.3; echo a2")
    kg.ok("delegate", "two", "--", "sh", "-c", "echo b1; sleep 0.3; printf b2")
    follow = kg.run("logs", "one", "two", "--follow")
    assert follow.returncode == 0, follow
    lines = follow.stdout.splitlines()
    assert sorted(lines) == ["one | a1", "one | a2", "two | b1", "two | b2"], lines
    assert lines.index("one | a1") < lines.index("one | a2") and lines.index("two | b1") < lines.index("two | b2")
    assert kg.ok("logs", "one", "#2", "--lines", "1") == "one | a2\ntwo | b2\n"
    assert kg.ok("logs", "one") == "a1\na2\n"  # one task: as it is, no prefix


def test_logs_follow_of_several_says_which_are_queued_then_follows_them(kg):
    kg.config(max_agents=1)
    gate = kg.rec / "go"
    kg.ok("delegate", "first", "--", "sh", "-c", f"echo f; while [ ! -e {gate} ]; do sleep 0.05; done")
    kg.ok("delegate", "second", "--", "sh", "-c", "echo s")
    follow = subprocess.Popen([sys.executable, "-m", "kugetsu", "logs", "--follow", "first", "second"], env=kg.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follow.stderr.readline().strip() == "(waiting: second is queued, position 1)"
        gate.touch()
        out, _ = follow.communicate(timeout=15)
    finally:
        follow.kill()
    assert out == "first | f\nsecond | s\n" and follow.returncode == 0
