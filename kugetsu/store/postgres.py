"""PgStore: the store protocol (kugetsu.store.files.StoreProtocol) on PostgreSQL.

The queue is one small locked row (`kugetsu.state`: counters, pauses, holds, the shared
config) and one row per task (`kugetsu.tasks`: its list, its place in it, typed columns
for SQL, the body as index.json has it). pm reads and changes the same Index as with
index.json, so every rule (positions, policies, admission) is the same code in a cluster.
A transaction takes the state row's lock (SELECT ... FOR UPDATE), which serializes all
writers of every machine: a global limit cannot be exceeded even for an instant, because
the writer that counts is the only one that can add (per-node limits over SKIP LOCKED rows
are how pgqueuer #761 and Hatchet #4778 overshot). `begin` loads only the task rows changed
since this store last looked (`rev`), `commit` writes only the rows that changed: a commit no
longer rewrites the whole queue, nor does every machine re-read it after each change. Nor does
a transaction cost more with a longer queue: what this store last saw is kept and changed in
place by what changed since (a task that went leaves a tombstone row), and a commit finds
the changed tasks without encoding or comparing every task (_rows_of, store/tracking.py). Readers
take no lock (one REPEATABLE READ snapshot). Events are rows committed in the same
transaction, and the commit NOTIFYs every service (LISTEN), so a change on one machine wakes
the others at once.
"""

from __future__ import annotations

import bisect
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import psycopg

from kugetsu.cluster import hosts, logs
from kugetsu.cluster.hosts import HostRow
from kugetsu.cluster.db import NOTIFY_CHANNEL, Unreachable, connect, errors, process_tag, redact
from kugetsu.errors import FileError
from kugetsu.core.models import INDEX_VERSION, Event, Index, Task, check_index, decode_task, upgrade, with_flat_run
from kugetsu.paths import Home
from kugetsu.store import tracking
from kugetsu.store.protocol import Since, Transactions, Txn, encoder, held, index_decoder, mark_writer

_event_decoder = msgspec.json.Decoder(Event)
INSERT_EVENTS = "INSERT INTO kugetsu.events (seq, task, at, body) VALUES (%s, %s, %s, %s)"
INSERT_HISTORY = "INSERT INTO kugetsu.history (id, finished_at, body) VALUES (%s, %s, %s)"
_VALUES = re.compile(r"VALUES (\(%s(?:, %s)*\))")
ROWS_AT_ONCE = 1000  # rows a statement: under PostgreSQL's 65,535 parameters at 8 columns a row


_SELECT_STATE = "SELECT doc, rev, next_ord, clock_timestamp(), config FROM kugetsu.state WHERE id = 1"
_SELECT_ROWS = "SELECT id, list, ord, body FROM kugetsu.tasks"  # + WHERE
UPSERT_TASK = ("INSERT INTO kugetsu.tasks (id, list, ord, rev, state, name, host, body) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
               " ON CONFLICT (id) DO UPDATE SET list = excluded.list, ord = excluded.ord, rev = excluded.rev,"
               " state = excluded.state, name = excluded.name, host = excluded.host, body = excluded.body")
UPSERT_PROMPT = "INSERT INTO kugetsu.prompts (id, body) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET body = excluded.body"


def event_rows(events: list[Event]) -> list[tuple[Any, ...]]:
    return [(e.seq, e.task, e.at, encoder.encode(e)) for e in events]


_FIX = "\nNothing was changed. Restore the database from a backup, or ask for help with the row."


class PgStore(Transactions):
    """One client of the cluster's queue: one connection, one transaction at a time."""

    def __init__(self, url: str):
        self.url = url
        self._conn: psycopg.Connection | None = None
        self._open = False  # a transaction is open on the connection
        # The state as this store last loaded or committed it: a long-lived store (a service)
        # then reads only the task rows changed since, and writes only those it changed.
        self._seen: _Seen | None = None
        self._busy: float | None = None  # time.monotonic() when the statement under way was sent
        self._began: _Seen | None = None  # the state the open transaction loaded
        # Moved at this store's last commit (or abort), where the tasks it keeps were written (or
        # dropped): a commit rewrites those assigned to since.
        self._since = tracking.Cursor()

    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.url)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @contextmanager
    def guarded(self) -> Iterator[psycopg.Connection]:
        """The connection, for every statement (the store's own, and the cluster's other
        tables: hosts, leases, log chunks): a lost connection is `Unreachable` and is made
        afresh by the next call (the database may be back), and the watchdog can see how
        long the statement under way has waited (`waiting_for`)."""
        self._busy = time.monotonic()
        try:
            with errors(self.url):
                yield self.conn
        except Unreachable:
            self.close()
            raise
        finally:
            self._busy = None

    def _execute(self, sql: str, params: tuple[Any, ...] = ()) -> psycopg.Cursor[Any]:
        with self.guarded() as conn:
            return conn.execute(sql, params)

    def _executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """One statement per ROWS_AT_ONCE rows (`VALUES (...), (...)`), never psycopg's
        executemany: that pipelines the rows without a Sync until the end, and a machine cut
        off in between left its backend waiting for the rest, inside the transaction that
        holds the queue's lock, where idle_in_transaction_session_timeout never fires (it
        runs only between whole statements): every other machine waited for its lock (seen
        in tests/test_cluster_torture.py, 1 run in 4). Between these statements the backend
        is idle in its transaction, and the server ends it after IDLE_IN_TXN."""
        if not rows:
            return
        m = _VALUES.search(sql)
        assert m is not None, sql
        for at in range(0, len(rows), ROWS_AT_ONCE):
            chunk = rows[at : at + ROWS_AT_ONCE]
            many = sql[: m.start(1)] + ", ".join([m.group(1)] * len(chunk)) + sql[m.end(1) :]
            self._execute(many, tuple(v for row in chunk for v in row))

    def waiting_for(self) -> float:
        """Seconds the statement under way has waited for its answer (0: none under way)."""
        busy = self._busy
        return 0.0 if busy is None else time.monotonic() - busy

    def interrupt(self) -> None:
        """From another thread: end the wait of a statement whose answer is not coming (a
        connection black-holed on the way, a server that hangs): its socket is shut down, the
        statement fails as `Unreachable`, and the next one connects afresh."""
        conn = self._conn
        if conn is None or conn.closed:
            return
        try:
            sock = socket.socket(fileno=os.dup(conn.fileno()))
        except OSError:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()

    # ---- reading (no lock) -------------------------------------------------------------

    def _decode(self, data: bytes) -> Index:
        """The state row's document: the Index without its tasks (or, written by a kugetsu
        of schema 3 or before, with them: they become rows at the next commit)."""
        if not data:
            return Index()
        try:
            return index_decoder.decode(data)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as err:
            raise FileError(f"{redact(self.url)}: the queue document does not decode: {err}{_FIX}") from None

    def _load(self, row: tuple[Any, ...]) -> _Seen:
        """The whole state as of the state row `row` (doc, rev, next_ord), read in the same
        snapshot or under its lock: what this store saw last, with the task rows changed since
        applied to it (tombstones included: what went), or every row the first time (or when
        this store is so far behind that tombstones it needs may be swept)."""
        header, rev, next_ord = bytes(row[0]), row[1], row[2]
        seen = self._seen
        if seen is not None and seen.rev == rev and seen.header == header:
            return seen
        index = self._decode(header)
        old = index.version == 1  # rows under a version-1 state row: flat runs (upgrade)
        index = upgrade(index, header)
        if index.active or index.queued or index.finished:  # a document of schema 3: its tasks are in it
            return self._checked(_seen(header, rev, next_ord, index, {}), index)
        self._seen = None  # changed in place below: never reused half done
        if seen is not None and seen.lists is not None and seen.rev < rev <= seen.rev + TOMBSTONE_REVS:
            changed = self._execute(_SELECT_ROWS + " WHERE rev > %s", (seen.rev,)).fetchall()
            fresh = _apply(changed, seen, self.url)
            index.active, index.queued, index.finished = (list(tasks) for tasks in seen.lists)
            # Only what changed is checked (the rest was, when it came): the same rules on a
            # small index of the changed tasks.
            probe = msgspec.structs.replace(index, active=fresh[0], queued=fresh[1], finished=fresh[2])
            self._checked(seen, probe)
            return _Seen(header, rev, next_ord, index, seen.rows, seen.lists, seen.ords)
        rows: dict[int, _Row] = {}
        tasks: dict[int, Task] = {}
        _take(self._execute(_SELECT_ROWS + " WHERE list < 3").fetchall(), rows, tasks, self.url, old)
        order = sorted(rows, key=lambda i: rows[i][:2])
        lists: tuple[list[Task], ...] = ([], [], [])
        for task_id in order:
            lists[rows[task_id][0]].append(tasks[task_id])
        index.active, index.queued, index.finished = lists
        return self._checked(_seen(header, rev, next_ord, index, rows), index)

    def _checked(self, seen: _Seen, index: Index) -> _Seen:
        problem = check_index(index) if index.version == INDEX_VERSION else f"unknown version {index.version}"
        if problem:
            raise FileError(f"{redact(self.url)}: {problem}{_FIX}")
        return seen

    def read(self) -> Index:
        """The last committed state, in one snapshot (the state row and the task rows of one
        commit), without waiting for a writer."""
        row = self._execute(_SELECT_STATE).fetchone()
        if row is None:
            return Index()
        seen = self._seen
        if self._open or (seen is not None and seen.rev == row[1] and seen.header == bytes(row[0])):
            # Inside this store's own transaction (its lock makes it one moment), or nothing
            # changed since this store last looked: no task row to read.
            return self._load(row).index
        with self.guarded() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            row = conn.execute(_SELECT_STATE).fetchone()
            if row is None:
                return Index()
            self._seen = self._load(row)
        return self._seen.index

    def read_config(self) -> dict[str, Any]:
        """The cluster's shared config (everything but a machine's own keys)."""
        row = self._execute("SELECT config FROM kugetsu.state WHERE id = 1").fetchone()
        return msgspec.json.decode(bytes(row[0])) if row and row[0] else {}

    def stamp(self) -> str:
        """Changes whenever a transaction commits a change (the queue row's version): a cheap
        look for a view that refreshes itself."""
        row = self._execute("SELECT xmin::text FROM kugetsu.state WHERE id = 1").fetchone()
        return row[0] if row else ""

    def watch(self) -> PgWatch:
        return PgWatch(self.url)

    def read_events(self, after: int = 0) -> list[Event]:
        rows = self._execute("SELECT body FROM kugetsu.events WHERE seq > %s ORDER BY seq", (after,)).fetchall()
        return [_event_decoder.decode(bytes(r[0])) for r in rows]

    def tail_events(self, count: int) -> list[Event]:
        if not count:
            return []
        rows = self._execute("SELECT body FROM kugetsu.events ORDER BY seq DESC LIMIT %s", (count,)).fetchall()
        return [_event_decoder.decode(bytes(r[0])) for r in reversed(rows)]

    def rotate_events(self, limit: int) -> int | None:
        """The file store bounds events.jsonl by size; here old events are kept (they are
        rows, and `stats` reads them): nothing to rotate."""
        return None

    # ---- writing -------------------------------------------------------------------------

    def begin(self, now: datetime | None = None) -> Txn:
        """Take the state row's lock and load the state; `now` is the database's clock, read
        after the lock: one clock for every machine, so events' times never go back."""
        if self._open:
            raise RuntimeError("nested kugetsu transaction (this store already holds one)")
        if getattr(held, "depth", 0):  # this thread holds a transaction of any store already
            raise RuntimeError("nested kugetsu transaction (it would deadlock on the queue row)")
        self._execute("BEGIN")
        self._open = True
        held.depth = 1
        try:
            row = self._execute(_SELECT_STATE + " FOR UPDATE").fetchone()
            assert row is not None, "kugetsu.state has its row from ensure_schema"
            unchanged = self._seen is not None and self._seen.rev == row[1] and self._seen.header == bytes(row[0])
            # Taken out while the transaction runs: a failed one may leave the objects half
            # changed, and they must never be reused.
            seen = self._load(row)
            self._seen = None
            if not unchanged:
                self._keep_counters_ahead(seen.index)
            txn = Txn(seen.index, now or row[3], unchanged=unchanged)
            txn.shared_config = bytes(row[4])
            self._began = seen
            return txn
        except BaseException:
            self.abort()
            raise

    def _keep_counters_ahead(self, index: Index) -> None:
        """Ids and event seqs never go back, even when the state row was emptied or restored
        from an older backup (as the file store's _keep_counters_ahead): one index lookup
        when all is well, the full look only when the row is behind its events."""
        row = self._execute("SELECT max(seq) FROM kugetsu.events").fetchone()
        if row is None or row[0] is None or row[0] < index.next_seq:
            return
        top = self._execute(
            "SELECT greatest((SELECT max(task) FROM kugetsu.events), (SELECT max(id) FROM kugetsu.history),"
            " (SELECT max(task) FROM kugetsu.log_chunks), (SELECT max(id) FROM kugetsu.tasks))").fetchone()
        index.next_seq = row[0] + 1
        index.next_id = max(index.next_id, (top[0] or 0) + 1 if top else 1)

    def commit(self, txn: Txn) -> None:
        """Write the task rows that changed, the state row, the events and archived tasks,
        NOTIFY, COMMIT: all or nothing."""
        began, self._began = self._began, None
        try:
            index = txn.index
            mark_writer(txn)
            for event in txn.events:
                event.seq = index.next_seq
                index.next_seq += 1
            index.outbox = []  # events are rows committed with the state: nothing to recover
            assert began is not None
            rev = began.rev + 1
            assigned = self._since.take()
            rows, upserts, gone, next_ord, ords = _rows_of(index, began, rev, assigned)
            header = encoder.encode(msgspec.structs.replace(index, active=[], queued=[], finished=[]))
            changed = bool(upserts or gone) or header != began.header
            if changed:
                self._executemany(UPSERT_TASK, upserts)
                if gone:  # tombstones: what went, for the others to read with what changed
                    self._execute("UPDATE kugetsu.tasks SET list = %s, rev = %s, body = '' WHERE id = ANY(%s)",
                                  (GONE, rev, gone))
                if rev % SWEEP_EVERY == 0:
                    self._execute("DELETE FROM kugetsu.tasks WHERE list = %s AND rev <= %s",
                                  (GONE, rev - TOMBSTONE_REVS))
                self._execute("UPDATE kugetsu.state SET doc = %s, rev = %s, next_ord = %s WHERE id = 1",
                              (header, rev, next_ord))
            else:
                rev, next_ord = began.rev, began.next_ord
            if txn.new_config is not None:
                self._execute("UPDATE kugetsu.state SET config = %s WHERE id = 1", (txn.new_config,))
            if txn.prompts:
                self._executemany(UPSERT_PROMPT, [(i, text.encode()) for i, text in txn.prompts.items()])
            if txn.events:
                self._executemany(INSERT_EVENTS, event_rows(txn.events))
            if txn.archive:
                self._executemany(INSERT_HISTORY, [(t.id, t.finished_at, encoder.encode(t)) for t in txn.archive])
            if changed or txn.events or txn.new_config is not None:
                self._execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, process_tag()))
            done = self._execute("COMMIT")
            if done.statusmessage != "COMMIT":  # the server rolled back (a statement failed in it)
                raise RuntimeError(f"the transaction was rolled back by the database ({done.statusmessage})")
            lists = (index.active, index.queued, index.finished)
            self._seen = _Seen(header, rev, next_ord, index, rows, tuple(list(tasks) for tasks in lists), ords)
        except BaseException:
            self._since.skip()  # what it changed is dropped with it (the next begin reloads)
            self._rollback()
            raise
        finally:
            self._open = False
            held.depth = 0

    def abort(self) -> None:
        self._began = None
        self._since.skip()  # what the transaction changed is dropped with it (the next begin reloads)
        try:
            self._rollback()
        finally:
            self._open = False
            held.depth = 0

    def _rollback(self) -> None:
        if self._conn is None or self._conn.closed:
            return
        try:
            self._conn.execute("ROLLBACK")
        except psycopg.Error:
            self.close()  # a broken connection: the server rolls back when it goes

    def prompts(self, ids: Iterable[int]) -> dict[int, str]:
        """Prompts are rows of kugetsu.prompts, written in the transaction of their task."""
        wanted = list(ids)
        if not wanted:
            return {}
        with self.guarded() as conn:
            rows = conn.execute("SELECT id, body FROM kugetsu.prompts WHERE id = ANY(%s)", (wanted,)).fetchall()
        return {int(i): bytes(body).decode("utf-8", "replace") for i, body in rows}

    # ---- history (tasks moved out of the document) ----------------------------------------

    def events_since(self, start: datetime) -> list[Event]:
        """Events at or after `start`, oldest first (`kugetsu stats`)."""
        rows = self._execute("SELECT body FROM kugetsu.events WHERE at >= %s ORDER BY seq", (start,)).fetchall()
        return [_event_decoder.decode(bytes(r[0])) for r in rows]

    def history_since(self, start: datetime) -> list[Task]:
        """Archived tasks that finished at or after `start` (`kugetsu stats`)."""
        rows = self._execute("SELECT body FROM kugetsu.history WHERE finished_at >= %s ORDER BY id",
                             (start,)).fetchall()
        return list({t.id: t for t in (decode_task(bytes(r[0])) for r in rows)}.values())

    def since(self, start: datetime) -> Since:
        """The window's events and archived tasks are rows; max_agents at its start is not
        looked for (the rows of a config change record only the new value)."""
        return Since(self.events_since(start), self.history_since(start), None)

    # ---- the cluster's machines and shipped logs (beside the queue) -------------------------

    def machines(self, lease_s: float) -> tuple[datetime, list[tuple[HostRow, str]]]:
        with self.guarded() as conn:
            return hosts.standing(conn, lease_s)

    def machine_rows(self) -> list[HostRow]:
        with self.guarded() as conn:
            return hosts.rows(conn)

    def mirror_log(self, task: int, home: Home) -> Path:
        path = home.mirror_log(task)
        with self.guarded() as conn:
            logs.mirror(conn, task, path)
        return path

    def history(self) -> list[bytes]:
        rows = self._execute("SELECT body FROM kugetsu.history ORDER BY id").fetchall()
        return [bytes(r[0]) for r in rows]


_stores: dict[tuple[str, int], PgStore] = {}

# A task row as this store saw it: its list (0 active, 1 queued, 2 finished; 3 a tombstone),
# its place in that list, its body.
_Row = tuple[int, int, bytes]
GONE = 3
# Revisions a tombstone is kept: a store further behind than that reads every row afresh.
TOMBSTONE_REVS = 1000
SWEEP_EVERY = 100  # revisions between two sweeps of old tombstones


class _Seen(msgspec.Struct):
    """The state as one store loaded or committed it."""

    header: bytes  # the state row's document (the Index without its tasks)
    rev: int  # the state row's revision: every commit that changes something adds one
    next_ord: int  # the next place in a list
    index: Index
    rows: dict[int, _Row]  # task id -> its row as loaded or written
    # The tasks of each list (active, queued, finished) as loaded or written, and their
    # places, in order (copies: the index's own lists change under a transaction); None when
    # its tasks have no rows yet (a schema-3 document).
    lists: tuple[list[Task], ...] | None = None
    ords: tuple[list[int], ...] | None = None


def _seen(header: bytes, rev: int, next_ord: int, index: Index, rows: dict[int, _Row]) -> _Seen:
    lists = (index.active, index.queued, index.finished)
    if not rows and any(lists):
        return _Seen(header, rev, next_ord, index, rows)
    return _Seen(header, rev, next_ord, index, rows, tuple(list(tasks) for tasks in lists),
                 tuple([rows[t.id][1] for t in tasks] for tasks in lists))


_live_decoder = msgspec.json.Decoder(tracking.Tracked)  # every task it hands out is Tracked


def _decode_task(task_id: int, data: bytes, url: str, old: bool = False) -> Task:
    """A task row; `old`: under a version-1 state row, where a row may hold a run's fields flat
    (with_flat_run; assigning its record is logged, so the next commit rewrites it)."""
    try:
        task = _live_decoder.decode(data)
        return with_flat_run(task, data) if old else task
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as err:
        raise FileError(f"{redact(url)}: task row {task_id} does not decode: {err}{_FIX}") from None


def _take(rows: list[tuple[Any, ...]], into: dict[int, _Row], tasks: dict[int, Task], url: str, old: bool) -> None:
    for task_id, lst, ord_, body in rows:
        data = bytes(body)
        tasks[task_id] = _decode_task(task_id, data, url, old)
        into[task_id] = (lst, ord_, data)


def _apply(changed: list[tuple[Any, ...]], seen: _Seen, url: str) -> tuple[list[Task], ...]:
    """Apply rows changed since `seen` (moved, new, changed, tombstones) to its rows, lists and
    places, in place: a task found by its place (bisect), taken out, put in at its new place.
    Returns the tasks that came or changed, by list."""
    assert seen.lists is not None and seen.ords is not None
    fresh: tuple[list[Task], ...] = ([], [], [])
    for task_id, lst, ord_, body in changed:
        old = seen.rows.pop(task_id, None)
        if old is not None and old[0] != GONE:
            at = bisect.bisect_left(seen.ords[old[0]], old[1])
            assert seen.lists[old[0]][at].id == task_id, (task_id, old[:2])
            del seen.lists[old[0]][at], seen.ords[old[0]][at]
        if lst == GONE:
            continue
        data = bytes(body)
        task = _decode_task(task_id, data, url)
        at = bisect.bisect_left(seen.ords[lst], ord_)
        seen.lists[lst].insert(at, task)
        seen.ords[lst].insert(at, ord_)
        seen.rows[task_id] = (lst, ord_, data)
        fresh[lst].append(task)
    return fresh


def _kept(old: list[Task], new: list[Task], most: int = 8) -> tuple[list[int], list[Task]] | None:
    """`new` as `old` with some tasks taken out and others added at its end (what the queue's
    rules do to it: admission appends, a start or a cancel takes one out): the positions in
    `old` taken out, and the tasks added. None when it is not so (or more than `most` went):
    the caller then looks at every task. Runs of the same tasks are compared a block at a time
    (C, by identity first), so a long queue costs a few block comparisons, not a step a task."""
    gone: list[int] = []
    i = j = 0
    while True:
        k = _same_run(old, i, new, j)
        i, j = i + k, j + k
        if i == len(old):
            return gone, new[j:]
        if len(gone) == most:
            return None
        gone.append(i)
        i += 1


def _same_run(a: list[Task], i: int, b: list[Task], j: int, block: int = 512) -> int:
    """How many tasks a[i:] and b[j:] have in common at their start."""
    n = 0
    most = min(len(a) - i, len(b) - j)
    while n < most:
        step = min(block, most - n)
        if a[i + n : i + n + step] == b[j + n : j + n + step]:
            n += step
            continue
        while n < most and (a[i + n] is b[j + n] or a[i + n] == b[j + n]):
            n += 1
        return n
    return n


def _verify(kept: list[Task], places: list[int], rows: dict[int, _Row], lst: int) -> None:
    bodies = encoder.encode_lines(kept).split(b"\n") if kept else []
    for task, place, body in zip(kept, places, bodies):
        if rows[task.id] != (lst, place, body):
            raise AssertionError(f"task #{task.id} was changed in place, not by assigning to a field: the cluster"
                                 " store would not have written it")


def _rows_of(index: Index, began: _Seen, rev: int, changed: dict[int, Task] | None
             ) -> tuple[dict[int, _Row], list[tuple[Any, ...]], list[int], int, tuple[list[int], ...]]:
    """Every task's row after the transaction, the rows to write (new or changed), the ids
    whose rows go (archived, cleaned), the next free place, and each list's places. A task
    keeps its place while its list's order allows it; one that moved (to another list, or to
    the end of its own) takes the next place, so the rows sorted by place are the lists in
    their order. The queue (the long list) is compared to what the transaction began with:
    taken-out tasks and tasks added at its end are found in a few block comparisons, and the
    tasks it kept are encoded only when they were assigned to since the last commit (`changed`,
    tracking.Cursor.take; None: the log does not reach back that far, and the queue is compared
    body by body too). The running and finished lists (short) are compared body by body; a change
    made in place to a task is seen there only (tracking)."""
    rows = began.rows  # changed in place: `began` is not used again (a failed commit reloads)
    upserts: list[tuple[Any, ...]] = []
    next_ord = began.next_ord
    left: set[int] = set()  # ids taken out of a list
    placed: set[int] = set()  # ids (re)placed in a list by this commit
    ords: list[list[int]] = []
    for lst, tasks in enumerate((index.active, index.queued, index.finished)):
        kept = None
        if lst == 1 and changed is not None and began.lists is not None and began.ords is not None:
            kept = _kept(began.lists[lst], tasks)
        if kept is not None and began.lists is not None and began.ords is not None:
            gone_at, added = kept
            places = list(began.ords[lst])
            for at in reversed(gone_at):
                left.add(began.lists[lst][at].id)
                del places[at]
            bodies = encoder.encode_lines(added).split(b"\n") if added else []
            for task, body in zip(added, bodies):
                place, next_ord = next_ord, next_ord + 1
                places.append(place)
                rows[task.id] = (lst, place, body)
                placed.add(task.id)
                upserts.append((task.id, lst, place, rev, task.state.value, task.name, task.host, body))
            tracking.track(added)
            kept_len = len(tasks) - len(added)
            for task in changed.values():  # assigned to since the last commit: written if its body changed
                row = rows.get(task.id)
                if row is None or row[0] != lst or task.id in placed:
                    continue
                at = bisect.bisect_left(places, row[1], 0, kept_len)
                if at == kept_len or tasks[at].id != task.id:
                    continue
                task = tasks[at]  # the task in the list (the one changed may be a stale copy)
                body = encoder.encode(task)
                if body != row[2]:
                    rows[task.id] = (lst, row[1], body)
                    upserts.append((task.id, lst, row[1], rev, task.state.value, task.name, task.host, body))
            if tracking.VERIFY:
                _verify(tasks[:kept_len], places, rows, lst)
            ords.append(places)
            continue
        if began.lists is not None:
            left.update(t.id for t in began.lists[lst])
        bodies = encoder.encode_lines(tasks).split(b"\n")
        places = []
        last = -1
        for task, body in zip(tasks, bodies):
            old = rows.get(task.id)
            if old is not None and old[0] == lst and old[1] > last and task.id not in placed:
                place = old[1]
            else:
                place, next_ord = next_ord, next_ord + 1
            last = place
            places.append(place)
            placed.add(task.id)
            row = rows[task.id] = (lst, place, body)
            if row != old:
                upserts.append((task.id, lst, place, rev, task.state.value, task.name, task.host, body))
        tracking.track(tasks)
        ords.append(places)
    gone = list(left - placed)
    for task_id in gone:
        rows.pop(task_id, None)
    return rows, upserts, gone, next_ord, tuple(ords)


class PgWatch:
    """LISTEN on the channel every commit NOTIFYs (PgStore.commit): the connection's socket is
    readable as soon as any process of any machine commits."""

    def __init__(self, url: str):
        self.url = url
        self.conn = self._listen()

    def _listen(self) -> psycopg.Connection:
        conn = connect(self.url)
        with errors(self.url):
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        return conn

    def fileno(self) -> int:
        return self.conn.fileno()

    def clear(self) -> None:
        try:
            for _ in self.conn.notifies(timeout=0):
                pass
        except psycopg.Error:
            # The connection was lost (its socket stays readable: a waiter would spin). A new
            # one; what was committed meanwhile the waiter reads next, as it looks now.
            self.conn.close()
            self.conn = self._listen()

    def close(self) -> None:
        self.conn.close()


def store_for(url: str) -> PgStore:
    """This thread's store for `url`: a command that opens the store in several places uses one
    connection."""
    key = (url, threading.get_ident())
    store = _stores.get(key)
    if store is None:
        store = _stores[key] = PgStore(url)
    return store
