"""Store: locked, atomic transactions on index.json, and the events.jsonl feed.

Every change of the index is one transaction: an exclusive kernel lock on index.lock
(released by the kernel if the holder dies), read, change, write by temp file + fsync +
rename + directory fsync. Readers need no lock: the rename is atomic.

Events are committed inside the index (its `outbox`) and appended to events.jsonl after
the rename; a process that dies in between leaves them in the outbox, and the next
transaction appends them. So events.jsonl needs no fsync of its own and loses nothing.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import re
import threading
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from contextlib import contextmanager
from itertools import accumulate
from datetime import datetime, timezone
from typing import TypeVar

import msgspec

from kugetsu.config.explain import describe_decode_error
from kugetsu.config.load import store_url
from kugetsu.config.model import Config
from kugetsu.errors import DiskFull, FileError
from kugetsu.core.models import INDEX_VERSION, Event, Index, QueueCounts, Task, check_index, upgrade
from kugetsu.store import tracking
from kugetsu.store.protocol import (Since, StoreProtocol, Transactions, Txn, decode_events, decode_head, encode_index,
                                    encoder, held, index_decoder, mark_writer)
from kugetsu.paths import Home, atomic_write, open_file, read_file, read_tail


_Decoded = TypeVar("_Decoded", Index, tuple[Index, QueueCounts])
log = logging.getLogger("kugetsu.store")  # the name its lines had before the store became a package
_stores: dict[str, Store] = {}  # open_store's file Stores of the main thread, by home


def open_store(home: Home) -> StoreProtocol:
    """The store of this home: the cluster's database when config `store` (or KUGETSU_STORE)
    names one, else the file store."""
    return store_at(home, store_url(home))


def store_of(cfg: Config, home: Home | None = None) -> StoreProtocol:
    """The store a loaded config names (without reading the config again). `home` is needed
    for the file store only: a caller without one asks what only a cluster has."""
    return store_at(home, cfg.store)


def store_at(home: Home | None, url: str | None) -> StoreProtocol:
    """The cluster's database at `url`, or (None) this home's file store."""
    if url is None:
        if home is None:
            raise ValueError("the file store is a home's: a caller without one asks what only a cluster has")
        # The main thread keeps one Store per home: a brief CLI command keeps what it
        # committed to its fast exit instead of freeing it task by task, and a process that
        # commits again skips decoding its own last write. Other threads (a server's worker
        # pool) get a fresh one each time: a Store keeps its last committed index, and one
        # per pool thread would keep as many copies of a long queue.
        if threading.current_thread() is not threading.main_thread():
            return Store(home)
        store = _stores.get(str(home.root))
        if store is None:
            store = _stores[str(home.root)] = Store(home)
        return store
    from kugetsu.store.postgres import store_for  # cluster mode only: psycopg is not light

    return store_for(url)


class Store(Transactions):
    """The file store: index.json under a kernel lock, events.jsonl (docs/architecture.md §3)."""

    def __init__(self, home: Home):
        self.home = home
        self._ensured = False
        self._appended = 0  # the last event seq this Store appended itself (no need to re-check it)
        # The index this Store last committed, with its bytes: a long-lived writer (the
        # service) skips decoding a file that is byte for byte what it wrote.
        self._committed: tuple[bytes, Index] | None = None
        # What that index was when committed (_Snapshot): a transaction on it that changed
        # nothing is found without encoding the queue, and writes nothing.
        self._snapshot: _Snapshot | None = None
        self._began: _Snapshot | None = None  # the snapshot of the transaction under way
        # Where each queued task of the last committed index is in index.json, as of `_since`:
        # a commit on that same index encodes the tasks assigned to since (its take) and cuts
        # the rest out of the bytes it began with (Txn.before: byte for byte what this Store
        # committed), so the queue's bytes are kept once, in `_committed`, not again per task
        # (~20 MB at 50,000 queued) or joined (~14 MB). An index decoded afresh (a one-shot
        # CLI command's, the service's after another writer) is encoded whole.
        self._places: dict[int, int] = {}  # a queued task's place in `_cached`, by id()
        self._cached: list[Task] = []  # keeps each task placed, so its id() stays its own
        self._steps = array("q")  # each place's bytes in the queue, with the ",\n" after it
        self._queue_at = 0  # where the queue's bytes start in the committed index.json
        self._since = tracking.Cursor()
        self._warm = False  # the transaction under way is on the index this Store committed
        self._lock_fd: int | None = None  # index.lock, open and locked while a transaction runs
        # Bumped whenever the committed queue may differ from the one committed before
        # (queue_version): a transaction on an index decoded afresh, a commit that encoded a
        # queued task again or changed the list.
        self._queue_version = 0
        self._ahead: tuple[bytes, Index] | None = None  # read_ahead's index, for the next begin

    # ---- reading (no lock) ---------------------------------------------------------

    def _read_bytes(self) -> bytes | None:
        """index.json's bytes; None when there is none yet (an empty file is a damaged one)."""
        try:
            fd = open_file(self.home.index, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def _load(self, reuse: tuple[bytes, Index] | None = None) -> tuple[Index, bytes]:
        if reuse is not None and self._holds(reuse[0]):
            return reuse[1], reuse[0]
        data = self._read_bytes()
        if data is None:
            return Index(), b""
        index = upgrade(self._decoded(data, index_decoder.decode), data)  # a version-1 index: its runs
        self._check(index)
        return index, data

    def _holds(self, data: bytes) -> bool:
        """Whether index.json is byte for byte `data`, read and compared a piece at a time: the
        service's every transaction asks this of what it committed, and a copy of the whole file
        (14 MB at 50,000 queued), freed at once, stayed in the heap all the same."""
        try:
            fd = open_file(self.home.index, os.O_RDONLY)
        except FileNotFoundError:
            return False
        with os.fdopen(fd, "rb", buffering=0) as f:
            if os.fstat(fd).st_size != len(data):
                return False
            at = 0
            while piece := f.read(_PIECE):
                if data[at:at + len(piece)] != piece:
                    return False
                at += len(piece)
            return at == len(data)

    def _decoded(self, data: bytes, decode: Callable[[bytes], _Decoded]) -> _Decoded:
        """`decode(data)`; a damaged index raises FileError. The cyclic garbage collector is
        off meanwhile: it would walk the index being built over and over, every object of
        which is still reachable (4x the decode's own time at 50,000 tasks, in the service)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return decode(data)
        # RecursionError: absurdly deep nesting; UnicodeDecodeError: non-UTF-8 bytes in a string
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as err:
            raise FileError(_describe_index_error(self.home, data, err) + _FIX) from None
        finally:
            if collecting:
                gc.enable()

    def _check(self, index: Index) -> None:
        problem = check_index(index) if index.version == INDEX_VERSION else f"unknown version {index.version}"
        if problem:
            raise FileError(f"{self.home.index}: {problem}{_FIX}")

    def read(self) -> Index:
        """The committed index, as a reader sees it (no lock; never half-written)."""
        return self._load()[0]

    def read_ahead(self) -> None:
        """Read (and check) the committed index and keep it for this Store's next transaction,
        which then decodes nothing if the file is still byte for byte the same: the service's
        start read its index twice (0.3 s each at 50,000 queued). Kept as another writer's
        (not `unchanged`: its clock and counters are looked at as after any other writer)."""
        index, data = self._load()
        self._ahead = (data, index) if data else None

    def read_head(self) -> tuple[Index, QueueCounts]:
        """The committed index without its queued and finished tasks, and the queued tasks'
        counts: what `capacity` needs, without decoding a long queue. Its check (check_index)
        sees the running tasks and the rest; `read` checks the skipped tasks too."""
        data = self._read_bytes()
        if data is None:
            return Index(), QueueCounts(queued=0)
        index, counts = self._decoded(data, decode_head)
        if index.version != INDEX_VERSION:
            return super().read_head()  # another version: `read` reads it whole (or refuses it)
        self._check(index)
        return index, counts

    def stamp(self) -> tuple[int, int, int]:
        """index.json's inode, mtime and size: every commit renames a new file in (the size
        tells two files apart should the second reuse the first's inode within one tick)."""
        try:
            st = os.stat(self.home.index)
        except FileNotFoundError:
            return 0, 0, 0
        return st.st_ino, st.st_mtime_ns, st.st_size

    def watch(self) -> None:
        """None: no descriptor tells of a rename (inotify is not in the standard library);
        a waiter watches the agents' pidfds and looks at the stamp."""
        return None

    def read_events(self, after: int = 0) -> list[Event]:
        """Events with seq > after, oldest first (events.jsonl.1, then events.jsonl)."""
        parts = []
        for path in (self.home.events_old, self.home.events):
            try:
                parts.append(path.read_bytes())
            except FileNotFoundError:
                pass
        return [e for e in decode_events(b"\n".join(parts)) if e.seq > after]  # "\n": a torn last line stays apart

    def tail_events(self, count: int) -> list[Event]:
        """The last `count` events, cheaply: reads only the end of the file (and of the
        rotated one, when the current file is still short)."""
        if not count:
            return []
        size = max(4096, count * 400)
        events = decode_events(read_tail(self.home.events, size))
        if len(events) < count:
            first = events[0].seq if events else None
            events = [e for e in decode_events(read_tail(self.home.events_old, size)) if first is None or e.seq < first] + events
        return events[-count:]

    # ---- writing -------------------------------------------------------------------

    def since(self, start: datetime) -> Since:
        """events.jsonl and history.jsonl read backwards to `start` (store/history.py)."""
        from kugetsu.store import history  # `kugetsu stats` only

        events, prior = history.events_since(self.home, start)
        return Since(events, history.history_since(self.home, start), prior)

    def begin(self, now: datetime | None = None) -> Txn:
        """Lock and load: a transaction that `commit` or `abort` ends. Between the two the lock
        is held, so a long-lived writer may make several changes in one transaction (the
        service does, for exits that come in a burst).

        `now` is read here, after the lock is taken: read before, a writer that waited for
        the lock would stamp its events earlier than those of the writer before it."""
        self._lock()
        try:
            # Taken out while the transaction runs: a failed one may leave the object half
            # changed, and it must never be reused.
            reuse, self._committed = self._committed, None
            snapshot, self._snapshot = self._snapshot, None
            ahead, self._ahead = self._ahead, None
            index, before = self._load(reuse or ahead)
            unchanged = reuse is not None and index is reuse[1]
            self._began = snapshot if unchanged else None
            self._warm = unchanged
            if not unchanged:
                self._queue_version += 1
                _keep_counters_ahead(self.home, index, before)
            self._recover_outbox(index)
        except BaseException:
            self._unlock()
            raise
        return Txn(index, now or datetime.now(timezone.utc), unchanged=unchanged, before=before)

    def queue_version(self) -> int | None:
        return self._queue_version

    def commit(self, txn: Txn) -> None:
        """Write what the transaction changed, and let go of the lock. A disk that is full
        raises DiskFull, and the index on disk is the one before the transaction."""
        try:
            began, self._began = self._began, None
            if began is not None and not (txn.prompts or txn.archive or txn.events) and began.same(txn.index):
                # Nothing changed: nothing encoded, nothing written (the service's safety-net
                # tick at a long queue). The index stays the one committed, and its snapshot.
                self._committed, self._snapshot = (txn.before, txn.index), began
                return
            data = self._commit(txn)
            self._committed = (data, txn.index)
            self._snapshot = _Snapshot.of(txn.index, self._since.at)
        except BaseException as err:
            self._queue_version += 1  # nothing known of what is committed: derive it afresh
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                what = Path(err.filename).name if isinstance(err.filename, str) else self.home.index.name
                raise DiskFull(
                    f"disk full: could not write {what}; nothing was written."
                    f" Free some space in {self.home.root} and try again."
                ) from None
            raise
        finally:
            self._unlock()

    def abort(self) -> None:
        """Let go of the lock, writing nothing."""
        self._began = None
        self._unlock()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self._lock()
        try:
            yield
        finally:
            self._unlock()

    def _lock(self) -> None:
        """The exclusive kernel lock on index.lock (released by the kernel if we die)."""
        if getattr(held, "depth", 0) or self._lock_fd is not None:  # this thread, or this Store (one writer)
            raise RuntimeError("nested kugetsu transaction (it would deadlock on index.lock)")
        if not self._ensured:
            self.home.ensure()
            self._ensured = True
        try:
            fd = open_file(self.home.lock, os.O_RDWR | os.O_CREAT)
        except FileNotFoundError:  # the home was removed under a long-lived Store (open_store's)
            self.home.ensure()
            fd = open_file(self.home.lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        held.depth = 1

    def _unlock(self) -> None:
        held.depth = 0
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # releases the lock

    def prompts(self, ids: Iterable[int]) -> dict[int, str]:
        """Each prompt is logs/<id>.prompt (0600), the file a {prompt_file} preset's agent reads.
        For many ids (`queue --json` of a long queue) logs/ is listed once, and only the
        prompts that are there are opened: a task without one costs no failed open."""
        ids = list(ids)
        logs = str(self.home.logs)
        present: set[str] | None = None
        if len(ids) > _LIST_PROMPTS_PAST:
            try:
                present = set(os.listdir(logs))
            except OSError:
                present = None  # look at each, as for a few
        out = {}
        for task_id in ids:
            name = f"{task_id}.prompt"
            if present is not None and name not in present:
                continue
            path = os.path.join(logs, name)
            try:
                out[task_id] = read_file(path).decode("utf-8", "replace")
            except FileNotFoundError:
                pass
            except OSError as err:  # a planted link (ELOOP), a file made unreadable: that task's alone
                log.warning("the prompt of task #%d cannot be read (%s): %s", task_id, path, err.strerror or err)
        return out

    def _write_prompts(self, prompts: dict[int, str]) -> dict[Path, bytes | None]:
        """Write the transaction's prompts, each whole or not at all (a new 0600 file renamed
        over the old). Returns what each file held before, for _restore_prompts."""
        before: dict[Path, bytes | None] = {}
        try:
            for task_id, text in prompts.items():
                path = self.home.prompt_file(task_id)
                try:
                    before[path] = read_file(path)
                except FileNotFoundError:
                    before[path] = None
                atomic_write(path, text.encode())
        except BaseException:
            _restore_prompts(before)
            raise
        return before

    def _commit(self, txn: Txn) -> bytes:
        """Write what the transaction changed; returns the index's bytes as now on disk."""
        # Prompts first: the committed index must find its tasks' prompts after a crash.
        # Should the index write fail, each is put back as it was.
        written = self._write_prompts(txn.prompts) if txn.prompts else {}
        try:
            return self._commit_index(txn)
        except BaseException:
            _restore_prompts(written)
            raise

    def _commit_index(self, txn: Txn) -> bytes:
        index = txn.index
        mark_writer(txn)
        for event in txn.events:
            event.seq = index.next_seq
            index.next_seq += 1
        if txn.events:
            index.outbox = txn.events
        if txn.archive:
            # Before the index write: a crash in between repeats lines (readers keep the
            # last line of an id), it never loses one.
            _append(self.home.history, b"".join(encoder.encode(t) + b"\n" for t in txn.archive), sync=True)
        data = self._encode(index, txn.before)
        if data != txn.before:
            atomic_write(self.home.index, data)
        if txn.events:
            try:
                _append_events(self.home.events, txn.events)
                self._appended = txn.events[-1].seq
            except OSError:
                pass  # committed all the same: the outbox holds them, the next transaction appends them
        return data

    def _encode(self, index: Index, before: bytes) -> bytes:
        """encode_index(index), byte for byte, encoding only the queued tasks that are new or
        were assigned to since the last commit (the queue of a long-lived writer at depth);
        the others' bytes are cut out of `before`, the index this warm transaction began with.
        Whole-queue steps are C's (map, zip, slices, joins): a step per task in Python would
        cost what the encoding saves."""
        queued = index.queued
        # Taken before encoding: an assignment from here on is the next commit's to see.
        changed = None
        if self._warm and self._places:
            changed = self._since.take()
        else:
            self._since.skip()
        if changed is None:  # a first commit, an index decoded afresh (or more assigned than the log keeps)
            self._queue_version += 1
            data = encode_index(index)
            self._place(queued, data)
            return data
        ids = list(map(id, queued))
        places: list[int | None] = list(map(self._places.get, ids))
        redo = set()
        if None in places:
            redo.update(i for i, place in enumerate(places) if place is None)
        stale = changed.keys() & self._places.keys()
        if stale:
            redo.update(i for i, key in enumerate(ids) if key in stale)
        tracking.track([queued[i] for i in redo])
        old = memoryview(before)[self._queue_at:]  # the queue's bytes as committed, and what follows
        joined: bytes | memoryview | None = None
        if not queued:
            self._queue_version += 1
            self._places, self._cached, self._steps = {}, [], array("q")  # the next commit encodes whole
        elif redo or len(ids) != len(self._cached) or places != list(range(len(ids))):
            self._queue_version += 1  # a task new, gone, moved or assigned to
            for i in redo:
                places[i] = None
            joined, self._steps = _joined(places, queued, old, self._steps)
            self._places = dict(zip(ids, range(len(ids))))
            self._cached = list(queued)
        else:  # the queue's bytes are the last commit's (a running task's figures changed)
            joined = old[:sum(self._steps) - 2]
        data, self._queue_at = _with_queue(index, joined)
        if tracking.VERIFY and data != encode_index(index):
            raise AssertionError("the index was changed in a way the file store's cache does not see"
                                 " (a queued task changed in place, not by assigning to a field)")
        return data

    def _place(self, queued: list[Task], data: bytes) -> None:
        """Where `queued`'s tasks are in `data` (encode_index's); none when they cannot be told
        apart (the next commit then encodes the index whole). Makes each queued task Tracked
        (for _Snapshot too)."""
        tracking.track(queued)
        self._places, self._cached, self._steps = {}, [], array("q")
        start = data.find(_QUEUE_OPEN)
        if start < 0:
            return
        start += len(_QUEUE_OPEN)
        end = data.find(_QUEUE_CLOSE, start)
        pieces = data[start:end].split(_TASK_SEP)
        if end < 0 or len(pieces) != len(queued):
            return
        # Each piece but the first lost the separator's 8 bytes (",\n" and its own "    {\n");
        # a step is a task's bytes and the ",\n" after it (the last one's too: the steps add
        # up to the queue's length + 2).
        steps = array("q", map((8).__add__, map(len, pieces)))
        steps[0] -= 6
        self._steps = steps
        self._queue_at = start
        self._places = dict(zip(map(id, queued), range(len(queued))))
        self._cached = list(queued)

    def rotate_events(self, limit: int) -> int | None:
        """Once events.jsonl is past `limit` bytes, it becomes events.jsonl.1 (replacing the
        older one) and the next event starts a new file: disk use stays under about twice
        the limit. Under the index lock, which every append holds, so no line is cut in two.
        Returns the size of the file rotated, or None."""
        try:
            if os.stat(self.home.events).st_size <= limit:
                return None  # the common case, without the lock
        except FileNotFoundError:
            return None
        with self._locked():
            size = os.stat(self.home.events).st_size
            if size <= limit:
                return None
            os.replace(self.home.events, self.home.events_old)
        return size

    def _recover_outbox(self, index: Index) -> None:
        if not index.outbox or index.outbox[-1].seq <= self._appended:
            return  # nothing, or this very Store appended it (the service's hot path)
        last = _last_seq(self.home)
        missing = [e for e in index.outbox if e.seq > last]
        if missing:
            _append_events(self.home.events, missing)


class _Snapshot:
    """A committed index as it was: its queue (the list's tasks, by identity; Tracked, so an
    assignment to any of them is seen), where the log of assignments was (tracking.mark), and the
    encoding of everything else (running and finished tasks, counters, the outbox...), which
    is short: compared whole, it sees a change made in place too."""

    __slots__ = ("index", "queued", "mark", "rest", "data")

    def __init__(self, index: Index, queued: list[Task], mark: int, rest: bytes, data: bytes | None):
        self.index = index
        self.queued = queued
        self.mark = mark
        self.rest = rest
        self.data = data  # the whole encoding, kept only under tracking.VERIFY

    @classmethod
    def of(cls, index: Index, mark: int) -> _Snapshot:
        """Of an index just committed, encoded as of `mark`: Store._encode made its queued
        tasks Tracked."""
        return cls(index, list(index.queued), mark, _encode_rest(index),
                   encode_index(index) if tracking.VERIFY else None)

    def same(self, index: Index) -> bool:
        """Whether `index` is this snapshot's, unchanged: no Tracked task was assigned to since
        (any task of any store: a few too many at worst, never one too few)."""
        same = (index is self.index and tracking.mark() == self.mark and index.queued == self.queued
                and _encode_rest(index) == self.rest)
        if same and self.data is not None and encode_index(index) != self.data:
            raise AssertionError("the index was changed in a way the file store's snapshot does not see"
                                 " (a queued task changed in place, not by assigning to a field)")
        return same


# index.json is formatted with an indent of 2: each queued task is an object at indent 4 in
# the top-level "queued" list, whose lines are found by their indent alone (a JSON string
# holds no raw newline).
_QUEUE_OPEN, _QUEUE_EMPTY, _QUEUE_CLOSE = b'\n  "queued": [\n', b'\n  "queued": [],\n', b"\n  ],\n"
_TASK_SEP = b",\n    {\n"


def _chunk(task: Task) -> bytes:
    """The task as encode_index writes it inside the queue."""
    return b"    " + msgspec.json.format(encoder.encode(task), indent=2).replace(b"\n", b"\n    ")


def _with_queue(index: Index, joined: bytes | memoryview | None) -> tuple[bytes, int]:
    """encode_index(index) from its queued tasks' bytes, joined by ",\n" (None: no queue), and
    where those start in it."""
    rest = msgspec.json.format(encoder.encode(msgspec.structs.replace(index, queued=[])), indent=2) + b"\n"
    if joined is None:
        return rest, 0
    at = rest.index(_QUEUE_EMPTY)
    data = b"".join((rest[:at], _QUEUE_OPEN, joined, _QUEUE_CLOSE, rest[at + len(_QUEUE_EMPTY):]))
    return data, at + len(_QUEUE_OPEN)


def _joined(places: list[int | None], queued: list[Task], old: memoryview, steps: array) -> tuple[bytes, array]:
    """The queue's bytes, as encode_index writes them, and their steps: `places` has each
    queued task's place in the queue last committed, whose bytes start `old` (each place's
    bytes and ",\n" are its step), or None for a task to encode. A run of tasks still in the
    order they had there is one slice of `old`, copied once by the join."""
    starts = list(accumulate(steps, initial=0))  # where each place's bytes start in `old`
    runs: list[tuple[int, int]] = []
    for lo, hi in _runs(places, 0, len(places)):
        if runs and _continues(places, runs[-1], lo):
            runs[-1] = (runs[-1][0], hi)  # the two halves of one run, cut apart by _runs
        else:
            runs.append((lo, hi))
    parts: list[bytes | memoryview] = []
    joined_steps = array("q")
    for lo, hi in runs:
        first = places[lo]
        if first is None:
            for task in queued[lo:hi]:
                chunk = _chunk(task)
                parts.append(chunk)
                joined_steps.append(len(chunk) + 2)
        else:
            last = first + hi - lo
            parts.append(old[starts[first]:starts[last] - 2])
            joined_steps.extend(steps[first:last])
    return b",\n".join(parts), joined_steps


def _continues(places: list[int | None], run: tuple[int, int], lo: int) -> bool:
    """Whether places[lo] is the place after the run's last."""
    first, start = places[run[0]], places[lo]
    return first is not None and start is not None and first + run[1] - run[0] == start


def _runs(places: list[int | None], lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """places[lo:hi] cut, in order, into ranges that are each all None or consecutive places,
    by halving: a few C comparisons of long stretches when a few tasks changed (the queue's head
    gone, a task assigned to, new ones at the end)."""
    first = places[lo]
    if first is None:
        if places[lo:hi].count(None) == hi - lo:
            yield lo, hi
            return
    elif places[hi - 1] == first + hi - 1 - lo and places[lo:hi] == list(range(first, first + hi - lo)):
        yield lo, hi
        return
    mid = (lo + hi) // 2
    yield from _runs(places, lo, mid)
    yield from _runs(places, mid, hi)


def _encode_rest(index: Index) -> bytes:
    """The index without its queue, encoded."""
    return encoder.encode(msgspec.structs.replace(index, queued=[]))


_PIECE = 1 << 20  # bytes of index.json read at a time by Store._holds

# Past this many ids, `prompts` lists logs/ once rather than trying to open each prompt.
_LIST_PROMPTS_PAST = 64

_FIX = (
    "\nNothing was changed. Repair the file by hand, or move it away to start with an empty"
    " queue (running agents are not affected)."
)


def _describe_index_error(home: Home, data: bytes, err: Exception) -> str:
    text = str(err)
    if re.match(r"Object (contains unknown|missing required) field `[^`]*`$", text):  # top level only
        return f"{home.index}: not a kugetsu index ({text[0].lower()}{text[1:]})"
    return describe_decode_error(home.index, data, err)


def _keep_counters_ahead(home: Home, index: Index, data: bytes) -> None:
    """Ids and event seqs never go back, even when index.json was moved away, replaced by an
    older copy or restored from a backup: a new task must never take an old task's id, and
    with it its log and exit file (it would be "finished" before it ran). Cheap checks on
    every index a writer loads afresh; the full look through logs/, events and history only
    when one of them shows the index is behind."""
    behind = not data or _last_seq(home) >= index.next_seq
    if not behind:
        behind = any(
            os.path.lexists(p) for p in (home.log(index.next_id), home.exit_file(index.next_id))
        )
    if not behind:
        return
    top_id, top_seq = _high_water(home)
    index.next_id = max(index.next_id, top_id + 1)
    index.next_seq = max(index.next_seq, top_seq + 1)


def _restore_prompts(before: dict[Path, bytes | None]) -> None:
    """Prompt files as they were before a transaction that did not commit."""
    for path, data in before.items():
        try:
            if data is None:
                path.unlink(missing_ok=True)
            else:
                atomic_write(path, data)
        except OSError:
            pass  # a full disk: the index that refers to the file was not written either


_LOG_NAME = re.compile(r"^(\d+)\.[a-z]+$")


def _high_water(home: Home) -> tuple[int, int]:
    """The highest task id and event seq anything in the home still shows."""
    top_id = top_seq = 0
    try:
        names = os.listdir(home.logs)
    except OSError:
        names = []
    for name in names:
        m = _LOG_NAME.match(name)
        if m:
            top_id = max(top_id, int(m.group(1)))
    for path in (home.events_old, home.events):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for event in decode_events(data):
            top_seq = max(top_seq, event.seq)
            if event.task is not None:
                top_id = max(top_id, event.task)
    try:
        with open(home.history, "rb") as f:
            for line in f:
                m = re.match(rb'\{"id":(\d+)', line)
                if m:
                    top_id = max(top_id, int(m.group(1)))
    except OSError:
        pass
    return top_id, top_seq


def _append(path: os.PathLike[str], data: bytes, sync: bool = False) -> None:
    fd = open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _append_events(path: os.PathLike[str], events: list[Event]) -> None:
    data = b"".join(encoder.encode(e) + b"\n" for e in events)
    fd = open_file(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # end a line torn by a crash, so this one stays readable
        os.write(fd, data)
    finally:
        os.close(fd)


def _last_seq(home: Home) -> int:
    """The seq of the last appended event; in events.jsonl.1 when a rotation has just
    started a new, still empty events.jsonl."""
    for path in (home.events, home.events_old):
        events = decode_events(read_tail(path, 4096))
        if events:
            return events[-1].seq
    return 0
