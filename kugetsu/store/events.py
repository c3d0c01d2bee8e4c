"""Reading the events file (events.jsonl and, after the service rotates it, events.jsonl.1):
the one place that knows its rotation. Forward from a cursor (EventTail: the Telegram feed)
and newest first (events_newest_first: `kugetsu stats`, which stops at its window's start).
Only the file store has these files; the cluster's events are rows (cluster/feeds.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

from kugetsu.core.models import Event
from kugetsu.paths import Home, nofollow, read_file
from kugetsu.store.protocol import decode_events

_CHUNK = 1 << 16


class EventTail:
    """Reads events.jsonl from where the last read stopped, so a long history is scanned
    once per feed, not on every new event. Follows the service's rotation of the file: what
    was not read yet of the old one (now events.jsonl.1) comes first. Rotated more than once
    between two reads, all of events.jsonl.1 comes first, and what was in between is gone
    (the feed says so: seqs have no holes)."""

    def __init__(self, home: Home):
        self.path, self.old = home.events, home.events_old
        self.started = False
        self.inode: int | None = None  # of the file being followed (None: there is none yet)
        self.offset = 0

    def after(self, seq: int) -> list[Event]:
        return [e for e in decode_events(self._read(seq)) if e.seq > seq]

    def _read(self, seq: int) -> bytes:
        current = _inode(self.path)
        data = b""
        if current != self.inode or not self.started:
            # A file to follow from its start (the first read, a rotation, the file made
            # anew). First what was not read yet of the file followed so far, now
            # events.jsonl.1; when that is gone too (rotated again since) or there was none,
            # all of events.jsonl.1, should the new file not go on right after `seq`.
            rest = self._chunk(self.old, self.inode) if self.started and self.inode is not None else None
            if rest is not None:
                data = rest
            elif _first_seq(self.path) > seq + 1:
                data = _whole(self.old) + b"\n"  # "\n": a torn last line stays apart
            self.started = True
            self.offset = 0
        self.inode = current
        if current is not None:
            data += self._chunk(self.path, current) or b""
        return data

    def _chunk(self, path: Path, inode: int) -> bytes | None:
        """The complete lines of `path` from the offset, if it is still the file `inode`
        (None if it is not, or is gone)."""
        try:
            with open(path, "rb", opener=nofollow) as f:
                if os.fstat(f.fileno()).st_ino != inode:
                    return None  # replaced meanwhile: the next read picks it up
                if f.seek(0, os.SEEK_END) < self.offset:
                    self.offset = 0  # replaced by a shorter file (by hand): read it all again
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return None
        data = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offset += len(data)
        return data


def _whole(path: Path) -> bytes:
    try:
        return read_file(path)
    except FileNotFoundError:
        return b""


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _first_seq(path: Path) -> float:
    """The seq of the file's first event; infinity for a missing or empty file."""
    try:
        with open(path, "rb", opener=nofollow) as f:
            first = decode_events(f.readline())
    except FileNotFoundError:
        return float("inf")
    return first[0].seq if first else float("inf")


def lines_backwards(path: os.PathLike[str], chunk: int = _CHUNK) -> Iterator[bytes]:
    """The lines of a file from the last to the first, reading `chunk` bytes at a time from
    the end: what lies before the lines a caller wants is never read. A missing file has
    no lines."""
    try:
        f = open(path, "rb", opener=nofollow)
    except FileNotFoundError:
        return
    with f:
        pos = f.seek(0, os.SEEK_END)
        rest = b""  # the start of a line whose beginning is in the chunk before
        while pos > 0:
            step = min(chunk, pos)
            pos -= step
            f.seek(pos)
            lines = (f.read(step) + rest).split(b"\n")
            rest = lines[0]  # maybe incomplete: joined with the next chunk read
            for line in reversed(lines[1:]):
                if line:
                    yield line
        if rest:
            yield rest


def events_newest_first(home: Home) -> Iterator[tuple[Event, int]]:
    """Every event, the newest first (events.jsonl from its end, then events.jsonl.1), each
    with the bytes its line took; an event seen twice (a rotation while this reads) and a line
    that does not decode are left out. Only what the caller goes on to ask for is read."""
    lowest = math.inf  # a rotation while we read must not show an event twice
    for path in (home.events, home.events_old):
        for line in lines_backwards(path):
            decoded = decode_events(line)
            if not decoded or decoded[0].seq >= lowest:
                continue
            lowest = decoded[0].seq
            yield decoded[0], len(line) + 1
