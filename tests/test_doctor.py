"""`kugetsu doctor` through the real CLI: a healthy home, then each broken condition it must
find, with its fix; and that it only looks (no home made, no service started)."""

from __future__ import annotations

import errno
import json
import os
import signal
from datetime import datetime, timedelta, timezone

import msgspec
from conftest import wait_for
from fakebot import TOKEN
from test_edges import at, no_traceback, small_tmpfs  # noqa: F401  (small_tmpfs is a fixture)
from test_telegram_bot import api, setup  # noqa: F401  (api is a fixture)

from kugetsu.app import control

from kugetsu.frontends import doctor
from kugetsu.core.models import Event

SIM = {"default_agent": "sim", "agents": {"sim": {"command": ["sh", "-c", "echo {prompt}"]}}}


def diagnose(kg) -> tuple[int, dict[str, dict]]:
    r = kg.run("doctor", "--json")
    assert r.returncode in (0, 1) and no_traceback(r), r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] == (r.returncode == 0) and report["problems"] == sum(not c["ok"] for c in report["checks"])
    return r.returncode, {c["name"]: c for c in report["checks"]}


def problems(checks: dict[str, dict]) -> list[str]:
    return [name for name, c in checks.items() if not c["ok"]]


def test_a_healthy_home_has_no_problems(kg):
    kg.config(**SIM)
    kg.ok("serve", "--detach")
    code, checks = diagnose(kg)
    assert code == 0 and problems(checks) == [], checks
    assert checks["service"]["detail"].startswith(f"running (pid {kg.service_pid()}), answering")
    assert checks["agent sim"]["detail"].startswith("sh -> /")
    assert "nobody uses" in checks["agent opencode"]["detail"]  # built-in, not installed, not wanted
    text = kg.ok("doctor")
    assert text.rstrip().endswith("no problems found") and "PROBLEM" not in text


def test_a_dead_service_is_found_and_left_dead(kg):
    kg.config(**SIM)
    gate = kg.rec / "go"
    kg.delegate("long", 0, 0, gate=gate)  # starts the service
    kg.wait_state("long", "running")  # at admission: the autostarted service may still be starting
    pid = wait_for(kg.service_pid, 15, "the autostarted service to be up")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not control.service_holds_lock(kg.home), 10, "the killed service to let go of its lock")
    code, checks = diagnose(kg)
    assert code == 1 and problems(checks) == ["service"], checks
    service = checks["service"]
    assert f"service.pid names pid {pid}, which is not running" in service["detail"]
    assert "while 1 task is queued or running" in service["detail"]
    assert service["fix"].startswith("`kugetsu serve --detach`")
    assert not control.service_holds_lock(kg.home)  # the doctor looked; it started nothing
    text = kg.run("doctor").stdout
    assert "PROBLEM  service" in text and "fix: `kugetsu serve --detach`" in text and text.endswith("1 problem found\n")
    gate.touch()


def test_a_stopped_service_does_not_answer(kg):
    kg.config(**SIM)
    kg.ok("serve", "--detach")
    pid = kg.service_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: doctor._process_state(pid) == "T", 10, "the service to stop")
        code, checks = diagnose(kg)
        assert code == 1 and problems(checks) == ["service"]
        assert checks["service"]["detail"] == f"the service (pid {pid}) is stopped"
        assert f"kill -CONT {pid}" in checks["service"]["fix"]
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_corrupt_config_is_a_finding_and_the_rest_is_checked(kg):
    kg.home.root.mkdir(mode=0o700)
    kg.home.config.write_text('{"max_agents": 3,\n "agents": {oops}}\n')
    code, checks = diagnose(kg)
    assert code == 1 and "config" in problems(checks)
    assert "not valid JSON at line 2" in checks["config"]["detail"] and "config check" in checks["config"]["fix"]
    assert checks["disk"]["ok"] and checks["index"]["ok"]  # the others ran, with the defaults
    assert kg.home.config.read_text().endswith("{oops}}\n")  # never rewritten


def test_a_missing_agent_command_is_found_with_the_fix(kg, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "private-agent").write_text("#!/bin/sh\n")
    (bin_dir / "private-agent").chmod(0o755)
    kg.config(default_agent="ghost", agents={
        "ghost": {"command": ["no-such-agent-xyz", "{prompt}"]},
        "extra": {"command": ["also-missing-abc"]},
        "private": {"command": ["private-agent"], "env": {"PATH": str(bin_dir)}},  # found on its own PATH
    })
    code, checks = diagnose(kg)
    assert code == 1 and problems(checks) == ["agent extra", "agent ghost"], checks
    ghost = checks["agent ghost"]
    assert "'no-such-agent-xyz' is not on PATH (the default agent, in config.json)" in ghost["detail"]
    assert "kugetsu config set agents.ghost" in ghost["fix"] and "default_agent" in ghost["fix"]
    assert "(in config.json)" in checks["agent extra"]["detail"]
    assert checks["agent private"]["detail"] == f"private-agent -> {bin_dir / 'private-agent'}"


def fill(mnt) -> None:  # type: ignore[no-untyped-def]
    """Write until the file system says it is full (unbuffered: nothing is left to flush)."""
    with open(mnt / "filler", "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 65536):
                pass
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_a_full_disk_is_found(small_tmpfs, tmp_path):
    k = at(tmp_path, small_tmpfs / "home")
    k.config(autostart=False, **SIM)
    code, checks = diagnose(k)
    assert code == 0 and checks["disk"]["ok"], checks["disk"]  # a small disk is no problem while it has room
    fill(small_tmpfs)
    code, checks = diagnose(k)
    assert code == 1 and problems(checks) == ["disk"]
    assert f"{small_tmpfs / 'home'}: full" in checks["disk"]["detail"] and "kugetsu clean" in checks["disk"]["fix"]


def test_a_clock_set_back_is_found(kg):
    kg.config(autostart=False, **SIM)
    # 2 h ahead, and half a minute more: doctor runs seconds later on a loaded machine (the
    # gap it shows is rounded down to whole minutes: 1h59m once).
    later = datetime.now(timezone.utc) + timedelta(hours=2, seconds=30)
    kg.home.events.write_bytes(msgspec.json.encode(Event(seq=1, type="config", at=later, key="max_agents", value=3))
                               + b"\n")
    code, checks = diagnose(kg)
    assert code == 1 and problems(checks) == ["clock"]
    assert "the clock is 2h behind the latest time kugetsu recorded" in checks["clock"]["detail"]
    assert "NTP" in checks["clock"]["fix"]


def test_telegram_token_checked_against_the_bot_api(kg, api):
    setup(kg, api, autostart=False, **SIM)
    code, checks = diagnose(kg)
    assert code == 0 and checks["telegram"]["detail"] == "token valid, bot @kugetsu_test_bot"
    assert not api.sent()  # it looks; it sends nobody a message
    setup(kg, api, autostart=False, telegram={"token": "123456:WRONG-token-zyxwvutsrq"}, **SIM)
    code, checks = diagnose(kg)
    assert code == 1 and problems(checks) == ["telegram"]
    assert "refused the token" in checks["telegram"]["detail"] and "WRONG" not in json.dumps(checks)
    assert TOKEN.split(":")[1] not in kg.run("doctor").stdout


def test_no_pidfds_is_a_problem(monkeypatch):
    def refuse(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refuse)
    check = doctor._proc()
    assert not check.ok and "pidfd_open is not available" in check.detail and "Linux 5.3" in check.fix


def test_the_doctor_writes_nothing(kg):
    r = kg.run("doctor")
    assert r.returncode in (0, 1) and no_traceback(r)
    assert "does not exist yet" in r.stdout
    assert not kg.home.root.exists()
    r = kg.run("doctor", "--frob")
    assert r.returncode == 2 and "unrecognized arguments: --frob" in r.stderr and not kg.home.root.exists()


def test_each_installed_agent_s_version_is_reported_and_a_newer_one_than_verified_is_a_warning(kg, tmp_path):
    from agentclis import PINS, agent_cli

    real = agent_cli("claude")  # the pinned Claude Code: its version is the verified one
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "codex").write_text("#!/bin/sh\necho 'codex-cli 99.1.0'\n")
    (newer / "codex").chmod(0o755)
    kg.env["PATH"] = f"{real.parent}{os.pathsep}{newer}{os.pathsep}{kg.env['PATH']}"
    code, checks = diagnose(kg)
    claude = checks["agent claude"]
    assert claude["ok"] and not claude.get("warning"), claude
    assert f"version {PINS['claude']['version']}" in claude["detail"]
    codex = checks["agent codex"]
    assert codex["ok"] and codex["warning"] and "version 99.1.0, newer than" in codex["detail"], codex
    assert "README" in codex["fix"]
    text = kg.ok("doctor") if code == 0 else kg.run("doctor").stdout
    assert any(line.startswith("warning") and "agent codex" in line for line in text.splitlines()), text
    from kugetsu.agents import VERIFIED

    assert VERIFIED == {name: pin["version"] for name, pin in PINS.items() if not pin.get("tool")}  # one table, two copies: kept equal
