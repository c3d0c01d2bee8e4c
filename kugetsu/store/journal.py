"""index.journal: the commits made since index.json was last written whole (docs/architecture.md §3).

index.json stays the place where the state is, as a snapshot; a writer that knows what its
transaction changed appends one record to the journal beside it instead of writing the whole
file again (at 50,000 queued, a few KB fsynced instead of 14 MB). A reader decodes the snapshot
and replays the records on it.

The file is lines (JSON holds no raw newline): a header naming the snapshot it follows, then one
line per commit, `<crc32 of the record, 8 hex digits> <record>`. A journal whose header names
another snapshot (one written whole since, or one put back by hand) is stale and ignored: the
snapshot's rename stays the commit point of a whole write. A last line cut short by a crash (no
newline, or a checksum that does not match) was never committed, and is ignored; the next writer
cuts it off before appending. A bad line with whole lines after it is damage, and is refused.

A record holds what changed: the index without its queued and finished tasks (`rest`: the
running tasks, the counters, pauses, holds, the outbox: short), the queue as runs of the queue
before it (`[first, end)` places) and the tasks that are new or changed, and the finished list
as how many left its head (`drop`) and the tasks appended (`done`), or whole.
"""

from __future__ import annotations

import io
import os
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from kugetsu.core.models import Index, Task
from kugetsu.store.protocol import IndexFile, encoder

_MAGIC = b"kugetsu-journal 1 "
T = TypeVar("T")


class Record(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One commit, as a reader decodes it."""

    rest: IndexFile  # its queued and finished lists empty
    queue: list[Task | tuple[int, int]] | None = None  # None: the queue before, unchanged
    drop: int = 0
    done: list[Task] = []
    finished: list[Task] | None = None  # the whole list, when it is not `drop` and `done`


class _Head(msgspec.Struct):
    """A record as `capacity` reads it: its queue's tasks left as their text."""

    rest: IndexFile
    queue: list[msgspec.Raw] | None = None


_record_decoder = msgspec.json.Decoder(Record)
_head_decoder = msgspec.json.Decoder(_Head)
_range_decoder = msgspec.json.Decoder(tuple[int, int])


class Damaged(Exception):
    """The journal is damaged (not merely cut short by a crash): what, in words."""


def header(snapshot: bytes) -> bytes:
    """The journal's first line, naming the snapshot it follows by its size and two checksums
    (a journal must never be replayed on another file: 64 bits of checksum, ~10 ms at 14 MB,
    against a decode of ~300)."""
    return _header(len(snapshot), zlib.crc32(snapshot), zlib.adler32(snapshot))


def header_of(f: io.FileIO) -> bytes:
    """header() of a file open for reading, read a piece at a time from its start."""
    size = crc = 0
    adler = 1
    while piece := os.pread(f.fileno(), _PIECE, size):
        size += len(piece)
        crc, adler = zlib.crc32(piece, crc), zlib.adler32(piece, adler)
    return _header(size, crc, adler)


def _header(size: int, crc: int, adler: int) -> bytes:
    return b"%s%d %08x%08x\n" % (_MAGIC, size, crc, adler)


_PIECE = 1 << 20


def line(record: bytes) -> bytes:
    return b"%08x %s\n" % (zlib.crc32(record), record)


def encode(rest: bytes, queue: list[Any] | None, finished: tuple[int, list[bytes]] | list[bytes]) -> bytes:
    """A record: `rest` the index's encoding without its queued and finished tasks, `queue` runs
    as (first, end) places of the queue before and tasks' encodings (msgspec.Raw), or None;
    `finished` as (drop, the encodings appended) or every task's encoding."""
    body: dict[str, Any] = {"rest": msgspec.Raw(rest)}
    if queue is not None:
        body["queue"] = queue
    if isinstance(finished, tuple):
        drop, done = finished
        if drop:
            body["drop"] = drop
        if done:
            body["done"] = [msgspec.Raw(d) for d in done]
    else:
        body["finished"] = [msgspec.Raw(d) for d in finished]
    return encoder.encode(body)


def records(data: bytes, snapshot_header: bytes) -> tuple[list[bytes], int] | None:
    """The records of a journal that follows the snapshot whose header is `snapshot_header`, and
    how many of its bytes are whole lines (where the next record goes); None for a journal of
    another snapshot (stale). Raises Damaged for a bad line with whole lines after it."""
    if not data.startswith(snapshot_header):
        return None
    at = len(snapshot_header)
    out = []
    while True:
        end = data.find(b"\n", at)
        if end < 0:
            return out, at  # nothing, or a last line cut short by a crash
        text = data[at:end]
        if not _good(text):
            if end + 1 < len(data):
                raise Damaged(f"line {len(out) + 2} does not match its checksum, and lines follow it")
            return out, at  # the last line, torn and then ended by a later writer's newline
        out.append(text[9:])
        at = end + 1


def _good(text: bytes) -> bool:
    """Whether a journal line is `<crc32> <record>` with the record's checksum."""
    if len(text) <= 9 or text[8:9] != b" ":
        return False
    try:
        crc = int(text[:8], 16)
    except ValueError:
        return False
    return crc == zlib.crc32(memoryview(text)[9:])


def replay(index: Index, found: list[bytes]) -> Index:
    """`index` (the snapshot's) with the records applied, in order. Raises Damaged when a record
    does not fit the index it follows (a place past the queue's end)."""
    for data in found:
        record = _record_decoder.decode(data)
        queued = index.queued
        if record.queue is not None:
            queued = _queue_after(queued, record.queue, lambda item: item if type(item) is tuple else None)
        if record.finished is not None:
            finished = record.finished
        else:
            if record.drop > len(index.finished):
                raise Damaged(f"a record drops {record.drop} finished tasks of {len(index.finished)}")
            finished = index.finished[record.drop:] + record.done if record.drop or record.done else index.finished
        index = record.rest
        index.queued = queued
        index.finished = finished
    return index


def replay_head(rest: Index, queued: list[msgspec.Raw], found: list[bytes]) -> tuple[Index, list[msgspec.Raw]]:
    """replay() for `capacity`: the queued tasks stay their text, the finished ones are not kept."""
    for data in found:
        record = _head_decoder.decode(data)
        if record.queue is not None:
            queued = _queue_after(queued, record.queue, _range_of)
        rest = record.rest
    rest.queued, rest.finished = [], []
    return rest, queued


def _queue_after(before: list[T], items: list[Any], range_of: Callable[[Any], tuple[int, int] | None]) -> list[T]:
    """A record's queue: each item a range of places in `before` (range_of says which, and
    where) or a task, in order."""
    queued: list[T] = []
    for item in items:
        places = range_of(item)
        if places is None:
            queued.append(item)
            continue
        first, end = places
        if not 0 <= first < end <= len(before):
            raise Damaged(f"a record names places {first}-{end} of a queue of {len(before)}")
        queued += before[first:end]
    return queued


def _range_of(item: msgspec.Raw) -> tuple[int, int] | None:
    """A record's queue item as `capacity` reads it: a range of places (`[first, end]`), else
    a task's text (None)."""
    return _range_decoder.decode(item) if memoryview(item)[:1] == b"[" else None
