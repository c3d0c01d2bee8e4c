"""Everything that happens at a time (queue expiry, run timeout, SIGKILL after kill_grace)
happens at that time, whatever came before it: a burst of expiries, a SIGKILL. Real
service, real CLI, real agents; lateness is measured with kugetsu's own timestamps
(events.jsonl, the tasks' expires_at and started_at) and the agents' own clocks, never
with the test's polling."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from conftest import wait_for

# The service aims at a few ms (tools/bench/deadlines.py measures it); this bound holds on a
# loaded 2-core machine and is still far under the 5 s reconcile a lost deadline waits for.
LATE = 0.5


def _t(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _stubborn(kg, name: str) -> list[str]:
    """An agent that records the SIGTERM it gets and keeps running: only SIGKILL ends it."""
    script = ('trap \'echo "term $(date +%s.%N)" >> "$0"\' TERM; echo "start $(date +%s.%N)" >> "$0"; '
              "while :; do sleep 60 & wait; done")  # the group's SIGTERM ends the sleep, not the loop
    return ["sh", "-c", script, str(kg.rec / name)]


def _polite(kg, name: str) -> list[str]:
    """An agent that records the SIGTERM it gets, then exits."""
    script = ('trap \'echo "term $(date +%s.%N)" >> "$0"; exit 143\' TERM; echo "start $(date +%s.%N)" >> "$0"; '
              "sleep 60 & wait")
    return ["sh", "-c", script, str(kg.rec / name)]


def _finished(kg) -> dict[str, dict]:
    return {t["name"]: t for t in kg.index()["finished"]}


def test_expiries_timeouts_and_kills_fire_on_time_after_a_burst_and_a_sigkill(kg):
    # Group q (one slot) holds the queue; the timed agents run beside it in the other slots.
    kg.config(max_agents=3, kill_grace="1s", max_queue=100, groups={"q": {"max_agents": 1}})
    hold = kg.rec / "hold.go"
    kg.delegate("hold", 0, 0, "--group", "q", gate=hold)
    burst = [f"b{i}" for i in range(32)]
    with ThreadPoolExecutor(8) as pool:  # 32 expiries packed as tightly as admission allows
        list(pool.map(lambda n: kg.ok("delegate", n, "--group", "q", "--expire-after", "2s", "--", "true"), burst))
    # Ignores SIGTERM: the run timeout (1 s) and then SIGKILL after kill_grace (1 s) end it.
    kg.ok("delegate", "stubborn", "--timeout", "1s", "--", *_stubborn(kg, "stubborn"))
    late = [f"late{i}" for i in range(3)]
    for i, name in enumerate(late):  # all due after the SIGKILL
        kg.ok("delegate", name, "--group", "q", "--expire-after", f"{3 + i}s", "--", "true")
    # Waiting reads the index (no CLI process per look: the machine's load is part of the test).
    wait_for(lambda: "stubborn" in _finished(kg), 20, "the SIGKILL of stubborn")
    kg.ok("delegate", "timed", "--timeout", "2s", "--", *_polite(kg, "timed"))
    wait_for(lambda: {*burst, *late, "timed"} <= set(_finished(kg)), 20, "the expiries and the timeout")
    tasks = _finished(kg)
    assert {tasks[n]["state"] for n in burst + late} == {"expired"}
    timed, stubborn = tasks["timed"], tasks["stubborn"]
    assert timed["state"] == stubborn["state"] == "failed"
    assert "timed out after 2s" in timed["reason"] and "timed out after 1s" in stubborn["reason"]

    # The index is committed before its events are appended (the outbox): wait for them too.
    wait_for(lambda: {*burst, *late} <= {e["name"] for e in kg.events("expired")}, 10, "the expired events")
    expired = {e["name"]: _t(e["at"]) for e in kg.events("expired")}
    lateness = {n: expired[n] - _t(tasks[n]["expires_at"]) for n in burst + late}
    worst = sorted(lateness.items(), key=lambda kv: -kv[1])[:5]
    assert all(0 <= v <= LATE for v in lateness.values()), f"expiries late by (s): {worst}"

    due_term = _t(stubborn["started_at"]) + 1
    term = kg.times("stubborn")["term"]
    assert 0 <= term - due_term <= LATE, f"SIGTERM {term - due_term:.3f}s after the timeout"
    final = next(e for e in kg.events("failed") if e["name"] == "stubborn")
    assert 0 <= _t(final["at"]) - (due_term + 1) <= LATE, f"SIGKILL {_t(final['at']) - due_term - 1:.3f}s late"

    due = _t(timed["started_at"]) + 2
    term = kg.times("timed")["term"]
    assert 0 <= term - due <= LATE, f"the 2s timeout stopped the agent {term - due + 2:.3f}s after its start"
    hold.touch()
    kg.wait_state("hold", "succeeded")


async def test_a_deadline_its_own_tick_sets_already_due_still_fires():
    """The way APScheduler dropped the deadline before (README, "Design decisions"): the tick
    a deadline job runs sets the next deadline, already due. A date job leaves the store when
    submitted and counts as running until its done-callback: re-added from inside, it is
    refused (max_instances) and dropped. deadlines.DeadlineTimer arms it from the listener
    instead, so every one fires, each within a few ms, on the real AsyncIOScheduler."""
    import asyncio
    import time
    from datetime import timedelta, timezone

    from kugetsu.service.deadlines import DeadlineTimer, new_scheduler

    scheduler = new_scheduler()
    scheduler.start()
    fired: list[tuple[float, float]] = []  # (when it was due, when it fired)
    due_at: list[datetime] = []

    def on_due() -> None:
        fired.append((due_at[-1].timestamp(), time.time()))
        if len(fired) < 20:  # the next deadline, set by the tick and already due (two in one tick)
            due_at.append(datetime.now(timezone.utc) - timedelta(milliseconds=1))
            timer.set(due_at[-1])

    timer = DeadlineTimer(scheduler, on_due)
    due_at.append(datetime.now(timezone.utc) + timedelta(milliseconds=50))
    timer.set(due_at[-1])
    deadline = time.monotonic() + 5
    while len(fired) < 20 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    scheduler.shutdown(wait=False)
    assert len(fired) == 20, f"only {len(fired)} of 20 deadlines fired"
    assert max(at - due for due, at in fired) < LATE


async def test_a_deadline_later_than_apschedulers_default_grace_still_fires():
    """A deadline that comes while the loop is busy (here blocked for 1.5 s; a suspended
    machine alike) fires as soon as the loop is back: APScheduler's default
    misfire_grace_time (1 s) would drop it in silence, and the task would wait for the 5 s
    reconcile. deadlines.JOB_DEFAULTS has no grace (docs/scheduling.md)."""
    import asyncio
    import time
    from datetime import timedelta, timezone

    from kugetsu.service.deadlines import DeadlineTimer, new_scheduler

    scheduler = new_scheduler()
    scheduler.start()
    fired: list[float] = []
    timer = DeadlineTimer(scheduler, lambda: fired.append(time.time()))
    timer.set(datetime.now(timezone.utc) + timedelta(milliseconds=100))
    await asyncio.sleep(0)
    time.sleep(1.5)  # the loop is blocked past the deadline and past a 1 s grace
    back = time.time()
    deadline = time.monotonic() + 2
    while not fired and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    scheduler.shutdown(wait=False)
    assert fired and fired[0] - back < LATE, "the late deadline was dropped"


def test_what_the_first_tick_asks_for_is_armed_though_the_scheduler_starts_after_it(kg):
    """The service starts APScheduler after its first tick (its import is not paid before the
    first agent starts): the deadlines that tick found still fire on time, not at the 5 s
    reconcile. Queued while no service ran: an expiry behind a running task (group q, one
    slot), and a start time (the other slot)."""
    kg.config(autostart=False, max_agents=2, groups={"q": {"max_agents": 1}})
    hold = kg.rec / "hold.go"
    kg.delegate("hold", 0, 0, "--group", "q", gate=hold)
    kg.ok("delegate", "expiring", "--group", "q", "--expire-after", "2s", "--", "true")
    kg.delegate("later", 0, 0, "--delay", "2s")
    kg.ok("serve", "--detach")
    wait_for(lambda: "expiring" in _finished(kg) and "later" in _finished(kg), 10, "the expiry and the start")
    wait_for(lambda: "expiring" in {e["name"] for e in kg.events("expired")}, 10, "the expired event")
    expired = next(e for e in kg.events("expired") if e["name"] == "expiring")
    late = _t(expired["at"]) - _t(_finished(kg)["expiring"]["expires_at"])
    assert 0 <= late <= LATE, f"the expiry came {late:.3f}s late"
    later = _finished(kg)["later"]
    late = kg.times("later")["start"] - _t(later["not_before"])
    assert 0 <= late <= LATE, f"the delayed task started {late:.3f}s late"
    hold.touch()
    kg.wait_state("hold", "succeeded")


async def test_the_schedulers_import_holds_back_no_promotion(kg, monkeypatch):
    """APScheduler is imported after the first tick, in a worker thread: the agents that tick
    started end and their successors start meanwhile. In the loop it held the first promotions
    back 40-60 ms (a drain begun as the service came up ran at half its pace). Made slow here
    (3 s), the whole drain is over before the import is."""
    import asyncio
    import importlib.abc
    import importlib.machinery
    import sys
    import time

    from conftest import service_in_process, wait_for_async

    name = "kugetsu.service.deadlines"
    imported: list[float] = []

    class Slow(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            real = spec.loader

            class Loader(importlib.abc.Loader):
                def create_module(self, spec):
                    return None

                def exec_module(self, module):
                    time.sleep(3)
                    real.exec_module(module)
                    imported.append(time.time())

            spec.loader = Loader()
            return spec

    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [Slow(), *sys.meta_path])
    kg.config(max_agents=1, autostart=False)
    names = [f"t{i}" for i in range(4)]
    await asyncio.to_thread(lambda: [kg.delegate(n, 0) for n in names])
    async with service_in_process(kg.home):
        await wait_for_async(lambda: all("end" in kg.times(n) for n in names), 30, "the drain")
        await wait_for_async(lambda: imported, 30, "the scheduler's import")
    ends = [kg.times(n)["end"] for n in names]
    assert max(ends) < imported[0], (ends, imported)
