"""Exit files used again: the exit file of a task that ended a while ago becomes the exit file
of a task about to start (runner.spawn), instead of a new file made for it.

Each spawn made two files in logs/: its task's log and its exit file. Making a file (an
inode) cost 0.74 ms of CPU on the machine the benchmarks run on (ext4; 0.006 ms on tmpfs),
where a rename costs 0.02: through 4 slots, whose drain is bound by the CPU, the service
spent half its samples there, and task-spooler makes one file a job. A log is the task's
output and stays. An exit file is only read while its task runs and shortly after its end
(the booking, the metrics' promotion times, `doctor`), so once a commit records an end, the
exit file of the task that ended KEEP ends before it may be used again: written over with
blanks in place first (the space it was allocated stays: an end is still recorded on a full
disk), then renamed to the new task's name, which replaces a stale exit file there as the
O_TRUNC it stands for did. In that order, a crash in between leaves blanks under the old
name (a finished task's, never read again), never an old status under the new one.

A task that runs again (a retry) keeps its file: it is not used again while the task is
running at a commit, and its own spawn takes it off the list. A wrapper that outlived its
booking finds no file at the old path and makes one (`1<>`), never writing into the one
used again. A file that is not what runner.spawn made (the size, a link: O_NOFOLLOW) is
left alone. With none to use, a spawn makes its own, as before. The list is the service's
memory only: a restarted one starts afresh, and the files it did not use stay, as before.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from pathlib import Path

from kugetsu.core.models import Index
from kugetsu.paths import Home, open_file
from kugetsu.service.runner import EXIT_BLANK

KEEP = 32  # the last ended tasks whose exit files stay as they are
MOST = 1000  # ended tasks remembered for use again (the oldest forgotten: their files stay)


class SpareExits:
    def __init__(self, home: Home, keep: int = KEEP, most: int = MOST):
        self.home, self.keep, self.most = home, keep, most
        self._booked: list[int] = []  # ends read from exit files since the last commit
        self.ended: deque[int] = deque()  # committed ends, oldest first: the last `keep` stay
        self.free: dict[int, None] = {}  # tasks whose exit files may be used again, oldest first

    def booked(self, task_id: int) -> None:
        """The task's end was read from its exit file: usable again once a commit records it."""
        self._booked.append(task_id)

    def committed(self, index: Index) -> None:
        """The index on disk (`index`) records the ends booked so far."""
        if not self._booked:
            return
        self.ended.extend(self._booked)
        self._booked.clear()
        if len(self.ended) <= self.keep:
            return
        running = {t.id for t in index.active}
        while len(self.ended) > self.keep:
            task_id = self.ended.popleft()
            if task_id not in running:
                self.free[task_id] = None
        while len(self.free) > self.most:
            del self.free[next(iter(self.free))]

    def take(self, task_id: int, path: Path) -> bool:
        """Make `path` (task_id's exit file) an old one written over with blanks; False: none
        to use, the caller makes the file."""
        self.free.pop(task_id, None)  # its own (a retry): never another's later
        while self.free:
            old = next(iter(self.free))
            del self.free[old]
            source = self.home.exit_file(old)
            try:
                fd = open_file(source, os.O_WRONLY)
            except OSError:  # removed with its task, never made, a link
                continue
            try:
                st = os.fstat(fd)
                blank = (stat.S_ISREG(st.st_mode) and st.st_size == len(EXIT_BLANK)
                         and os.pwrite(fd, EXIT_BLANK, 0) == len(EXIT_BLANK))
            except OSError:
                blank = False
            finally:
                os.close(fd)
            if not blank:
                continue
            try:
                os.rename(source, path)
            except OSError:
                continue
            return True
        return False
