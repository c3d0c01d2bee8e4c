"""Resources are capacity (issue 29): declared memory and slots in admission, measured use,
per-task limits enforced by sampling and by cgroups. Real agents: Python processes that
grow a bytearray in steps (never beyond ~200 MB) and shell scripts that fork (bounded)."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections import ChainMap
from pathlib import Path

import pytest

from conftest import T0, wait_for
from test_cluster import machines  # noqa: F401  (a fixture: homes sharing one PostgreSQL)

from kugetsu.core.models import Task
from kugetsu.service import runner, usage
from kugetsu.paths import Home

M = 1024**2

# An agent that grows to $1 MiB in steps of 10 MiB (touching every page), records each step's
# size, then holds it for $2 seconds.
HOG = (
    "import sys, time\n"
    "goal, hold, rec = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]\n"
    "chunks = []\n"
    "while len(chunks) * 10 < goal:\n"
    "    chunks.append(bytearray(10 * 1024 * 1024))\n"
    "    open(rec, 'a').write(f'{len(chunks) * 10} {time.time()}\\n')\n"
    "    time.sleep(0.05)\n"
    "time.sleep(hold)\n"
)


def hog(kg, name: str, mb: int, hold: float = 30.0) -> list[str]:
    script = kg.rec.parent / "hog.py"
    script.write_text(HOG)
    return [sys.executable, str(script), str(mb), str(hold), str(kg.rec / name)]


def grown(kg, name: str) -> int:
    """The size (MiB) the hog `name` has reached, by its own record."""
    try:
        lines = (kg.rec / name).read_text().split()
    except FileNotFoundError:
        return 0
    return int(lines[-2]) if lines else 0


def cgroups_here() -> bool:
    return os.geteuid() == 0 and usage.cgroup_base(Home(Path("/nonexistent"))) is not None


def cgroup_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


# ---- admission by declared memory and slots ------------------------------------------------


def test_memory_admission_positions_are_the_real_start_order(kg):
    """max_memory 200M: a 120M task runs; a 100M one waits, with the numbers, and a 20M one
    queued after it does not pass it; they start in the order their positions said."""
    kg.config(max_agents=4, max_memory="200M", resources={"mode": "sampling", "interval": "0.2s"})
    gate = kg.rec.parent / "gate"
    assert kg.delegate("big", 0, 0, "--memory", "120M", gate=gate).startswith("started big")
    out = kg.delegate("mid", 0, 0, "--memory", "100M")
    assert out.startswith("queued mid (#2), position 1 of 1; waiting for: memory (120.0M of 200.0M in use")
    assert kg.delegate("small", 0, 0, "--memory", "20M").startswith("queued small (#3), position 2 of 2")
    q = kg.json("queue")
    assert q["queued"][0]["waiting_for"] == "memory (120.0M of 200.0M in use, it needs 100.0M)"
    assert [t["name"] for t in q["queued"]] == ["mid", "small"]
    assert [t["memory"] for t in q["queued"]] == [100 * M, 20 * M]
    cap = kg.json("capacity")
    assert (cap["max_memory"], cap["memory_used"]) == (200 * M, 120 * M)
    assert "waiting_for     memory (120.0M of 200.0M in use" in kg.ok("status", "mid")
    gate.touch()
    for name in ("big", "mid", "small"):
        kg.wait_state(name, "succeeded")
    assert [e["name"] for e in kg.events("started")] == ["big", "mid", "small"]
    # the small one did not pass the task ahead of it: both waited for the big one's end
    assert min(kg.times("mid")["start"], kg.times("small")["start"]) >= kg.times("big")["end"]


def test_slots_count_in_max_agents_and_groups(kg):
    kg.config(max_agents=3, groups={"gpu": {"max_agents": 2}})
    gate = kg.rec.parent / "gate"
    assert kg.delegate("one", 0, 0, gate=gate).startswith("started one")
    out = kg.delegate("heavy", 0, 0, "--slots", "3")
    assert out.startswith("queued heavy (#2), position 1 of 1; waiting for: slots (1 of 3 in use, it takes 3)")
    assert kg.delegate("after", 0).startswith("queued after (#3), position 2 of 2")
    r = kg.run("delegate", "huge", "--slots", "4", "--", "true")
    assert r.returncode == 2 and "a task of 4 slots could never start: max_agents is 3" in r.stderr
    r = kg.run("delegate", "g", "--slots", "3", "--group", "gpu", "--", "true")
    assert r.returncode == 2 and "could never start in group gpu, which has 2" in r.stderr
    r = kg.run("delegate", "z", "--slots", "0", "--", "true")
    assert r.returncode == 2 and "expected 1 or more" in r.stderr and "Traceback" not in r.stderr
    r = kg.run("delegate", "z", "--memory", "lots", "--", "true")
    assert r.returncode == 2 and "is not a size" in r.stderr
    assert kg.task("heavy")["slots"] == 3
    gate.touch()
    kg.wait_state("after", "succeeded")
    assert kg.times("heavy")["start"] >= kg.times("one")["end"]
    assert kg.times("after")["start"] >= kg.times("heavy")["end"]


def test_a_preset_declares_memory_and_max_procs(kg):
    kg.config(max_memory="1G", agents={"big": {"command": ["sh", "-c", "true"], "memory": "300M",
                                                "max_procs": 50, "slots": 2}})
    kg.ok("delegate", "p", "--agent", "big")
    t = kg.wait_state("p", "succeeded")
    assert (t["memory"], t["max_procs"], t["slots"]) == (300 * M, 50, 2)
    r = kg.run("delegate", "q", "--agent", "big", "--memory", "2G")
    assert r.returncode == 2 and "could never start: max_memory is 1.0G" in r.stderr


# ---- limits enforced -------------------------------------------------------------------------


def _over_limit_is_stopped(kg, mode: str, interval: str = "0.1s") -> None:
    kg.config(max_agents=1, kill_grace="2s", resources={"mode": mode, "interval": interval})
    kg.ok("delegate", "hog", "--memory", "60M", "--", *hog(kg, "hog", 200))
    kg.delegate("next", 0)
    t = kg.wait_state("hog", "failed", timeout=20)
    assert t["reason"].startswith("memory limit 60.0M exceeded (peak "), t["reason"]
    assert t["peak_memory"] >= 60 * M  # the kernel's own count stops at the limit
    assert grown(kg, "hog") < 200  # stopped on its way
    kg.wait_state("next", "succeeded")
    assert any(e["type"] == "failed" and e["reason"].startswith("memory limit 60.0M") for e in kg.events())


def test_over_its_memory_limit_a_task_is_stopped_sampling(kg):
    _over_limit_is_stopped(kg, "sampling")
    assert "resources: sampling mode" in kg.home.service_log.read_text()


@pytest.mark.skipif(not cgroups_here(), reason="needs root and cgroup v1 memory and pids controllers")
def test_over_its_memory_limit_the_kernel_stops_it_cgroup(kg):
    """cgroup mode, measured only every minute: the kernel alone bounds the task (its OOM
    killer, in the task's own cgroup under the service's), and its end says why."""
    _over_limit_is_stopped(kg, "cgroup", "60s")
    assert "resources: cgroup mode" in kg.home.service_log.read_text()
    assert "the kernel ended 1 of its processes" in kg.task("hog")["reason"]
    base = usage.cgroup_base(kg.home)
    assert base is not None
    wait_for(lambda: not any(base.memory.glob("task-*")), 10, "the task's cgroups to be removed")


@pytest.mark.skipif(not cgroups_here(), reason="needs root and cgroup v1 memory and pids controllers")
def test_a_task_with_limits_runs_in_its_own_cgroups(kg):
    kg.config(resources={"mode": "cgroup"})
    gate = kg.rec.parent / "gate"
    kg.delegate("free", 0, 0, gate=gate)
    kg.delegate("bounded", 0, 0, "--memory", "100M", "--max-procs", "30", gate=gate)
    wait_for(lambda: kg.times("bounded").get("start") and kg.times("free").get("start"), 10, "both to start")
    free, bounded = (kg.task(n)["agent_pid"] for n in ("free", "bounded"))
    assert f"kugetsu-{kg.home.key}/task-2-1" in cgroup_of(bounded)
    assert "kugetsu-" not in cgroup_of(free)  # no limit, no cgroup of its own
    mem = usage.cgroup_base(kg.home).memory / "task-2-1"
    assert int((mem / "memory.limit_in_bytes").read_text()) == 100 * M
    assert "KUGETSU_CGROUP_PROCS" not in (runner.environ(bounded) or b"").decode()
    gate.touch()
    kg.wait_state("bounded", "succeeded")
    wait_for(lambda: not mem.exists(), 10, "its cgroups to be removed")
    kg.ok("shutdown")
    assert not mem.parent.exists()  # a stopped service leaves no cgroup behind


@pytest.mark.skipif(not cgroups_here(), reason="needs root and cgroup v1 memory and pids controllers")
def test_tasks_without_limits_make_no_cgroup(kg):
    kg.config(resources={"mode": "auto"})
    kg.delegate("plain", 0)
    kg.wait_state("plain", "succeeded")
    assert not usage.cgroup_base(kg.home).memory.exists()


FORKER = 'i=0; while [ $i -lt 200 ]; do sleep 30 & i=$((i+1)); done; wait'


def _fork_storm_is_bounded(kg, mode: str) -> None:
    kg.config(max_agents=1, kill_grace="1s", resources={"mode": mode, "interval": "0.1s"})
    kg.ok("delegate", "storm", "--max-procs", "20", "--", "sh", "-c", FORKER)
    t = kg.wait_state("storm", "failed", timeout=20)
    assert t["reason"].startswith("process limit 20 exceeded"), t["reason"]
    token = kg.index()["finished"][0]["token"]
    from kugetsu.service import runner

    wait_for(lambda: not runner.scan_token(token), 10, "every process of the storm to be gone")


def test_a_fork_storm_is_stopped_sampling(kg):
    _fork_storm_is_bounded(kg, "sampling")


@pytest.mark.skipif(not cgroups_here(), reason="needs root and cgroup v1 memory and pids controllers")
def test_a_fork_storm_is_bounded_by_the_kernel_cgroup(kg):
    _fork_storm_is_bounded(kg, "cgroup")
    reason = kg.task("storm")["reason"]
    assert "forks refused" in reason
    assert int(reason.split("(")[1].split()[0]) <= 20  # never more than its limit at once


# ---- measured use ----------------------------------------------------------------------------


def test_measured_use_in_status_queue_and_the_final_record(kg):
    kg.config(resources={"mode": "sampling", "interval": "0.1s"})
    kg.ok("delegate", "m", "--", *hog(kg, "m", 50, 3))
    wait_for(lambda: grown(kg, "m") >= 50, 10, "the hog to grow")
    t = wait_for(lambda: (t := kg.task("m")).get("rss") and t["rss"] > 45 * M and t, 5, "a measurement")
    assert t["procs"] >= 1
    assert "MEM" in kg.ok("queue") and "peak" in kg.ok("status", "m")
    t = kg.wait_state("m", "succeeded")
    assert t["peak_memory"] > 45 * M and t["cpu_seconds"] > 0  # the final record keeps them
    assert "peak_memory" in kg.ok("status", "m")
    stats = kg.json("stats", "--by", "source")
    assert stats["rows"]["cli"]["peak_memory"] == t["peak_memory"] == stats["total"]["peak_memory"]
    assert "PEAK MEM" in kg.ok("stats", "--by", "agent")


# An agent that grows to $1 MiB (touching every page), says so in $4, holds it until $2 exists,
# lets it go and then uses a little CPU at a time until $3 exists: its peak is behind it, its
# CPU time grows.
LIVE = (
    "import os, sys, time\n"
    "goal, drop, gate, rec = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]\n"
    "chunks = [bytearray(10 * 1024 * 1024) for _ in range(goal // 10)]\n"
    "open(rec, 'w').write('grown')\n"
    "while not os.path.exists(drop):\n"
    "    time.sleep(0.02)\n"
    "del chunks\n"
    "while not os.path.exists(gate):\n"
    "    busy = time.process_time() + 0.02\n"
    "    while time.process_time() < busy:\n"
    "        pass\n"
    "    time.sleep(0.05)\n"
)


def live(kg, name: str, mb: int) -> tuple[list[str], Path, Path]:
    """The agent's argv, the file that makes it let its memory go, the one that ends it."""
    script = kg.rec.parent / "live.py"
    script.write_text(LIVE)
    drop, gate = kg.rec / f"{name}.drop", kg.rec / f"{name}.go"
    return [sys.executable, str(script), str(mb), str(drop), str(gate), str(kg.rec / name)], drop, gate


def _peaked(kg, name: str, mb: int) -> dict:
    """Once the agent has grown, and queue --json shows its peak: its object then (its memory
    let go)."""
    wait_for(lambda: (kg.rec / name).exists(), 15, "the agent to grow")
    t = wait_for(lambda: (t := _running(kg)) and (t.get("peak_memory") or 0) > (mb - 10) * M and t, 10,
                 "its peak in queue --json")
    (kg.rec / f"{name}.drop").touch()
    wait_for(lambda: (_running(kg) or {}).get("rss", M) < (mb - 20) * M, 10, "its memory let go")
    return t


def _running(kg) -> dict | None:
    active = kg.json("queue")["active"]
    return active[0] if active else None


def _index_written_within(kg, seconds: float) -> bool:
    """Whether index.json is written (a new file: atomic_write renames one over it) within
    `seconds`."""
    before = os.stat(kg.home.index)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = os.stat(kg.home.index)
        if (now.st_ino, now.st_mtime_ns) != (before.st_ino, before.st_mtime_ns):
            return True
        time.sleep(0.05)
    return False


def test_a_running_tasks_measured_use_costs_no_index_write(kg):
    """Issue 31: the figures of a running task are measured every resources.interval; they are
    shown live (usage.json) and booked on its record when its run ends, not written with the
    whole index (14 MB at 50,000 queued) at every tick while it runs."""
    from kugetsu.service.daemon import RECONCILE_EVERY

    kg.config(resources={"mode": "sampling", "interval": "0.1s"})
    argv, _, gate = live(kg, "m", 60)
    kg.ok("delegate", "m", "--", *argv)
    _peaked(kg, "m", 60)
    first = wait_for(lambda: (t := _running(kg)) and t["cpu_seconds"] and t, 10, "its CPU time in queue --json")
    # Two safety-net ticks (and 100 measurements) go by; only the figures change, and nothing
    # of them is written: index.json stays the same file.
    assert not _index_written_within(kg, 2 * RECONCILE_EVERY + 1), "a measurement rewrote index.json"
    later = _running(kg)
    assert later["cpu_seconds"] > first["cpu_seconds"] and later["peak_memory"] >= first["peak_memory"]
    assert kg.task("m")["cpu_seconds"] >= later["cpu_seconds"]  # status shows them live too
    assert kg.json("stats", "--by", "source")["rows"]["cli"]["peak_memory"] >= first["peak_memory"]
    assert kg.json("kill", "-s", "WINCH", "m")["peak_memory"] >= first["peak_memory"]  # a verb's too (WINCH: ignored)
    gate.touch()
    t = kg.wait_state("m", "succeeded")
    assert t["peak_memory"] >= later["peak_memory"] and t["cpu_seconds"] >= later["cpu_seconds"]
    stats = kg.json("stats", "--by", "source")
    assert stats["rows"]["cli"]["peak_memory"] == t["peak_memory"]


@pytest.mark.parametrize("stop", ["kill -9", "shutdown"])
def test_a_service_stopped_while_a_task_runs_keeps_its_peak(kg, stop):
    """The service stops while a task runs on: a service killed leaves its last look in
    usage.json, one that shuts down books it on the task's record; either way the next
    service goes on from there, and the peak the task reached before is on its final record."""
    kg.config(resources={"mode": "sampling", "interval": "0.1s"})
    argv, _, gate = live(kg, "m", 60)
    kg.ok("serve", "--detach")
    kg.ok("delegate", "m", "--", *argv)
    _peaked(kg, "m", 60)
    killed = kg.service_pid()
    if stop == "shutdown":
        kg.ok("shutdown")
    else:
        os.kill(killed, signal.SIGKILL)
    kg.ok("serve", "--detach")
    wait_for(lambda: kg.service_pid() != killed and (t := _running(kg)) and t.get("rss"), 10,
             "a measurement by the new service")
    gate.touch()
    t = kg.wait_state("m", "succeeded")
    assert t["peak_memory"] > 50 * M and t["cpu_seconds"] > 0


def test_doctor_says_which_mode_is_in_force_and_config_checks_it(kg):
    kg.config(resources={"mode": "sampling", "interval": "1s"}, max_memory="3G")
    out = kg.run("doctor").stdout
    assert "max_memory 3.0G; sampling every 1s: a task over its memory limit is stopped at the next look" in out
    r = kg.run("config", "set", "resources.mode", "magic")
    assert r.returncode == 2 and "resources.mode" in r.stderr and "Traceback" not in r.stderr
    r = kg.run("config", "set", "max_memory", "lots")
    assert r.returncode == 2 and "is not a size" in r.stderr
    if cgroups_here():
        kg.ok("config", "set", "resources.mode", "auto")
        assert "cgroup mode (v1): the kernel bounds each task" in kg.run("doctor").stdout


def test_the_default_memory_budget_is_the_ram_less_the_reserve_and_a_default_is_counted(kg):
    """max_memory unset: the machine's RAM less memory_reserve (both config); a task that
    declares nothing counts resources.default_memory."""
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    kg.config(memory_reserve="2G", resources={"mode": "sampling", "default_memory": "100M"})
    gate = kg.rec.parent / "gate"
    kg.delegate("plain", 0, 0, gate=gate)
    kg.wait_state("plain", "running")
    cap = kg.json("capacity")
    assert (cap["max_memory"], cap["memory_used"]) == (ram - 2 * 1024 * M, 100 * M)
    assert "(RAM " in kg.run("doctor").stdout and "less memory_reserve)" in kg.run("doctor").stdout
    r = kg.run("config", "set", "memory_reserve", "lots")
    assert r.returncode == 2 and "is not a size" in r.stderr
    gate.touch()
    kg.wait_state("plain", "succeeded")


def test_metrics_show_each_running_tasks_use_and_the_memory_budget(kg):
    pytest.importorskip("prometheus_client", reason="the `metrics` extra is not installed")
    from test_metrics import endpoint, scrape, value

    kg.config(max_memory="2G", metrics={"listen": "127.0.0.1:0"}, resources={"mode": "sampling", "interval": "0.1s"})
    kg.ok("serve", "--detach")
    url = endpoint(kg)
    kg.ok("delegate", "m", "--source", "pm", "--memory", "200M", "--", *hog(kg, "m", 40, 30))
    wait_for(lambda: grown(kg, "m") >= 40, 10, "the hog to grow")
    labels = {"task": "1", "source": "pm", "agent": ""}
    samples = wait_for(lambda: (s := scrape(url)) and (value(s, "kugetsu_task_memory_bytes", **labels) or 0) > 35 * M
                       and s, 10, "the page to show its memory")
    assert value(samples, "kugetsu_task_memory_peak_bytes", **labels) >= value(samples, "kugetsu_task_memory_bytes", **labels)
    assert value(samples, "kugetsu_task_processes", **labels) >= 1
    assert value(samples, "kugetsu_memory_declared_bytes") == 200 * M
    assert value(samples, "kugetsu_max_memory_bytes") == 2 * 1024 * M
    kg.ok("cancel", "m")
    samples = wait_for(lambda: (s := scrape(url)) and value(s, "kugetsu_task_memory_bytes", **labels) is None and s,
                       10, "a task that ended to leave the page")
    assert value(samples, "kugetsu_memory_declared_bytes") == 0


async def test_the_dashboard_shows_declared_and_measured_memory(kg):
    import asyncio

    from dashboard_data import until

    from kugetsu.frontends.tui.app import make_app

    kg.config(max_memory="1G", resources={"mode": "sampling", "interval": "0.1s"})
    app = make_app(kg.home, cwd=str(kg.home.root.parent))
    async with app.run_test() as pilot:
        await asyncio.to_thread(kg.ok, "delegate", "m", "--memory", "300M", "--", *hog(kg, "m", 40, 30))
        await until(pilot, lambda: app.running.keys == ["1"], timeout=10, what="the task in Running")
        await until(pilot, lambda: "(peak " in str(app.output.border_title), timeout=10, what="its memory in the title")
        assert "of 300.0M" in str(app.output.border_title)
        await until(pilot, lambda: "memory 300.0M of 1.0G declared · using " in str(app.summary.render()), timeout=10,
                    what="the memory in the summary")
        await asyncio.to_thread(kg.ok, "cancel", "m")
        await until(pilot, lambda: "1" in app.finished.keys, timeout=10, what="the task in Finished")
        await until(pilot, lambda: "· peak " in str(app.output.border_title), timeout=10, what="its peak, once final")


@pytest.mark.skipif(not cgroups_here(), reason="needs root and cgroup v1 memory and pids controllers")
def test_cgroup_mode_counts_a_process_that_dropped_the_tasks_token(kg):
    """`env -i` clears the environment (the token with it): sampling cannot tell the process
    is the task's, its cgroup can."""
    kg.config(resources={"mode": "cgroup", "interval": "0.1s"})
    kg.ok("delegate", "m", "--memory", "300M", "--", "env", "-i", *hog(kg, "m", 40, 30))
    wait_for(lambda: grown(kg, "m") >= 40, 10, "the hog to grow")
    wait_for(lambda: (kg.task("m").get("rss") or 0) > 35 * M, 10, "its memory to be counted")
    kg.ok("cancel", "m")


@pytest.mark.skipif(not cgroups_here(), reason="needs root and cgroup v1 memory and pids controllers")
async def test_a_drain_sweeps_its_cgroups_once_a_second_not_at_each_end(kg, monkeypatch):
    """A sweep of finished runs' cgroups takes every live task's attempt (a copy of the queue:
    0.3 ms of each end of a 4-slot drain at 50,000 queued when each end swept): the ends of a
    drain share one a second (daemon.SWEEP_EVERY), and every cgroup still goes, the last ones
    as the service stops."""
    import asyncio

    from conftest import service_in_process, wait_for_async

    from kugetsu.service import daemon

    kg.config(max_agents=2, autostart=False, max_queue=50, resources={"mode": "cgroup"})
    names = [f"t{i}" for i in range(16)]
    await asyncio.to_thread(lambda: [kg.delegate(n, 0.1, 0, "--memory", "100M") for n in names])
    sweeps: list[float] = []
    real = usage.remove_finished
    monkeypatch.setattr(usage, "remove_finished", lambda *a: (sweeps.append(time.monotonic()), real(*a))[1])
    base = usage.cgroup_base(kg.home)
    assert base is not None
    async with service_in_process(kg.home):
        t0 = time.monotonic()
        await wait_for_async(lambda: len(kg.index()["finished"]) == len(names), 30, "the drain to be committed")
        took = time.monotonic() - t0
        # Stopped at once: the last ends' sweep, still due, is done as the service stops.
    assert not any(base.memory.glob("task-*")), "a run's cgroups left behind"
    during = [t for t in sweeps if t <= t0 + took]
    assert len(during) <= took / daemon.SWEEP_EVERY + 2, (len(during), took)  # each end swept: 12 in 1.0 s


# ---- the rule, pure ----------------------------------------------------------------------------


def test_over_limits_stops_with_the_reason_and_never_a_retry_for_its_last_runs_figures():
    from conftest import T0
    from kugetsu.core import admission, retries, step
    from kugetsu.config.model import Config
    from kugetsu.core.models import Index

    cfg = Config(kill_grace="5s")
    index = Index()
    task, _ = admission.admit(index, cfg, T0, admission.Request(cwd="/", command=["true"], memory=100 * M, max_procs=20,
                                                  retries=1))
    step.settle(index, cfg, T0)
    seen = step.Measured(task=task.id, memory=110 * M, peak=120 * M, cpu=1.5, procs=3)
    assert step.over_limits(index, cfg, T0, [seen]) == [task]
    assert task.reason == "memory limit 100.0M exceeded (peak 120.0M)" and task.peak_memory == 120 * M
    assert task.run.kill_at is not None and (task.run.kill_at - T0).total_seconds() == 5
    assert step.over_limits(index, cfg, T0, [seen]) == []  # once: it is being stopped
    retries.conclude(index, cfg, task, T0, 137)
    step.settle(index, cfg, T0)
    assert task.attempt == 2 and task.run.stop is None  # retried
    assert step.over_limits(index, cfg, T0, [seen]) == []  # a figure of its first run
    storm = step.Measured(task=task.id, memory=M, peak=M, cpu=0.1, procs=20, forks_refused=7, attempt=2)
    assert step.over_limits(index, cfg, T0, [storm]) == [task]
    assert task.reason == "process limit 20 exceeded (20 processes, 7 forks refused)"


def test_a_runs_measured_use_is_booked_when_it_ends_not_at_every_tick():
    """step.tick books what was measured of a running task on its record at the tick its run
    ends (before a retry starts its next attempt), not at each tick before (each would write
    the whole index); in a cluster, where the record is how the other machines see it, at
    every tick."""
    from conftest import T0
    from kugetsu.core import admission, step
    from kugetsu.config.model import Config
    from kugetsu.core.models import Index

    cfg = Config()
    index = Index()
    task, _ = admission.admit(index, cfg, T0, admission.Request(cwd="/", command=["true"], retries=1))
    step.settle(index, cfg, T0)
    task.run.pid = 4242
    seen = step.Measured(task=task.id, memory=10 * M, peak=30 * M, cpu=2.5, procs=1)
    step.tick(index, cfg, T0, step.Observations(measured=[seen]))
    assert (task.peak_memory, task.cpu_seconds) == (None, None)
    assert step.use_so_far(task, seen) == (30 * M, 2.5)  # what queue, status and stats show
    step.tick(index, cfg, T0, step.Observations(measured=[seen], exits=[step.Exit(task=task.id, code=1)]))
    assert task.attempt == 2  # retried (and started again), with its first run's figures
    assert (task.peak_memory, task.cpu_seconds) == (30 * M, 2.5)
    again = step.Measured(task=task.id, memory=40 * M, peak=40 * M, cpu=0.5, procs=1, attempt=2)
    step.over_limits(index, cfg, T0, [again])
    assert task.peak_memory == 30 * M
    step.over_limits(index, cfg, T0, [again], every=True)  # a cluster's
    assert (task.peak_memory, task.cpu_seconds) == (40 * M, 2.5)


def test_pressure_is_part_of_the_same_check():
    """The resource guard's readings fold into Board.fits: the guard holds every start, and a
    task that declares more memory than is available waits for it, by name."""
    from conftest import T0
    from kugetsu.core import admission, policy, selection
    from kugetsu.config.model import Config
    from kugetsu.core.models import Index

    G = 1024 * M
    import msgspec

    cfg = msgspec.convert({"max_memory": "100G", "resource_guard": {"min_available_memory": "100M"}}, Config)
    index = Index()
    big, _ = admission.admit(index, cfg, T0, admission.Request(cwd="/", command=["true"], memory=8 * G))
    small, _ = admission.admit(index, cfg, T0, admission.Request(cwd="/", command=["true"], memory=G))
    tight = policy.Resources(available_memory=4 * G, load_per_cpu=0.1)
    assert selection.plan_starts(index, cfg, T0, tight) == []  # the big one is next, and nothing passes it
    assert selection.waiting_for(index, cfg, T0, tight) == {big.id: "memory (4.0G available, it needs 8.0G)"}
    assert selection.waiting_for_one(index, cfg, T0, big, tight) == "memory (4.0G available, it needs 8.0G)"
    held = policy.Resources(available_memory=50 * M, load_per_cpu=0.1)
    assert selection.waiting_for(index, cfg, T0, held)[small.id].startswith("held: 50 MiB available")
    assert [t.id for t in selection.plan_starts(index, cfg, T0, policy.Resources(available_memory=20 * G))] == [big.id, small.id]


def test_cgroup_v2_delegated_subtree_is_found_and_written_as_v2_wants(tmp_path):
    """No cgroup v2 with memory and pids on these machines: the v2 paths are proved on a copy
    of its files (what the kernel shows and what kugetsu writes), the v1 path above for real."""
    home = Home(tmp_path / "home")
    root = tmp_path / "cgroup"  # a v2-only machine: the hierarchy at the root
    own = root / "system.slice" / "kugetsu.service"
    own.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (own / "cgroup.subtree_control").write_text("memory pids\n")
    base = usage.cgroup_base(home, root, own="0::/system.slice/kugetsu.service\n")
    assert base is not None and base.v2 and base.memory == base.pids == own / f"kugetsu-{home.key}"
    base.memory.mkdir()
    (base.memory / "cgroup.subtree_control").write_text("")
    groups = usage.make_groups(base, 7, 2, 64 * M, 20)
    assert (base.memory / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (groups.memory / "memory.max").read_text() == str(64 * M)
    assert (groups.memory / "memory.swap.max").read_text() == "0"
    assert (groups.pids / "pids.max").read_text() == "20"
    assert groups.procs_files() == f"{groups.memory}/cgroup.procs"  # one hierarchy: joined once
    (groups.memory / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    (groups.memory / "pids.events").write_text("max 3\n")
    (groups.memory / "memory.peak").write_text(str(65 * M))
    assert groups.read() == (1, 3, 65 * M)
    assert usage.groups_of(base, 7, 2) == groups
    for f in groups.memory.iterdir():
        f.unlink()
    assert usage.remove_finished(base, {}, 8) == 0 and not groups.memory.exists()
    # Not delegated (memory and pids not enabled for its children): no cgroup mode.
    (own / "cgroup.subtree_control").write_text("cpu\n")
    assert usage.cgroup_base(home, root, own="0::/system.slice/kugetsu.service\n") is None
    # A hybrid machine: v1 controllers first, v2 under `unified` otherwise.
    hybrid = tmp_path / "hybrid"
    (hybrid / "unified" / "me").mkdir(parents=True)
    (hybrid / "unified" / "cgroup.controllers").write_text("memory pids\n")
    (hybrid / "unified" / "me" / "cgroup.subtree_control").write_text("memory pids\n")
    found = usage.cgroup_base(home, hybrid, own="4:memory:/x\n0::/me\n")  # v1 memory, but no v1 pids
    assert found is not None and found.v2 and found.memory.parent == hybrid / "unified" / "me"


def test_finished_runs_cgroups_go_and_the_queues_attempts_are_looked_at_only_when_asked(tmp_path):
    """remove_finished keeps a running task's cgroup and a queued one's of its attempt now, and
    removes one of an earlier attempt or of a task no longer live; the queued tasks' attempts
    (usage.Attempts) are taken only when a cgroup of a task that is not running is there (at
    50,000 queued, a dict built at every look kept ~5 MB of the service's RSS)."""
    base = usage.Base(memory=tmp_path / "kg", pids=tmp_path / "kg", v2=True)
    queued = [Task(id=5, name="five", command=["true"], cwd="/", created_at=T0),
              Task(id=6, name="six", command=["true"], cwd="/", created_at=T0, attempt=2)]
    (base.memory / "task-7-1").mkdir(parents=True)
    attempts = usage.Attempts(list(queued))
    assert usage.remove_finished(base, ChainMap({7: 1}, attempts), 10) == 0
    assert attempts._lists is None and (base.memory / "task-7-1").exists()  # the running task's: kept, nothing taken
    for name in ("task-5-1", "task-6-1", "task-6-2", "task-9-1"):
        (base.memory / name).mkdir()
    assert usage.remove_finished(base, ChainMap({7: 1}, attempts), 10) == 0
    assert sorted(p.name for p in base.memory.iterdir()) == ["task-5-1", "task-6-2", "task-7-1"]
    assert dict(attempts) == {5: 1, 6: 2} and len(attempts) == 2


# ---- cluster mode ------------------------------------------------------------------------------


def test_each_machine_of_a_cluster_admits_by_its_own_memory_and_stops_its_tasks_over_their_limit(machines):
    """Issue 29 in cluster mode: max_memory is each machine's own (a task that no longer fits
    on one starts on the other; one that fits on neither waits, saying so), a task over its
    limit is stopped by the machine that runs it, and every machine reads its reason and peak."""
    a, b = machines("m1", slots=2), machines("m2", slots=2)
    a.ok("config", "set", "max_agents", "4")
    a.ok("config", "set", "resources", '{"mode": "sampling", "interval": "0.1s"}')
    for k in (a, b):
        k.ok("config", "set", "max_memory", "200M")
    gate = a.rec.parent / "gate"
    a.ok("delegate", "one", "--memory", "150M", "--host", "m1", "--", *a.agent("one", 0, 0, gate))
    a.wait_state("one", "running", timeout=20)
    a.ok("delegate", "two", "--memory", "150M", "--", *a.agent("two", 0, 0, gate))
    assert a.wait_state("two", "running", timeout=20)["host"] == "m2"  # m1's 200M hold one of them
    a.ok("delegate", "three", "--memory", "150M", "--", *a.agent("three", 0, 0, gate))
    [queued] = b.json("queue")["queued"]
    assert queued["name"] == "three" and queued["waiting_for"].startswith("memory ("), queued
    gate.touch()
    a.wait_state("three", "succeeded", timeout=30)
    b.ok("delegate", "hog", "--memory", "60M", "--host", "m2", "--", *hog(b, "hog", 200))
    t = a.wait_state("hog", "failed", timeout=30)
    assert t["host"] == "m2" and t["reason"].startswith("memory limit 60.0M exceeded (peak "), t["reason"]
    assert t["peak_memory"] >= 60 * M and grown(b, "hog") < 200


def test_the_sweeps_attempts_are_each_live_tasks_own():
    """usage.Attempts, the sweep's `live` (two lists, not a dict of the whole queue): a task's
    attempt by its id, None for a task that is not live, as a dict of them answers."""
    ids, attempts = [7, 3, 12], [1, 2, 1]
    live = usage.Attempts([Task(id=i, name=f"t{i}", command=["true"], cwd="/", created_at=T0, attempt=a)
                           for i, a in zip(ids, attempts)])
    assert {i: live.get(i) for i in (3, 7, 12, 5)} == {3: 2, 7: 1, 12: 1, 5: None}
    assert dict(live) == dict(zip(ids, attempts)) and len(live) == 3


def test_a_measurement_interval_under_the_floor_names_a_floor_that_is_accepted(kg):
    """The error says what to write instead, in a form the config reads (it said `50ms`, which
    is not a duration kugetsu reads)."""
    kg.config(resources={"interval": "0.01"})
    r = kg.run("capacity")
    assert r.returncode == 2 and "resources.interval" in r.stderr and "Traceback" not in r.stderr, r.stderr
    floor = re.search(r"at least (\S+)", r.stderr).group(1)
    kg.config(resources={"interval": floor})
    kg.ok("capacity")
