"""Exits that come in a burst share one commit: the service keeps an exit's transaction
open (lock held) for service.COMMIT_DELAY, lets each next agent go at once, and writes the
index once for the lot. Real service, real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from conftest import service_in_process, wait_for, wait_for_async

from kugetsu.service import daemon as service
from kugetsu.store.files import Store

CODES = [0, 1, 2, 0, 3, 0, 1, 0]  # each task's own exit status


def _queue_behind_a_gated_blocker(kg, names):
    kg.config(max_agents=1, autostart=False, max_queue=50)
    gate = kg.rec / "go"
    kg.delegate("blocker", 0, gate=gate)
    for name, code in zip(names, CODES):
        kg.delegate(name, 0, code)
    return gate


def _ended(kg, names):
    return [n for n in names if "end" in kg.times(n)]


async def test_a_burst_shares_commits_and_a_cli_command_waits_for_it(kg, monkeypatch):
    names = [f"t{i}" for i in range(len(CODES))]
    gate = await asyncio.to_thread(_queue_behind_a_gated_blocker, kg, names)
    monkeypatch.setattr(service, "COMMIT_DELAY", 5.0)  # the whole burst fits in one hold
    commits = []
    real_commit = Store.commit  # the CLI runs in subprocesses: only the service's commits count here
    monkeypatch.setattr(Store, "commit", lambda store, txn: (commits.append(len(txn.events)), real_commit(store, txn)))
    async with service_in_process(kg.home):
        await wait_for_async(lambda: 2 in kg.wrappers(), what="blocker running and t0 warm")
        before = len(commits)
        gate.touch()
        # Every agent runs, one after the other, while the index still says none has ended:
        # promotion does not wait for the commit.
        await wait_for_async(lambda: len(_ended(kg, names)) == len(names), what="the whole burst to run")
        assert len(commits) == before  # none committed yet: the exits' transaction is held
        assert [t["name"] for t in kg.index()["queued"]] == names  # the lock-free view: the last commit
        # A CLI transaction waits for the held one (the lock), then builds on it.
        late = await asyncio.to_thread(kg.ok, "delegate", "late", "--", "true")
        assert "slot 1/1" in late, late
        finished = [t["name"] for t in kg.index()["finished"] if t["name"] != "late"]
        assert finished == ["blocker", *names]
        assert commits[before] == 1 + 2 * len(names)  # nine exits (finished, started), one commit
    finished = {t["name"]: t for t in kg.index()["finished"]}
    for name, code in zip(names, CODES):
        assert finished[name]["exit_code"] == code
        assert finished[name]["state"] == ("succeeded" if code == 0 else "failed")
        assert (kg.rec / name).read_text().count("start") == 1
    # Events committed together keep their order: each task queued, started, then ended.
    kinds = [(e["type"], e["name"]) for e in kg.events() if e.get("name") in names]
    for name, code in zip(names, CODES):
        assert [k for k, n in kinds if n == name] == ["queued", "started", "succeeded" if code == 0 else "failed"]


def test_kill9_during_a_held_burst_loses_no_status_and_runs_nothing_twice(kg):
    """The service dies with a burst's bookkeeping held in memory: the index on disk says
    the tasks are still queued, but their wrappers recorded each agent's status. The next
    service records each task with its real status, and starts none a second time."""
    names = [f"t{i}" for i in range(len(CODES))]
    gate = _queue_behind_a_gated_blocker(kg, names)
    held = subprocess.Popen(  # the real service, with a hold long enough to kill it inside
        [sys.executable, "-c", "import sys; from kugetsu.service import daemon; from kugetsu.frontends.cli import main as cli;"
         " daemon.COMMIT_DELAY = 60; sys.exit(cli.main(['serve']))"],
        env=kg.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: kg.service_pid() == held.pid and kg.task("blocker")["pid"], what="the service to start blocker")
        gate.touch()
        wait_for(lambda: len(_ended(kg, names)) == len(names), what="the whole burst to run")
        assert [t["name"] for t in kg.index()["queued"]] == names  # nothing of the burst committed
        os.kill(held.pid, signal.SIGKILL)
    finally:
        held.kill()
        held.wait()
    kg.ok("serve", "--detach")
    for name, code in zip(names, CODES):
        t = kg.wait_state(name, "succeeded", "failed")
        assert t["exit_code"] == code, (name, t)
        assert (kg.rec / name).read_text().count("start") == 1
    assert kg.wait_state("blocker", "succeeded")["exit_code"] == 0
    assert not kg.index()["queued"] and not kg.index()["active"]
