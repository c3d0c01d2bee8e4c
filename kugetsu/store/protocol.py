"""The store protocol: what pm's callers need of a store, and the pieces both stores share (the
transaction object, index.json's encoding, the per-thread "a transaction is held" mark).

The file store (store/files.py) and the cluster's PostgreSQL store (store/postgres.py) both
build on this module and on nothing of each other's; tests/test_store_contract.py is the
contract they pass.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kugetsu.core.models import ClockMark, Event, Index, QueueCounts, QueuedBrief, Task
from kugetsu.paths import Home

if TYPE_CHECKING:  # the cluster's tables are read by its store only (psycopg is not light)
    from kugetsu.cluster.hosts import HostRow

    Standing = tuple[datetime, list[tuple[HostRow, str]]]


class IndexFile(Index, forbid_unknown_fields=True):
    """index.json as it must be on disk: a JSON object that merely decodes (`{"max_agents": 2}`,
    a config file put in the wrong place) is not an index, and is refused rather than taken
    for an empty queue."""

    version: int
    next_id: int


class IndexHeadFile(IndexFile, forbid_unknown_fields=True):
    """index.json with its queued tasks left as their JSON text and its finished ones skipped:
    what `capacity` reads. Skipping a task is ~20x cheaper than decoding it (50,000 queued)."""

    queued: list[msgspec.Raw] = []
    finished: msgspec.Raw = msgspec.Raw(b"[]")


index_decoder = msgspec.json.Decoder(IndexFile)
head_decoder = msgspec.json.Decoder(IndexHeadFile)
_briefs_decoder = msgspec.json.Decoder(list[QueuedBrief])
encoder = msgspec.json.Encoder()
held = threading.local()
_event_decoder = msgspec.json.Decoder(Event)


def encode_index(index: Index) -> bytes:
    return msgspec.json.format(encoder.encode(index), indent=2) + b"\n"


def head_of(data: bytes) -> tuple[Index, list[msgspec.Raw]]:
    """index.json without its queued and finished tasks (the index's lists are empty), and its
    queued tasks as their text. Raises what index_decoder raises on a damaged file."""
    head = head_decoder.decode(data)
    index = Index(**{f: getattr(head, f) for f in Index.__struct_fields__ if f not in ("queued", "finished")})
    return index, head.queued


def count_queued(index: Index, queued: list[msgspec.Raw], texts: Iterable[bytes]) -> QueueCounts:
    """The counts of queued tasks left as their text, found in `texts`."""
    # A queued task at the defaults has no "memory" or "slots" key (defaults are left out), and
    # in JSON text a quote inside a string is escaped: without either key anywhere, no queued
    # task accounts. Only with one, or a hold to count for, are the briefs decoded.
    if index.holds or any(b'"memory":' in t or b'"slots":' in t for t in texts):
        briefs = _briefs_decoder.decode(b"[" + b",".join(bytes(r) for r in queued) + b"]")
        return QueueCounts.of(briefs, index.holds)
    return QueueCounts(queued=len(queued))


def decode_events(data: bytes) -> list[Event]:
    """The events of events.jsonl lines; a line torn by a crash is skipped."""
    events = []
    for line in data.splitlines():
        try:
            events.append(_event_decoder.decode(line))
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            continue  # a line torn by a crash mid-append; its event is still in the outbox
    return events


_writer: list[str] = []


def writer() -> str:
    """This process, as a clock error names it: `kugetsu delegate (pid 4242)`."""
    if not _writer:
        import sys

        command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
        name = f"kugetsu {command}" if command else os.path.basename(sys.argv[0] or "python")
        _writer.append(f"{name[:60]} (pid {os.getpid()})")
    return _writer[0]


def mark_writer(txn: Txn) -> None:
    """A transaction that records events signs the index with its clock (Index.clock): a time
    from a wrong clock can then be traced to the command that wrote it (skew.correct_clock).
    Only then: a transaction that changes nothing else must not rewrite the index."""
    if txn.events:
        txn.index.clock = ClockMark(at=txn.now, by=writer())


class Txn:
    """What a transaction sees and collects: the index, and the events and archived tasks to write."""

    def __init__(self, index: Index, now: datetime, unchanged: bool = False):
        self.index = index
        self.now = now
        self.unchanged = unchanged  # the index is the one this Store last committed, untouched since
        self.events: list[Event] = []
        self.archive: list[Task] = []
        # Prompts to keep (task id -> text): written with the index, never inside it.
        self.prompts: dict[int, str] = {}
        # Cluster mode: the shared config as the transaction found it, and its new text to
        # commit with the queue (`config set`); the file store keeps config.json apart.
        self.shared_config: bytes = b""
        self.new_config: bytes | None = None

    def emit(self, events: list[Event]) -> None:
        self.events.extend(events)


class StoreProtocol(Protocol):
    """What pm's callers need of a store (docs/architecture.md §9): serialized transactions, lock-free
    reads of the committed index, and the event feed after a cursor. `Store` (the file store of
    docs/architecture.md §3) is the one implementation so far; tests/test_store_contract.py is the
    contract any other (the cluster's PostgreSQL store) must pass."""

    def begin(self, now: datetime | None = None) -> Txn:
        """Serialize with every other writer and load the index; `now` is read after that."""
        ...

    def commit(self, txn: Txn) -> None:
        """Make the transaction's index and events durable at once, or raise and change nothing."""
        ...

    def abort(self) -> None:
        """End the transaction, changing nothing."""
        ...

    def transaction(self, now: datetime | None = None) -> AbstractContextManager[Txn]:
        """begin, then commit on success or abort on an exception."""
        ...

    def read(self) -> Index:
        """The last committed index, without waiting for a writer."""
        ...

    def read_head(self) -> tuple[Index, QueueCounts]:
        """The last committed index without its queued and finished tasks (empty lists), and
        what `capacity` needs of the queued ones (QueueCounts)."""
        ...

    def read_events(self, after: int = 0) -> list[Event]:
        """Committed events with seq > after, oldest first."""
        ...

    def tail_events(self, count: int) -> list[Event]:
        """The last `count` committed events, cheaply."""
        ...

    def rotate_events(self, limit: int) -> int | None:
        """Keep the event feed bounded (the file store); returns the size rotated, or None."""
        ...

    def prompts(self, ids: Iterable[int]) -> dict[int, str]:
        """The stored prompts of these tasks (a task without one is left out). Kept beside the
        index, not in it: the index's size (what every command reads) does not grow with them."""
        ...

    def stamp(self) -> object:
        """A cheap look (no decoding) that differs after any process commits a change: what a
        view that refreshes itself compares."""
        ...

    def read_ahead(self) -> None:
        """Read and check the committed index (raising as `read` does) for a transaction about
        to begin: a store that can keeps it for that transaction (the service's start)."""
        ...

    def append_commits(self) -> None:
        """A long-lived writer's store (the service's, an MCP server's admissions): its commits
        may go to a journal, which `fold` ends (the file store's index.journal); another store
        has nothing to change."""
        ...

    def fold(self) -> None:
        """Leave the committed state in one place, a long-lived writer's last act (the service
        stopping, an MCP server letting go of its store): the file store writes index.json
        whole with its journal's records in it (a file a person may repair by hand while
        neither runs)."""
        ...

    def queue_version(self) -> int | None:
        """After a commit: a number that stays the same while the queue committed is the one
        committed before it, the same tasks in the same order, none assigned to (the service
        then reuses what it derived from the queue: its successor, its next expiry). None:
        the store cannot tell (derive it again)."""
        ...

    def watch(self) -> Watch | None:
        """A file descriptor to select on that becomes readable as soon as any process
        commits, for a waiter; None when the store has none (then it looks at `stamp`)."""
        ...

    def guarded(self) -> AbstractContextManager[Any]:
        """The store's connection, for statements beside the queue's (a cluster's hosts,
        leases and log chunks), guarded: a lost connection is `Unreachable`, and a watchdog
        can see how long a statement has waited (`waiting_for`). The file store has no such
        tables: None."""
        ...

    def since(self, start: datetime) -> Since:
        """What `kugetsu stats` reads of a window [start, now]: the events and the archived
        tasks at or after `start`, and max_agents at `start` when known."""
        ...

    def machines(self, lease_s: float) -> Standing | None:
        """The cluster's machines with how each stands (up, silent, gone) by the database's
        clock, which is returned too; None: a store of one machine, which has no others."""
        ...

    def machine_rows(self) -> list[HostRow] | None:
        """The cluster's machines as they are recorded, without judging their leases (`doctor`);
        None: a store of one machine."""
        ...

    def mirror_log(self, task: int, home: Home) -> Path | None:
        """The local mirror of a task's output that another machine shipped (in `home`),
        brought up to what the store has; None: the store ships no logs (each log is where
        its task ran)."""
        ...

    def waiting_for(self) -> float:
        """Seconds the statement under way has waited for its answer (0: none waits)."""
        ...

    def interrupt(self) -> None:
        """Make the statement that waits fail at once (its connection is made afresh)."""
        ...


class Since(msgspec.Struct, frozen=True):
    """A stats window as a store read it (StoreProtocol.since)."""

    events: list[Event]
    archived: list[Task]
    max_agents_at_start: int | None = None  # unknown: the value the window's first change set


class Watch(Protocol):
    def fileno(self) -> int:
        ...

    def clear(self) -> None:
        """Take what made it readable (after select said so)."""
        ...

    def close(self) -> None:
        ...


class Transactions:
    """`transaction` for a store that has begin, commit and abort, and what of the protocol a
    store without a connection has nothing to do for (both stores build on it)."""

    def begin(self, now: datetime | None = None) -> Txn:
        raise NotImplementedError

    def commit(self, txn: Txn) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def read(self) -> Index:
        raise NotImplementedError

    def read_head(self) -> tuple[Index, QueueCounts]:
        """The committed index without its queued and finished tasks, and the queued tasks'
        counts: what `capacity` needs. A store without a cheaper way reads the whole index."""
        index = self.read()
        return msgspec.structs.replace(index, queued=[], finished=[]), QueueCounts.of(index.queued, index.holds)

    @contextmanager
    def guarded(self) -> Iterator[Any]:
        """No connection (the file store): nothing to guard. The cluster's store overrides it."""
        yield None

    def machines(self, lease_s: float) -> Standing | None:
        return None  # one machine: no cluster to stand in

    def read_ahead(self) -> None:
        """Read and check the committed index (it raises as `read` does), for a transaction
        about to begin; a store that can keeps it for that transaction."""
        self.read()

    def append_commits(self) -> None:
        return None  # the cluster's store writes only the changed rows already

    def fold(self) -> None:
        return None  # the cluster's rows are the state already

    def queue_version(self) -> int | None:
        return None  # no cheap way to tell: whatever is derived from the queue is derived again

    def machine_rows(self) -> list[HostRow] | None:
        return None

    def mirror_log(self, task: int, home: Home) -> Path | None:
        return None  # each task's log is on the machine it ran on: this one

    def waiting_for(self) -> float:
        return 0.0  # a file store's statements are system calls: none waits on a peer

    def interrupt(self) -> None:
        pass

    @contextmanager
    def transaction(self, now: datetime | None = None) -> Iterator[Txn]:
        """Begin, let the caller change `txn.index`, commit. An exception commits nothing."""
        txn = self.begin(now)
        try:
            yield txn
        except BaseException:
            self.abort()
            raise
        self.commit(txn)
