"""The warm wrapper (position 1's wrapper started ahead, waiting on a pipe) and the
adoption of a wrapper that a crash left unrecorded: real service, real processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from datetime import datetime, timedelta, timezone

from conftest import agent_wrappers, service_in_process, wait_for, wait_for_async  # noqa: F401

from kugetsu.core import selection, step

from kugetsu.service import processes, runner


def _warm_for(kg, task_id):
    """pids of this home's living wrappers of task `task_id`."""
    found = kg.wrappers().get(task_id)
    return [found[0]] if found else []


def _next_waits_warm_behind_a_gated_blocker(kg):
    """One slot, held by `blocker` until the returned gate file exists; `next` (#2) is at
    position 1 and its wrapper is started and waiting."""
    kg.config(max_agents=1)
    gate = kg.rec / "go"
    kg.delegate("blocker", 0, gate=gate)
    kg.delegate("next", 0)
    wait_for(lambda: _warm_for(kg, 2), what="a warm wrapper for position 1")
    return gate


def test_position_one_waits_warm_and_never_runs_before_its_turn(kg):
    gate = _next_waits_warm_behind_a_gated_blocker(kg)
    assert kg.times("next") == {}  # started ahead, but its agent has not run
    assert kg.task("next")["state"] == "queued"
    gate.touch()
    t = kg.wait_state("next", "succeeded")
    assert t["pid"] is not None and set(kg.times("next")) == {"start", "end"}
    assert kg.times("next")["start"] >= kg.times("blocker")["end"]


def test_a_task_let_go_warm_records_its_wrappers_start_time(kg):
    """A warm wrapper's start time is read as it is let go (runner.start_of), not as it is
    spawned: the running task's record still names its process by pid and start time, which
    is what a restarted service trusts it by."""
    gate = _next_waits_warm_behind_a_gated_blocker(kg)
    kg.ok("delegate", "third", "--", *kg.agent("third", 0, gate=kg.rec / "go3"))
    wait_for(lambda: 3 in kg.wrappers(), what="third's wrapper, warm")
    gate.touch()  # next ends at once: third is let go early, as the successor
    running = wait_for(lambda: [t for t in kg.index()["active"] if t["name"] == "third"], what="third to run")[0]
    assert running["pid_start"] is not None and runner.process_start(running["pid"]) == running["pid_start"]
    (kg.rec / "go3").touch()
    kg.wait_state("third", "succeeded")


def test_every_queued_task_waits_warm_and_they_run_in_order_once_each(kg):
    gate = _next_waits_warm_behind_a_gated_blocker(kg)
    kg.delegate("third", 0)
    kg.delegate("fourth", 0)
    wait_for(lambda: set(kg.wrappers()) == {1, 2, 3, 4}, what="wrappers for the whole queue")
    assert all(kg.times(n) == {} for n in ("next", "third", "fourth"))  # started ahead, none has run
    gate.touch()
    for name in ("next", "third", "fourth"):
        kg.wait_state(name, "succeeded")
    starts = [kg.times(n)["start"] for n in ("blocker", "next", "third", "fourth")]
    ends = [kg.times(n)["end"] for n in ("blocker", "next", "third", "fourth")]
    assert starts == sorted(starts) and all(s >= e for s, e in zip(starts[1:], ends))  # one at a time, FIFO
    assert all((kg.rec / n).read_text().count("start") == 1 for n in ("next", "third", "fourth"))


async def test_only_the_first_warm_ahead_tasks_wait_warm(kg, monkeypatch):
    kg.config(max_agents=1, autostart=False)
    gate = kg.rec / "go"
    await asyncio.to_thread(kg.delegate, "blocker", 0, gate=gate)
    for name in ("a", "b", "c", "d"):
        await asyncio.to_thread(kg.delegate, name, 0)
    monkeypatch.setattr(processes, "WARM_AHEAD", 2)
    async with service_in_process(kg.home):
        await wait_for_async(lambda: set(kg.wrappers()) == {1, 2, 3}, what="blocker running, a and b warm")
        await asyncio.to_thread(kg.ok, "cancel", "a")  # c moves up: it is warmed, a's wrapper goes
        await wait_for_async(lambda: set(kg.wrappers()) == {1, 3, 4}, what="b and c warm, a's wrapper gone")
        gate.touch()
        await wait_for_async(lambda: len(kg.index()["finished"]) == 5, what="the queue to drain")
    assert kg.times("a") == {} and all(kg.times(n) for n in ("b", "c", "d"))


async def _quick_runs_then_a_blocker_and(kg, names: tuple[str, ...]):
    """Runs to go by for selection.warm_ahead's pace (PACE_LEAST agents that end at once, #1-#5),
    then one slot held by `blocker` (#6) until the returned gate file exists, `names` queued
    behind it."""
    gate = kg.rec / "go"
    for i in range(selection.PACE_LEAST):
        await asyncio.to_thread(kg.delegate, f"quick{i}", 0)
        await wait_for_async(lambda: kg.task(f"quick{i}")["state"] == "succeeded", what=f"quick{i} to end")
    await asyncio.to_thread(kg.delegate, "blocker", 0, gate=gate)
    for name in names:
        await asyncio.to_thread(kg.delegate, name, 0)
    return gate


async def test_behind_agents_slower_than_the_window_only_the_next_promotion_waits_warm(kg, monkeypatch):
    """Runs long against WARM_WINDOW (minutes against 30 s, in real use): one wrapper a slot
    waits, not one per queued task (issue 31); each promotion warms the next, in order, once."""
    kg.config(max_agents=1, autostart=False)
    monkeypatch.setattr(processes, "WARM_WINDOW", 0.0001)
    async with service_in_process(kg.home):
        gate = await _quick_runs_then_a_blocker_and(kg, ("a", "b", "c"))
        await wait_for_async(lambda: set(kg.wrappers()) == {6, 7}, what="the blocker and a's wrapper alone")
        assert all(kg.times(n) == {} for n in ("a", "b", "c"))  # none has run
        gate.touch()
        await wait_for_async(lambda: len(kg.index()["finished"]) == 9, what="the queue to drain")
    starts = [kg.times(n)["start"] for n in ("blocker", "a", "b", "c")]
    ends = [kg.times(n)["end"] for n in ("blocker", "a", "b", "c")]
    assert starts == sorted(starts) and all(s >= e for s, e in zip(starts[1:], ends))  # one at a time, FIFO
    assert all((kg.rec / n).read_text().count("start") == 1 for n in ("a", "b", "c"))


async def test_behind_quick_agents_the_next_ones_wait_warm_until_the_pace_slows(kg, monkeypatch):
    """Runs quick against WARM_WINDOW: the next WARM_AHEAD wait warm, for a drain; once the
    runs are slow against it, one a slot again."""
    kg.config(max_agents=1, autostart=False)
    monkeypatch.setattr(processes, "WARM_AHEAD", 3)
    async with service_in_process(kg.home):
        gate = await _quick_runs_then_a_blocker_and(kg, ("a", "b", "c", "d"))
        await wait_for_async(lambda: set(kg.wrappers()) == {6, 7, 8, 9}, what="the blocker, a, b and c warm")
        monkeypatch.setattr(processes, "WARM_WINDOW", 0.0001)  # the pace, against it, is slow now
        await asyncio.to_thread(kg.delegate, "e", 0)  # a tick
        await wait_for_async(lambda: set(kg.wrappers()) == {6, 7}, what="the blocker and a's wrapper alone")
        gate.touch()
        await wait_for_async(lambda: len(kg.index()["finished"]) == 11, what="the queue to drain")
    assert all((kg.rec / n).read_text().count("start") == 1 for n in ("a", "b", "c", "d", "e"))


def test_cancelled_warm_task_leaves_no_process(kg):
    kg.config(max_agents=1)
    kg.delegate("blocker", 30)
    kg.delegate("next", 0)
    warm = wait_for(lambda: _warm_for(kg, 2), what="a warm wrapper")
    kg.ok("cancel", "next")
    wait_for(lambda: not _warm_for(kg, 2), timeout=5, what="the warm wrapper to exit")
    assert kg.times("next") == {} and not kg.home.exit_file(2).exists()
    assert kg.task("next")["state"] == "cancelled"
    assert warm[0] not in agent_wrappers(kg.home)


def test_warm_wrapper_of_a_killed_service_exits_and_the_task_runs_once(kg):
    gate = _next_waits_warm_behind_a_gated_blocker(kg)
    os.kill(kg.service_pid(), signal.SIGKILL)
    wait_for(lambda: not _warm_for(kg, 2), timeout=5, what="the orphaned warm wrapper to exit")
    assert kg.times("next") == {}
    gate.touch()
    kg.ok("queue")  # brings the service back
    kg.wait_state("next", "succeeded")
    assert (kg.rec / "next").read_text().count("start") == 1


def test_a_wrapper_started_but_not_recorded_is_adopted_not_run_twice(kg):
    """A crash between starting a queued task's wrapper and committing: the restarted
    service finds the wrapper running its agent and gives it the task."""
    kg.config(max_agents=1, autostart=False)
    go = kg.rec / "go"  # the agent runs until the restarted service has adopted it
    kg.delegate("lost-write", 0, gate=go)
    assert kg.task("lost-write")["state"] == "running"  # the CLI gave it the slot; no service yet
    index = kg.index()
    task = index["active"][0]
    # What a service that died right after spawning would leave: a wrapper, and no pid recorded.
    spawned, t = _unrecorded_wrapper_then_a_service(kg, task, go)
    assert t["pid"] == spawned.pid
    assert (kg.rec / "lost-write").read_text().count("start") == 1


def _unrecorded_wrapper_then_a_service(kg, task: dict, go):
    """Start `task`'s wrapper by hand (as a service that died before recording it would
    have), start a service, and let the agent end once the service has adopted it.
    Returns the wrapper and the task as it finished."""
    spawned = runner.spawn(kg.home, task["id"], task["name"], task["command"], task["cwd"], {}, token=task["token"])
    wait_for(lambda: kg.times(task["name"]), what=f"{task['name']}'s agent to start")
    kg.ok("serve", "--detach")
    wait_for(lambda: kg.task(task["name"])["pid"] == spawned.pid, what="the service to adopt the wrapper")
    go.touch()
    finished = kg.wait_state(task["name"], "succeeded")
    spawned.popen.wait()
    return spawned, finished


def test_a_queued_task_whose_wrapper_ran_is_adopted(kg):
    """The same crash when the index still says queued (the service had not committed the
    start): the wrapper's agent is adopted, not started a second time."""
    kg.config(max_agents=1, autostart=False, max_queue=5)
    kg.delegate("holder", 0)  # takes the slot in the index; its process never starts (no service)
    go = kg.rec / "go"  # the agent runs until the restarted service has adopted it
    kg.delegate("second", 0, gate=go)
    queued = kg.index()["queued"][0]
    assert queued["name"] == "second"
    holder = kg.index()["active"][0]
    # The dead service had finished `holder` and started `second` but committed neither.
    h = runner.spawn(kg.home, holder["id"], holder["name"], holder["command"], holder["cwd"], {}, token=holder["token"])
    h.popen.wait()
    s, t = _unrecorded_wrapper_then_a_service(kg, queued, go)
    assert t["pid"] == s.pid and (kg.rec / "second").read_text().count("start") == 1
    holder = kg.task("holder")
    # It left no process for the service to record, only its exit status: booked, and said.
    assert holder["state"] == "succeeded" and holder["pid"] is None and holder["exit_code"] == 0
    assert f"task #{holder['id']} started before a crash and ended with exit status 0: booked" in kg.home.service_log.read_text()


async def test_a_task_let_go_early_but_not_started_by_pm_is_recorded_not_run_twice(kg, monkeypatch, caplog):
    """At an agent's exit the service lets selection.successor's warm wrapper go before its
    transaction. Should that transaction not start the task (a broken promise, forced here
    by skipping the exit's settle), the agent already running is recorded as the task's
    run: it is never started a second time. The service runs in this process."""
    kg.config(max_agents=1, autostart=False)
    gate = kg.rec / "go"
    await asyncio.to_thread(kg.delegate, "blocker", 0, gate=gate)
    await asyncio.to_thread(kg.delegate, "next", 0)
    async with service_in_process(kg.home):
        await wait_for_async(lambda: 2 in kg.wrappers(), what="blocker running and next warm")
        warm_pid = kg.wrappers()[2][0]
        real_settle, skipped = step.settle, []

        def settle_but_not_at_the_exit(index, cfg, now, resources=None, here=None, look=None):
            if any(t.name == "blocker" for t in index.finished) and not skipped:
                skipped.append(now)
                return step.Plan()
            return real_settle(index, cfg, now, resources, here, look)

        monkeypatch.setattr(step, "settle", settle_but_not_at_the_exit)
        caplog.set_level(logging.ERROR, logger="kugetsu.service")
        gate.touch()
        done = await wait_for_async(lambda: [t for t in kg.index()["finished"] if t["name"] == "next"], what="next to finish")
    assert skipped, "the exit's transaction did not run"
    assert done[0]["state"] == "succeeded" and done[0]["pid"] == warm_pid
    assert (kg.rec / "next").read_text().count("start") == 1
    assert [e["task"] for e in kg.events("started")].count(2) == 1
    assert "let go early but not picked" in caplog.text


def test_an_exit_is_not_kept_waiting_while_a_hundred_wrappers_are_warmed(kg):
    """A service that finds a deep queue (a start, a burst of delegations) warms the next
    WARM_AHEAD wrappers, ~1.5 ms of fork and exec each: spawned in one go they held the
    loop for 100 spawns (150-200 ms here), and an agent that ended meanwhile waited that
    long for its successor. Now those of the next promotions are spawned at once and the
    rest once the loop is idle (processes.WARM_NOW, WARM_IDLE): the successor starts after a
    few. #2 counts the service's children as it starts: the wrappers warmed by then."""
    from kugetsu.core.models import Index, Task
    from kugetsu.store.protocol import encode_index

    kg.config(max_agents=1, max_queue=200, autostart=False)
    kg.home.root.mkdir(mode=0o700, exist_ok=True)
    count = kg.rec / "children"
    # The agent's parent is its wrapper, whose parent is the service.
    counter = ('svc=$(cut -d" " -f4 /proc/$PPID/stat); cat /proc/$svc/task/*/children | wc -w > "$0"; '
               'echo "start $(date +%s.%N)" >> "$1"')
    now = datetime.now(timezone.utc)
    index = Index(next_id=101)
    for i in range(1, 101):
        argv = (kg.agent("first") if i == 1 else ["sh", "-c", counter, str(count), str(kg.rec / "second")] if i == 2
                else ["true"])
        index.queued.append(Task(id=i, name=f"t{i}", command=argv, cwd="/", created_at=now, token=runner.new_token(),
                                 expires_at=now + timedelta(hours=1)))
    kg.home.index.write_bytes(encode_index(index))
    kg.ok("serve", "--detach")
    wait_for(lambda: count.exists() and count.read_text().strip(), timeout=30, what="#2 to start")
    assert kg.times("first") and int(count.read_text()) < 50
    wait_for(lambda: len(kg.index()["finished"]) == 100, timeout=60, what="the queue to drain")
