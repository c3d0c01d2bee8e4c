"""The file store at depth (issue 31): a commit appends what it changed to index.journal
instead of writing index.json whole; a transaction that changes nothing writes nothing; what is
on disk is always what the transaction committed, as a fresh reader replays it; a crash's torn
record is never read; a journal of another index.json is never replayed on this one."""

from __future__ import annotations

import json
import os
import threading

import pytest

from conftest import T0, wait_for
from test_edges import _fill, small_tmpfs  # noqa: F401  (small_tmpfs is a fixture)

from kugetsu.core.models import Task, TaskState
from kugetsu.errors import DiskFull, FileError
from kugetsu.paths import Home
from kugetsu.store import files, journal, tracking
from kugetsu.store.files import Store
from kugetsu.store.protocol import encode_index


def _task(i: int) -> Task:
    return Task(id=i, name=f"t{i}", command=["true", f"line\n{i}"], cwd="/", created_at=T0, env={"K": str(i)})


@pytest.fixture
def warm(tmp_path) -> Store:
    """A Store that committed a queue of 50 tasks itself (the service's kind)."""
    store = Store(Home(tmp_path / "home"))
    store.append_commits()
    with store.transaction() as txn:
        txn.index.queued = [_task(i) for i in range(1, 51)]
        txn.index.next_id = 51
    with store.transaction() as txn:  # a second commit on its own index: a record
        txn.index.queued[0].name = "first"
    return store


def _fresh(store: Store) -> bytes:
    """The index a fresh reader reads, encoded."""
    return encode_index(Store(store.home).read())


def _stat(path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _records(home: Home) -> list[dict]:
    lines = home.journal.read_bytes().splitlines()
    assert lines[0].startswith(b"kugetsu-journal 1 ")
    return [json.loads(line[9:]) for line in lines[1:]]


def test_a_transaction_that_changes_nothing_writes_nothing(warm, monkeypatch):
    monkeypatch.setattr(tracking, "VERIFY", False)  # its own check reads the files
    before = (_stat(warm.home.index), _stat(warm.home.journal))
    for _ in range(3):
        with warm.transaction() as txn:
            assert len(txn.index.queued) == 50
    assert (_stat(warm.home.index), _stat(warm.home.journal)) == before


def test_a_change_appends_only_the_tasks_it_touched_and_leaves_index_json_alone(warm):
    index_json = _stat(warm.home.index)
    with warm.transaction() as txn:
        txn.index.queued[10].priority = "high"  # assigned: this task only
    record = _records(warm.home)[-1]
    assert [item["id"] for item in record["queue"] if isinstance(item, dict)] == [11]
    with warm.transaction() as txn:  # admitted at the end, one taken out, one moved to running
        txn.index.queued.append(_task(51))
        txn.index.next_id = 52
        del txn.index.queued[5]
        task = txn.index.queued.pop(0)
        task.state = TaskState.RUNNING
        txn.index.active.append(task)
    record = _records(warm.home)[-1]
    assert [item["id"] for item in record["queue"] if isinstance(item, dict)] == [51]
    assert [t["id"] for t in record["rest"]["active"]] == [1]
    assert _stat(warm.home.index) == index_json  # index.json was not written again
    index = Store(warm.home).read()
    assert [t.id for t in index.active] == [1]
    assert [t.id for t in index.queued] == [i for i in range(2, 52) if i != 6]
    assert next(t for t in index.queued if t.id == 11).priority == "high"


@pytest.mark.parametrize("change", ["header", "queued field", "reorder", "running task", "finished",
                                    "finished dropped", "queue emptied", "nothing"])
def test_every_kind_of_change_reaches_the_disk(warm, change):
    """Each commit on the warm Store leaves on disk what a fresh reader reads as the index."""
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
        elif change in ("finished", "finished dropped"):
            for task in index.queued[:5]:
                task.state = TaskState.SUCCEEDED
            index.finished += index.queued[:5]
            del index.queued[:5]
        elif change == "queue emptied":
            index.queued = []
        expected = encode_index(index)
    assert _fresh(warm) == expected
    with warm.transaction() as txn:  # and the next commit starts from what it wrote
        if change == "finished dropped":
            del txn.index.finished[:2]  # the oldest gone to history.jsonl
            txn.index.finished.append(txn.index.queued.pop(0))
            txn.index.finished[-1].state = TaskState.FAILED
        elif txn.index.queued:
            txn.index.queued[0].name = "again"
        txn.index.paused = not txn.index.paused
        expected = encode_index(txn.index)
    assert _fresh(warm) == expected


def test_another_writer_in_between_is_read_afresh_and_a_one_shot_writer_writes_index_json_whole(warm):
    """A one-shot command (a Store that decoded the index afresh) leaves index.json whole, the
    file a person may repair by hand; the long-lived writer reads it afresh, and appends again
    from its next commit on."""
    other = Store(warm.home)
    with other.transaction() as txn:
        txn.index.queued[3].name = "theirs"
    assert not warm.home.journal.exists()
    assert json.loads(warm.home.index.read_bytes())["queued"][3]["name"] == "theirs"
    with warm.transaction() as txn:
        assert txn.index.queued[3].name == "theirs"
        txn.index.queued[4].name = "ours"
    index_json = _stat(warm.home.index)
    with warm.transaction() as txn:
        txn.index.queued[5].name = "ours too"
    index = Store(warm.home).read()
    assert [t.name for t in index.queued[3:6]] == ["theirs", "ours", "ours too"]
    assert _stat(warm.home.index) == index_json and len(_records(warm.home)) == 1


def test_the_journal_past_a_quarter_of_index_json_is_folded_into_a_new_index_json(warm, monkeypatch):
    monkeypatch.setattr(files, "_JOURNAL_LEAST", 0)  # a quarter of index.json alone
    size = warm.home.index.stat().st_size
    for i in range(40):
        with warm.transaction() as txn:
            txn.index.queued[i].name = f"renamed {i}"
        assert warm.home.journal.stat().st_size <= size // 4 if warm.home.journal.exists() else True
    assert _stat(warm.home.index)[0] != 0 and _fresh(warm) == encode_index(warm.read())
    names = [t.name for t in Store(warm.home).read().queued]
    assert names[:40] == [f"renamed {i}" for i in range(40)]


def test_a_record_cut_short_by_a_crash_is_not_read_and_the_next_writer_cuts_it_off(warm):
    committed = _fresh(warm)
    with open(warm.home.journal, "ab") as f:  # a crash in the middle of an append
        f.write(b"0badc0de {\"rest\":{\"version\":2")
    assert _fresh(warm) == committed
    restarted = Store(warm.home)  # the service that crashed, started again
    restarted.append_commits()
    restarted.read_ahead()
    with restarted.transaction() as txn:
        txn.index.queued[0].name = "after the crash"
        expected = encode_index(txn.index)
    assert _fresh(warm) == expected
    assert len(_records(warm.home)) == 2  # the torn line was cut off, the new record appended
    assert all(line[:8] != b"0badc0de" for line in warm.home.journal.read_bytes().splitlines())


def test_a_damaged_record_with_records_after_it_is_refused_and_nothing_is_written(warm):
    with warm.transaction() as txn:
        txn.index.queued[1].name = "second record"
    data = bytearray(warm.home.journal.read_bytes())
    first = data.index(b"\n") + 1
    data[first + 20] ^= 1  # a bit flipped in the first record
    warm.home.journal.write_bytes(bytes(data))
    with pytest.raises(FileError, match="(?s)index.journal: damaged .*move it away"):
        Store(warm.home).read()
    with pytest.raises(FileError):
        with Store(warm.home).transaction():
            pass
    assert warm.home.journal.read_bytes() == bytes(data)


def test_a_journal_of_another_index_json_is_ignored(warm):
    """index.json put back by hand (a backup, an edit): the journal that followed the old one
    is not replayed on it, and the next record starts a new journal."""
    restored = Store(warm.home).read()
    restored.queued = restored.queued[:3]
    warm.home.index.write_bytes(encode_index(restored))
    assert _fresh(warm) == encode_index(restored)
    service = Store(warm.home)
    service.append_commits()
    service.read_ahead()
    with service.transaction() as txn:
        txn.index.paused = True
        expected = encode_index(txn.index)
    assert _fresh(warm) == expected and len(_records(warm.home)) == 1


def test_readers_see_whole_commits_while_a_writer_appends_and_folds(warm, monkeypatch):
    """A reader takes no lock: while a writer appends records and writes index.json whole
    again and again, every read is some commit's index, in the order they were made."""
    monkeypatch.setattr(files, "_JOURNAL_LEAST", 0)
    monkeypatch.setattr(tracking, "VERIFY", False)
    done = threading.Event()
    seen: list[int] = []

    def write() -> None:
        try:
            for i in range(150):
                with warm.transaction() as txn:
                    txn.index.queued[i % 50].name = f"n{i}"
                    txn.index.next_seq = i + 2  # the commit's number
        finally:
            done.set()

    writer = threading.Thread(target=write)
    writer.start()
    reader = Store(warm.home)
    while not done.is_set():
        index = reader.read()
        seen.append(index.next_seq)
        if index.next_seq > 1:
            i = index.next_seq - 2
            assert index.queued[i % 50].name == f"n{i}"
    writer.join()
    assert seen == sorted(seen) and len(seen) > 5


def test_the_head_read_replays_the_journal(warm):
    with warm.transaction() as txn:
        txn.index.queued[0].memory = 1 << 30
        del txn.index.queued[10:20]
    index, counts = Store(warm.home).read_head()
    assert counts.queued == 40 and counts.accounting
    assert index.queued == [] and index.next_id == 51


def test_the_service_appends_while_it_runs_and_leaves_index_json_whole_when_it_stops(kg):
    """The real service: its commits go to the journal (index.json is not rewritten per task),
    and its stop folds them in, so that with no service running index.json alone is the state."""
    kg.config(max_agents=1, autostart=False)
    for i in range(3):
        kg.delegate(f"t{i}")
    index_json = _stat(kg.home.index)
    kg.ok("serve", "--detach")
    try:
        for i in range(3):
            kg.wait_state(f"t{i}", "succeeded", timeout=60)
        assert _stat(kg.home.index) == index_json  # every start and end was a record
        assert _records(kg.home)  # (a burst of exits shares one record: not one per task)
    finally:
        kg.ok("shutdown")
    wait_for(lambda: kg.service_pid() is None, 15, "the service to stop")
    assert not kg.home.journal.exists()
    on_disk = json.loads(kg.home.index.read_bytes())
    assert sorted((t["name"], t["state"]) for t in on_disk["finished"]) == [(f"t{i}", "succeeded") for i in range(3)]


@pytest.mark.parametrize("seed", range(6))
def test_random_commits_on_a_long_lived_store_always_leave_what_was_committed(tmp_path, monkeypatch, seed):
    """Random changes of the kinds the rules make (the head started, tasks admitted, one
    cancelled in the middle, fields assigned, the order changed, finished tasks trimmed), on a
    warm Store with a small journal limit so that it also folds: after every commit a fresh
    reader reads exactly the index committed."""
    import random

    monkeypatch.setattr(files, "_JOURNAL_LEAST", 4096)
    rng = random.Random(seed)
    store = Store(Home(tmp_path / "home"))
    store.append_commits()
    store.read_ahead()
    next_id = 1
    for _ in range(120):
        with store.transaction() as txn:
            index = txn.index
            for _ in range(rng.randint(1, 3)):
                kind = rng.choice(["start", "start", "admit", "admit", "cancel", "assign", "reorder", "trim", "pause"])
                queued = index.queued
                if kind == "start" and queued:
                    started = rng.randint(1, 3)
                    for task in queued[:started]:
                        task.state = TaskState.SUCCEEDED
                        index.finished.append(task)
                    del queued[:started]
                elif kind == "admit":
                    for _ in range(rng.randint(1, 4)):
                        queued.append(_task(next_id))
                        next_id += 1
                    index.next_id = next_id
                elif kind == "cancel" and queued:
                    task = queued.pop(rng.randrange(len(queued)))
                    task.state = TaskState.CANCELLED
                    index.finished.append(task)
                elif kind == "assign" and queued:
                    rng.choice(queued).name = f"n{rng.random()}"
                elif kind == "reorder" and len(queued) > 1:
                    i, j = rng.randrange(len(queued)), rng.randrange(len(queued))
                    queued[i], queued[j] = queued[j], queued[i]
                elif kind == "trim" and index.finished:
                    del index.finished[:rng.randint(1, 3)]
                elif kind == "pause":
                    index.paused = not index.paused
            expected = encode_index(index)
        assert _fresh(store) == expected


def test_a_long_lived_writer_other_than_the_service_writes_index_json_whole(tmp_path):
    """A dashboard's or an MCP server's Store keeps its index too, but does not fold a journal
    when it stops: its commits leave index.json whole."""
    store = Store(Home(tmp_path / "home"))
    for i in range(1, 4):
        with store.transaction() as txn:
            txn.index.queued.append(_task(i))
            txn.index.next_id = i + 1
    assert not store.home.journal.exists()
    assert [t["id"] for t in json.loads(store.home.index.read_bytes())["queued"]] == [1, 2, 3]


def test_a_full_disk_fails_the_commit_and_leaves_the_journal_as_it_was(small_tmpfs):
    """The service's store on a real 1 MiB tmpfs filled up: its commit raises DiskFull, the
    journal is cut back to its last whole record, a fresh reader reads the index before the
    transaction, and once space is freed the next commit goes on from there."""
    store = Store(Home(small_tmpfs / "home"))
    store.append_commits()
    with store.transaction() as txn:
        txn.index.queued = [_task(i) for i in range(1, 51)]
        txn.index.next_id = 51
    with store.transaction() as txn:
        txn.index.queued[0].name = "first"
    committed, journal_bytes = _fresh(store), store.home.journal.read_bytes()
    _fill(small_tmpfs)
    with pytest.raises(DiskFull, match="disk full: could not write index.journal; nothing was written"):
        with store.transaction() as txn:
            for task in txn.index.queued[:4]:
                task.name = "y" * 8000  # a record of ~32 KB: under the journal's limit, over what is left
    assert store.home.journal.read_bytes() == journal_bytes and _fresh(store) == committed
    (small_tmpfs / "filler").unlink()
    with store.transaction() as txn:
        assert txn.index.queued[0].name == "first"
        txn.index.queued[1].name = "after"
        expected = encode_index(txn.index)
    assert _fresh(store) == expected


def test_a_queued_task_put_back_as_an_equal_copy_and_changed_later_reaches_the_disk(warm, monkeypatch):
    """The head's check compares the queue with == (look.follow): a task replaced by an
    equal copy passes it, and a later change of that copy, unseen by the log of assignments
    (which follows the objects the Store knows), must still be written."""
    import msgspec

    monkeypatch.setattr(tracking, "VERIFY", False)  # what is checked here is the fresh read
    with warm.transaction() as txn:
        txn.index.queued[7] = msgspec.structs.replace(txn.index.queued[7])  # equal, another object
    with warm.transaction() as txn:
        txn.index.queued[7].priority = "high"  # on the copy
        txn.index.queued[7].name = "copied"
        committed = encode_index(txn.index)
    assert _fresh(warm) == committed
    assert Store(warm.home).read().queued[7].name == "copied"


def test_the_services_store_shares_repeated_strings_and_a_change_stays_one_tasks(warm):
    """The Store that keeps its index (the service's) decodes the queued tasks' repeated strings
    as one object each (files._Shared: less memory at depth); a one-shot reader's are its own.
    A change to one task, an assignment or a list's word changed in place, stays that task's,
    on disk too."""
    home = warm.home
    with Store(home).transaction():  # a one-shot writer's: index.json whole, as a service starts on
        pass
    assert not home.journal.exists()
    service = Store(home)
    service.append_commits()
    service.read_ahead()
    with service.transaction() as txn:
        a, b, c = txn.index.queued[:3]
        assert a.cwd is b.cwd and a.command[0] is b.command[0] and a.source is b.source
        assert a.command is not b.command and a.env is not b.env and a.after is not b.after
        a.cwd = "/elsewhere"
        b.command = [*b.command[:1], "changed"]
        assert c.cwd == "/" and c.command == ["true", "line\n3"]
        expected = encode_index(txn.index)
    fresh = Store(home).read()
    assert _fresh(warm) == expected
    assert [t.cwd for t in fresh.queued[:3]] == ["/elsewhere", "/", "/"]
    assert [t.command for t in fresh.queued[:3]] == [["true", "line\n1"], ["true", "changed"], ["true", "line\n3"]]
    plain = Store(home).read().queued
    assert plain[1].cwd is not plain[2].cwd  # a reader that keeps nothing pays nothing for it


def test_a_queued_task_assigned_to_is_found_in_a_queue_out_of_id_order(warm):
    """The record's tasks assigned to are found by their id in a queue in id order, and by
    identity in one that is not (a task sent back to the queue, a reorder): either way the one
    task changed is written, and a fresh reader reads what was committed."""
    with warm.transaction() as txn:
        txn.index.queued.reverse()  # ids 50 down to 1
    for where in (3, 40):
        with warm.transaction() as txn:
            head = txn.index.queued.pop(0)
            head.state = TaskState.RUNNING
            txn.index.active.append(head)
            txn.index.queued[where].name = f"moved{where}"
            expected = encode_index(txn.index)
        record = _records(warm.home)[-1]
        assert [item["name"] for item in record["queue"] if isinstance(item, dict)] == [f"moved{where}"]
        assert _fresh(warm) == expected


@pytest.mark.parametrize("threads", ["a thread", "no thread to be had"])
def test_the_journal_header_worked_out_beside_the_decode_names_the_snapshot(tmp_path, monkeypatch, threads):
    """The service's Store works out the journal's first line (checksums of index.json) on a
    thread while it decodes the index it starts on; with no thread to be had it reads the file
    at the first record instead. Either way the journal follows that index.json: a fresh reader
    replays it, and the header is the file's."""
    home = Home(tmp_path / "home")
    writer = Store(home)
    with writer.transaction() as txn:  # index.json written whole, as a command would
        txn.index.queued.extend(_task(i) for i in range(1, 200))
        txn.index.next_id = 200
    if threads != "a thread":
        def refuse(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Thread, "start", refuse)
    store = Store(home)
    store.append_commits()
    store.read_ahead()
    with store.transaction() as txn:
        txn.index.queued[0].name = "renamed"
        expected = encode_index(txn.index)
    assert store.home.journal.exists()
    first = store.home.journal.read_bytes().split(b"\n", 1)[0] + b"\n"
    assert first == journal.header(store.home.index.read_bytes())
    assert _fresh(store) == expected
