"""Reading agents' logs with bounded memory, and keeping them bounded on disk.

An agent's output is input: it may be a gigabyte, or one line of a hundred megabytes. Every
reader of a log (the CLI's `logs`, the dashboard's output pane, the bot's excerpts, the MCP
`logs` tool, the exit's limit check, cluster shipping) goes through here and never holds
more than a window of it: `tail` reads at most `max_bytes` from the end and cuts any line
longer than `line_max` (its end is kept, the newest output; a marker says how much went);
`stream` copies a region in chunks.

On disk, a log is capped by `compact` (config `log_max_size`), which the service runs on
its agents' logs when one passes the cap: the first HEAD bytes stay (how the agent
started), then a marker line that says how many bytes were dropped, then the last quarter
of the cap (how it goes on). The agent writes its log itself (stdout and stderr are the
file, opened O_APPEND: no relay process per task), so the compaction moves the tail down in
place and truncates after it; O_APPEND makes the agent's next write land at the new end.
A write that lands between the compaction's last look at the size and its truncate is lost:
the same microseconds-wide window as logrotate's copytruncate.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import BinaryIO

from kugetsu.config.units import format_size, LOG_MIN
from kugetsu.paths import open_file

WINDOW = 8 * 1024 * 1024  # the most of a log any reader holds at once
LINE_MAX = 16 * 1024  # the most of one line shown; the rest is cut with a marker
CHUNK = 1024 * 1024  # reads and copies go by this much
HEAD = LOG_MIN // 4  # what a capped log keeps of its beginning, whatever its cap

# The line a compaction writes at HEAD (after a newline if the head ends mid-line). The
# count is the total dropped so far: a later compaction adds to it.
_MARKER = re.compile(rb"\n?\[kugetsu: (\d{1,20}) bytes of output dropped here \(log_max_size [^\]\n]{1,40}\)\]\n")


class Tail:
    """The end of a log: `data` (lines, long ones cut), the file's `size`, and `start`, where
    the bytes read began (a follower goes on from `size`)."""

    __slots__ = ("data", "size", "start")

    def __init__(self, data: bytes, size: int, start: int):
        self.data, self.size, self.start = data, size, start

    @property
    def truncated(self) -> bool:
        return self.start > 0


def _open(path: os.PathLike[str] | str) -> BinaryIO:
    return os.fdopen(open_file(path, os.O_RDONLY), "rb")


def tail(path: os.PathLike[str] | str, lines: int | None = None, max_bytes: int = WINDOW,
         line_max: int = LINE_MAX) -> Tail:
    """The last `lines` lines (None: as many as fit) within the last `max_bytes` bytes of a
    log, each line cut to `line_max` bytes; an empty Tail when there is no file. A line that
    began before the window is shown (cut) only when the window holds fewer lines than asked."""
    try:
        f = _open(path)
    except FileNotFoundError:
        return Tail(b"", 0, 0)
    with f:
        size = os.fstat(f.fileno()).st_size
        low = max(0, size - max_bytes)
        start = _lines_start(f, size, low, lines) if lines is not None else low
        if lines == 0:
            return Tail(b"", size, size)
        f.seek(start)
        data = f.read(size - start)
        whole = start == 0 or _byte(f, start - 1) == b"\n"  # did the window begin at a line's start?
    return Tail(cut_lines(data, line_max, first_whole=whole, drop_partial=lines is None), size, start)


def _lines_start(f: BinaryIO, size: int, low: int, lines: int) -> int:
    """Where the last `lines` lines begin, looking back no further than `low`: read backwards
    by CHUNK, counting newlines (the file's final newline ends the last line, it starts none)."""
    pos, found = size, 0
    end = size - 1 if size and _byte(f, size - 1) == b"\n" else size
    while pos > low:
        n = min(CHUNK, pos - low)
        pos -= n
        f.seek(pos)
        chunk = f.read(n)[: max(0, end - pos)]
        count = chunk.count(b"\n")
        if found + count >= lines:
            i = len(chunk)
            for _ in range(lines - found):
                i = chunk.rfind(b"\n", 0, i)
            return pos + i + 1
        found += count
    return low


def _byte(f: BinaryIO, at: int) -> bytes:
    f.seek(at)
    return f.read(1)


def cut_lines(data: bytes, line_max: int = LINE_MAX, first_whole: bool = True, drop_partial: bool = False) -> bytes:
    """Each line of `data` at most `line_max` bytes: a longer one keeps its end, after
    `[… N bytes cut] ` (`more than N` for a first line that began before `data`, when
    not `first_whole`). `drop_partial`: leave such a first line out if other lines follow."""
    if not first_whole and drop_partial and b"\n" in data[:-1]:
        data, first_whole = data[data.find(b"\n") + 1 :], True
    if len(data) <= line_max and first_whole:
        return data
    out = []
    for i, line in enumerate(data.split(b"\n")):
        partial = i == 0 and not first_whole
        if len(line) > line_max or partial:
            kept = line[-line_max:] if len(line) > line_max else line
            while kept and 0x80 <= kept[0] < 0xC0 and len(kept) > line_max - 3:  # not in a character's middle
                kept = kept[1:]
            cut = len(line) - len(kept)
            label = f"{cut} bytes cut" if not partial else f"more than {cut} bytes cut" if cut else "earlier bytes cut"
            line = f"[\u2026 {label}] ".encode() + kept
        out.append(line)
    return b"\n".join(out)


def stream(f: BinaryIO, write: Callable[[bytes], object], limit: int | None = None) -> int:
    """Copy from `f`'s position to its end (at most `limit` bytes) to `write`, CHUNK by
    CHUNK: memory stays at one chunk whatever the log. Returns the bytes copied."""
    done = 0
    while limit is None or done < limit:
        chunk = f.read(CHUNK if limit is None else min(CHUNK, limit - done))
        if not chunk:
            break
        write(chunk)
        done += len(chunk)
    return done


class Follower:
    """Reads what is appended to a log, CHUNK by CHUNK, from `offset`, across the service's
    compactions: each look checks the marker (one pread) and, when it changed, moves the
    offset to where its bytes went. Output dropped before it was read is counted in
    `missed` (the caller says so). A file that shrinks otherwise (replaced, truncated by
    hand) is read again from its start."""

    def __init__(self, f: BinaryIO, offset: int):
        self.f, self.offset, self.missed = f, offset, 0
        self.mark = dropped(f.fileno())

    def read(self) -> bytes:
        fd = self.f.fileno()
        mark = dropped(fd)
        if mark != self.mark:
            if self.offset > HEAD:
                offset, floor = moved(self.mark, mark, self.offset), HEAD + mark[1]
                if offset < floor:  # dropped before this look: go on from what was kept
                    self.missed += floor - offset
                    offset = floor
                self.offset = offset
            self.mark = mark
        size = os.fstat(fd).st_size
        if size < self.offset:
            self.offset = 0
        data = os.pread(fd, min(CHUNK, size - self.offset), self.offset) if size > self.offset else b""
        self.offset += len(data)
        return data


# ---- the cap on disk ---------------------------------------------------------------------


def dropped(fd: int) -> tuple[int, int]:
    """A log's compaction marker at HEAD: (bytes dropped so far, the marker's length), or
    (0, 0) when the log was never compacted. Read with one pread, so a follower checks it at
    every look."""
    probe = os.pread(fd, 200, HEAD)
    m = _MARKER.match(probe)
    return (int(m.group(1)), m.end()) if m else (0, 0)


def moved(before: tuple[int, int], after: tuple[int, int], offset: int) -> int:
    """Where a byte that was at `offset` is after the compactions between two looks at the
    marker (`dropped`): earlier by what they dropped, the marker's own length accounted.
    An offset that now falls before the kept tail (its bytes were dropped) maps to the
    tail's start: the caller sees a value below HEAD + marker and says what it missed."""
    if before == after or offset <= HEAD:
        return offset
    return offset - before[1] + before[0] - after[0] + after[1]


def compact(path: os.PathLike[str] | str, cap: int) -> int:
    """If the log is over `cap` bytes: keep its first HEAD bytes and its last quarter of
    `cap` (from a line's start when one begins near there), with a marker line between that
    says how much was dropped in all. Returns the bytes dropped now (0: under the cap). Runs
    in a worker thread: a copy of up to cap/4, in CHUNKs."""
    try:
        fd = open_file(path, os.O_RDWR)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size <= cap:
            return 0
        before, old_len = dropped(fd)
        src = max(HEAD + old_len, size - cap // 4)
        near = os.pread(fd, 64 * 1024, src)
        nl = near.find(b"\n")
        if 0 <= nl < len(near) - 1:
            src += nl + 1  # the tail starts with a whole line
        now = src - HEAD - old_len  # agent output dropped by this compaction
        lead = b"" if os.pread(fd, 1, HEAD - 1) == b"\n" else b"\n"
        marker = lead + f"[kugetsu: {before + now} bytes of output dropped here (log_max_size {format_size(cap)})]\n".encode()
        dst = HEAD + len(marker)
        while True:
            end = os.fstat(fd).st_size
            while src < end:
                data = os.pread(fd, min(CHUNK, end - src), src)
                if not data:
                    break
                os.pwrite(fd, data, dst)
                src += len(data)
                dst += len(data)
            if os.fstat(fd).st_size == end:  # caught up with the agent: cut after the tail
                # The marker last: a follower that looks meanwhile still finds its bytes
                # where they were (the copy only writes below where it reads).
                os.pwrite(fd, marker, HEAD)
                os.ftruncate(fd, dst)
                return now
    finally:
        os.close(fd)
