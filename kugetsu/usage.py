"""What the running tasks use, measured, and the kernel's part in bounding it (README,
"Resources"). The service's side: pm decides what an over-limit task gets (pm.over_limits).

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
from datetime import datetime
from pathlib import Path

import msgspec

from kugetsu import runner
from kugetsu.pm import Measured
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
        self.peaks: dict[tuple[int, int], int] = {}  # (task id, attempt) -> the largest memory seen

    def measure(self, tokens: dict[int, str], groups: dict[int, TaskGroups | None],
                attempts: dict[int, int]) -> dict[int, Measured]:
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
            peak = max(self.peaks.get(run, 0), memory[tid], kernel[2])
            self.peaks[run] = peak
            out[tid] = Measured(task=tid, memory=memory[tid], peak=peak, cpu=round(cpu[tid], 2), procs=procs[tid],
                                oom_kills=kernel[0], forks_refused=kernel[1], attempt=run[1])
        for run in [r for r in self.peaks if r[0] not in tokens]:
            del self.peaks[run]
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


def _own_cgroup(controller: str) -> Path | None:
    """This process's cgroup directory for a v1 controller (None: not mounted, not v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            where = CGROUP_ROOT / controller / path.lstrip("/")
            return where if (where / "cgroup.procs").exists() else None
    return None


def cgroup_base(home: Home) -> dict[str, Path] | None:
    """controller -> the directory this service makes its tasks' cgroups in (a child of its
    own cgroup), when it may: cgroup v1 memory and pids, mounted and writable. None: not here."""
    out = {}
    for controller in ("memory", "pids"):
        own = _own_cgroup(controller)
        if own is None or not os.access(own, os.W_OK):
            return None
        out[controller] = own / f"kugetsu-{home.key}"
    return out


def probe(home: Home) -> tuple[str, str]:
    """(mode in force for `resources.mode: auto`, why), for the service and doctor."""
    base = cgroup_base(home)
    if base is None:
        return "sampling", "no writable cgroup v1 memory and pids controllers for this user"
    try:
        for d in base.values():
            d.mkdir(mode=0o700, exist_ok=True)
    except OSError as err:
        return "sampling", f"cannot create a cgroup under {base['memory'].parent}: {err.strerror}"
    return "cgroup", f"cgroup v1 memory and pids under {base['memory'].parent}, {base['pids'].parent}"


class TaskGroups(msgspec.Struct):
    """A task's own cgroups (memory, pids), and its limits written there."""

    memory: Path
    pids: Path

    def procs_files(self) -> str:
        return f"{self.memory}/cgroup.procs {self.pids}/cgroup.procs"

    def pids_in(self) -> list[int]:
        """The processes in its memory cgroup (children cannot leave it)."""
        try:
            return [int(p) for p in (self.memory / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def read(self) -> tuple[int, int, int]:
        """(OOM kills, forks refused, kernel's peak) as the kernel counted them."""
        oom = refused = peak = 0
        try:
            for line in (self.memory / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    oom = int(line.split()[1])
            peak = int((self.memory / "memory.max_usage_in_bytes").read_text())
        except (OSError, ValueError):
            pass
        try:
            for line in (self.pids / "pids.events").read_text().splitlines():
                if line.startswith("max "):
                    refused = int(line.split()[1])
        except (OSError, ValueError):
            pass
        return oom, refused, peak


def make_groups(base: dict[str, Path], task_id: int, attempt: int, memory: int | None,
                max_procs: int | None) -> TaskGroups:
    """The cgroups a task's run starts in, with its limits (OSError: could not)."""
    name = f"task-{task_id}-{attempt}"
    groups = TaskGroups(memory=base["memory"] / name, pids=base["pids"] / name)
    for d in base.values():
        d.mkdir(mode=0o700, exist_ok=True)
    for d in (groups.memory, groups.pids):
        d.mkdir(mode=0o700, exist_ok=True)
    if memory:
        (groups.memory / "memory.limit_in_bytes").write_text(str(memory))
        try:  # and no escape to swap: the limit is on memory and swap together
            (groups.memory / "memory.memsw.limit_in_bytes").write_text(str(memory))
        except OSError:
            pass
    if max_procs:
        (groups.pids / "pids.max").write_text(str(max_procs))
    return groups


def groups_of(base: dict[str, Path], task_id: int, attempt: int) -> TaskGroups | None:
    """The cgroups of a task's run, if it has them (a task without limits has none)."""
    name = f"task-{task_id}-{attempt}"
    groups = TaskGroups(memory=base["memory"] / name, pids=base["pids"] / name)
    return groups if groups.memory.is_dir() else None


def remove_finished(base: dict[str, Path], live: dict[int, int], next_id: int) -> int:
    """Remove the cgroups of runs that are over: of tasks neither queued nor running, or of
    an earlier attempt (`live`: task id -> its attempt now). Tasks admitted since (id from
    `next_id` on) are left alone: their run may be about to join its cgroups. Only empty
    ones can go: the next look tries again). Returns how many are left to remove."""
    left = 0
    for d in base.values():
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
