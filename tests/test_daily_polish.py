"""Issue 19's polish: what a newcomer reads, through the real CLI (config errors, `queue`,
`status`, the README's own examples)."""

from __future__ import annotations

import json

import pytest


def _set(kg, key, value):
    r = kg.run("config", "set", key, value)
    return r.returncode, r.stderr.strip()


def test_config_set_type_error_names_the_real_key_and_how_to_quote(kg):
    kg.config(autostart=False, agents={"x": {"command": ["sh", "-c", "sleep $FAKE_DUR"]}})
    before = kg.home.config.read_bytes()
    code, err = _set(kg, "agents.x.env.FAKE_DUR", "30")
    assert code == 2, err
    assert "agents.x.env.FAKE_DUR" in err and "[...]" not in err
    assert "expected a string, got 30" in err
    assert """kugetsu config set agents.x.env.FAKE_DUR '"30"'""" in err
    assert "Traceback" not in err
    assert kg.home.config.read_bytes() == before


def test_config_unknown_key_under_a_preset_lists_the_presets_keys(kg):
    kg.config(autostart=False)
    code, err = _set(kg, "agents.x.comand", '["a"]')
    assert code == 2
    assert "unknown key 'agents.x.comand'" in err
    assert "command, env, worktree" in err and "max_queue" not in err


def test_config_bad_choice_lists_the_choices(kg):
    kg.config(autostart=False)
    code, err = _set(kg, "strategy", "lifo")
    assert code == 2
    assert "'lifo'" in err and "fifo, priority, fair" in err
    code, err = _set(kg, "worktrees.keep", "sometimes")
    assert code == 2 and "changed, always, never" in err
    code, err = _set(kg, "groups.g.max_agents", "100")
    assert code == 2 and "groups.g.max_agents" in err and "at most 64" in err


def test_config_file_with_the_error_names_the_file_and_the_key(kg):
    kg.config(agents={"x": {"command": ["a"], "worktre": True}})
    r = kg.run("config", "check")
    assert r.returncode == 2
    assert str(kg.home.config) in r.stderr
    assert "agents.x.worktre" in r.stderr and "command, env, worktree" in r.stderr
    kg.config(agents={"x": {"command": ["a"], "env": {"OK": "1", "FAKE_DUR": 30}}})
    r = kg.run("config", "check")
    assert r.returncode == 2
    assert str(kg.home.config) in r.stderr and "'agents.x.env.FAKE_DUR'" in r.stderr
    assert 'expected a string, got 30' in r.stderr and '"30"' in r.stderr
    kg.config(strategy="lifo")
    r = kg.run("config", "check")
    assert r.returncode == 2 and "'strategy'" in r.stderr and "fifo, priority, fair" in r.stderr


def _columns(text: str, header_word: str) -> tuple[str, list[str]]:
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header_word))
    rows = []
    for line in lines[at + 1 :]:
        if not line.strip():
            break
        rows.append(line)
    return lines[at], rows


def test_a_stopping_task_says_so_inside_a_column_of_queue(kg):
    import subprocess
    import sys

    from conftest import wait_for

    kg.config(kill_grace="20s")
    kg.ok("delegate", "calm", "--", "sleep", "30")
    kg.ok("delegate", "stubborn", "--", "sh", "-c", "trap '' TERM; sleep 30")
    # Admitted as running by the CLI, it has a process once the service spawned it: cancelled
    # before that, it ends at once (nothing to stop) and is never seen stopping (CI, once).
    wait_for(lambda: kg.task("stubborn")["pid"], what="stubborn's process")
    canceller = subprocess.Popen([sys.executable, "-m", "kugetsu", "cancel", "stubborn"], env=kg.env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: "stopping" in kg.ok("queue"), 10, "stubborn to be stopping")
        header, rows = _columns(kg.ok("queue"), "SLOT")
        assert header.split()[-2:] == ["STATE", "COMMAND"]
        state_at = header.index("STATE")
        for row in rows:  # the word sits under its header, not past the last column
            assert row[state_at:].split()[0] in ("running", "stopping"), (header, row)
        assert [row[state_at:].split()[0] for row in rows] == ["running", "stopping"]
    finally:
        canceller.kill()
        canceller.wait()


def test_status_prints_a_multiline_prompt_once_indented_and_no_queue_deadline_once_running(kg):
    kg.config(agents={"x": {"command": ["sh", "-c", "sleep 30", "{prompt}"]}})
    kg.ok("delegate", "t1", "--agent", "x", "--prompt", "line one\nline two\nline three")
    kg.wait_state("t1", "running")
    out = kg.ok("status", "t1")
    assert out.count("line two") == 1, out
    lines = out.splitlines()
    first = next(line for line in lines if line.startswith("prompt"))
    indent = first.index("line one")
    after = lines[lines.index(first) + 1 : lines.index(first) + 3]
    assert after == [" " * indent + "line two", " " * indent + "line three"], out
    assert "expires_at" not in out
    assert "{prompt}" in next(line for line in lines if line.startswith("command"))
    kg.ok("delegate", "q", "--", "true")  # still queued? no: 3 slots; a queued one keeps its deadline
    kg.config(max_agents=1, agents={"x": {"command": ["sh", "-c", "sleep 30", "{prompt}"]}})
    kg.ok("delegate", "waits", "--", "true")
    assert "expires_at" in kg.ok("status", "waits")


def test_queue_all_cuts_a_long_reason_with_an_ellipsis(kg):
    from kugetsu.core.models import Index, Task, TaskState
    from kugetsu.paths import atomic_write
    from kugetsu.store.protocol import encode_index

    from datetime import datetime, timezone

    reason = "the process vanished and no exit status could be recovered after the service restarted"
    kg.config(autostart=False)
    kg.home.ensure()
    at = datetime.now(timezone.utc)
    atomic_write(kg.home.index, encode_index(Index(next_id=2, finished=[Task(
        id=1, name="gone", state=TaskState.LOST, command=["x"], cwd="/", created_at=at, started_at=at,
        finished_at=at, reason=reason)])))
    out = kg.ok("queue", "--all")
    row = next(line for line in out.splitlines() if "gone" in line)
    assert row.endswith("…") and reason[:40] in row, row
    assert reason in kg.ok("status", "gone")  # whole where there is room


def test_delegate_checks_the_agent_on_the_services_path_not_the_clis(kg, tmp_path):
    import os
    import subprocess
    import sys

    bin_dir = tmp_path / "mybin"
    bin_dir.mkdir()
    agent = bin_dir / "my-agent"
    agent.write_text("#!/bin/sh\necho ran\n")
    agent.chmod(0o755)
    kg.config(agents={"mine": {"command": ["my-agent", "{prompt}"]}}, default_agent="mine")
    # The service starts from a shell without mybin on its PATH (a login shell, a unit file).
    service_path = os.environ["PATH"]
    subprocess.run([sys.executable, "-m", "kugetsu", "serve", "--detach"], env={**kg.env, "PATH": service_path},
                   check=True, capture_output=True, timeout=30)
    cli_env = {**kg.env, "PATH": f"{bin_dir}{os.pathsep}{service_path}"}
    r = subprocess.run([sys.executable, "-m", "kugetsu", "delegate", "t", "--prompt", "hi"], env=cli_env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "my-agent" in r.stderr and "service" in r.stderr and str(kg.service_pid()) in r.stderr
    assert str(agent) in r.stderr  # where this shell finds it, to say why it is refused anyway
    assert "Traceback" not in r.stderr
    assert kg.json("queue")["active"] == [] and kg.json("queue")["queued"] == []
    # With a full path (or PATH in the preset's env) it runs.
    kg.ok("config", "set", "agents.mine.command", json.dumps([str(agent), "{prompt}"]))
    kg.ok("delegate", "t2", "--prompt", "hi")
    assert kg.wait_state("t2", "succeeded", "failed")["state"] == "succeeded"
