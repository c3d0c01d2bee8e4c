"""The demo as a user runs it, and what the everyday commands import."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
import subprocess
import sys
import time

import pytest
from conftest import REPO, processes_under, wait_for


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: pytest's (longer under xdist) would push the demo's
    socket past what a Unix socket path may be."""
    d = Path(tempfile.mkdtemp(prefix="kg", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_demo_shows_the_whole_job_and_leaves_nothing_behind(kg, short_tmp):
    tmp_path = short_tmp  # its throw-away home lands here (short: its socket lives in it), so we can look for leftovers
    env = {**kg.env, "TMPDIR": str(tmp_path)}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kugetsu", "demo"], env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert took < 45
    # The delegate lines are the real command (the expiry that issue-4 is given too) and its real answer.
    for expected in ("$ kugetsu delegate issue-4 --source demo --expire-after 4s -- ", "started issue-1 (#2), slot 2/2",
                     "queued issue-6 (#7), position 5 of 5", "cancelled issue-2", "expired   issue-4",
                     "failed    issue-5", "SUMMARY", "at most 2 running at once (max_agents 2)"):
        assert expected in out, expected
    # Every delegate, the first too, is shown the same way: the command, then on its own line
    # what `delegate` printed (the first once read `->  started in slot 1/2`, issue 27).
    delegates = [i for i, line in enumerate(out.splitlines()) if "] $ kugetsu delegate " in line]
    assert len(delegates) == 7, out
    for i in delegates:
        assert re.fullmatch(r" {9}(started \S+ \(#\d+\), slot \d/2|queued \S+ \(#\d+\), position \d of \d)",
                            out.splitlines()[i + 1]), out.splitlines()[i:i + 2]
    # positions move: issue-5 is position 4 at admission, position 1 after the cancel and the expiry
    assert re.search(r"^\s+1\s+6\s+issue-5", out, re.M)
    # a simulated usage limit: issue-7 back in the queue, its preset held while the others
    # start, and at the reset time it resumes its session and succeeds
    assert "requeued  issue-7  (sim-claude usage limit: back in the queue, held until" in out
    assert "held        (sim-claude usage limit: 1 task held until" in out
    assert "sim-claude usage limit, retry at" in out and "released" in out
    lines = out.splitlines()
    held = next(i for i, line in enumerate(lines) if "] held " in line)
    released = next(i for i, line in enumerate(lines) if "] released " in line)
    assert any("] started " in line for line in lines[held:released])  # other work goes on
    assert re.search(r"^ *1  issue-7  succeeded", out, re.M)
    assert processes_under(tmp_path) == []
    assert list(tmp_path.glob("kugetsu-demo-*")) == []  # the throw-away home is gone


@pytest.mark.parametrize("command", [["capacity", "--json"], ["queue", "--json"], ["delegate", "x", "--", "true"]])
def test_everyday_commands_do_not_import_heavy_modules(kg, command):
    kg.config(autostart=False)
    # A home with a schedule and a task waiting for its start time: still no APScheduler.
    kg.ok("schedule", "add", "nightly", "--cron", "0 2 * * *", "--", "true")
    kg.ok("delegate", "later", "--delay", "1h", "--", "true")
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "kugetsu", *command], env=kg.env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time")}
    heavy = {m for m in imported if m.split(".")[0] in ("textual", "telegram", "apscheduler", "pydantic", "psutil",
                                                         "asyncio", "subprocess", "platformdirs", "prometheus_client",
                                                         "textual_serve", "aiohttp", "playwright", "mcp",
                                                         "mcp_types", "anyio", "starlette", "uvicorn",
                                                         # what typing_extensions brings, 10 ms (kugetsu/__init__.py)
                                                         "inspect", "dis", "ast",
                                                         # shutil (with bz2, lzma): runner.which instead, 3 ms
                                                         "shutil", "bz2", "lzma",
                                                         # for warnings a command seldom has, 7 ms (core/limits.py)
                                                         "logging")}
    # kugetsu's own modules that only their commands need (stats reads history, doctor probes)
    heavy |= imported & {"kugetsu.app.stats", "kugetsu.frontends.metrics", "kugetsu.frontends.doctor", "kugetsu.frontends.web", "kugetsu.core.schedules",
                          "kugetsu.service.deadlines"}
    heavy |= {m for m in imported if m.startswith("kugetsu.frontends.mcp")}  # the MCP server: only `kugetsu mcp` loads it
    assert heavy == set()


def test_serve_detach_starts_the_service_before_it_loads_any_reading_of_the_queue(kg):
    """`serve --detach` (the issue-31 start-up at 50,000 queued) reads no queue: the CLI loads
    neither the reading of the index nor the rules nor the views before the service it starts
    (loading them was ~40 ms of the start on the bench's machine). Through the real CLI, its
    own imports (-X importtime is the CLI's, not passed to the service it starts)."""
    kg.config(autostart=False)
    kg.delegate("first", 0)
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "kugetsu", "serve", "--detach"], env=kg.env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time")}
    assert "kugetsu.app.control" in imported  # the import log is the CLI's
    loaded = imported & {"kugetsu.app.reading", "kugetsu.app.transaction", "kugetsu.core.step", "kugetsu.core.selection",
                         "kugetsu.store.files", "kugetsu.frontends.render", "kugetsu.frontends.cli.admin"}
    assert loaded == set()
    kg.wait_state("first", "succeeded")


def test_a_started_service_loads_no_cli_module_and_starts_its_agents_before_apscheduler(kg):
    """`serve --detach` (and every autostart) runs `python -m kugetsu.service`: not the CLI's
    parser and the modules only its commands use (~35 ms of each start); APScheduler is
    loaded after the first tick, which started the agent (deadlines: ~35 ms). The service's
    imports, in order, from its log (PYTHONPROFILEIMPORTTIME), against its agent's start."""
    kg.config(autostart=False)
    kg.delegate("first", 0)
    kg.env["PYTHONPROFILEIMPORTTIME"] = "1"
    kg.ok("serve", "--detach")
    kg.wait_state("first", "succeeded")
    wait_for(lambda: "kugetsu service up" in kg.home.service_log.read_text(), 10, "the service to say it is up")
    log = kg.home.service_log.read_text().splitlines()
    imported = [line.split("|")[-1].strip() for line in log if line.startswith("import time")]
    assert "kugetsu.service.daemon" in imported
    # (thin, the delegate socket's half of the CLI, is the service's: it answers handed requests)
    cli = [m for m in imported if m == "argparse" or m.startswith("kugetsu.frontends.cli.")
           and m != "kugetsu.frontends.cli.thin"]
    assert cli == [], f"the service loaded {cli}"
    # The service says it is up after its first tick, which spawned the agent: then APScheduler.
    up = next(i for i, line in enumerate(log) if "kugetsu service up" in line)
    scheduler = next(i for i, line in enumerate(log)
                     if line.startswith("import time") and line.split("|")[-1].strip() == "apscheduler")
    assert scheduler > up, "APScheduler was loaded before the first tick"


def test_a_msgspec_that_needs_typing_extensions_is_imported_as_it_wants(tmp_path):
    """kugetsu imports msgspec with typing_extensions hidden (msgspec falls back to typing's
    get_type_hints, 10 ms saved); a msgspec that cannot do without it still loads."""
    fake = tmp_path / "msgspec"
    fake.mkdir()
    (fake / "__init__.py").write_text("import typing_extensions\nFAKE = True\n")
    code = ("import kugetsu, sys, msgspec; assert msgspec.FAKE; assert sys.modules['typing_extensions'] is not None;"
            " print('ok')")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"},
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


def test_runner_which_finds_what_shutil_which_finds(tmp_path):
    """runner.which stands in for shutil.which on the delegate path (no shutil import)."""
    import shutil

    from kugetsu.service import runner

    exe = tmp_path / "bin" / "agent"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (tmp_path / "bin" / "plain").write_text("not executable")
    (tmp_path / "bin" / "dir").mkdir()
    bins = str(tmp_path / "bin")
    for command, path in [("sh", None), ("agent", None), ("agent", bins), ("agent", f"/nonexistent:{bins}"),
                          ("plain", bins), ("dir", bins), ("sh", ""), (str(exe), None), (str(tmp_path), None),
                          ("nosuch-command-here", None), ("agent", f"::{bins}")]:
        assert runner.which(command, path) == shutil.which(command, path=path), (command, path)
