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
import io
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from contextlib import contextmanager
from itertools import compress, islice
from bisect import bisect_left
from operator import attrgetter
from datetime import datetime, timezone
from types import ModuleType
from typing import NamedTuple, TypeVar

import msgspec

from kugetsu.config.explain import describe_decode_error
from kugetsu.config.load import store_url
from kugetsu.config.model import Config
from kugetsu.errors import DiskFull, FileError, warn
from kugetsu.core.look import follow
from kugetsu.core.models import INDEX_VERSION, Event, Index, QueueCounts, Task, TaskState, check_index, upgrade
from kugetsu.store import head, tracking
from kugetsu.store.protocol import (IndexFile, Since, StoreProtocol, Transactions, Txn, count_queued, decode_events,
                                    encode_index, encoder, head_of, held, index_decoder, mark_writer)
from kugetsu.paths import Home, atomic_write, open_file, read_file, read_tail


_Decoded = TypeVar("_Decoded", Index, tuple[Index, list[msgspec.Raw]])
_stores: dict[str, Store] = {}  # open_store's file Stores of the main thread, by home


def _warn(message: str, *args: object) -> None:
    warn("kugetsu.store", message, *args)  # the name its lines had before the store became a package


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
    """The file store: index.json and index.journal under a kernel lock, events.jsonl
    (docs/architecture.md §3)."""

    def __init__(self, home: Home):
        self.home = home
        self._ensured = False
        self._appended = 0  # the last event seq this Store appended itself (no need to re-check it)
        # The index this Store last committed: a long-lived writer (the service) whose files
        # are still as it left them (_OnDisk) decodes nothing.
        self._committed: Index | None = None
        # What that index was when committed (_Snapshot): a transaction on it that changed
        # nothing is found without encoding the queue, and writes nothing.
        self._snapshot: _Snapshot | None = None
        self._began: _Snapshot | None = None  # the snapshot of the transaction under way
        self._disk: _OnDisk | None = None  # index.json and index.journal as last read or written
        # What the index last committed (or loaded by a writer) was, for the next record: its
        # queue (the tasks, by identity), the finished tasks' encodings, and the rest's
        # (journal.encode). No map of each task's place is kept: at 50,000 queued it held ~5.6
        # MB of the service's RSS, and a drain's or an admission's commit needs none
        # (_assigned_among).
        self._queue: list[Task] = []
        self._finished: list[bytes] = []
        self._rest = b""
        # The next commit writes index.json whole: the transaction's index was decoded afresh (a
        # one-shot command's, the service's after another writer), or it is a version-1 file.
        # Only a Store that keeps its index (the service's, an MCP server's) appends to the
        # journal: a command run while neither runs leaves index.json whole, the file a person
        # may repair by hand.
        self._whole = True
        self._old = False  # the index last loaded was a version-1 file (written anew, as version 2)
        self._appends = False  # append_commits: this Store's writer folds the journal when it stops
        self._since = tracking.Cursor()
        self._lock_fd: int | None = None  # index.lock, open and locked while a transaction runs
        # Bumped whenever the committed queue may differ from the one committed before
        # (queue_version): a transaction on an index decoded afresh, a commit that changed the queue.
        self._queue_version = 0
        self._ahead: Index | None = None  # read_ahead's index, for the next begin

    # ---- reading (no lock) ---------------------------------------------------------

    def _files(self) -> _Files | None:
        """index.json's and index.journal's bytes and identities, as one commit left them (None:
        no index.json yet; an empty file is a damaged one). A reader holds no lock: should a
        writer write index.json whole between the two reads (and remove the journal that went
        with the old one), both are read again."""
        for _ in range(_CONSISTENT_TRIES):
            try:
                fd = open_file(self.home.index, os.O_RDONLY)
            except FileNotFoundError:
                return None
            f = os.fdopen(fd, "rb", buffering=0)
            try:
                key = _key(os.fstat(fd))
                data = f.readall()
                journal_data, journal_key = _read(self.home.journal)
                try:
                    same = _key(os.lstat(self.home.index)) == key
                except FileNotFoundError:
                    same = False
            except BaseException:
                f.close()
                raise
            if same:
                return _Files(data, key, f, journal_data, journal_key)
            f.close()
        raise FileError(f"{self.home.index}: it kept changing while it was read; try again")

    def _load(self, writer: bool) -> Index:
        """The committed index: index.json decoded, the journal's records replayed on it. A
        writer (under the lock) also keeps what the files are (_OnDisk); its commit writes
        index.json whole."""
        files = self._files()
        if files is None:
            if writer:
                self._disk = _OnDisk(None, _lkey(self.home.journal), False, None, 0, b"", 0)
                self._whole = True
            return Index()
        data, key, journal_data, journal_key = files.data, files.key, files.journal, files.journal_key
        if not writer:
            files.pin.close()
        # The journal's first line names this index.json by two checksums of it (~20 ms at
        # 50,000 queued), wanted at the first record: worked out on another core while this one
        # decodes (zlib lets go of the GIL), off the service's start.
        ahead = _HeaderAhead(data) if writer and self._appends and not journal_data else None
        # The index the service's Store (an appending writer's) loads is kept for as long as it
        # runs: its queued tasks share their repeated strings (_decode_kept; ~9 MB of RSS at
        # 50,000 queued). A read of its own is not kept, and pays nothing for it.
        index = self._decoded(data, _decode_kept if writer and self._appends else index_decoder.decode)
        old = index.version != INDEX_VERSION
        index = upgrade(index, data)  # a version-1 index: its runs
        head = _journal().header(data) if journal_data else None
        found: list[bytes] = []
        length = 0
        follows = False  # a journal that follows this index.json is there (else the next record starts one)
        if journal_data:
            with self._journal_read():
                got = _journal().records(journal_data, head)
                if got is not None:
                    follows = True
                    found, length = got
                    index = _journal().replay(index, found)
        self._check(index)
        if writer:
            self._disk = _OnDisk(key, journal_key, follows, files.pin, length, head, len(data), ahead)
            self._whole = True
            self._old = old
        return index

    def _decoded(self, data: bytes, decode: Callable[[bytes], _Decoded]) -> _Decoded:
        """`decode(data)`; a damaged index raises FileError. The cyclic garbage collector is
        off meanwhile: it would walk the index being built over and over, every object of
        which is still reachable (4x the decode's own time at 50,000 tasks, in the service)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            decoded = decode(data)
            # Straight to the oldest generation (freeze, then unfreeze, moves every tracked
            # object there without a look at any): the next young collection would otherwise
            # walk all of the new index (~75 ms at 50,000 queued, the service's start), and
            # the next middle one again (~55 ms). Nothing is kept from the collector: the
            # next full collection sees all of it, as it would have.
            gc.freeze()
            gc.unfreeze()
            return decoded
        # RecursionError: absurdly deep nesting; UnicodeDecodeError: non-UTF-8 bytes in a string
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as err:
            raise FileError(_describe_index_error(self.home, data, err) + _FIX) from None
        finally:
            if collecting:
                gc.enable()

    @contextmanager
    def _journal_read(self) -> Iterator[None]:
        """A damaged journal (not one cut short by a crash) raises FileError: the file, what, and
        what to do."""
        try:
            yield
        # RecursionError: absurdly deep nesting; UnicodeDecodeError: non-UTF-8 bytes in a string
        except (_journal().Damaged, msgspec.DecodeError, RecursionError, UnicodeDecodeError) as err:
            raise FileError(f"{self.home.journal}: damaged ({err}).{_FIX_JOURNAL}") from None

    def _check(self, index: Index) -> None:
        problem = check_index(index) if index.version == INDEX_VERSION else f"unknown version {index.version}"
        if problem:
            raise FileError(f"{self.home.index}: {problem}{_FIX}")

    def read(self) -> Index:
        """The committed index, as a reader sees it (no lock; never half-written)."""
        return self._load(writer=False)

    def read_ahead(self) -> None:
        """Read (and check) the committed index and keep it for this Store's next transaction,
        which then decodes nothing if the files are still as they were: the service's start
        read its index twice (0.3 s each at 50,000 queued). Kept as another writer's (not
        `unchanged`: its clock and counters are looked at as after any other writer)."""
        index = self._load(writer=True)
        if self._disk is not None and self._disk.key is not None and not self._old:
            self._ahead = index
            self._whole = False  # kept: the first transaction appends what it changed
            self._since.skip()
            self._know(index)

    def read_head(self) -> tuple[Index, QueueCounts]:
        """The committed index without its queued and finished tasks, and the queued tasks'
        counts: what `capacity` needs, without decoding a long queue (and from index.head,
        while it is this index.json's, without reading it). Its check (check_index) sees the
        running tasks and the rest; `read` checks the skipped tasks too."""
        summary = self._summary()
        if summary is not None:
            return summary
        files = self._files()
        if files is None:
            return Index(), QueueCounts(queued=0)
        files.pin.close()
        data, journal_data = files.data, files.journal
        index, queued = self._decoded(data, head_of)
        if index.version != INDEX_VERSION:
            return super().read_head()  # another version: `read` reads it whole (or refuses it)
        found: list[bytes] = []
        if journal_data:
            with self._journal_read():
                got = _journal().records(journal_data, _journal().header(data))
                if got is not None:
                    found = got[0]
                    index, queued = _journal().replay_head(index, queued, found)
        self._check(index)
        return index, count_queued(index, queued, [data, *found])

    def _summary(self) -> tuple[Index, QueueCounts] | None:
        """index.head, while it names the index.json that is there and no journal follows it
        (store/head.py): what read_head reads of index.json, without reading index.json."""
        of = head.identity_at(self.home.index)
        summary = None if of is None else head.read(self.home.head, of)
        if summary is None or _lkey(self.home.journal) is not None:
            return None
        if head.identity_at(self.home.index) != of:
            return None  # moved since: the journal was looked for beside another index.json
        if check_index(summary[0]):
            return None  # the whole read says what is wrong
        return summary

    def stamp(self) -> tuple[int, ...]:
        """index.json's and index.journal's inode, mtime and size: every commit renames a new
        index.json in or appends to the journal (the size tells two files apart should the
        second reuse the first's inode within one tick)."""
        out: list[int] = []
        for path in (self.home.index, self.home.journal):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                out += (0, 0, 0)
            else:
                out += (st.st_ino, st.st_mtime_ns, st.st_size)
        return tuple(out)

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
            kept = reuse if reuse is not None else ahead
            unchanged = False
            if kept is not None and self._unmoved():
                index, unchanged = kept, reuse is not None
            else:
                index = self._load(writer=True)
            self._began = snapshot if unchanged else None
            if not unchanged:
                self._queue_version += 1
                _keep_counters_ahead(self.home, index, self._disk is not None and self._disk.key is not None)
            self._recover_outbox(index)
        except BaseException:
            self._unlock()
            raise
        return Txn(index, now or datetime.now(timezone.utc), unchanged=unchanged)

    def _unmoved(self) -> bool:
        """Whether index.json and index.journal are as this Store last read or wrote them: no
        other writer came between (a writer renames a new index.json in, or appends to the
        journal), by their identities alone."""
        disk = self._disk
        if disk is None:
            return False
        return _lkey(self.home.index) == disk.key and _lkey(self.home.journal) == disk.journal_key

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
                self._committed, self._snapshot = txn.index, began
                return
            self._commit(txn)
            self._committed = txn.index
            # An appending Store encoded the rest for its record already (kept in _rest, _finished).
            rest = (self._rest, self._finished) if self._appends else _encode_rest(txn.index)
            self._snapshot = _Snapshot.of(txn.index, self._since.at, rest)
        except BaseException as err:
            self._queue_version += 1  # nothing known of what is committed: derive it afresh
            self._disk = None  # nor of what is on disk: the next transaction reads it
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
                _warn("the prompt of task #%d cannot be read (%s): %s", task_id, path, err.strerror or err)
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

    def _commit(self, txn: Txn) -> None:
        """Write what the transaction changed."""
        # Prompts first: the committed index must find its tasks' prompts after a crash.
        # Should the index write fail, each is put back as it was.
        written = self._write_prompts(txn.prompts) if txn.prompts else {}
        try:
            self._commit_index(txn)
        except BaseException:
            _restore_prompts(written)
            raise

    def _commit_index(self, txn: Txn) -> None:
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
        self._write(index)
        if tracking.VERIFY:
            fresh = Store(self.home).read()
            # Both as a reader decodes them: a value set to what is also its default (a task's
            # priority set to "normal") is written, and read back as the default, left out.
            if encode_index(fresh) != encode_index(index_decoder.decode(encode_index(index))):
                raise AssertionError("what index.json and index.journal hold is not the index committed"
                                     " (a queued task changed in place, not by assigning to a field?)")
        if txn.events:
            try:
                _append_events(self.home.events, txn.events)
                self._appended = txn.events[-1].seq
            except OSError:
                pass  # committed all the same: the outbox holds them, the next transaction appends them

    def _write(self, index: Index) -> None:
        """Commit `index`: one record appended to index.journal, or (the journal past a quarter
        of index.json, or what changed unknown) index.json written whole. Nothing when nothing
        changed."""
        disk = self._disk
        record = None if disk is None or self._whole or not self._appends else self._record(index)
        if record == _UNCHANGED:
            return
        if record is not None and disk is not None:
            line = _journal().line(record)
            start = disk.length or len(disk.first_line())
            if start + len(line) <= max(_JOURNAL_LEAST, disk.size // 4):
                self._append_record(disk, line)
                return
        self._write_whole(index)

    def _record(self, index: Index) -> bytes | None:
        """What changed since the index this Store last committed or loaded, as a journal record
        (journal.encode); _UNCHANGED; None when it cannot be told (the log of assignments no
        longer reaches back: the index is written whole). Only the queued tasks that are new or
        were assigned to since are encoded; the rest of the queue is runs of places, found by C's
        steps (map, zip, slices): a step per task in Python would cost what the journal saves."""
        changed = self._since.take()  # an assignment from here on is the next commit's to see
        if changed is None:
            return None
        queue = self._queue_change(index.queued, changed)
        finished: tuple[int, list[bytes]] | list[bytes] = (0, [])
        rest, now = _encode_rest(index)
        if now != self._finished:
            finished = _finished_change(self._finished, now)
            self._finished = now
        if queue is None and finished == (0, []) and rest == self._rest:
            return _UNCHANGED
        self._rest = rest
        return _journal().encode(rest, queue, finished)

    def _queue_change(self, queued: list[Task], changed: dict[int, Task]) -> list[object] | None:
        """A record's `queue` (None: unchanged since the last commit), and what this Store keeps
        of the queue brought up to date. The changes of a drain and of admission at depth (tasks
        gone from the head, tasks added at the end, a few assigned to) are found by comparing the
        two lists by identity in C, and cost what changed; any other change looks up every
        task's place."""
        old = self._queue
        was = len(old)
        gone_tasks = follow(old, queued)  # `old` made `queued` in place
        if gone_tasks is None:
            return self._queue_rebuilt(queued, changed)
        gone = len(gone_tasks)
        kept = was - gone
        added = queued[kept:]
        redo = _assigned_among(queued, kept, changed, added)
        if not (gone or added or redo):
            return None
        self._queue_version += 1
        items: list[object] = []
        at = 0
        for i in redo:
            if i > at:
                items.append((gone + at, gone + i))
            items.append(msgspec.Raw(encoder.encode(queued[i])))
            at = i + 1
        if kept > at:
            items.append((gone + at, gone + kept))
        items += (msgspec.Raw(encoder.encode(task)) for task in added)
        tracking.track(added)
        return items

    def _queue_rebuilt(self, queued: list[Task], changed: dict[int, Task]) -> list[object]:
        """_queue_change for any change: each task's place in the queue before, runs of them, and
        the tasks new or assigned to since encoded."""
        ids = list(map(id, queued))
        before = dict(zip(map(id, self._queue), range(len(self._queue))))  # for this commit only
        places: list[int | None] = list(map(before.get, ids))
        redo = set()
        if None in places:
            redo.update(i for i, place in enumerate(places) if place is None)
        stale = changed.keys() & before.keys()
        if stale:
            redo.update(i for i, key in enumerate(ids) if key in stale)
        self._queue_version += 1  # a task new, gone, moved or assigned to
        for i in redo:
            places[i] = None
        queue: list[object] = []
        for lo, hi in _merged_runs(places):
            first = places[lo]
            if first is None:
                queue += (msgspec.Raw(encoder.encode(task)) for task in queued[lo:hi])
            else:
                queue.append((first, first + hi - lo))
        tracking.track([queued[i] for i in redo])
        self._queue = list(queued)
        return queue

    def _append_record(self, disk: _OnDisk, line: bytes) -> None:
        """Append one record to the journal and fsync it: the commit. A journal not begun for
        this index.json yet (or a stale one) is made anew with its header, whole or not at all; a
        last line a crash cut short is cut off first. Should the write fail (a full disk), the
        journal is cut back to where it was."""
        path = self.home.journal
        if not disk.follows:
            first = disk.first_line()
            atomic_write(path, first + line)  # in place of a journal of another index.json, if any
            disk.length = len(first) + len(line)
            disk.follows = True
        else:
            fd = open_file(path, os.O_WRONLY)
            try:
                try:
                    if os.fstat(fd).st_size != disk.length:
                        os.ftruncate(fd, disk.length)
                    if os.pwrite(fd, line, disk.length) != len(line):
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                    os.fdatasync(fd)
                except OSError as err:
                    try:
                        os.ftruncate(fd, disk.length)
                    except OSError:
                        pass
                    if err.filename is None:
                        raise OSError(err.errno, err.strerror, str(path)) from None
                    raise
            finally:
                os.close(fd)
            disk.length += len(line)
        disk.journal_key = _lkey(path)

    def _write_whole(self, index: Index) -> None:
        """index.json written whole (temp file, fsync, rename, fsync of the directory: the
        commit), and the journal that followed the one before removed: a crash in between
        leaves a journal whose header names the old file, which every reader ignores."""
        self._since.skip()
        self._queue_version += 1
        data = encode_index(index)
        atomic_write(self.home.index, data)
        try:
            os.unlink(self.home.journal)
        except FileNotFoundError:
            pass
        pin = os.fdopen(open_file(self.home.index, os.O_RDONLY), "rb", buffering=0)
        st = os.fstat(pin.fileno())
        self._disk = _OnDisk(_key(st), None, False, pin, 0, None, len(data))
        head.write(self.home.head, index, st)  # after the commit: a cache, never the state
        self._whole = False
        self._know(index)

    def append_commits(self) -> None:
        """From now on this Store's commits on the index it kept append to index.journal: the
        long-lived writers', which fold the journal into index.json as they stop (the service)
        or let go of the Store (an MCP server's admissions). Any other writer (a command, a
        dashboard) writes index.json whole, so that with neither running index.json alone is
        the state."""
        self._appends = True

    def fold(self) -> None:
        """index.json written whole with the journal's records in it, and the journal gone: a
        long-lived writer does this as it stops (the service) or lets go of its Store (an MCP
        server's admissions), so that while neither runs index.json alone is the state (the
        file a person may repair by hand). A failure (a full disk) leaves both files as they
        were, which is as good."""
        if not self.home.journal.exists():
            return
        with self._locked():
            try:
                committed = self._committed
                index = committed if committed is not None and self._unmoved() else self._load(writer=True)
                if self._disk is not None and self._disk.follows:
                    self._write_whole(index)
            except (OSError, FileError) as err:
                self._disk = self._committed = None
                _warn("index.journal could not be folded into index.json (%s); it is read as before", err)

    def _know(self, index: Index) -> None:
        """Keep what `index` is (just loaded or written whole, the log of assignments skipped to
        before), for the next record. Its queued tasks become Tracked, so that an assignment to
        one is seen (by _Snapshot too, which every long-lived Store uses)."""
        tracking.track(index.queued)
        if not self._appends:
            return
        self._queue = list(index.queued)
        self._rest, self._finished = _encode_rest(index)

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

    def __init__(self, index: Index, queued: list[Task], mark: int, rest: _Rest, data: bytes | None):
        self.index = index
        self.queued = queued
        self.mark = mark
        self.rest = rest
        self.data = data  # the whole encoding, kept only under tracking.VERIFY

    @classmethod
    def of(cls, index: Index, mark: int, rest: _Rest) -> _Snapshot:
        """Of an index just committed, encoded as of `mark` (`rest`: _encode_rest's): Store._know
        and _queue_change made its queued tasks Tracked."""
        return cls(index, list(index.queued), mark, rest,
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


class _Files(NamedTuple):
    """index.json and index.journal as one commit left them (Store._files)."""

    data: bytes
    key: _Key
    pin: io.FileIO  # index.json, still open
    journal: bytes | None
    journal_key: _Key | None


class _OnDisk:
    """index.json and index.journal as a writer last read or wrote them, under the lock. While
    both are as they were, its next transaction decodes nothing: another writer would have
    renamed a new index.json in, or appended to the journal. `pin` keeps index.json open, so that
    no other file takes its inode meanwhile."""

    __slots__ = ("key", "journal_key", "follows", "pin", "length", "header", "size", "ahead")

    def __init__(self, key: _Key | None, journal_key: _Key | None, follows: bool, pin: io.FileIO | None,
                 length: int, header: bytes | None, size: int, ahead: _HeaderAhead | None = None):
        self.key = key  # index.json's identity; None: there is none
        self.journal_key = journal_key  # the journal's; None: there is none
        self.follows = follows  # the journal follows this index.json (else it is another's, or none)
        self.pin = pin
        self.length = length  # the journal's bytes that are whole records (where the next goes)
        self.header = header  # the journal's first line for this index.json (first_line), once known
        self.size = size  # index.json's size
        self.ahead = ahead  # the header being worked out from the bytes decoded, if it is

    def first_line(self) -> bytes:
        """journal.header of index.json: worked out ahead, or read from the file kept open (once,
        at the first record: a one-shot command that writes index.json whole never needs it)."""
        if self.header is None:
            ahead, self.ahead = self.ahead, None
            self.header = ahead.result() if ahead is not None else None
            if self.header is None:
                assert self.pin is not None
                self.header = _journal().header_of(self.pin)
        return self.header


class _HeaderAhead:
    """journal.header(data), worked out in a thread of its own from the moment it is made."""

    def __init__(self, data: bytes):
        self._header: bytes | None = None
        self._data: bytes | None = data
        self._journal = _journal()  # imported here: an import in the thread would wait on this one's
        self._thread: threading.Thread | None = threading.Thread(target=self._work, name="kugetsu-index-header",
                                                                 daemon=True)
        try:
            self._thread.start()
        except RuntimeError:  # no thread to be had (a limit on them): first_line reads the file
            self._thread = self._data = None

    def _work(self) -> None:
        assert self._data is not None
        self._header, self._data = self._journal.header(self._data), None

    def result(self) -> bytes | None:
        """The header; None if there was no thread or it failed (short of memory): first_line
        reads the file."""
        if self._thread is not None:
            self._thread.join()
        return self._header


_Key = tuple[int, int, int, int]


def _key(st: os.stat_result) -> _Key:
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _lkey(path: Path) -> _Key | None:
    try:
        return _key(os.lstat(path))
    except FileNotFoundError:
        return None


def _read(path: Path) -> tuple[bytes | None, _Key | None]:
    """A file of the home and its identity; (None, None) when there is none."""
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    with os.fdopen(fd, "rb", buffering=0) as f:
        return f.readall(), _key(os.fstat(fd))


def _journal() -> ModuleType:
    """store/journal.py, imported where a journal is read or written: a command with no journal
    to read (every one while no long-lived writer runs) never loads it, nor zlib."""
    from kugetsu.store import journal

    return journal


class _Shared(Task):
    """A queued task as the service's Store decodes it (_decode_kept): msgspec calls
    __post_init__ as it builds each one, and the strings that many queued tasks have equal
    (the working directory, where it came from, its preset and group, its repository, its
    command's words, its route) become the one interned object each, ~190 bytes a task at the
    bench's 50,000 (more for an agent's command line of many words). Interned then, the copy
    just decoded is freed at once and the next task's objects take its place: interned after
    the decode, the copies left holes between live objects and RSS did not move. Only strings,
    which are immutable, are shared; never a list or a dict. Encoded exactly as a Task, and
    made Tracked as any queued task the Store keeps (tracking.track)."""

    def __post_init__(self) -> None:
        self.cwd = _intern(self.cwd)
        self.source = _intern(self.source)
        self.command = list(map(_intern, self.command))
        if self.agent is not None:
            self.agent = _intern(self.agent)
        if self.group is not None:
            self.group = _intern(self.group)
        if self.repo is not None:
            self.repo = _intern(self.repo)
        if self.route:
            self.route = list(map(_intern, self.route))


class _KeptIndexFile(IndexFile, forbid_unknown_fields=True):
    """index.json as the service's Store decodes it: its queued tasks _Shared."""

    queued: list[_Shared] = []


_kept_decoders: list[msgspec.json.Decoder[_KeptIndexFile]] = []  # made at the first use: 0.6 ms of every command's start


def _decode_kept(data: bytes) -> IndexFile:
    """index.json decoded for a Store that keeps it (the service's), its queued tasks sharing
    their repeated strings; an IndexFile as index_decoder's (a subclass orders its fields
    otherwise, and the fields' order is index.json's)."""
    if not _kept_decoders:
        _kept_decoders.append(msgspec.json.Decoder(_KeptIndexFile))
    kept = _kept_decoders[0].decode(data)
    return IndexFile(**{name: getattr(kept, name) for name in IndexFile.__struct_fields__})


def _assigned_among(queued: list[Task], kept: int, changed: dict[int, Task], added: list[Task]) -> list[int]:
    """The places, in order, among the first `kept` tasks of `queued` (those kept from the queue
    before) of the tasks assigned to since (`changed`, by id()). A task still queued has state
    QUEUED (every reader refuses an index where one has not: check_index), so only those of
    `changed` are looked for, less the ones added at the end (encoded whole anyway): in a drain
    none is (the tasks assigned to there started or ended), nor in an admission. Each one left
    is looked for by its id, by bisection (a queue is in id order but for tasks sent back to
    it), and found there only as that very object; one that is not is looked for by one
    identity pass in C."""
    wanted = [task for task in changed.values() if task.state is TaskState.QUEUED]
    if wanted and added:
        new = set(map(id, added))
        wanted = [task for task in wanted if id(task) not in new]
    places: list[int] = []
    missed: set[int] = set()
    for task in wanted:
        i = bisect_left(queued, task.id, 0, kept, key=_ID)
        if i < kept and queued[i] is task:
            places.append(i)
        else:
            missed.add(id(task))
    if missed:
        places += compress(range(kept), map(missed.__contains__, map(id, islice(queued, kept))))
    return sorted(places)


def _merged_runs(places: list[int | None]) -> list[tuple[int, int]]:
    """places cut, in order, into ranges that are each all None or consecutive places."""
    runs: list[tuple[int, int]] = []
    if places:
        for lo, hi in _runs(places, 0, len(places)):
            if runs and _continues(places, runs[-1], lo):
                runs[-1] = (runs[-1][0], hi)  # the two halves of one run, cut apart by _runs
            else:
                runs.append((lo, hi))
    return runs


def _finished_change(before: list[bytes], now: list[bytes]) -> tuple[int, list[bytes]] | list[bytes]:
    """How the finished list went from `before` to `now` (each task's encoding): how many left
    its head and which were appended (the common case: tasks end, the oldest move to
    history.jsonl), or, changed otherwise, the whole list."""
    try:
        drop = before.index(now[0]) if now else len(before)
    except ValueError:
        drop = len(before)  # none of those before stays
    kept = len(before) - drop
    if before[drop:] == now[:kept]:
        return drop, now[kept:]
    return now


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


_Rest = tuple[bytes, list[bytes]]


def _encode_rest(index: Index) -> _Rest:
    """The index without its queue, encoded (_Snapshot): as a journal record has it, the rest
    without the finished tasks, and each finished task."""
    return _encode_bare(index), list(map(encoder.encode, index.finished))


def _encode_bare(index: Index) -> bytes:
    """The index without its queued and finished tasks, encoded (a journal record's `rest`)."""
    return encoder.encode(msgspec.structs.replace(index, queued=[], finished=[]))


# A commit appends to the journal while it stays under a quarter of index.json (a reader decodes
# at most 1.25x the state), or this: a short index.json is not written whole at every other commit.
_JOURNAL_LEAST = 256 << 10
_ID = attrgetter("id")
_intern = sys.intern
_CONSISTENT_TRIES = 20  # a reader's tries at reading index.json and its journal as one commit left them

# Past this many ids, `prompts` lists logs/ once rather than trying to open each prompt.
_LIST_PROMPTS_PAST = 64

_UNCHANGED = b""  # Store._record: nothing changed (a record is never empty)

_FIX = (
    "\nNothing was changed. Repair the file by hand, or move it away to start with an empty"
    " queue (running agents are not affected)."
)
_FIX_JOURNAL = (
    "\nNothing was changed. It holds the commits since index.json was last written whole: move it"
    " away to go back to that index.json (those commits are lost), or repair it by hand."
)


def _describe_index_error(home: Home, data: bytes, err: Exception) -> str:
    text = str(err)
    if re.match(r"Object (contains unknown|missing required) field `[^`]*`$", text):  # top level only
        return f"{home.index}: not a kugetsu index ({text[0].lower()}{text[1:]})"
    return describe_decode_error(home.index, data, err)


def _keep_counters_ahead(home: Home, index: Index, found: bool) -> None:
    """Ids and event seqs never go back, even when index.json was moved away, replaced by an
    older copy or restored from a backup: a new task must never take an old task's id, and
    with it its log and exit file (it would be "finished" before it ran). Cheap checks on
    every index a writer loads afresh; the full look through logs/, events and history only
    when one of them shows the index is behind."""
    behind = not found or _last_seq(home) >= index.next_seq
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
