"""Cluster mode under fire, on a real PostgreSQL with real services and agents: clients on
three machines delegate and cancel while services are killed -9 and restarted, and the
database goes away mid-drain. Seeded (printed; KUGETSU_TORTURE_SEED replays);
KUGETSU_TORTURE=long runs longer."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from conftest import Kugetsu, agent_wrappers, wait_for
from kugetsu.core.models import task_record
from tcpproxy import Proxy
from test_cluster import Machine, machines, overlap  # noqa: F401  (machines is a fixture)

LONG = os.environ.get("KUGETSU_TORTURE") == "long"
pytestmark = pytest.mark.torture


def _starts(k: Kugetsu, name: str) -> int:
    try:
        return sum(1 for line in (k.rec / name).read_text().splitlines() if line.startswith("start"))
    except FileNotFoundError:
        return 0


def _check(k: Kugetsu, tasks: dict[str, dict], max_agents: int, slots: dict[str, int]) -> None:
    """Nothing ran twice, limits held on the agents' own clocks, each machine within its slots."""
    spans: dict[str, tuple[float, float]] = {}
    for name, task in tasks.items():
        runs = _starts(k, name)
        assert runs <= 1, f"{name} ran {runs} times"
        times = k.times(name)
        if "start" in times:
            # An agent killed by a cancel writes no end stamp: it was gone by the time kugetsu
            # made the task final (its processes ended first). Only one still running ends now.
            gone = task["finished_at"] and datetime.fromisoformat(task["finished_at"].replace("Z", "+00:00")).timestamp()
            spans[name] = (times["start"], times.get("end", gone or time.time()))
        if task["state"] == "succeeded":
            assert runs == 1 and "end" in times, name
    assert overlap(list(spans.values())) <= max_agents
    for host, n in slots.items():
        mine = [spans[t] for t, task in tasks.items() if task.get("host") == host and t in spans]
        assert overlap(mine) <= n, f"{host} ran more than {n} at once"


def _final(k: Kugetsu, names: set[str], timeout: float) -> dict[str, dict]:
    """Every task, once all of `names` are final (read from the database: `queue --all` shows
    the latest 20 finished only)."""
    import json

    import msgspec

    from kugetsu.store.postgres import PgStore

    store = PgStore(json.loads(k.home.config.read_text())["store"])

    def tasks() -> dict[str, dict]:
        index = store.read()
        return {t.name: task_record(msgspec.to_builtins(t)) for t in index.all_tasks()}

    def done() -> dict[str, dict] | None:
        now = tasks()
        return now if all(n in now and now[n]["state"] not in ("queued", "running") for n in names) else None

    try:
        return wait_for(done, timeout, "every task to be final")  # type: ignore[return-value]
    except AssertionError:
        now = tasks()
        live = [(n, now[n]["state"], now[n].get("host")) for n in names if n in now and now[n]["state"] in ("queued", "running")]
        import psycopg

        with psycopg.connect(store.url, autocommit=True) as db:  # who holds what in the database
            activity = db.execute(
                "SELECT pid, application_name, state, wait_event_type, now() - xact_start, left(query, 80)"
                " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchall()
        stacks = [f"pg_stat_activity: {activity}"]
        for home in sorted(k.home.root.parent.iterdir()):  # what each service is doing (faulthandler)
            try:
                pid = int((home / "service.pid").read_text())
                os.kill(pid, signal.SIGUSR1)
                time.sleep(0.5)
                stacks.append(f"--- {home.name}\n" + (home / "service.log").read_text()[-6000:])
            except (OSError, ValueError):
                continue
        raise AssertionError(f"not final: {live}; unknown: {sorted(names - set(now))}; hosts: {k.json('hosts')}\n"
                             + "\n".join(stacks)) from None
    finally:
        store.close()


def test_clients_on_three_machines_while_services_are_killed_and_restarted(machines: Machine):
    seed = int(os.environ.get("KUGETSU_TORTURE_SEED") or random.randrange(1 << 30))
    print(f"KUGETSU_TORTURE_SEED={seed}")
    rng = random.Random(seed)
    slots = {"m1": 2, "m2": 2, "m3": 1}
    ms = [machines(name, slots=n) for name, n in slots.items()]
    ms[0].ok("config", "set", "max_agents", "4")
    ms[0].ok("config", "set", "history_limit", "1000")
    clients, per_client = (20, 8) if LONG else (6, 4)
    names: set[str] = set()
    cancelled: set[str] = set()
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[str] = []

    def client(i: int) -> None:
        r = random.Random(seed + i)
        mine: list[str] = []
        for j in range(per_client):
            k = r.choice(ms)
            name = f"c{i}-{j}"
            res = k.run("delegate", name, "--", *k.agent(name, r.choice([0.05, 0.2, 0.5])))
            if res.returncode != 0:
                errors.append(f"{name}: {res.returncode} {res.stderr}")
                continue
            with lock:
                names.add(name)
            mine.append(name)
            if r.random() < 0.2:
                victim = r.choice(mine)
                res = r.choice(ms).run("cancel", victim)
                if res.returncode == 0:
                    with lock:
                        cancelled.add(victim)

    def chaos() -> None:
        while not stop.wait(rng.uniform(0.5, 1.5)):
            k = rng.choice(ms)
            pid = k.service_pid()
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                wait_for(lambda: not k.home.service_pid.exists() or k.service_pid() != pid or True, 1)
            k.run("serve", "--detach")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    killer = threading.Thread(target=chaos)
    killer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    killer.join()
    for k in ms:  # every machine has its service again
        k.run("serve", "--detach")
    assert not errors, errors
    tasks = _final(ms[0], names, 120 if LONG else 60)
    states = Counter(t["state"] for t in tasks.values())
    assert states["lost"] == 0 and states["failed"] == 0, (states, [t for t in tasks.values() if t["state"] in ("lost", "failed")])
    assert {n for n, t in tasks.items() if t["state"] == "cancelled"} <= cancelled
    _check(ms[0], tasks, 4, slots)


def test_the_database_going_away_mid_drain_loses_nothing_and_runs_nothing_twice(machines: Machine, pg_url: str):
    """Services reach the database through a proxy the test cuts: connections reset and new
    ones refused (the database restarting) for a few seconds, twice, while tasks drain."""
    admin = pg_url.rsplit("/", 1)
    proxy = Proxy(("127.0.0.1", int(os.environ.get("KUGETSU_TEST_PG_PORT", "5432"))))
    try:
        url = proxy.url(admin[1])
        a, b = machines("m1", slots=2, url=url), machines("m2", slots=2, url=url)
        direct = Kugetsu(a.home.root.parent / "direct")  # a client that does not go through the proxy
        direct.config(store=pg_url, host="direct")
        direct.ok("config", "set", "max_agents", "3")
        names = [f"d{i}" for i in range(8 if not LONG else 40)]
        gate = direct.rec / "gate"
        for n in names:
            direct.ok("delegate", n, "--", *direct.agent(n, 1.0, 0, gate))
        for _ in range(2):
            wait_for(lambda: len(direct.json("queue")["active"]) >= 2, 15, "agents running")  # type: ignore[index]
            proxy.cut("refuse")
            r = a.run("queue")
            assert r.returncode == 1 and "database unreachable" in r.stderr and "Traceback" not in r.stderr
            gate.touch()  # the running agents end while their services cannot book it
            time.sleep(2)  # the outage itself
            proxy.restore()
        tasks = _final(direct, set(names), 60)
        assert Counter(t["state"] for t in tasks.values()) == {"succeeded": len(names)}
        _check(direct, tasks, 3, {"m1": 2, "m2": 2})
        for k in (a, b):
            log = k.home.service_log.read_text()
            # once per outage by the service's loop (and once by its heartbeat thread), not per retry
            assert log.count("ERROR") <= 2 * 2 + 1, log
            assert "Traceback" not in log
        assert not agent_wrappers(a.home) and not agent_wrappers(b.home)
    finally:
        proxy.close()


def test_a_whole_machine_killed_loses_its_tasks_within_the_lease_and_its_slots_go_to_others(machines: Machine):
    a, b = machines("m1", slots=1), machines("m2", slots=1)
    a.ok("config", "set", "cluster.lease", "3s")
    a.ok("config", "set", "max_agents", "2")
    for k in (a, b):  # the lease setting reaches running services at their next tick; restart for the heartbeat period
        k.ok("shutdown")
        k.ok("serve", "--detach")
    b.delegate("doomed", 30.0, 0, "--host", "m2")
    b.wait_state("doomed", "running")
    wait_for(lambda: b.times("doomed").get("start"), 10, "the agent to start")
    a.delegate("waiting", 0.0, 0, "--host", "m1")
    a.delegate("blocked", 0.0, 0)  # the cluster has room; m1 runs it after "waiting"
    # the whole machine dies: its service and its agents
    pid = b.service_pid()
    for w in agent_wrappers(b.home):
        os.killpg(w, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
    t0 = time.monotonic()
    task = a.wait_state("doomed", "lost", timeout=20)
    assert time.monotonic() - t0 < 3 * 2 + 5 and "m2 stopped answering" in task["reason"]
    assert {r["name"]: r["state"] for r in a.json("hosts")}["m2"] == "gone"  # type: ignore[union-attr]
    a.delegate("after", 0.0, 0)
    assert a.wait_state("after", "succeeded")["host"] == "m1"


def test_a_machine_cut_off_from_the_database_starts_nothing_and_is_fenced_when_it_returns(machines: Machine, pg_url: str):
    """m2 reaches the database through a proxy that goes silent (a network that drops
    everything, as a cable pulled): it cannot start anything; past the lease m1 ends its task
    as lost; when the network is back m2 kills what it still runs of it before anything else."""
    proxy = Proxy(("127.0.0.1", 5432))
    try:
        a = machines("m1", slots=1)
        b = machines("m2", slots=1, url=proxy.url(pg_url.rsplit("/", 1)[1]))
        a.ok("config", "set", "cluster.lease", "3s")
        for k in (a, b):  # the heartbeat period follows the lease from the service's start
            k.ok("shutdown")
            k.ok("serve", "--detach")
        a.delegate("victim", 0.0, 0, "--host", "m2", gate=a.rec / "never")
        wait_for(lambda: a.times("victim").get("start"), 15, "the agent to start on m2")
        proxy.cut("silent")
        a.delegate("next", 0.0, 0, "--host", "m2")
        task = a.wait_state("victim", "lost", timeout=20)
        assert "m2 stopped answering" in task["reason"]
        assert agent_wrappers(b.home), "the agent runs on while its machine is cut off"
        assert a.task("next")["state"] == "queued", "a machine cut off from the database started something"
        proxy.restore()
        wait_for(lambda: not agent_wrappers(b.home), 20, "m2 to kill the lost task's agent")
        assert a.wait_state("next", "succeeded", timeout=20)["host"] == "m2"
        assert "killing it" in b.home.service_log.read_text()
    finally:
        proxy.close()


def test_a_statement_whose_answer_never_comes_is_interrupted(pg_url: str):
    """The service's watchdog (cluster.member) ends such a wait with PgStore.interrupt."""
    from kugetsu.store.postgres import PgStore
    from kugetsu.errors import Unreachable

    proxy = Proxy(("127.0.0.1", 5432))
    store = PgStore(proxy.url(pg_url.rsplit("/", 1)[1]))
    try:
        store.read()
        proxy.cut("silent")
        failed: list[BaseException] = []

        def read() -> None:
            try:
                store.read()
            except BaseException as err:  # noqa: BLE001  (the test looks at what it was)
                failed.append(err)

        t = threading.Thread(target=read)
        t.start()
        wait_for(lambda: store.waiting_for() > 0.3, 5, "the statement to wait")
        assert t.is_alive()
        store.interrupt()
        t.join(5)
        assert not t.is_alive() and isinstance(failed[0], Unreachable)
        proxy.restore()
        assert store.read() is not None  # connects afresh
    finally:
        store.close()
        proxy.close()


def test_a_wait_outlasts_a_database_outage_and_says_so_only_at_its_deadline(machines: Machine, pg_url: str):
    """The waiter reaches the database through a proxy that refuses it for a while: the task
    runs on meanwhile, and so does the wait, which ends with the task once the database is
    back. A wait whose deadline falls in an outage says why it could not tell (exit 1)."""
    import subprocess
    import sys

    proxy = Proxy(("127.0.0.1", 5432))
    try:
        a = machines("m1")
        w = machines("w", url=proxy.url(pg_url.rsplit("/", 1)[1]), serve=False)
        a.delegate("long", 0.0, 0, gate=a.rec / "go")
        w.wait_state("long", "running")

        def wait(*args: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "kugetsu", "wait", "long", *args], env=w.env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        import psycopg

        with psycopg.connect(pg_url, autocommit=True) as db:
            def looking() -> list[str]:
                """What the backends serving the proxy's clients ran last."""
                ports = proxy.upstream_ports()
                rows = db.execute("SELECT client_port, query FROM pg_stat_activity"
                                  " WHERE datname = current_database() AND client_port IS NOT NULL").fetchall()
                return [q for port, q in rows if port in ports]

            wait_for(lambda: not looking(), 10, "the CLI calls before to be gone")
            patient, hasty = wait(), wait("--timeout", "3s")
            # Both waits in their loop: each listens (the watch is made as the loop begins: from
            # then on an outage is ridden out) and has a connection that has looked at the queue.
            # Counting the looks alone was met by a wait's first read, before its loop (CI, once).
            def in_loop() -> bool:
                queries = looking()
                return (sum(q.startswith("LISTEN") for q in queries) >= 2
                        and sum(q.startswith(("SELECT xmin", "SELECT doc")) for q in queries) >= 2)

            wait_for(in_loop, 15, "both waits to listen and look at the queue")
        proxy.cut("refuse")
        out, err = hasty.communicate(timeout=30)
        assert hasty.returncode == 1 and "database unreachable" in err, (hasty.returncode, err)
        assert patient.poll() is None, patient.communicate()
        proxy.restore()
        (a.rec / "go").touch()
        out, err = patient.communicate(timeout=30)
        assert patient.returncode == 0 and err == "", (patient.returncode, err)
    finally:
        proxy.close()
