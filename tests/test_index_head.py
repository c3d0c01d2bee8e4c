"""index.head (issue 31): `capacity` with no service running reads a small summary that every
whole write of index.json leaves beside it, not the whole queue; the summary is only a cache,
taken only while it names the index.json that is there and no journal follows it, so a file
put back by hand, a garbage or planted summary, or a service's appends are read as before."""

from __future__ import annotations

import json
import os
import stat

from conftest import T0

from kugetsu.core.models import Hold, Index, QueueCounts, Task, TaskState
from kugetsu.paths import Home, atomic_write
from kugetsu.store.files import Store
from kugetsu.store.protocol import encode_index


def _task(i: int, **kw: object) -> Task:
    return Task(id=i, name=f"t{i}", command=["true", "x" * 200], cwd="/", created_at=T0, **kw)


def _deep(home: Home, n: int) -> Store:
    """A queue of `n` committed by a command's kind of Store (it writes index.json whole), with
    a held preset's tasks, one declaring memory, one running."""
    store = Store(home)
    with store.transaction() as txn:
        txn.index.queued = [_task(i, agent="codex" if i % 3 == 0 else "claude") for i in range(1, n + 1)]
        txn.index.queued[7].memory = 1 << 30
        txn.index.active = [_task(n + 1, state=TaskState.RUNNING, started_at=T0)]
        txn.index.holds["codex"] = Hold(reason="held by hand", since=T0)
        txn.index.next_id = n + 2
    return store


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_the_head_read_at_depth_reads_a_small_file_and_counts_as_the_whole_read(tmp_path):
    home = Home(tmp_path / "home")
    _deep(home, 10_000)
    Store(home).read_head()  # anything imported on the way is read now, not below
    before = _rchar()
    index, counts = Store(home).read_head()
    read = _rchar() - before
    whole = Store(home).read()
    assert counts == QueueCounts.of(whole.queued, whole.holds) == QueueCounts(
        queued=10_000, held_agents={"codex": 3333}, accounting=True)
    assert index.queued == index.finished == [] and [t.id for t in index.active] == [10_001]
    assert index.holds == whole.holds and index.next_id == 10_002
    assert home.index.stat().st_size > 2_000_000
    assert read < 64 << 10, f"read {read} bytes for a queue of 10,000"
    assert stat.S_IMODE(os.stat(home.head).st_mode) == 0o600


def test_an_index_json_put_back_by_hand_is_read_not_the_summary(tmp_path):
    home = Home(tmp_path / "home")
    _deep(home, 50)
    other = Index(next_id=4, queued=[_task(1), _task(2), _task(3, memory=1 << 20)])
    atomic_write(home.index, encode_index(other))  # renamed in: another file
    assert Store(home).read_head()[1] == QueueCounts(queued=3, accounting=True)
    with open(home.index, "r+b") as f:  # written over in place: the same file, other bytes
        data = encode_index(Index(next_id=3, queued=[_task(1), _task(2)]))
        f.write(data)
        f.truncate(len(data))
    assert Store(home).read_head()[1] == QueueCounts(queued=2)


def test_a_damaged_or_planted_summary_is_ignored_and_the_next_write_replaces_it(tmp_path):
    home = Home(tmp_path / "home")
    store = _deep(home, 30)
    head = home.head
    expected = QueueCounts(queued=30, held_agents={"codex": 10}, accounting=True)
    for junk in (b"", b"{", b'{"of": [1, 2, 3, 4, 5]}', b"\xff" * 100, head.read_bytes()[:-5], b"[]" * 10):
        head.write_bytes(junk)
        assert Store(home).read_head()[1] == expected, junk
    secret = tmp_path / "elsewhere"
    secret.write_bytes(b"not kugetsu's")
    head.unlink()
    head.symlink_to(secret)
    assert Store(home).read_head()[1] == expected
    with store.transaction() as txn:
        txn.index.queued.pop(0)
    assert not head.is_symlink() and secret.read_bytes() == b"not kugetsu's"
    assert Store(home).read_head()[1] == QueueCounts(queued=29, held_agents={"codex": 10}, accounting=True)


def test_while_a_journal_follows_index_json_the_summary_is_not_taken(tmp_path):
    home = Home(tmp_path / "home")
    service = Store(home)  # the long-lived kind: its commits append to the journal
    service.append_commits()
    with service.transaction() as txn:
        txn.index.queued = [_task(i) for i in range(1, 41)]
        txn.index.next_id = 41
    with service.transaction() as txn:
        del txn.index.queued[:10]
        txn.index.paused = True
    assert home.journal.exists()
    index, counts = Store(home).read_head()
    assert counts == QueueCounts(queued=30) and index.paused
    service.fold()  # as the service stops: index.json whole again, and its summary with it
    assert not home.journal.exists()
    assert Store(home).read_head()[1] == QueueCounts(queued=30)


def test_capacity_through_the_cli_agrees_with_or_without_the_summary(kg):
    kg.config(max_agents=2, autostart=False)
    kg.ok("pause")  # all five stay queued
    for i in range(5):
        kg.ok("delegate", f"t{i}", *(["--memory", "1G"] if i == 2 else []), "--", "true")
    kg.ok("hold", "claude")
    with_head = kg.json("capacity")
    assert kg.home.head.exists()
    kg.home.head.unlink()
    without = kg.json("capacity")
    assert with_head == without and with_head["queued"] == 5, (with_head, without)
    kg.ok("cancel", "t0")
    assert kg.json("capacity")["queued"] == 4
    assert json.loads(kg.home.index.read_bytes())["queued"][0]["name"] == "t1"
