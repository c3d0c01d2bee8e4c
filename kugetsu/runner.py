"""Agent processes: spawn with exit capture, identify, wait for, and kill by group.

An agent runs under a tiny `sh` wrapper that is the leader of a new session and process
group. The wrapper runs the argv (never a shell string: the argv is passed as "$@") and
writes the agent's exit status to `logs/<id>.exit`. The wrapper outlives the service, so
an exit that happens while the service is down is still known when it comes back. It costs
about a millisecond, where a Python supervisor per task would cost 15+ ms.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import msgspec

from kugetsu.paths import Home

# TERM/INT/HUP are trapped (not ignored: an ignored signal would stay ignored in the agent)
# so that the wrapper survives the group's SIGTERM long enough to record the agent's status.
# A warm wrapper (`$2` = warm) is started ahead of its turn and waits for one line on its
# stdin, a pipe from the service: promotion is then one write, not a process start-up. If
# the pipe closes instead (task cancelled, service gone), it exits without running anything.
WRAPPER = (
    's=$1; w=$2; shift 2; '
    'if [ "$w" = warm ]; then read -r go || exit 0; exec </dev/null; fi; '
    'trap : TERM INT HUP; "$@"; echo $? > "$s"'
)


def marker(home: Home, task_id: int) -> str:
    """The wrapper's $0: names the task in `ps` and lets a restarted service find it."""
    return f"kugetsu[{home.key}]#{task_id}"


class Spawned(msgspec.Struct):
    pid: int
    start: int | None
    popen: Any  # subprocess.Popen: the spawner reaps it to learn how the wrapper ended
    gate: int | None = None  # a warm wrapper's pipe: write a line to start it, close to drop it
    exit_file: Path | None = None


def spawn(
    home: Home, task_id: int, name: str, argv: list[str], cwd: str, env: dict[str, str], warm: bool = False
) -> Spawned:
    """Start the task's wrapper: running at once, or (warm) waiting for `release`."""
    import subprocess  # only the service spawns; the CLI never pays for this import

    log = home.log(task_id)
    exit_file = home.exit_file(task_id)
    # Empty, which reads as "no status yet": created here, so that the wrapper only rewrites
    # it when its agent ends (creating a file there would cost ~50 us on every promotion).
    os.close(os.open(exit_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    gate_r, gate_w = os.pipe() if warm else (None, None)  # not inheritable: only this wrapper gets it
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        popen = subprocess.Popen(
            ["/bin/sh", "-c", WRAPPER, marker(home, task_id), str(exit_file), "warm" if warm else "now", *argv],
            cwd=cwd,
            env={
                **os.environ,
                **env,
                "KUGETSU_TASK_ID": str(task_id),
                "KUGETSU_TASK_NAME": name,
                "KUGETSU_HOME": str(home.root),
            },
            stdin=subprocess.DEVNULL if gate_r is None else gate_r,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
        )
    except BaseException:
        if gate_w is not None:
            os.close(gate_w)
        exit_file.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
        if gate_r is not None:
            os.close(gate_r)
    return Spawned(popen.pid, process_start(popen.pid), popen, gate_w, exit_file)


def release(spawned: Spawned) -> None:
    """Let a warm wrapper run its agent now."""
    assert spawned.gate is not None
    try:
        os.write(spawned.gate, b"go\n")
    finally:
        os.close(spawned.gate)
        spawned.gate = None


def drop(spawned: Spawned) -> None:
    """A warm wrapper that will not run: closing its pipe makes it exit without running
    anything, and its task keeps no exit file."""
    if spawned.gate is not None:
        os.close(spawned.gate)
        spawned.gate = None
        if spawned.exit_file is not None:
            spawned.exit_file.unlink(missing_ok=True)


def has_children(pid: int) -> bool:
    """Has the process a child (for a wrapper: is its agent running)?"""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return bool(f.read().strip())
    except OSError:
        return False


def read_exit(home: Home, task_id: int) -> int | None:
    """The agent's exit status as its wrapper recorded it, or None."""
    try:
        text = home.exit_file(task_id).read_text().strip()
        return int(text)
    except (FileNotFoundError, ValueError):
        return None


# ---- identity: a pid is never trusted without its start time -----------------------------


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if there is no such
    (living) process. Read from /proc: the CLI cannot afford to import psutil for this."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return _psutil_start(pid)
    # The command name (field 2) may hold spaces and ')': split after its last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # zombie or dead: it has exited
        return None
    return int(fields[19])


def _psutil_start(pid: int) -> int | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return int(proc.create_time() * 100)
    except psutil.Error:
        return None


def alive(pid: int | None, start: int | None) -> bool:
    """Is `pid` still the very process that was started at `start`?"""
    return pid is not None and start is not None and process_start(pid) == start


def kill_group(pid: int | None, start: int | None, sig: signal.Signals) -> bool:
    """Signal the task's whole process group (grandchildren included), only if the group
    leader is still the process we started. Returns whether a signal was sent."""
    if not alive(pid, start):
        return False
    try:
        os.killpg(pid, sig)  # type: ignore[arg-type]
        return True
    except ProcessLookupError:
        return False


def open_pidfd(pid: int | None, start: int | None) -> int | None:
    """A pidfd that becomes readable when the process exits, if it is still the same process."""
    if pid is None:
        return None
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return None
    if process_start(pid) != start:  # checked after opening: the fd pins this very process
        os.close(fd)
        return None
    return fd


def find_wrapper(home: Home, task_id: int) -> tuple[int, int] | None:
    """(pid, start) of a living wrapper of this task, found by its marker. Used at service
    start, for a task whose spawn was not recorded because its spawner died."""
    return find_wrappers(home).get(task_id)


def find_wrappers(home: Home) -> dict[int, tuple[int, int]]:
    """task id -> (pid, start) of this home's living wrappers: one pass over /proc."""
    prefix = marker(home, 0)[:-1].encode()  # "kugetsu[<home key>]#"
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 3 and argv[3].startswith(prefix) and argv[3][len(prefix):].isdigit():
            start = process_start(int(entry.name))
            if start is not None:
                found[int(argv[3][len(prefix):])] = (int(entry.name), start)
    return found
