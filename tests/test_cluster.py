"""Cluster mode (docs/architecture.md §10) with a real PostgreSQL, real services and real agents:
several "machines" are homes on this one, each with its own service and host name, sharing
one database. The agents record their own times in one shared directory."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import Kugetsu, agent_wrappers, wait_for
from test_worktrees import repo  # noqa: F401  (a fixture: a real git repository)

Machine = Callable[..., Kugetsu]


@pytest.fixture
def machines(tmp_path: Path, pg_url: str) -> Iterator[Machine]:
    made: list[Kugetsu] = []

    def make(name: str, slots: int = 2, url: str = pg_url, serve: bool = True) -> Kugetsu:
        k = Kugetsu(tmp_path / name)
        k.config(store=url, host=name, host_max_agents=slots)
        made.append(k)
        if serve:
            k.ok("serve", "--detach")
        return k

    yield make
    for k in made:
        k.cleanup()


def overlap(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one instant."""
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    top = cur = 0
    for _, d in points:
        cur += d
        top = max(top, cur)
    return top


def final(k: Kugetsu, names: list[str], timeout: float = 30) -> dict[str, dict]:
    def done() -> dict[str, dict] | None:
        tasks = {t["name"]: t for t in k.json("queue", "--all")["finished"]}  # type: ignore[index]
        return tasks if all(n in tasks for n in names) else None
    return wait_for(done, timeout, f"{names} to finish")  # type: ignore[return-value]


def test_one_capacity_across_machines_never_exceeded_and_each_machine_within_its_slots(machines: Machine):
    a, b = machines("m1", slots=2), machines("m2", slots=2)
    a.ok("config", "set", "max_agents", "3")
    a.ok("config", "set", "history_limit", "100")
    names = [f"t{i}" for i in range(9)]
    gate = a.rec / "gate"
    for i, n in enumerate(names):
        (a if i % 2 else b).delegate(n, 0.1, 0, gate=gate)
    running = wait_for(lambda: len(r := a.json("queue")["active"]) == 3 and r, 10, "3 running")  # type: ignore[index]
    assert sorted(t["host"] for t in running) in (["m1", "m1", "m2"], ["m1", "m2", "m2"])
    gate.touch()
    tasks = final(a, names)
    assert {t["state"] for t in tasks.values()} == {"succeeded"}
    spans = {n: (a.times(n)["start"], a.times(n)["end"]) for n in names}
    assert overlap(list(spans.values())) <= 3
    assert overlap(list(spans.values())) == 3, "a free slot of the cluster was left unused"
    for host in ("m1", "m2"):
        mine = [spans[n] for n in names if tasks[n]["host"] == host]
        assert mine and overlap(mine) <= 2


def test_a_pinned_task_runs_on_its_machine_and_hosts_lists_the_machines(machines: Machine):
    a, b = machines("m1"), machines("m2")
    a.delegate("pinned", 0.0, 0, "--host", "m2")
    a.delegate("long", 30.0, 0, "--host", "m1")
    assert a.wait_state("pinned", "succeeded")["host"] == "m2"
    a.wait_state("long", "running")
    rows = {r["name"]: r for r in a.json("hosts")}  # type: ignore[union-attr]
    assert rows["m1"]["state"] == rows["m2"]["state"] == "up"
    assert rows["m1"]["running"] == 1 and rows["m1"]["tasks"] == ["long"] and rows["m1"]["this"]
    assert rows["m2"]["running"] == 0 and not rows["m2"]["this"]
    text = b.ok("hosts")
    assert "m1" in text and "m2 *" in text and "long" in text
    out = b.ok("queue")
    assert "HOST" in out and "m1" in out
    r = a.run("delegate", "bad", "--host", "m 1", "--", "true")
    assert r.returncode == 2 and r.stderr == (
        "kugetsu: invalid host 'm 1': a machine's name is 1-64 letters, digits, '.', '_' or '-'"
        " (`kugetsu hosts` lists the machines)\n")


def test_a_cancel_on_one_machine_stops_an_agent_on_another_within_a_second(machines: Machine):
    a, b = machines("m1"), machines("m2")
    gate = a.rec / "never"
    a.delegate("far", 0.0, 0, "--host", "m2", gate=gate)
    b.wait_state("far", "running")
    wait_for(lambda: a.times("far").get("start"), 10, "the agent to start")
    a.ok("cancel", "far")
    t0 = time.monotonic()
    wait_for(lambda: not agent_wrappers(b.home), 5, "the agent on m2 to be stopped")
    assert time.monotonic() - t0 < 1.0, "the cancel took more than a second to reach the other machine"
    assert a.wait_state("far", "cancelled", timeout=10)["reason"] == "cancelled by cli"


def test_config_set_on_one_machine_applies_on_every_machine(machines: Machine):
    a, b = machines("m1", serve=False), machines("m2", serve=False)
    a.ok("config", "set", "max_agents", "5")
    assert b.json("capacity")["max_agents"] == 5  # type: ignore[index]
    assert b.ok("config", "get", "max_agents").strip() == "5"
    assert a.ok("config", "get", "host").strip() == "m1" and b.ok("config", "get", "host").strip() == "m2"


def test_output_of_an_agent_on_another_machine_is_read_from_anywhere(machines: Machine):
    a = machines("m1")
    machines("m2")  # the machine the task runs on
    a.ok("delegate", "talk", "--host", "m2", "--", "sh", "-c", "for i in 1 2 3; do echo line $i; done")
    a.wait_state("talk", "succeeded")
    wait_for(lambda: "line 3" in a.ok("logs", "talk"), 10, "the output to be shipped")
    assert a.ok("logs", "talk") == "line 1\nline 2\nline 3\n"
    assert a.ok("logs", "talk", "-n", "1") == "line 3\n"


def test_a_big_log_on_another_machine_is_shipped_up_to_the_cap_and_read_within_it(machines: Machine):
    """Hostile output in a cluster (issue 24 item 5): an agent on m2 writes 30 MB; what m2
    ships to the database, and what m1 mirrors and reads, stop at cluster.log_max_size."""
    from test_big_logs import MB, big_agent, measured

    a = machines("m1")
    machines("m2")
    a.ok("config", "set", "cluster.log_max_size", "1MiB")
    a.ok("delegate", "big", "--host", "m2", "--", *big_agent(30 * MB))
    a.wait_state("big", "succeeded", timeout=60)
    # m1 reads its mirror of what m2 shipped: the first MiB, then nothing more comes.
    wait_for(lambda: len(measured(a, "logs", "big")[0].stdout) == MB, 20, "the shipped MiB to be read on m1")
    r, rss, secs = measured(a, "logs", "big", "--lines", "2")
    assert r.returncode == 0 and r.stdout.startswith(b"some output") and rss < 100 and secs < 5, (r, rss, secs)
    mirrored = [p.stat().st_size for p in a.home.root.rglob("*") if p.is_file() and "mirror" in str(p)]
    assert mirrored and max(mirrored) <= MB, mirrored


def test_a_silent_machine_loses_its_tasks_within_the_lease_and_is_fenced_when_it_returns(machines: Machine):
    a, b = machines("m1", slots=1), machines("m2", slots=1)
    a.ok("config", "set", "cluster.lease", "3s")
    a.ok("config", "set", "max_agents", "2")
    b.delegate("victim", 0.0, 0, "--host", "m2", gate=b.rec / "never")
    b.wait_state("victim", "running")
    wait_for(lambda: a.times("victim").get("start"), 10, "the agent to start")
    pid = b.service_pid()
    assert pid
    os.kill(pid, signal.SIGSTOP)  # its service is frozen: no heartbeats, no database
    try:
        t0 = time.time()
        task = a.wait_state("victim", "lost", timeout=20)
        assert "m2" in task["reason"] and time.time() - t0 < 12
        assert agent_wrappers(b.home), "the agent runs on while its machine is away"
        a.delegate("after", 0.0, 0, "--host", "m1")
        a.wait_state("after", "succeeded")
    finally:
        os.kill(pid, signal.SIGCONT)
    # back: it kills what it still runs of the lost task before anything else
    wait_for(lambda: not agent_wrappers(b.home), 15, "the fenced machine to end its lost agent")
    rows = {r["name"]: r for r in a.json("hosts")}  # type: ignore[union-attr]
    wait_for(lambda: {r["name"]: r for r in a.json("hosts")}["m2"]["state"] == "up", 10, "m2 to rejoin")  # type: ignore[index]
    assert rows["m2"]["epoch"] >= 2
    b.delegate("again", 0.0, 0, "--host", "m2")
    b.wait_state("again", "succeeded")


def test_an_unreachable_database_is_one_line_and_exit_1(tmp_path: Path):
    k = Kugetsu(tmp_path / "h")
    k.env["KUGETSU_STORE"] = "postgresql://127.0.0.1:1/nothing"
    for args in (["queue"], ["delegate", "x", "--", "true"], ["capacity", "--json"], ["hosts"]):
        r = k.run(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert r.stderr.startswith("kugetsu: database unreachable: postgresql://127.0.0.1:1/nothing"), r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_hosts_and_host_pinning_need_a_cluster(kg: Kugetsu):
    r = kg.run("hosts")
    assert r.returncode == 2 and "needs cluster mode" in r.stderr
    r = kg.run("delegate", "x", "--host", "m1", "--", "true")
    assert r.returncode == 2 and "needs cluster mode" in r.stderr


def test_store_migrate_moves_a_file_home_and_refuses_when_busy(kg: Kugetsu, pg_url: str, tmp_path: Path):
    kg.config(max_agents=2, history_limit=1)
    for n in ("one", "two", "three"):
        kg.ok("delegate", n, "--prompt", f"the prompt of {n}", "--", *kg.agent(n))
        kg.wait_state(n, "succeeded")
    r = kg.run("store", "migrate", pg_url)
    assert r.returncode == 1 and "service of this home is running" in r.stderr
    kg.ok("shutdown")
    out = kg.ok("store", "migrate", pg_url)
    assert "moved 1 finished task(s), 2 archived" in out
    assert json.loads(kg.home.config.read_text()) == {"store": pg_url}
    assert not kg.home.index.exists() and not kg.home.head.exists()  # aside, and its summary gone
    other = Kugetsu(tmp_path / "other")
    other.config(store=pg_url, host="other")
    assert other.json("capacity")["max_agents"] == 2  # type: ignore[index]
    assert [t["name"] for t in other.json("queue", "--all")["finished"]] == ["three"]  # type: ignore[index]
    assert other.json("status", "three")["prompt"] == "the prompt of three"
    again = Kugetsu(tmp_path / "again")
    again.config(max_agents=1)
    r = again.run("store", "migrate", pg_url)
    assert r.returncode == 1 and "already holds a kugetsu queue" in r.stderr
    exported = tmp_path / "exported"
    kg.ok("store", "export", str(exported))
    assert json.loads((exported / "config.json").read_text()) == {"max_agents": 2, "history_limit": 1}
    back = Kugetsu(exported)
    assert [t["name"] for t in back.json("queue", "--all")["finished"]] == ["three"]  # type: ignore[index]
    assert back.json("status", "three")["prompt"] == "the prompt of three"
    back.delegate("four")
    assert back.wait_state("four", "succeeded")["id"] == 4
    back.cleanup()


def test_joining_a_cluster_with_a_queue_or_config_of_its_own_is_refused(kg: Kugetsu, pg_url: str):
    kg.config(max_agents=2)
    r = kg.run("config", "set", "store", pg_url)
    assert r.returncode == 2 and "store migrate" in r.stderr and "max_agents" in r.stderr
    assert json.loads(kg.home.config.read_text()) == {"max_agents": 2}


def test_exactly_one_machine_runs_the_telegram_bot_and_another_takes_over(machines: Machine, pg_url: str):
    from fakebot import TOKEN, FakeBotAPI
    from test_telegram_bot import ME

    api = FakeBotAPI().start()
    try:
        a, b = machines("m1", serve=False), machines("m2", serve=False)
        a.ok("config", "set", "cluster.lease", "3s")
        a.ok("config", "set", "telegram", json.dumps({"token": TOKEN, "api_base_url": api.base_url,
                                                       "allowed_chat_ids": [ME], "notify_chat_ids": [ME]}))
        a.ok("serve", "--detach")
        wait_for(lambda: api.calls_to("getUpdates"), 15, "the bot to poll")
        b.ok("serve", "--detach")
        a.delegate("first", 0.0, 0, "--host", "m2")
        wait_for(lambda: api.with_text(ME, "<b>first</b> (#1) succeeded"), 15, "the first notification")

        def holders() -> list[str]:
            return [k.home.root.name for k in (a, b) if "holding the Telegram bot's lease" in k.home.service_log.read_text()]
        assert holders() == ["m1"]
        # Delivery is at least once: a crash between a send and its cursor write repeats that
        # one message. Kill the holder once the cursor has moved past the first task's end.
        import psycopg

        with psycopg.connect(pg_url, autocommit=True) as db:
            last = db.execute("SELECT max(seq) FROM kugetsu.events").fetchone()[0]  # the first task's end
            wait_for(lambda: (db.execute("SELECT seq FROM kugetsu.cursors").fetchone() or [0])[0] >= last, 10,
                     "the cursor to pass the first task's end")
        pid = a.service_pid()
        assert pid
        os.kill(pid, signal.SIGKILL)  # the holder dies: its lease runs out, m2 takes the bot
        wait_for(lambda: "holding the Telegram bot's lease" in b.home.service_log.read_text(), 15, "m2 to take the bot")
        b.delegate("second", 0.0, 0, "--host", "m2")
        wait_for(lambda: api.with_text(ME, "<b>second</b> (#2) succeeded"), 15, "the second notification")
        for needle in ("<b>first</b> (#1) succeeded", "started <b>first</b>", "<b>second</b> (#2) succeeded"):
            assert len(api.with_text(ME, needle)) == 1, "\n".join(f"{c.at} {c.params['text']}" for c in api.sent(ME))
    finally:
        api.close()


async def test_the_dashboard_on_one_machine_shows_the_cluster_and_another_machine_s_output(machines: Machine):
    import asyncio

    from dashboard_data import until

    from kugetsu.frontends.tui.app import make_app

    watcher, worker = machines("m1", serve=False), machines("m2")
    go = worker.rec / "go"
    agent = ["sh", "-c", 'echo hello from m2; while [ ! -e "$0" ]; do sleep 0.05; done; echo all done', str(go)]
    app = make_app(watcher.home, cwd=str(watcher.home.root.parent))
    async with app.run_test() as pilot:
        await asyncio.to_thread(watcher.ok, "delegate", "far", "--host", "m2", "--", *agent)
        await until(pilot, lambda: app.running.keys == ["1"], timeout=10, what="the task in Running")
        await until(pilot, lambda: "hello from m2" in app.output.lines, timeout=10, what="its shipped output")
        go.touch()
        await until(pilot, lambda: "1" in app.finished.keys, timeout=10, what="the task in Finished")
        await until(pilot, lambda: "all done" in app.output.lines, timeout=10, what="the end of its output")


def test_a_password_in_the_store_url_is_never_shown(tmp_path: Path):
    k = Kugetsu(tmp_path / "h")
    k.env["KUGETSU_STORE"] = "postgresql://kugetsu:hunter2@127.0.0.1:1/nothing"
    r = k.run("queue")
    assert r.returncode == 1 and "hunter2" not in r.stderr and "kugetsu:***@127.0.0.1:1" in r.stderr


def test_a_task_pinned_to_a_machine_that_is_not_up_says_why_it_waits(machines: Machine):
    a = machines("m1", serve=False)
    out = a.ok("delegate", "lonely", "--host", "nowhere", "--", "true")
    assert out.strip().endswith("waiting for: host nowhere is not up (the task is pinned to it: `kugetsu hosts`)"), out
    assert "host nowhere is not up" in a.ok("queue")
    assert a.json("queue")["queued"][0]["waiting_for"].startswith("host nowhere is not up")  # type: ignore[index]


def test_one_machine_never_loads_the_cluster_code(kg: Kugetsu):
    import subprocess
    import sys

    for args in (["capacity"], ["delegate", "x", "--", "true"], ["queue"]):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "kugetsu", *args], env=kg.env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "psycopg" not in r.stderr and "kugetsu.cluster" not in r.stderr, args


def test_doctor_checks_the_database_first(machines: Machine, tmp_path: Path):
    a = machines("m1")
    out = a.run("doctor")
    assert "cluster" in out.stdout and "answers; machines: m1" in out.stdout, out.stdout
    k = Kugetsu(tmp_path / "away")
    k.config(store="postgresql://127.0.0.1:1/nothing", host="away")
    r = k.run("doctor")
    assert r.returncode == 1 and "database unreachable: postgresql://127.0.0.1:1/nothing" in r.stdout
    assert "start PostgreSQL" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_wait_priority_stats_and_clean_work_from_any_machine(machines: Machine):
    a = machines("m1", serve=False)
    machines("m2")  # runs the agents
    a.ok("config", "set", "strategy", "priority")
    a.ok("config", "set", "max_agents", "1")
    a.delegate("first", 0.0, 0, "--host", "m2", gate=a.rec / "go")
    a.delegate("second", 0.0, 0)
    a.delegate("third", 0.0, 3)
    assert "position 1" in a.ok("priority", "third", "urgent")
    (a.rec / "go").touch()
    r = a.run("wait", "first", "second", "third", "--timeout", "30s")
    assert r.returncode == 1 and "third (#3) failed: exit code 3" in r.stderr, r.stderr
    order = sorted(["first", "second", "third"], key=lambda n: a.times(n)["start"])
    assert order == ["first", "third", "second"]
    stats = a.json("stats")
    assert stats["total"]["succeeded"] == 2 and stats["total"]["failed"] == 1, stats  # type: ignore[index]
    assert "removed 3 finished tasks" in a.ok("clean")
    assert a.json("queue", "--all")["finished"] == []  # type: ignore[index]


def test_a_worktree_task_runs_in_its_own_worktree_on_the_machine_that_has_its_repository(machines: Machine, repo: Path):
    """Delegated from m1 (no service), it starts on m2, whose git worker makes the worktree
    from the repository there and keeps it with the work (placement by directory is tested
    in test_placement.py: here both "machines" see the same disk)."""
    from test_worktrees import branches

    a = machines("m1", serve=False)
    machines("m2")  # runs the agents
    a.ok("delegate", "wt", "--worktree", "--cwd", str(repo), "--", "sh", "-c", "echo changed > f.txt")
    task = wait_for(lambda: (t := a.task("wt"))["state"] == "succeeded" and t["worktree_state"] != "active" and t,
                    20, "the worktree task to end and its worktree to be closed")
    assert task["host"] == "m2" and task["worktree_state"] == "kept", task  # type: ignore[index]
    assert "kugetsu/wt" in branches(repo)
    assert a.json("worktrees") is not None  # lists from a machine that has none


def test_a_link_planted_for_the_output_mirror_is_refused_not_followed(machines: Machine, tmp_path: Path):
    a = machines("m1", serve=False)
    machines("m2")  # runs the agent
    a.ok("delegate", "talk", "--host", "m2", "--", "echo", "hello")
    a.wait_state("talk", "succeeded")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (a.home.root / "mirror").symlink_to(elsewhere)
    r = a.run("logs", "talk")
    assert r.returncode == 2 and "is a symbolic link" in r.stderr and "Traceback" not in r.stderr, r
    assert list(elsewhere.iterdir()) == []


def test_a_wait_rides_out_its_database_connections_being_cut(machines: Machine, pg_url: str):
    """A restart or failover of the database cuts every connection: the waiting PM agent's
    `kugetsu wait` (and the service) connect again and go on; the wait still ends when the
    task does, with its outcome."""
    import subprocess
    import sys

    import psycopg

    a = machines("m1")
    gate = a.rec / "go"
    a.delegate("long", 0.0, 0, gate=gate)
    a.wait_state("long", "running")
    waiter = subprocess.Popen([sys.executable, "-m", "kugetsu", "wait", "long"], env=a.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def backends(db, query: str = "%") -> list[int]:
        return [r[0] for r in db.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                                         " AND pid <> pg_backend_pid() AND application_name = 'kugetsu'"
                                         " AND query LIKE %s", (query,)).fetchall()]

    with psycopg.connect(pg_url, autocommit=True) as db:
        # The service LISTENs, and so does the wait, once it is in its loop (the last thing it
        # connects): from there on it rides out a lost connection.
        wait_for(lambda: len(backends(db, "LISTEN%")) >= 2, 15, "the wait to listen")
        before = backends(db)
        for pid in before:
            db.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: not set(before) & set(backends(db)), 10, "the cut connections to be gone")
    assert waiter.poll() is None, waiter.communicate()
    gate.touch()
    out, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 0 and err == "", (waiter.returncode, err)
    assert a.task("long")["state"] == "succeeded"


def test_prompts_are_rows_beside_the_queue_and_reach_an_agent_on_another_machine(machines: Machine, pg_url: str):
    """A prompt admitted on m1 is a row of kugetsu.prompts (not in the queue's document that
    every machine re-reads after each change); m2's agent gets it, for {prompt} in its argv
    and for {prompt_file} as a file made on m2."""
    import psycopg

    a, b = machines("m1"), machines("m2")
    rec = str(a.rec)
    a.ok("config", "set", "agents.argv", json.dumps({"command": [
        "sh", "-c", 'printf %s "$1" > "$2"', "sh", "{prompt}", rec + "/{name}.out"]}))
    a.ok("config", "set", "agents.file", json.dumps({"command": [
        "sh", "-c", 'cat "$1" > "$2"', "sh", "{prompt_file}", rec + "/{name}.out"]}))
    texts = {"by-argv": "x" * 60_000 + " $(id) '{name}'", "by-file": "from a file ✓ {prompt}"}
    a.ok("delegate", "by-argv", "--agent", "argv", "--host", "m2", "--prompt", texts["by-argv"])
    a.ok("delegate", "by-file", "--agent", "file", "--host", "m2", "--prompt", texts["by-file"])
    for name, text in texts.items():
        assert a.wait_state(name, "succeeded", timeout=30)["host"] == "m2"
        assert (a.rec / f"{name}.out").read_text() == text
        assert a.json("status", name)["prompt"] == b.json("status", name)["prompt"] == text
    with psycopg.connect(pg_url) as conn:
        rows = [bytes(r[0]) for r in conn.execute("SELECT body FROM kugetsu.tasks")]
        assert len(rows) == 2 and all(b"xxxxxxxxxx" not in r and len(r) < 2_000 for r in rows)
        assert conn.execute("SELECT count(*) FROM kugetsu.prompts").fetchone()[0] == 2


def test_a_schedule_fires_once_on_the_lease_holder_and_another_takes_over(machines: Machine, pg_url: str):
    """Two services share a schedule (every 1 s): only the machine holding the schedules'
    lease fires it, no firing happens twice; its holder is killed -9, the other takes the
    lease over and the firings go on, still once each (docs/scheduling.md)."""
    import psycopg

    a, b = machines("m1", serve=False), machines("m2", serve=False)
    a.ok("config", "set", "cluster.lease", "3s")
    a.ok("serve", "--detach")
    wait_for(lambda: "holding the schedules' lease" in a.home.service_log.read_text(), 15, "m1 to take the lease")
    b.ok("serve", "--detach")
    rec = a.rec / "tick"
    a.ok("schedule", "add", "tick", "--every", "1s", "--", "sh", "-c", 'date +%s.%N >> "$0"', str(rec))

    def firings() -> list[tuple[str, int]]:
        with psycopg.connect(pg_url, autocommit=True) as db:
            rows = db.execute("SELECT body FROM kugetsu.events ORDER BY seq").fetchall()
        evs = [json.loads(r[0]) for r in rows]
        return [(e["value"], e["task"]) for e in evs if e["type"] == "schedule" and e.get("task")]

    wait_for(lambda: len(firings()) >= 3, 15, "three firings")
    holders = [k.home.root.name for k in (a, b) if "holding the schedules' lease" in k.home.service_log.read_text()]
    assert holders == ["m1"]
    pid = a.service_pid()
    assert pid
    os.kill(pid, signal.SIGKILL)  # the holder dies: its lease runs out, m2 takes the firings over
    killed = len(firings())
    wait_for(lambda: "holding the schedules' lease" in b.home.service_log.read_text(), 15, "m2 to take the lease")
    wait_for(lambda: len(firings()) >= killed + 3, 15, "firings from m2")
    fired = firings()
    times = [at for at, _ in fired]
    assert len(set(times)) == len(times), fired  # no scheduled time fired twice
    assert len({task for _, task in fired}) == len(fired)
    assert sorted(times) == times
    wait_for(lambda: len(rec.read_text().split()) >= len(fired), 15, "every firing's task to run")
