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
    import subprocess
    import sys

    from test_mcp import pidfds

    def waiter(*args: str) -> subprocess.Popen:
        """`kugetsu wait ARGS --json`, once it watches a running task (a pidfd open on it)."""
        w = subprocess.Popen([sys.executable, "-m", "kugetsu", "wait", *args, "--json"], env=kg.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: w.poll() is None and pidfds(w.pid) > 0, 20, f"wait {' '.join(args)} to watch")
        return w

    kg.config(max_agents=3, groups={"g": {"max_agents": 1}})
    gate, gate_b = kg.rec / "gate", kg.rec / "gate-b"
    kg.delegate("a", 0, 0, gate=gate)
    # b holds the group's slot until the group's waiter watches it (on a loaded machine b and
    # c could both have ended before a `wait` started after them: nothing left to wait for).
    kg.delegate("b", 0, 0, "--group", "g", gate=gate_b)
    kg.delegate("c", 0, 1, "--group", "g")
    group = waiter("--group", "g")
    gate_b.touch()
    out, err = group.communicate(timeout=30)
    assert group.returncode == 1, err  # c failed
    done = json.loads(out)
    assert sorted(t["name"] for t in done) == ["b", "c"] and all(t["state"] != "running" for t in done)
    assert kg.task("a")["state"] == "running"
    r = kg.run("wait", "--all", "--timeout", "0.3")
    assert r.returncode == 124 and r.stdout == ""
    everything = waiter("--all")  # it is waiting on a before a may end
    gate.touch()
    out, err = everything.communicate(timeout=30)
    assert everything.returncode == 0, err
    assert [t["name"] for t in json.loads(out)] == ["a"]
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
    r = kg.run("remove", "done", "live")
    assert r.returncode == 1 and "live (#2) is running" in r.stderr and "cancel it first (#2)" in r.stderr
    assert kg.task("#1")["state"] == "succeeded" and log.exists()  # nothing removed, not even the finished one
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


def test_delegate_env_reaches_the_agent_and_only_its_names_are_shown(kg):
    kg.config(max_agents=2)
    secret = "sk-live-0123456789abcdef"
    out = kg.rec / "env"
    env = {**kg.env, "FROM_SHELL": "shell value"}
    r = __import__("subprocess").run(
        [__import__("sys").executable, "-m", "kugetsu", "delegate", "e", "--env", f"API_KEY={secret}",
         "--env", "EMPTY=", "--env", "FROM_SHELL", "--env", "HAS_EQ=a=b", "--",
         "sh", "-c", 'printf "%s|%s|%s|%s" "$API_KEY" "${EMPTY-unset}" "$FROM_SHELL" "$HAS_EQ" > "$0"', str(out)],
        env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    t = kg.wait_state("e", "succeeded")
    assert out.read_text() == f"{secret}||shell value|a=b"
    assert t["env_names"] == ["API_KEY", "EMPTY", "FROM_SHELL", "HAS_EQ"] and "env" not in t
    shown = kg.ok("status", "e") + kg.ok("queue", "--all", "--json") + kg.ok("logs", "e")
    assert "API_KEY" in kg.ok("status", "e") and secret not in shown
    assert secret not in kg.home.events.read_text()
    # retry keeps the variables (the task keeps them; they are shown nowhere)
    kg.ok("retry", "e")
    wait_for(lambda: out.read_text() == f"{secret}||shell value|a=b" and kg.task("#2")["state"] == "succeeded")


@pytest.mark.parametrize(("arg", "said"), [
    ("1BAD=x", "invalid environment variable name '1BAD'"),
    ("A-B=x", "invalid environment variable name 'A-B'"),
    ("=x", "invalid environment variable name ''"),
    ("KUGETSU_TASK_TOKEN=forged", "KUGETSU_TASK_TOKEN is kugetsu's own"),
    ("kugetsu_home=x", "kugetsu_home is kugetsu's own"),
    ("NOT_IN_THIS_SHELL_XYZ", "not set in this shell"),
])
def test_delegate_env_refuses_bad_names_and_writes_nothing(kg, arg, said):
    kg.config(autostart=False)
    r = kg.run("delegate", "x", "--env", arg, "--", "true")
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not kg.home.index.exists() or kg.index()["queued"] == []
    assert "forged" not in r.stderr  # a value is never echoed: it may be a secret


async def test_mcp_delegate_env_and_queue_filters(kg):
    from test_mcp import connect

    kg.config(max_agents=1)
    out = kg.rec / "mcp-env"
    gate = kg.rec / "gate"
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"name": "e", "env": {"TOKEN_X": "s3cret-value"}, "command": [
            "sh", "-c", 'printf %s "$TOKEN_X" > "$0"; while [ ! -e "$1" ]; do sleep 0.02; done', str(out), str(gate)]})
        assert r.structured_content["task"]["env_names"] == ["TOKEN_X"] and "s3cret" not in str(r.structured_content)
        r = await c.call_tool("delegate", {"name": "bad", "env": {"KUGETSU_HOME": "/x"}, "command": ["true"]})
        assert r.is_error and "kugetsu's own" in r.content[0].text
        await c.call_tool("delegate", {"name": "q", "source": "pm", "command": ["true"]})
        r = await c.call_tool("queue", {"source": "pm"})
        q = r.structured_content
        assert [t["name"] for t in q["queued"]] == ["q"] and q["active"] == []
        r = await c.call_tool("queue", {"state": ["running"]})
        assert [t["name"] for t in r.structured_content["active"]] == ["e"] and r.structured_content["queued"] == []
    wait_for(lambda: out.exists() and out.read_text() == "s3cret-value")
    gate.touch()


def test_json_on_logs_hold_and_release(kg):
    kg.config(max_agents=1, agents={"x": {"command": ["sh", "-c", "echo one; echo two; echo three", "{prompt}"]}})
    kg.ok("delegate", "l", "--agent", "x", "--prompt", "p")
    kg.wait_state("l", "succeeded")
    [obj] = json.loads(kg.ok("logs", "l", "--json"))
    assert obj["name"] == "l" and obj["state"] == "succeeded" and obj["text"] == "one\ntwo\nthree\n"
    assert obj["size"] == len(obj["text"]) and obj["truncated"] is False
    objs = json.loads(kg.ok("logs", "l", "#1", "--lines", "1", "--json"))
    assert [o["text"] for o in objs] == ["three\n", "three\n"] and objs[0]["truncated"] is True
    r = kg.run("logs", "l", "--json", "--follow")
    assert r.returncode == 2 and "--follow" in r.stderr
    held = kg.json("hold", "x", "--until", "30m")
    assert held["agent"] == "x" and held["held"] is True and held["until"] and held["changed"]
    kg.ok("delegate", "w", "--agent", "x", "--prompt", "p")
    assert kg.json("hold", "x")["queued"] == 1  # by hand now: no end
    out = kg.json("release", "x")
    assert out["held"] is False and out["until"] is None and out["changed"]
    kg.wait_state("w", "succeeded")
    r = kg.run("release", "x", "--json")
    assert r.returncode == 1 and "not held" in r.stderr and r.stdout == ""


def _proc_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]


def _stopped(pid: int) -> bool:
    """Stopped (SIGSTOP), or waiting on a child that is: dash forks its commands with vfork, and
    a group stopped between the vfork and the child's exec leaves the shell in the vfork's
    uninterruptible wait ('D'), as stopped as it gets until SIGCONT reaches the child (seen 2
    times in 300 stops of such a loop here, 3 full suites in 9 under load)."""
    state = _proc_state(pid)
    if state == "T":
        return True
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return False
    return state == "D" and bool(children) and all(_proc_state(int(c)) == "T" for c in children)


def _counter_agent(kg, name: str, extra: str = "") -> list[str]:
    """An agent whose child, in its own session (outside the task's process group, with the
    token), writes a tick to rec/NAME.stray every 20 ms, and which itself ticks rec/NAME."""
    main, stray = kg.rec / name, kg.rec / f"{name}.stray"
    script = (f'setsid sh -c \'echo $$ > "$1.pid"; while :; do echo x >> "$1"; sleep 0.02; done\' _ "{stray}" & '
              f'{extra} while :; do echo x >> "{main}"; sleep 0.02; done')
    return ["sh", "-c", script]


def _ticks(path: Path) -> int:
    try:
        return len(path.read_text())
    except FileNotFoundError:
        return 0


def test_pause_and_resume_one_task_stops_its_whole_tree_and_its_timeout(kg):
    kg.config(max_agents=2)
    kg.ok("delegate", "p", "--timeout", "3s", "--", *_counter_agent(kg, "p"))
    main, stray = kg.rec / "p", kg.rec / "p.stray"
    wait_for(lambda: _ticks(main) > 4 and _ticks(stray) > 4 and (kg.rec / "p.stray.pid").exists(), what="ticks")
    stray_pid = int((kg.rec / "p.stray.pid").read_text())
    out = kg.ok("pause", "p")
    assert "p (#1) paused" in out and "kugetsu resume p" in out
    t = kg.task("p")
    assert t["state"] == "running" and t["paused_at"]
    wait_for(lambda: _stopped(stray_pid), what="the stray stopped")
    # The agent's pid is looked up again at each poll, and what was seen is kept for the
    # message: this wait failed 3 runs in 9 of a loaded full suite (never alone), the stray
    # stopped, with the pid read once right after `pause`; the message then showed the agent
    # in 'D' for 10 s, dash's vfork wait on a child stopped before its exec (_stopped).
    seen: list = []

    def agent_stopped() -> bool:
        pid = kg.task("p")["agent_pid"]
        seen[:] = [pid, _proc_state(pid) if pid else None, _proc_state(t["agent_pid"]) if t["agent_pid"] else None]
        return bool(pid) and _stopped(pid)

    try:
        wait_for(agent_stopped, what="the agent stopped")
    except AssertionError:  # wait_for's timeout
        raise AssertionError(f"the agent was not seen stopped: pid now, its state, the first pid's state: {seen}, "
                             f"the first read: {t}")
    before = (_ticks(main), _ticks(stray))
    time.sleep(3.5)  # longer than its timeout: a paused task does not time out
    assert (_ticks(main), _ticks(stray)) == before
    assert kg.task("p")["state"] == "running"
    assert "paused" in kg.ok("queue").split("\n")[4]  # its row's STATE
    assert "was already paused" in kg.ok("pause", "p")
    kg.ok("resume", "p")
    wait_for(lambda: _ticks(main) > before[0] and _ticks(stray) > before[1], what="ticking again")
    t = kg.task("p")
    assert t["paused_at"] is None and t["paused_s"] >= 3.4
    assert [e["type"] for e in kg.events() if e.get("task") == 1 and e["type"] in ("paused", "resumed")] == [
        "paused", "resumed"]
    # the timeout counts the running time only: about 3 s more than without the pause
    t = kg.wait_state("p", "failed", timeout=20)
    ran = (__import__("datetime").datetime.fromisoformat(t["finished_at"])
           - __import__("datetime").datetime.fromisoformat(t["started_at"])).total_seconds()
    assert "timed out after 3s" in t["reason"] and ran >= 6.4, ran


def test_pause_of_a_queued_task_is_refused_and_pause_without_task_is_the_queue(kg):
    kg.config(max_agents=1)
    gate = kg.rec / "gate"
    kg.delegate("a", 0, 0, gate=gate)
    kg.ok("delegate", "b", "--", "true")
    r = kg.run("pause", "b")
    assert r.returncode == 1 and "only a running task can be paused" in r.stderr and "pause without a task holds the queue" in r.stderr
    r = kg.run("pause", "b", "--group", "g")
    assert r.returncode == 2 and "not both" in r.stderr
    assert "no queued task starts" in kg.ok("pause")  # the queue, as before
    assert kg.json("capacity")["paused"] is True
    kg.ok("resume")
    gate.touch()


def test_cancel_of_a_paused_task_ends_it_at_once(kg):
    kg.config(max_agents=1, kill_grace="30s")
    kg.ok("delegate", "c", "--", *_counter_agent(kg, "c"))
    wait_for(lambda: (kg.rec / "c.stray.pid").exists() and kg.task("c").get("agent_pid"), what="started")
    kg.ok("pause", "c")
    t0 = time.monotonic()
    kg.ok("cancel", "c")
    assert time.monotonic() - t0 < 10  # SIGTERM acted on: not the 30 s grace
    assert kg.task("c")["state"] == "cancelled"


def test_kill_sends_a_signal_to_the_whole_tree(kg):
    kg.config(max_agents=1)
    trap = kg.rec / "usr1"
    kg.ok("delegate", "k", "--", *_counter_agent(kg, "k", extra=f'trap "echo got >> {trap}" USR1;'))
    wait_for(lambda: (kg.rec / "k.stray.pid").exists() and _ticks(kg.rec / "k") > 2, what="started")
    stray_pid = int((kg.rec / "k.stray.pid").read_text())
    out = kg.ok("kill", "-s", "USR1", "k")
    assert "sent SIGUSR1 to k (#1)" in out
    wait_for(lambda: trap.exists() and trap.read_text() == "got\n", what="the agent's trap ran once")
    wait_for(lambda: _proc_state(stray_pid) == "gone", what="the stray ended by SIGUSR1 (no trap)")
    assert kg.task("k")["state"] == "running"
    assert any(e["type"] == "signalled" and e["reason"] == "SIGUSR1 sent by cli" for e in kg.events())
    for bad, said in [("NOPE", "no such signal"), ("STOP", "pause the task instead"), ("CONT", "resume the task instead")]:
        r = kg.run("kill", "-s", bad, "k")
        assert r.returncode == 2 and said in r.stderr, r.stderr
    kg.ok("kill", "k")  # SIGTERM
    assert kg.wait_state("k", "failed", "succeeded")["state"] == "failed"
    r = kg.run("kill", "k")
    assert r.returncode == 1 and "only a running task can be signalled" in r.stderr


@pytest.mark.parametrize("strategy", ["fifo", "priority", "fair"])
def test_next_puts_a_queued_task_first_and_it_starts_next(kg, strategy):
    kg.config(max_agents=1, strategy=strategy)
    gate = kg.rec / "gate"
    kg.delegate("run", 0, 0, gate=gate)
    for name in ("a", "b", "c"):
        kg.ok("delegate", name, "--source", name, "--priority", "urgent" if name == "a" else "normal",
              "--", *kg.agent(name))
    out = kg.ok("next", "c")
    assert "c (#4) moved to the front, position 1" in out
    assert [t["name"] for t in kg.json("queue")["queued"]] == ["c", "a", "b"]
    assert "unchanged" in kg.ok("next", "c")
    kg.ok("next", "b")  # the latest `next` first
    assert [t["name"] for t in kg.json("queue")["queued"]] == ["b", "c", "a"]
    gate.touch()
    wait_for(lambda: all(kg.times(n).get("end") for n in ("a", "b", "c")), 20, "all ran")
    assert kg.times("b")["start"] < kg.times("c")["start"] < kg.times("a")["start"]
    r = kg.run("next", "a")
    assert r.returncode == 1 and "only a queued task can be moved" in r.stderr


def test_stash_sets_a_task_aside_until_unstash(kg):
    kg.config(max_agents=1, queue_timeout="3s")
    gate = kg.rec / "gate"
    kg.delegate("run", 0, 0, gate=gate)
    kg.ok("delegate", "s", "--", *kg.agent("s"))
    kg.ok("delegate", "t", "--", *kg.agent("t"))
    out = kg.ok("stash", "s")
    assert "s (#2) stashed, set aside (`kugetsu unstash s`)" in out
    q = kg.json("queue")
    assert [(t["name"], t["position"], t["waiting_for"]) for t in q["queued"]] == [
        ("t", 1, None), ("s", None, "stashed")]
    assert "stashed" in kg.ok("queue")
    gate.touch()
    kg.wait_state("t", "succeeded")
    time.sleep(3.5)  # past its queue deadline: a stashed task does not expire, nor start
    s = kg.task("s")
    assert s["state"] == "queued" and s["stashed_at"] and not kg.times("s")
    kg.ok("unstash", "s")
    assert kg.wait_state("s", "succeeded")["stashed_at"] is None
    assert [e["type"] for e in kg.events() if e.get("task") == 2 and e["type"] in ("stashed", "unstashed")] == [
        "stashed", "unstashed"]
    r = kg.run("stash", "s")
    assert r.returncode == 1 and "only a queued task can be stashed" in r.stderr


def _edit_home(kg):
    kg.config(max_agents=1, agents={
        "x": {"command": ["sh", "-c", 'printf "x|%s|%s|%s" "$1" "$2" "$PWD" > "$0"', str(kg.rec / "out"), "{prompt}",
                          "{name}"]},
        "y": {"command": ["sh", "-c", 'printf "y|%s|%s" "$(cat "$1")" "$Y_VAR" > "$0"', str(kg.rec / "out"),
                          "{prompt_file}"], "env": {"Y_VAR": "from-y"}},
    })
    gate = kg.rec / "gate"
    kg.delegate("run", 0, 0, gate=gate)
    return gate


def test_edit_name_cwd_and_agent_of_a_queued_task(kg, tmp_path):
    gate = _edit_home(kg)
    kg.ok("delegate", "t", "--agent", "x", "--prompt", "hello", "--env", "OWN=1")
    other = tmp_path / "elsewhere"
    other.mkdir()
    out = kg.ok("edit", "t", "--name", "t2", "--cwd", str(other))
    assert "edited t2 (#2), position 1" in out
    t = kg.task("t2")
    assert t["cwd"] == str(other) and t["command"][-1] == "t2"  # {name} made again
    for args, said, code in [
        (("--name", "run"), "already queued or running", 2),
        (("--name", "12"), "digits only", 2),
        (("--cwd", str(tmp_path / "nope")), "is not a directory", 2),
        (("--agent", "nope"), "unknown agent preset 'nope'", 2),
    ]:
        r = kg.run("edit", "t2", *args)
        assert r.returncode == code and said in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    kg.ok("edit", "t2", "--agent", "y")  # the prompt now goes as a file; the preset's env changes, its own stays
    t = kg.task("t2")
    assert t["agent"] == "y" and t["env_names"] == ["OWN", "Y_VAR"]
    edited = [e for e in kg.events("edited") if e["task"] == 2]
    assert [e["key"] for e in edited] == ["name,cwd", "agent"] and "hello" not in json.dumps(edited)
    gate.touch()
    kg.wait_state("t2", "succeeded")
    assert (kg.rec / "out").read_text() == "y|hello|from-y"


def test_edit_command_of_a_queued_task(kg):
    gate = _edit_home(kg)
    kg.ok("delegate", "c", "--", "sh", "-c", "echo old > \"$0\"", str(kg.rec / "cmd"))
    r = kg.run("edit", "c", "--prompt", "new words")
    assert r.returncode == 2 and "give the new command" in r.stderr
    r = kg.run("edit", "c", "--", "no-such-program-xyz")
    assert r.returncode == 2 and "no-such-program-xyz" in r.stderr
    kg.ok("edit", "c", "--", "sh", "-c", "echo new > \"$0\"", str(kg.rec / "cmd"))
    assert kg.task("c")["command"][2] == 'echo new > "$0"'
    assert [e["key"] for e in kg.events("edited")] == ["command"]
    gate.touch()
    kg.wait_state("c", "succeeded")
    assert (kg.rec / "cmd").read_text() == "new\n"


def _with_editor(kg, name: str, body: str):
    """`kugetsu edit p --prompt-editor` with $EDITOR a shell script of `body` ($1: the file)."""
    import subprocess
    import sys

    editor = kg.rec / name
    editor.write_text("#!/bin/sh\n" + body + "\n")
    editor.chmod(0o755)
    return subprocess.run([sys.executable, "-m", "kugetsu", "edit", "p", "--prompt-editor"],
                          env={**kg.env, "EDITOR": str(editor), "VISUAL": ""}, capture_output=True, text=True)


def test_edit_prompt_editor_uses_editor(kg):
    gate = _edit_home(kg)
    kg.ok("delegate", "p", "--agent", "x", "--prompt", "first draft")
    r = _with_editor(kg, "editor.sh", 'stat -c %a "$1" > "$0.mode"; cat "$1" > "$0.seen"; printf "second draft" > "$1"')
    assert r.returncode == 0 and "edited p (#2)" in r.stdout, r.stderr
    assert (kg.rec / "editor.sh.seen").read_text() == "first draft"
    assert (kg.rec / "editor.sh.mode").read_text().strip() == "600"
    assert kg.task("p")["prompt"] == "second draft"
    r = _with_editor(kg, "same.sh", "true")
    assert r.returncode == 0 and "unchanged" in r.stderr
    r = _with_editor(kg, "fails.sh", "exit 3")
    assert r.returncode == 2 and "exited with status 3: nothing was changed" in r.stderr
    gate.touch()
    kg.wait_state("p", "succeeded")
    assert (kg.rec / "out").read_text().startswith("x|second draft|p|")


def test_group_add_list_and_remove(kg):
    kg.config(max_agents=2)
    assert "no groups" in kg.ok("group", "list")
    r = kg.run("delegate", "x", "--group", "gpu", "--", "true")
    assert r.returncode == 2 and "kugetsu group add gpu --max 1" in r.stderr
    assert "group gpu added: 2 slots" in kg.ok("group", "add", "gpu", "--max", "2")
    assert json.loads(kg.home.config.read_text())["groups"] == {"gpu": {"max_agents": 2}}
    for args, said in [(("add", "gpu"), "exists already"), (("add", "bad name"), "invalid group name"),
                       (("add", "z", "--max", "65"), "at most 64"), (("remove", "nope"), "no group 'nope'")]:
        r = kg.run("group", *args)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    gate = kg.rec / "gate"
    kg.delegate("g1", 0, 0, "--group", "gpu", gate=gate)
    kg.ok("pause", "--group", "gpu")
    rows = json.loads(kg.ok("group", "list", "--json"))
    assert rows == [{"name": "gpu", "max_agents": 2, "active": 1, "queued": 0, "paused": True}]
    assert "gpu" in kg.ok("group", "list") and "yes" in kg.ok("group", "list")
    before = kg.home.config.read_bytes()
    r = kg.run("group", "remove", "gpu")
    assert r.returncode == 1 and "g1 (#1)" in r.stderr and kg.home.config.read_bytes() == before
    gate.touch()
    kg.wait_state("g1", "succeeded")
    assert "group gpu removed" in kg.ok("group", "remove", "gpu")
    assert json.loads(kg.home.config.read_text()).get("groups", {}) == {}


@pytest.mark.parametrize(("args", "said"), [
    (("queue", "--state=--"), "--state: unknown state '--'"),
    (("clean", "--state=--"), "--state: unknown state '--'"),
    (("kill", "--signal=--", "x"), "no such signal"),
    (("group", "add", "--max=--", "g"), "--max: '--' is not a valid value"),
    (("delegate", "--env=--", "x", "--", "true"), "--env: give NAME=VALUE"),
    (("kill", "-s", "0", "x"), "no such signal"),
])
def test_new_options_given_dashdash_or_nonsense_say_so_in_one_line(kg, args, said):
    kg.config(autostart=False)
    r = kg.run(*args)
    assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_edit_refuses_a_worktree_tasks_name_and_directory(kg, tmp_path):
    from test_worktrees import git

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "-c", "user.name=T", "-c", "user.email=t@e", "commit", "-q", "--allow-empty", "-m", "init")
    gate = _edit_home(kg)
    kg.ok("delegate", "wt", "--worktree", "--cwd", str(repo), "--", "true")
    r = kg.run("edit", "wt", "--name", "wt2")
    assert r.returncode == 1 and "branch kugetsu/wt" in r.stderr and "cannot change" in r.stderr
    r = kg.run("edit", "wt", "--cwd", str(tmp_path))
    assert r.returncode == 1 and "worktree of" in r.stderr
    t = kg.task("wt")  # nothing written (the service writes the index meanwhile: compare the task)
    assert (t["name"], t["cwd"]) == ("wt", str(repo)) and not kg.events("edited")
    gate.touch()


async def test_mcp_wait_for_a_group(kg):
    from test_mcp import connect

    kg.config(max_agents=2, groups={"batch": {"max_agents": 2}})
    async with connect(kg) as c:
        for name, code in (("b1", 0), ("b2", 3)):
            await c.call_tool("delegate", {"name": name, "group": "batch", "command": ["sh", "-c", f"sleep 0.3; exit {code}"]})
        await c.call_tool("delegate", {"name": "other", "command": ["sleep", "30"]})
        r = await c.call_tool("wait", {"group": "batch", "timeout": "20s"})
        out = r.structured_content
        assert out["done"] and not out["all_succeeded"]
        assert sorted((t["name"], t["state"]) for t in out["tasks"]) == [("b1", "succeeded"), ("b2", "failed")]
        r = await c.call_tool("wait", {})
        assert r.is_error and "or a group" in r.content[0].text
        await c.call_tool("cancel", {"tasks": ["other"]})
