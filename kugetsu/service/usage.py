"""What the running tasks use, measured, and the kernel's part in bounding it (README,
"Resources"). The service's side: pm decides what an over-limit task gets (step.over_limits).

A task's use is that of every process it owns: the processes carrying its token (runner) in
sampling mode, those of its own cgroups in cgroup mode (where children cannot leave). One
measurement is one pass over /proc (a worker thread's, never the loop's): /proc/PID/stat
gives a process's RSS, CPU time and start; its environment is read once per process (its
token does not change while it runs the same program).

Modes (config `resources.mode`):
- cgroup: each task with a memory or process limit runs in cgroups of its own under the
  service's (cgroup v1's memory and pids controllers, which root may create here): the
  kernel counts every byte and refuses every fork beyond the limits; a task the kernel had
  to act on (its OOM killer, a fork refused) is then stopped by the service.
- sampling: the service measures every `resources.interval` and stops an over-limit task
  then; between two looks a task may go beyond its limit, and a fork storm is ended, not
  prevented.
- auto: cgroup where this service may create them, else sampling.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from datetime import datetime
from operator import attrgetter
from pathlib import Path

import msgspec

from kugetsu.service import runner
from kugetsu.core.models import Task
from kugetsu.core.step import Measured
from kugetsu.paths import Home, atomic_write

CGROUP_ROOT = Path("/sys/fs/cgroup")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICKS = os.sysconf("SC_CLK_TCK")
MAX_PROCS_READ = 100_000  # processes looked at in one pass at most: a bounded look, whatever the machine


class Usage(msgspec.Struct, kw_only=True):
    """usage.json: the service's last look, for `status`, `queue`, the dashboard, metrics."""

    at: datetime
    mode: str
    tasks: dict[int, Measured] = {}


def _stat(pid: int) -> tuple[int, int, float, int] | None:
    """(ppid, rss bytes, cpu seconds, start ticks) from /proc/PID/stat; None: gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # after the command, which may hold spaces
    try:
        # CPU: its own, and that of its children it has reaped (a task's short-lived commands)
        cpu = sum(int(f) for f in fields[11:15]) / _TICKS
        return int(fields[1]), int(fields[21]) * _PAGE, cpu, int(fields[19])
    except (IndexError, ValueError):
        return None


class Sampler:
    """Measures the running tasks; kept by the service, used from one worker thread at a time."""

    def __init__(self, home: Home, mode: str):
        self.home = home
        self.mode = mode  # "cgroup" or "sampling": what is in force
        self.tokens: dict[tuple[int, int], str | None] = {}  # (pid, start) -> its token, read once
        # (task id, attempt) -> the largest memory and CPU time seen of that run: a run's figures
        # never go back (CPU time does, when a process that is not reaped in the task ends),
        # as its record keeps them (step.book_measured, at its end).
        self.most: dict[tuple[int, int], tuple[int, float]] = {}

    def resume(self, last: Usage) -> None:
        """Start from the last look of a service that was killed (usage.json): the runs it
        measured keep the peak they reached before, which /proc no longer shows."""
        for tid, m in last.tasks.items():
            self.most[(tid, m.attempt)] = (m.peak, m.cpu)

    def measure(self, tokens: dict[int, str], groups: dict[int, TaskGroups | None],
                attempts: Mapping[int, int]) -> dict[int, Measured]:
        """task id -> its use now, for the tasks in `tokens` (id -> token), in their run
        `attempts` (id -> attempt: a retry's peak starts afresh)."""
        by_token = {tok: tid for tid, tok in tokens.items()}
        memory = dict.fromkeys(tokens, 0)
        cpu = dict.fromkeys(tokens, 0.0)
        procs = dict.fromkeys(tokens, 0)
        seen: dict[tuple[int, int], str | None] = {}
        counted: set[int] = set()
        for pid in runner.users_pids(MAX_PROCS_READ):
            st = _stat(pid)
            if st is None:
                continue
            key = (pid, st[3])
            if key in self.tokens:
                token = self.tokens[key]
            else:
                env = runner.environ(pid)
                if env == b"":  # caught mid-exec: looked at again next time
                    continue
                token = runner.token_in(env) if env is not None else None
            seen[key] = token
            tid = by_token.get(token) if token is not None else None
            if tid is None:
                continue
            memory[tid] += st[1]
            cpu[tid] += st[2]
            procs[tid] += 1
            counted.add(pid)
        self.tokens = seen  # what has gone is forgotten
        for tid, g in groups.items():  # cgroup mode: its processes that dropped the token count too
            for pid in g.pids_in() if g is not None and tid in memory else ():
                if pid not in counted and (st := _stat(pid)) is not None:
                    memory[tid] += st[1]
                    cpu[tid] += st[2]
                    procs[tid] += 1
        out = {}
        for tid in tokens:
            g = groups.get(tid)
            kernel = g.read() if g is not None else (0, 0, 0)
            run = (tid, attempts.get(tid, 1))
            peak, most = self.most.get(run, (0, 0.0))
            peak, most = self.most[run] = max(peak, memory[tid], kernel[2]), max(most, round(cpu[tid], 2))
            out[tid] = Measured(task=tid, memory=memory[tid], peak=peak, cpu=most, procs=procs[tid],
                                oom_kills=kernel[0], forks_refused=kernel[1], attempt=run[1])
        for run in [r for r in self.most if r[0] not in tokens]:
            del self.most[run]
        return out

    def publish(self, measured: dict[int, Measured], at: datetime) -> None:
        """Write usage.json (0600, atomically) for the commands that show it."""
        atomic_write(self.home.usage, msgspec.json.encode(Usage(at=at, mode=self.mode, tasks=measured)))


def read(home: Home) -> Usage | None:
    """The service's last look (None: none, or not readable: nothing is shown)."""
    try:
        return msgspec.json.decode(home.usage.read_bytes(), type=Usage)
    except (OSError, msgspec.DecodeError):
        return None


# ---- cgroups ---------------------------------------------------------------------------------


class Base(msgspec.Struct, frozen=True):
    """Where this service makes its tasks' cgroups: a child of its own cgroup in the memory
    and the pids hierarchies (cgroup v1: two directories), or in the one hierarchy of cgroup v2
    (a subtree delegated to it, memory and pids enabled for its children: the same directory)."""

    memory: Path
    pids: Path
    v2: bool = False

    def dirs(self) -> list[Path]:
        return [self.memory] if self.memory == self.pids else [self.memory, self.pids]


def _v2_mount(root: Path) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted: `root` itself (a v2-only machine), or its
    `unified` beside the v1 controllers (a hybrid one)."""
    for where in (root, root / "unified"):
        if (where / "cgroup.controllers").exists():
            return where
    return None


def cgroup_base(home: Home, root: Path = CGROUP_ROOT, own: str | None = None) -> Base | None:
    """Where this service may make its tasks' cgroups, or None: cgroup v1's memory and pids
    controllers mounted, and our own cgroups in them writable (root, as on these machines);
    else a cgroup v2 cgroup of ours, writable, whose children get memory and pids (delegated,
    e.g. by systemd's Delegate=yes). `own`: /proc/self/cgroup's text (tests give another)."""
    if own is None:
        try:
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    v1: dict[str, Path] = {}
    v2 = None
    for line in own.splitlines():
        hid, names, path = (line.split(":", 2) + ["", ""])[:3]
        for controller in ("memory", "pids"):
            if controller in names.split(","):
                v1[controller] = root / controller / path.lstrip("/")
        if hid == "0" and names == "":
            mount = _v2_mount(root)
            v2 = mount / path.lstrip("/") if mount is not None else None
    name = f"kugetsu-{home.key}"
    if len(v1) == 2 and all((d / "cgroup.procs").exists() and os.access(d, os.W_OK) for d in v1.values()):
        return Base(memory=v1["memory"] / name, pids=v1["pids"] / name)
    if v2 is not None and os.access(v2, os.W_OK):
        try:
            enabled = (v2 / "cgroup.subtree_control").read_text().split()
        except OSError:
            return None
        if "memory" in enabled and "pids" in enabled:
            return Base(memory=v2 / name, pids=v2 / name, v2=True)
    return None


def prepare(base: Base) -> None:
    """Make the base directories (OSError: could not); in v2, let their children have memory
    and pids limits too."""
    for d in base.dirs():
        d.mkdir(mode=0o700, exist_ok=True)
    if base.v2 and "memory" not in (base.memory / "cgroup.subtree_control").read_text().split():
        (base.memory / "cgroup.subtree_control").write_text("+memory +pids")


def probe(home: Home) -> tuple[str, str]:
    """(mode in force for `resources.mode: auto`, why), for the service and doctor."""
    base = cgroup_base(home)
    if base is None:
        return "sampling", "no cgroup of this service's where it may set memory and pids limits (cgroup v1 as root," \
                           " or a delegated cgroup v2 subtree)"
    # Nothing is made yet: a task's cgroups (and their parent) are made when one with limits
    # starts, and removed when it ends; a task whose cgroups cannot be made is sampled.
    if base.v2:
        return "cgroup", f"cgroup v2 memory and pids under {base.memory.parent}"
    return "cgroup", f"cgroup v1 memory and pids under {base.memory.parent}, {base.pids.parent}"


def _count(path: Path, key: str) -> int:
    """The `key N` line of a cgroup's events file (0: none, or no file)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + " "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _number(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


class TaskGroups(msgspec.Struct):
    """A task's own cgroups (memory, pids; in v2 one and the same), its limits written there."""

    memory: Path
    pids: Path
    v2: bool = False

    def procs_files(self) -> str:
        dirs = [self.memory] if self.memory == self.pids else [self.memory, self.pids]
        return " ".join(f"{d}/cgroup.procs" for d in dirs)

    def pids_in(self) -> list[int]:
        """The processes in its memory cgroup (children cannot leave it)."""
        try:
            return [int(p) for p in (self.memory / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def read(self) -> tuple[int, int, int]:
        """(OOM kills, forks refused, kernel's peak) as the kernel counted them."""
        if self.v2:
            return (_count(self.memory / "memory.events", "oom_kill"), _count(self.pids / "pids.events", "max"),
                    _number(self.memory / "memory.peak"))
        return (_count(self.memory / "memory.oom_control", "oom_kill"), _count(self.pids / "pids.events", "max"),
                _number(self.memory / "memory.max_usage_in_bytes"))


def _groups(base: Base, task_id: int, attempt: int) -> TaskGroups:
    name = f"task-{task_id}-{attempt}"
    return TaskGroups(memory=base.memory / name, pids=base.pids / name, v2=base.v2)


def make_groups(base: Base, task_id: int, attempt: int, memory: int | None, max_procs: int | None) -> TaskGroups:
    """The cgroups a task's run starts in, with its limits (OSError: could not)."""
    prepare(base)
    groups = _groups(base, task_id, attempt)
    for d in base.dirs():
        (d / groups.memory.name).mkdir(mode=0o700, exist_ok=True)
    if memory:
        # and no escape to swap: v1 limits memory and swap together, v2 allows no swap
        files = (("memory.max", memory), ("memory.swap.max", 0)) if base.v2 else (
            ("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory))
        (groups.memory / files[0][0]).write_text(str(files[0][1]))
        try:
            (groups.memory / files[1][0]).write_text(str(files[1][1]))
        except OSError:
            pass  # no swap accounting on this kernel
    if max_procs:
        (groups.pids / "pids.max").write_text(str(max_procs))
    return groups


def groups_of(base: Base, task_id: int, attempt: int) -> TaskGroups | None:
    """The cgroups of a task's run, if it has them (a task without limits has none)."""
    groups = _groups(base, task_id, attempt)
    return groups if groups.memory.is_dir() else None


def remove_base(base: Base) -> None:
    """The service stops: its cgroups' parent goes, if no run's cgroups are left in it."""
    for d in base.dirs():
        try:
            d.rmdir()
        except OSError:
            pass


class Attempts(Mapping[int, int]):
    """Task id -> its attempt, of `tasks` (remove_finished's `live`, the sampler's): two lists
    (ids, attempts) taken in C's steps at the first lookup, and a lookup a scan of the ids in
    C. remove_finished looks up only the few ids its cgroups' names give, and at an idle look
    none: a dict of every live task was 25 ms at each end of a drain at 50,000 queued, and one
    built at every look (every 2 s, idle) kept ~5 MB of the service's RSS. `tasks`: a list of
    the service's, taken in the loop's thread (the lookups run in a worker's)."""

    def __init__(self, tasks: list[Task]):
        self._tasks = tasks
        self._lists: tuple[list[int], list[int]] | None = None

    def _of(self) -> tuple[list[int], list[int]]:
        if self._lists is None:
            self._lists = list(map(_ID, self._tasks)), list(map(_ATTEMPT, self._tasks))
        return self._lists

    def __getitem__(self, task_id: int) -> int:
        ids, attempts = self._of()
        try:
            return attempts[ids.index(task_id)]  # ids are unique
        except ValueError:
            raise KeyError(task_id) from None

    def __iter__(self) -> Iterator[int]:
        return iter(self._of()[0])

    def __len__(self) -> int:
        return len(self._tasks)


_ID, _ATTEMPT = attrgetter("id"), attrgetter("attempt")


def remove_finished(base: Base, live: Mapping[int, int], next_id: int) -> int:
    """Remove the cgroups of runs that are over: of tasks neither queued nor running, or of
    an earlier attempt (`live`: task id -> its attempt now). Tasks admitted since (id from
    `next_id` on) are left alone: their run may be about to join its cgroups. Only empty
    ones can go: the next look tries again). Returns how many are left to remove."""
    left = 0
    for d in base.dirs():
        try:
            names = [e.name for e in os.scandir(d) if e.is_dir() and e.name.startswith("task-")]
        except OSError:
            continue
        for name in names:
            try:
                _, task_id, attempt = name.split("-")
                if int(task_id) >= next_id or live.get(int(task_id)) == int(attempt):
                    continue
                (d / name).rmdir()
            except (OSError, ValueError):
                left += 1
    return left
