"""PgStore: the store protocol (kugetsu.store.StoreProtocol) on PostgreSQL.

The queue is one document in one row, as index.json is one file: pm reads and changes the
same Index either way, so every rule (positions, policies, admission) is the same code in a
cluster. A transaction takes that row's lock (SELECT ... FOR UPDATE), which serializes all
writers of every machine: a global limit cannot be exceeded even for an instant, because
the writer that counts is the only one that can add. Readers take no lock (MVCC: they see
the last committed document). Events are rows committed in the same transaction, and the
commit NOTIFYs every service (LISTEN), so a change on one machine wakes the others at once.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import msgspec
import psycopg

from kugetsu.cluster.db import NOTIFY_CHANNEL, Unreachable, connect, errors, process_tag, redact
from kugetsu.errors import FileError
from kugetsu.models import INDEX_VERSION, Event, Index, Task, check_index
from kugetsu.store import Transactions, Txn, _encoder, _held, _index_decoder, encode_index, mark_writer

_event_decoder = msgspec.json.Decoder(Event)
_task_decoder = msgspec.json.Decoder(Task)
INSERT_EVENTS = "INSERT INTO kugetsu.events (seq, task, at, body) VALUES (%s, %s, %s, %s)"
INSERT_HISTORY = "INSERT INTO kugetsu.history (id, finished_at, body) VALUES (%s, %s, %s)"
UPSERT_PROMPT = "INSERT INTO kugetsu.prompts (id, body) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET body = excluded.body"


def event_rows(events: list[Event]) -> list[tuple[Any, ...]]:
    return [(e.seq, e.task, e.at, _encoder.encode(e)) for e in events]


_FIX = "\nNothing was changed. Restore the database from a backup, or ask for help with the row."


class PgStore(Transactions):
    """One client of the cluster's queue: one connection, one transaction at a time."""

    def __init__(self, url: str):
        self.url = url
        self._conn: psycopg.Connection | None = None
        self._open = False  # a transaction is open on the connection
        # The document this store last committed: an unchanged one is not rewritten, and a
        # long-lived writer skips decoding a document that is byte for byte its own.
        self._committed: tuple[bytes, Index] | None = None
        self._busy: float | None = None  # time.monotonic() when the statement under way was sent

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
        with self.guarded() as conn:
            conn.cursor().executemany(sql, rows)

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
        if not data:
            return Index()
        if self._committed is not None and self._committed[0] == data:
            return self._committed[1]
        try:
            index = _index_decoder.decode(data)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as err:
            raise FileError(f"{redact(self.url)}: the queue document does not decode: {err}{_FIX}") from None
        problem = check_index(index) if index.version == INDEX_VERSION else f"unknown version {index.version}"
        if problem:
            raise FileError(f"{redact(self.url)}: {problem}{_FIX}")
        return index

    def read(self) -> Index:
        row = self._execute("SELECT doc FROM kugetsu.state WHERE id = 1").fetchone()
        return self._decode(bytes(row[0])) if row else Index()

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
        """Take the queue row's lock and load it; `now` is the database's clock, read after
        the lock: one clock for every machine, so events' times never go back."""
        if self._open:
            raise RuntimeError("nested kugetsu transaction (this store already holds one)")
        if getattr(_held, "depth", 0):  # this thread holds a transaction of any store already
            raise RuntimeError("nested kugetsu transaction (it would deadlock on the queue row)")
        self._execute("BEGIN")
        self._open = True
        _held.depth = 1
        try:
            row = self._execute(
                "SELECT doc, config, clock_timestamp() FROM kugetsu.state WHERE id = 1 FOR UPDATE").fetchone()
            assert row is not None, "kugetsu.state has its row from ensure_schema"
            before = bytes(row[0])
            # Taken out while the transaction runs: a failed one may leave the object half
            # changed, and it must never be reused.
            reuse, self._committed = self._committed, None
            unchanged = reuse is not None and reuse[0] == before  # this store's own last commit
            index = reuse[1] if unchanged else self._decode(before)  # type: ignore[index]
            if not unchanged:
                self._keep_counters_ahead(index)
            txn = Txn(index, now or row[2], unchanged=unchanged, before=before)
            txn.shared_config = bytes(row[1])
            return txn
        except BaseException:
            self.abort()
            raise

    def _keep_counters_ahead(self, index: Index) -> None:
        """Ids and event seqs never go back, even when the queue row was emptied or restored
        from an older backup (as the file store's _keep_counters_ahead): one index lookup
        when all is well, the full look only when the row is behind its events."""
        row = self._execute("SELECT max(seq) FROM kugetsu.events").fetchone()
        if row is None or row[0] is None or row[0] < index.next_seq:
            return
        top = self._execute(
            "SELECT greatest((SELECT max(task) FROM kugetsu.events), (SELECT max(id) FROM kugetsu.history),"
            " (SELECT max(task) FROM kugetsu.log_chunks))").fetchone()
        index.next_seq = row[0] + 1
        index.next_id = max(index.next_id, (top[0] or 0) + 1 if top else 1)

    def commit(self, txn: Txn) -> None:
        """Write the document, the events and archived tasks, NOTIFY, COMMIT: all or nothing."""
        try:
            index = txn.index
            mark_writer(txn)
            for event in txn.events:
                event.seq = index.next_seq
                index.next_seq += 1
            index.outbox = []  # events are rows committed with the document: nothing to recover
            data = encode_index(index)
            if data != txn.before:
                self._execute("UPDATE kugetsu.state SET doc = %s WHERE id = 1", (data,))
            if txn.new_config is not None:
                self._execute("UPDATE kugetsu.state SET config = %s WHERE id = 1", (txn.new_config,))
            if txn.prompts:
                self._executemany(UPSERT_PROMPT, [(i, text.encode()) for i, text in txn.prompts.items()])
            if txn.events:
                self._executemany(INSERT_EVENTS, event_rows(txn.events))
            if txn.archive:
                self._executemany(INSERT_HISTORY, [(t.id, t.finished_at, _encoder.encode(t)) for t in txn.archive])
            if data != txn.before or txn.events or txn.new_config is not None:
                self._execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, process_tag()))
            done = self._execute("COMMIT")
            if done.statusmessage != "COMMIT":  # the server rolled back (a statement failed in it)
                raise RuntimeError(f"the transaction was rolled back by the database ({done.statusmessage})")
            self._committed = (data, index)
        except BaseException:
            self._rollback()
            raise
        finally:
            self._open = False
            _held.depth = 0

    def abort(self) -> None:
        try:
            self._rollback()
        finally:
            self._open = False
            _held.depth = 0

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
        return list({t.id: t for t in (_task_decoder.decode(bytes(r[0])) for r in rows)}.values())

    def history(self) -> list[bytes]:
        rows = self._execute("SELECT body FROM kugetsu.history ORDER BY id").fetchall()
        return [bytes(r[0]) for r in rows]


_stores: dict[tuple[str, int], PgStore] = {}


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
