"""A drain sends no signal without a reason (issue 31): while a burst of exits shares one held
transaction, the agents let go in it are recorded by that very transaction, so they are no
'strays' to SIGKILL. Before the fix, 200 tasks through 4 slots logged thousands of 'was let
go but is no longer queued or running' warnings, each with a signal to a group that had
ended (one pid reuse away from a stranger's processes). Real service, real agents."""

from __future__ import annotations

import asyncio
import logging
import os

from conftest import service_in_process, wait_for_async

from kugetsu.app import delegation

from kugetsu.core import admission
from kugetsu.config.load import load_config

TASKS = 200


async def test_a_drain_of_200_tasks_at_4_slots_sends_no_signal_and_warns_nothing(kg, monkeypatch, caplog):
    kg.config(max_agents=4, autostart=False, max_queue=TASKS + 10)
    cfg = load_config(kg.home)
    reqs = [admission.Request(name=f"t{i}", command=["true"], cwd=str(kg.home.root), source="test") for i in range(TASKS)]
    admitted = delegation.delegate_many(kg.home, cfg, reqs)
    assert all(isinstance(a, delegation.Admission) for a in admitted), admitted[:3]

    signals: list[tuple[int, int]] = []
    real_killpg = os.killpg

    def counting_killpg(pgid: int, sig: int) -> None:
        if sig != 0:  # 0 only asks whether the group is there
            signals.append((pgid, sig))
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", counting_killpg)
    caplog.set_level(logging.WARNING, logger="kugetsu.service")
    async with service_in_process(kg.home):
        def drained() -> bool:
            index = kg.index()
            return not index["queued"] and not index["active"]
        await wait_for_async(drained, timeout=120, what=f"{TASKS} tasks to drain")
    states = {t["state"] for t in kg.index()["finished"]}
    assert states == {"succeeded"}, states
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [], warnings[:5]
    assert signals == [], signals[:5]
