"""The store protocol's contract (kugetsu.store.files.StoreProtocol, docs/architecture.md §9): what every
store must do, whatever it keeps its state in. Each test takes a `make_store` factory: the
file store today; the cluster's PostgreSQL store is added to STORES and runs the same tests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from conftest import REPO, T0

from kugetsu.core.models import Event, Task, TaskState
from kugetsu.paths import Home
from kugetsu.store.files import Store
from kugetsu.store.protocol import StoreProtocol


def file_store(tmp: Path, request: pytest.FixtureRequest) -> StoreProtocol:
    return Store(Home(tmp / "home"))


def postgresql_store(tmp: Path, request: pytest.FixtureRequest) -> StoreProtocol:
    from kugetsu.store.postgres import PgStore

    store = PgStore(request.getfixturevalue("pg_url"))
    request.addfinalizer(store.close)
    return store


STORES: dict[str, Callable[[Path, pytest.FixtureRequest], StoreProtocol]] = {
    "file": file_store, "postgresql": postgresql_store,
}


@pytest.fixture(params=sorted(STORES))
def make_store(request, tmp_path) -> Callable[[], StoreProtocol]:
    """A factory of stores on one shared state: two calls are two clients (two processes'
    view) of the same queue."""
    return lambda: STORES[request.param](tmp_path, request)


@pytest.fixture
def store_env(request, tmp_path) -> dict[str, str]:
    """The environment under which `open_store` in another process opens this test's store."""
    env = {"KUGETSU_HOME": str(tmp_path / "home")}
    if request.node.callspec.params["make_store"] == "postgresql":
        env["KUGETSU_STORE"] = request.getfixturevalue("pg_url")
    return env


def _task(i: int) -> Task:
    return Task(id=i, name=f"t{i}", command=["true"], cwd="/", created_at=T0)


def _admit(store: StoreProtocol, n: int = 1) -> list[int]:
    ids = []
    with store.transaction() as txn:
        for _ in range(n):
            task = _task(txn.index.next_id)
            txn.index.next_id += 1
            txn.index.queued.append(task)
            txn.emit([Event(type="queued", at=txn.now, task=task.id, name=task.name)])
            ids.append(task.id)
    return ids


def test_a_commit_is_seen_by_every_reader_and_an_abort_by_none(make_store):
    a, b = make_store(), make_store()
    assert b.read().queued == []
    _admit(a, 2)
    assert [t.id for t in b.read().queued] == [1, 2]
    txn = a.begin()
    txn.index.queued.clear()
    a.abort()
    assert [t.id for t in b.read().queued] == [1, 2]
    with pytest.raises(RuntimeError), a.transaction() as txn:
        txn.index.queued.clear()
        raise RuntimeError("the caller failed: nothing is written")
    assert [t.id for t in make_store().read().queued] == [1, 2]


def test_prompts_are_kept_beside_the_state_with_their_commit_only(make_store):
    """A task's prompt is stored with the transaction that admits (or edits) it, read back
    by any client, and is not inside the state every transaction loads and writes."""
    a, b = make_store(), make_store()
    text = "a prompt: $(id) '{name}' \0 ünï ✓ " + "x" * 50_000
    with a.transaction() as txn:
        txn.index.queued.append(_task(txn.index.next_id))
        txn.prompts[txn.index.next_id] = text
        txn.index.next_id += 1
    assert b.prompts([1, 2]) == {1: text} and b.prompts([]) == {}
    assert len(msgspec_json(b.read())) < 5_000
    with pytest.raises(RuntimeError), a.transaction() as txn:  # a failed commit changes no prompt
        txn.prompts[1] = "edited"
        txn.prompts[2] = "new"
        raise RuntimeError("the caller failed: nothing is written")
    assert make_store().prompts([1, 2]) == {1: text}
    with a.transaction() as txn:
        txn.prompts[1] = "edited"
    assert make_store().prompts([1]) == {1: "edited"}


def msgspec_json(index: object) -> bytes:
    from kugetsu.store.protocol import encode_index

    return encode_index(index)  # type: ignore[arg-type]


def test_events_after_a_cursor_have_increasing_seqs_and_times(make_store):
    store = make_store()
    _admit(store, 3)
    _admit(make_store(), 2)
    events = make_store().read_events()
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert [e.at for e in events] == sorted(e.at for e in events)
    assert [e.seq for e in store.read_events(after=3)] == [4, 5]
    assert store.read_events(after=5) == []


def test_now_is_read_once_the_transaction_holds_its_turn(make_store):
    a, b = make_store(), make_store()
    txn = a.begin()
    got: list[datetime] = []
    waiter = threading.Thread(target=lambda: got.append(_begin_and_commit(b)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "a second writer did not wait for the first"
    held_until = datetime.now(timezone.utc)
    a.commit(txn)
    waiter.join(10)
    assert got and got[0] >= held_until - timedelta(milliseconds=5)


def _begin_and_commit(store: StoreProtocol) -> datetime:
    txn = store.begin()
    store.commit(txn)
    return txn.now


def test_writers_in_other_processes_serialize_and_lose_no_update(make_store, store_env):
    """Four processes, 25 read-modify-write transactions each: no update lost, ids unique."""
    make_store()  # the state exists
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from kugetsu.core.models import Task\nfrom kugetsu.paths import default_home\nfrom kugetsu.store.files import open_store\n"
        "from datetime import datetime, timezone\n"
        "s = open_store(default_home())\n"
        "for _ in range(25):\n"
        "    with s.transaction() as txn:\n"
        "        i = txn.index.next_id; txn.index.next_id += 1\n"
        "        txn.index.queued.append(Task(id=i, name=f't{i}', command=['x'], cwd='/',"
        " created_at=datetime.now(timezone.utc)))\n"
    ) % (str(REPO),)
    env = {**os.environ, **store_env}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(4)]
    assert all(p.wait(60) == 0 for p in procs)
    index = make_store().read()
    assert sorted(t.id for t in index.queued) == list(range(1, 101)) and index.next_id == 101


def test_one_store_object_holds_one_transaction_at_a_time(make_store):
    store = make_store()
    txn = store.begin()
    with pytest.raises(RuntimeError):
        store.begin()
    store.commit(txn)
    store.commit(store.begin())  # and it is usable again


def test_ids_and_seqs_never_go_back_when_the_state_is_reset(make_store, tmp_path):
    """A reset: the file store's index.json moved away (logs, events stay); the database's
    queue row emptied by hand (its events stay)."""
    store = make_store()
    _admit(store, 2)
    for p in (tmp_path / "home").glob("index.json"):
        p.rename(p.with_name("index.json.bak"))
    if hasattr(store, "conn"):
        store.conn.execute("UPDATE kugetsu.state SET doc = ''")
        store.conn.execute("DELETE FROM kugetsu.tasks")
    with store.transaction() as txn:
        assert txn.index.next_id > 2 and txn.index.next_seq > 2


def test_the_stamp_changes_with_each_commit_and_a_watch_wakes_at_once(make_store):
    """What waiters and self-refreshing views use instead of decoding the state to see whether
    it changed: the stamp; and where the store has one, a descriptor readable at a commit."""
    import select

    reader, writer = make_store(), make_store()
    watch = reader.watch()
    before = reader.stamp()
    assert reader.stamp() == before
    _admit(writer)
    changed = reader.stamp()
    assert changed != before
    writer.begin()
    writer.abort()
    assert reader.stamp() == changed
    if watch is None:  # the file store: a waiter looks at the stamp
        return
    try:
        assert select.select([watch], [], [], 5)[0], "the commit did not wake the watch"
        watch.clear()
        assert not select.select([watch], [], [], 0.05)[0], "clear left it readable"
        _admit(writer)
        assert select.select([watch], [], [], 5)[0]
        watch.clear()
    finally:
        watch.close()


def _lists(index) -> tuple[list[tuple[int, str]], ...]:
    return tuple([(t.id, t.priority) for t in tasks] for tasks in (index.active, index.queued, index.finished))


def test_clients_that_take_turns_see_the_same_lists_in_the_same_order(make_store):
    """Two long-lived clients (a service on each of two machines) change the state in turns,
    each keeping what it saw last (the cluster store then reads only what changed since): a
    task moved between lists, or out and back, or archived; each sees the other's changes,
    in the lists' own order, as a fresh client does."""
    import random

    from kugetsu.core.models import TaskState

    rng = random.Random(7)
    clients = [make_store(), make_store()]
    _admit(clients[0], 6)
    for step in range(120):
        store = clients[step % 2]
        with store.transaction() as txn:
            index = txn.index
            move = rng.choice(["admit", "start", "finish", "requeue", "archive", "edit", "roundtrip"])
            if move == "admit":
                task = _task(index.next_id)
                index.next_id += 1
                index.queued.append(task)
            elif move == "start" and index.queued:
                task = index.queued.pop(rng.randrange(len(index.queued)))
                task.state = TaskState.RUNNING
                index.active.append(task)
            elif move == "finish" and index.active:
                task = index.active.pop(rng.randrange(len(index.active)))
                task.state, task.finished_at = TaskState.SUCCEEDED, txn.now
                index.finished.append(task)
            elif move == "requeue" and index.active:
                task = index.active.pop(rng.randrange(len(index.active)))
                task.state = TaskState.QUEUED
                index.queued.append(task)
            elif move == "archive" and index.finished:
                txn.archive.append(index.finished.pop(0))
            elif move == "edit" and index.queued:
                rng.choice(index.queued).priority = rng.choice(["urgent", "high", "normal", "low"])
            elif move == "roundtrip" and len(index.queued) > 1:  # out of its list and back: now last
                index.queued.append(index.queued.pop(0))
            expected = _lists(index)
        fresh = make_store()
        for reader in (*clients, fresh):
            assert _lists(reader.read()) == expected, (step, move)
        if hasattr(fresh, "close"):
            fresh.close()  # one connection at a time, not 120
        with clients[(step + 1) % 2].transaction() as txn:
            assert _lists(txn.index) == expected, (step, move)


@pytest.mark.parametrize("change", ["another thread", "more than the log keeps", "run in place", "list in place"])
def test_a_long_lived_store_writes_every_change_to_what_it_kept(make_store, monkeypatch, change):
    """A store that keeps what it committed writes only what changed since (store/tracking.py):
    a queued task assigned to by a thread other than the committing one, more assignments than
    the log keeps (the store then compares every task), a running task's run record or list
    changed in place: each reaches what a fresh client reads."""
    from kugetsu.core.models import Attempt, Run
    from kugetsu.store import tracking

    store = make_store()
    _admit(store, 6)
    with store.transaction() as txn:  # one running, with its run record
        task = txn.index.queued.pop(0)
        task.state, task.run = TaskState.RUNNING, Run(slot=1)
        txn.index.active.append(task)
    with store.transaction() as txn:
        index = txn.index
        if change == "another thread":
            worker = threading.Thread(target=lambda: setattr(index.queued[2], "name", "renamed"))
            worker.start()
            worker.join()
        elif change == "more than the log keeps":
            monkeypatch.setattr(tracking, "_MOST", 8)
            for step in range(20):
                index.queued[step % 5].priority = ["high", "low"][step % 2]
            index.queued[1].cwd = "/elsewhere"
        elif change == "run in place":
            index.active[0].run.pid = 4242
        else:
            index.active[0].attempts.append(Attempt(ended_at=T0, exit_code=3))
        expected = _bodies(index)
    fresh = make_store()
    assert _bodies(fresh.read()) == expected
    assert _bodies(store.read()) == expected
    if hasattr(fresh, "close"):
        fresh.close()


def _bodies(index) -> list[list[bytes]]:
    from kugetsu.store.protocol import encoder

    return [[encoder.encode(t) for t in tasks] for tasks in (index.active, index.queued, index.finished)]


def test_a_queue_document_of_schema_3_becomes_rows_at_the_first_commit(request, pg_url):
    """A database an older kugetsu left (every task inside the state row's document) is read
    as it is, and its first commit moves the tasks into rows."""
    from kugetsu.store.postgres import PgStore
    from kugetsu.core.models import Index
    from kugetsu.store.protocol import encode_index

    old = Index(next_id=4, queued=[_task(1), _task(3)], finished=[_task(2)])
    old.finished[0].state = TaskState.SUCCEEDED
    store = PgStore(pg_url)
    request.addfinalizer(store.close)
    store.conn.execute("DELETE FROM kugetsu.tasks")
    store.conn.execute("UPDATE kugetsu.state SET doc = %s, rev = 0", (encode_index(old),))
    assert _lists(store.read()) == _lists(old)
    with store.transaction() as txn:
        assert _lists(txn.index) == _lists(old)
        txn.index.queued[0].priority = "high"
    fresh = PgStore(pg_url)
    request.addfinalizer(fresh.close)
    assert [t.priority for t in fresh.read().queued] == ["high", "normal"]
    assert store.conn.execute("SELECT count(*) FROM kugetsu.tasks").fetchone() == (3,)
    assert b'"queued":[]' in bytes(store.conn.execute("SELECT doc FROM kugetsu.state").fetchone()[0])


def test_the_head_read_counts_the_queue_as_the_whole_read_does(make_store):
    """read_head (what `capacity` reads: the index without its queued and finished tasks, and
    their counts) agrees with read() on every count capacity shows: how many, how many of a
    held preset's, whether one declares memory or slots. A name that merely says "memory"
    (the file store looks for the key in the text first) changes nothing."""
    from kugetsu.core.models import Hold, QueueCounts

    a = make_store()
    assert a.read_head() == (a.read(), QueueCounts(queued=0))
    with a.transaction() as txn:
        for i in range(1, 201):
            task = _task(i)
            task.agent = "claude" if i % 3 else "codex"
            task.name = 'say "memory": 1, "slots": 2' if i == 7 else task.name
            txn.index.queued.append(task)
        txn.index.active.append(msgspec_replace(_task(201), state=TaskState.RUNNING, started_at=T0, slots=2))
        txn.index.finished.append(msgspec_replace(_task(202), state=TaskState.SUCCEEDED, finished_at=T0))
        txn.index.next_id = 203
    index, counts = make_store().read_head()
    assert index.queued == [] and index.finished == [] and [t.id for t in index.active] == [201]
    assert counts == QueueCounts(queued=200, accounting=False)
    with a.transaction() as txn:
        txn.index.holds["codex"] = Hold(reason="held by hand", since=T0)
        txn.index.queued[5].memory = 1 << 30
    index, counts = make_store().read_head()
    full = make_store().read()
    assert index.holds == full.holds and index.next_id == full.next_id == 203
    assert counts == QueueCounts.of(full.queued, full.holds) == QueueCounts(
        queued=200, held_agents={"codex": 66}, accounting=True)


def msgspec_replace(task: Task, **changes: object) -> Task:
    import msgspec

    return msgspec.structs.replace(task, **changes)


def test_a_machine_reads_only_what_another_changed_also_when_a_task_went(request, pg_url):
    """Issue 26: the cluster store's cost must not grow with the queue. Another machine starts
    one task, finishes one and archives one (a row goes) in a queue of 300; this machine's next
    read and transaction fetch the few rows that changed, never the whole queue, and see what a
    fresh client sees."""
    from kugetsu.core import lifecycle
    from kugetsu.store.postgres import PgStore

    class Counting(PgStore):
        fetched = 0

        def _execute(self, sql, params=()):
            cur = super()._execute(sql, params)
            if "FROM kugetsu.tasks" in sql and sql.startswith("SELECT id"):
                Counting.fetched += max(cur.rowcount, 0)
            return cur

    here, there = Counting(pg_url), PgStore(pg_url)
    request.addfinalizer(here.close)
    request.addfinalizer(there.close)
    _admit(there, 300)
    here.read()
    for step in range(3):
        with there.transaction() as txn:
            index = txn.index
            if index.active:
                txn.emit(lifecycle.finish(index, index.active[0], txn.now, 0))
                txn.archive.extend(lifecycle.trim_history(index, 1))
            txn.emit(lifecycle.start(index, index.queued[len(index.queued) // 2], txn.now))
        Counting.fetched = 0
        seen = _lists(here.read())
        with here.transaction() as txn:
            txn.index.queued[-1].priority = "high"
        assert Counting.fetched <= 4, (step, Counting.fetched)
        fresh = PgStore(pg_url)
        assert _lists(fresh.read()) == _lists(here.read()) and seen[0] == _lists(here.read())[0]
        fresh.close()


def test_what_differs_between_one_machine_and_a_cluster_is_asked_of_the_store(make_store, request, tmp_path):
    """`kugetsu stats` reads its window, `hosts` and `doctor` the machines, `logs` a shipped log
    through the store: the front ends do not branch on the mode."""
    a = make_store()
    start = datetime.now(timezone.utc) - timedelta(minutes=1)
    _admit(a, 2)
    with a.transaction() as txn:
        done = txn.index.queued.pop(0)
        done.state, done.finished_at = TaskState.CANCELLED, txn.now
        txn.archive.append(done)
        txn.emit([Event(type="cancelled", at=txn.now, task=done.id, name=done.name)])
    window = a.since(start)
    assert [(e.type, e.task) for e in window.events] == [("queued", 1), ("queued", 2), ("cancelled", 1)]
    assert [t.id for t in window.archived] == [1]
    later = a.since(datetime.now(timezone.utc) + timedelta(minutes=1))
    assert (later.events, later.archived) == ([], [])
    clustered = request.node.callspec.params["make_store"] == "postgresql"
    standing = a.machines(30.0)
    assert (standing is not None) == clustered == (a.machine_rows() is not None)
    if standing is not None:
        assert isinstance(standing[0], datetime) and isinstance(standing[1], list)
    assert (a.mirror_log(1, Home(tmp_path / "home")) is not None) == clustered
