"""The service's memory at depth (issue 31): what it keeps of a long queue is the decoded
tasks and one copy of their bytes, not three (the index read, the queue's bytes joined, each
task's bytes apart), and the heap gives back what a commit's big buffers used."""

from __future__ import annotations

import os
from datetime import timedelta

from conftest import T0, wait_for

from kugetsu.core.models import Index, Task
from kugetsu.store.protocol import encode_index

DEPTH = 20_000
# The real service at 20,000 queued (a queue_home of tools/bench/depth.py): ~88 MB before a
# bound was set, 58.5-60 MB after, 54-54.5 MB once the queued tasks shared their repeated
# strings and no map of their places or dict of their attempts was kept (issue 31: 104 -> 84
# MB at 50,000). The bound leaves ~2.5 MB of room, and fails when one of those comes back, or
# a second copy of the queue's bytes (~5.5 MB here) is kept again with the heap's unreturned
# buffers.
BOUND_MB = 57


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_the_service_at_20000_queued_keeps_its_memory_under_a_bound(kg, tmp_path):
    gate = tmp_path / "gate"
    kg.config(max_agents=1, max_queue=DEPTH + 10, autostart=False)
    index = Index(next_id=DEPTH + 2)
    index.queued.append(Task(id=1, name="blocker", command=kg.agent("blocker", gate=gate), cwd="/", created_at=T0))
    for i in range(2, DEPTH + 2):
        index.queued.append(Task(id=i, name=f"t{i}", command=["true", str(i)], cwd="/", created_at=T0,
                                 token=os.urandom(16).hex(), expires_at=T0 + timedelta(days=3650), source="bench"))
    kg.home.index.write_bytes(encode_index(index))
    # The service as users run it: without the tests' VERIFY mode, which keeps a full encoding
    # of each commit to check the shortcuts against (a copy of the queue's bytes of its own).
    kg.env.pop("KUGETSU_PG_VERIFY", None)
    try:
        kg.ok("serve", "--detach")
        pid = kg.service_pid()
        assert pid
        wait_for(lambda: "start" in kg.times("blocker"), 60, "the blocker to start")
        wait_for(lambda: kg.index()["active"] and kg.index()["active"][0].get("pid"), 30, "its start committed")
        seen: list[float] = []
        try:
            wait_for(lambda: seen.append(_rss_mb(pid)) or seen[-1] < BOUND_MB, 20, "")
        except AssertionError:
            raise AssertionError(f"the service's RSS stayed over {BOUND_MB} MB for 20 s: {seen[-1]:.1f} MB"
                                 f" (least {min(seen):.1f})") from None
        print(f"RSS {seen[-1]:.1f} MB")
    finally:
        gate.touch()
