"""Issue 27's control of one task in a cluster (real PostgreSQL, two machines): pause acts on
the machine that runs the task, another machine says where to run it, and a cancel from
another machine ends a paused task at once (its machine's service sends SIGCONT after the
SIGTERM), not after kill_grace."""

from __future__ import annotations

import time

from conftest import agent_wrappers, wait_for
from test_cluster import machines  # noqa: F401  (a fixture: machines of one cluster)


def test_pause_in_a_cluster_and_a_cancel_from_elsewhere(machines):  # noqa: F811
    a, b = machines("m1"), machines("m2")
    a.ok("config", "set", "kill_grace", "30s")
    gate = a.rec / "never"
    a.delegate("far", 0.0, 0, "--host", "m2", gate=gate)
    b.wait_state("far", "running")
    wait_for(lambda: a.times("far").get("start") and b.task("far").get("pid"), 10, "the agent to start")
    r = a.run("pause", "far")
    assert r.returncode == 1 and "runs on m2" in r.stderr and "run the command on m2" in r.stderr
    b.ok("pause", "far")
    assert a.task("far")["paused_at"]
    t0 = time.monotonic()
    a.ok("cancel", "far")
    wait_for(lambda: not agent_wrappers(b.home), 10, "the paused agent on m2 to end")
    assert time.monotonic() - t0 < 10, "a paused task waited for kill_grace"
    assert a.wait_state("far", "cancelled", timeout=10)["state"] == "cancelled"
