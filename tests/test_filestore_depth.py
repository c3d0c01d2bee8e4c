"""The file store at depth (issue 31): a long-lived writer's transaction that changes nothing
encodes and writes nothing, and one that changes a queued task encodes that task, not the
queue; what is on disk is always what a fresh reader decodes, byte for byte as encode_index
writes it."""

from __future__ import annotations

import os

import pytest

from conftest import T0

from kugetsu.core.models import Task, TaskState
from kugetsu.paths import Home
from kugetsu.store import files, tracking
from kugetsu.store.files import Store
from kugetsu.store.protocol import encode_index


def _task(i: int) -> Task:
    return Task(id=i, name=f"t{i}", command=["true", f"line\n{i}"], cwd="/", created_at=T0, env={"K": str(i)})


@pytest.fixture
def warm(tmp_path) -> Store:
    """A Store that committed a queue of 50 tasks itself (the service's kind)."""
    store = Store(Home(tmp_path / "home"))
    with store.transaction() as txn:
        txn.index.queued = [_task(i) for i in range(1, 51)]
        txn.index.next_id = 51
    with store.transaction() as txn:  # a second commit on its own index: the warm path
        txn.index.queued[0].name = "first"
    return store


def _on_disk(store: Store) -> bytes:
    data = store.home.index.read_bytes()
    assert data == encode_index(Store(store.home).read())  # what a fresh reader decodes
    return data


def _count(store: Store, monkeypatch) -> dict[str, int]:
    """How often the whole index, and how many single queued tasks, get encoded from now on
    by the warm `store`."""
    calls = {"index": 0, "task": 0}
    whole, one = files.encode_index, files._chunk

    def encode_whole(index):
        calls["index"] += 1
        return whole(index)

    def encode_one(task):
        calls["task"] += 1
        return one(task)

    monkeypatch.setattr(files, "encode_index", encode_whole)
    monkeypatch.setattr(files, "_chunk", encode_one)
    monkeypatch.setattr(tracking, "VERIFY", False)  # its own full encoding would count
    with store.transaction() as txn:  # a commit without it (the tests' is on: conftest)
        txn.index.queued[1].name = "second"
    calls.update(index=0, task=0)
    return calls


def test_a_transaction_that_changes_nothing_encodes_and_writes_nothing(warm, monkeypatch):
    calls = _count(warm, monkeypatch)
    before = os.stat(warm.home.index)
    for _ in range(3):
        with warm.transaction() as txn:
            assert len(txn.index.queued) == 50
    assert calls == {"index": 0, "task": 0}
    after = os.stat(warm.home.index)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_change_encodes_only_the_tasks_it_touched(warm, monkeypatch):
    calls = _count(warm, monkeypatch)
    with warm.transaction() as txn:
        txn.index.queued[10].priority = "high"  # assigned: this task only
    assert calls == {"index": 0, "task": 1}
    assert b'"priority": "high"' in _on_disk(warm)
    with warm.transaction() as txn:  # admitted at the end, one taken out, one moved to running
        txn.index.queued.append(_task(51))
        txn.index.next_id = 52
        del txn.index.queued[5]
        task = txn.index.queued.pop(0)
        task.state = TaskState.RUNNING
        txn.index.active.append(task)
    assert calls == {"index": 0, "task": 2}
    index = Store(warm.home).read()
    assert [t.id for t in index.active] == [1]
    assert [t.id for t in index.queued] == [i for i in range(2, 52) if i != 6]
    _on_disk(warm)


@pytest.mark.parametrize("change", ["header", "queued field", "reorder", "running task", "nothing"])
def test_every_kind_of_change_reaches_the_disk(warm, change):
    """Each commit on the warm Store leaves index.json as a fresh reader sees the index."""
    with warm.transaction() as txn:
        index = txn.index
        if change == "header":
            index.paused = True
        elif change == "queued field":
            index.queued[-1].cwd = "/elsewhere"
        elif change == "reorder":
            index.queued.reverse()
        elif change == "running task":
            index.active.append(index.queued.pop())
            index.active[0].state = TaskState.RUNNING
        expected = encode_index(index)
    assert _on_disk(warm) == expected
    with warm.transaction() as txn:  # and the next commit starts from what it wrote
        txn.index.queued[0].name = "again"
        expected = encode_index(txn.index)
    assert _on_disk(warm) == expected


def test_another_writer_in_between_is_read_afresh(warm):
    other = Store(warm.home)
    with other.transaction() as txn:
        txn.index.queued[3].name = "theirs"
    with warm.transaction() as txn:
        assert txn.index.queued[3].name == "theirs"
        txn.index.queued[4].name = "ours"
    index = Store(warm.home).read()
    assert (index.queued[3].name, index.queued[4].name) == ("theirs", "ours")
    _on_disk(warm)
