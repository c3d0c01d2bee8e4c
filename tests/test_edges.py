"""Edges of the Hardening issue, through the real CLI: secrets never shown, odd digits,
a runtime dir or home that is not ours, symlinks planted in the home, a full disk."""

from __future__ import annotations

import json


SECRET = "123456:AAEsecretSECRETsecret"


def test_a_token_is_never_printed_nor_written_to_events_at_any_depth(kg):
    out = kg.ok("config", "set", "telegram", json.dumps({"token": SECRET, "allowed_chat_ids": [1]}))
    assert SECRET not in out and '"token": "***"' in out
    out = kg.ok("config", "set", "agents.gh", json.dumps({"command": ["gh"], "env": {"GITHUB_TOKEN": SECRET, "X": "y"}}))
    assert SECRET not in out and '"X": "y"' in out
    for args in (("get", "telegram"), ("get", "telegram.token"), ("get", "agents"), ("get", "agents.gh.env"),
                 ("show",), ("show", "--json")):
        shown = kg.ok("config", *args)
        assert SECRET not in shown and "***" in shown, args
    assert json.loads(kg.ok("config", "get", "telegram"))["allowed_chat_ids"] == [1]
    assert SECRET not in kg.home.events.read_text()
    assert [e["value"]["token"] for e in kg.events("config") if e["key"] == "telegram"] == ["***"]
    assert json.loads(kg.home.config.read_text())["telegram"]["token"] == SECRET  # stored as given


def test_config_set_dash_reads_the_value_from_stdin(kg):
    r = kg.run("config", "set", "telegram.token", "-", input=SECRET)  # printf '%s' "$TOKEN" | ...
    assert r.returncode == 0 and SECRET not in r.stdout + r.stderr, r
    assert json.loads(kg.home.config.read_text())["telegram"]["token"] == SECRET
    assert kg.ok("config", "set", "max_agents", "-", input="5\n").strip() == "max_agents = 5"
    before = kg.home.config.read_bytes()
    for given, message in (("", "standard input was empty"), ("\n", "standard input was empty"),
                           ("a\nb\n", "expected one line")):
        r = kg.run("config", "set", "telegram.token", "-", input=given)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r
    assert kg.home.config.read_bytes() == before
    assert "printf '%s'" in kg.ok("config", "set", "--help")


def test_config_set_dash_on_a_terminal_does_not_echo_the_value(kg):
    import os
    import subprocess
    import sys

    from conftest import wait_for

    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kugetsu", "config", "set", "telegram.token", "-"],
                            env=kg.env, stdin=slave, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    os.set_blocking(master, False)
    seen = b""

    def read_terminal() -> bytes:
        nonlocal seen
        try:
            seen += os.read(master, 4096)
        except (BlockingIOError, OSError):  # nothing yet; EIO once the child closed it
            pass
        return seen

    wait_for(lambda: b"not echoed" in read_terminal(), 20, "the prompt")
    os.write(master, SECRET.encode() + b"\n")
    out, _ = proc.communicate(timeout=20)
    read_terminal()
    os.close(master)
    assert proc.returncode == 0 and out.decode().strip() == 'telegram.token = "***"'
    assert SECRET.encode() not in seen
    assert json.loads(kg.home.config.read_text())["telegram"]["token"] == SECRET


def test_unicode_digits_are_names_not_ids(kg):
    kg.config(max_agents=1)
    for name in ("one", "two", "three"):
        kg.delegate(name, 30)
    for args in (("status", "²"), ("status", "#²"), ("cancel", "٣"), ("cancel", "³")):
        r = kg.run(*args)
        assert r.returncode == 1 and "no task" in r.stderr and "Traceback" not in r.stderr, r
    assert kg.task("3")["state"] == "queued"  # "٣" (Arabic-Indic three) is not task #3
    r = kg.run("logs", "one", "--lines", "²")
    assert r.returncode == 2 and "expected a whole number" in r.stderr, r
    assert kg.json("status", "#3")["name"] == "three"
