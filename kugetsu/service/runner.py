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
from datetime import datetime, timezone
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from kugetsu.config.model import STORE_ENV
from kugetsu.errors import redact_url
from kugetsu.paths import Home, open_file

if TYPE_CHECKING:
    from kugetsu.service.spares import SpareExits

# The agent's argv reaches the wrapper in its environment (KUGETSU_ARG_<i>, readable in /proc
# only by the same user), not on its command line: `ps` shows every local user the command
# line of each waiting wrapper, and a queued task's prompt must not be there. The wrapper
# builds "$@" from them (eval only ever sees the variables' names, never their values, so
# a prompt full of quotes, `;` or `$()` is passed verbatim) and unsets them before the agent
# runs; a warm one does so while it waits, so that a promotion costs none of it.
# TERM/INT/HUP are trapped (not ignored: an ignored signal would stay ignored in the agent)
# so that the wrapper survives the group's SIGTERM long enough to record the agent's status.
# A warm wrapper (`$2` = warm) is started ahead of its turn and waits for one line on its
# stdin, a pipe from the service: promotion is then one write, not a process start-up. If
# the pipe closes instead (task cancelled, service gone), it exits without running anything.
# The status is written over the blanks the exit file was created with (`1<>` opens it
# without truncating): the space is allocated when the task starts, so an agent's end is
# recorded even on a disk that filled up while it ran.
WRAPPER = (
    'for f in $KUGETSU_CGROUP_PROCS; do echo $$ > "$f"; done; unset KUGETSU_CGROUP_PROCS; '
    's=$1; w=$2; n=$3; set --; '
    'i=0; while [ $i -lt $n ]; do eval "set -- \\"\\$@\\" \\"\\$KUGETSU_ARG_$i\\"; unset KUGETSU_ARG_$i"; i=$((i+1)); done; '
    'if [ "$w" = warm ]; then read -r go || exit 0; exec </dev/null; fi; '
    'if [ -n "$KUGETSU_LOG_HEADER" ]; then printf "%s\\n" "$KUGETSU_LOG_HEADER"; fi; unset KUGETSU_LOG_HEADER; '
    'trap : TERM INT HUP; "$@"; echo $? 1<> "$s"'
)
# A run after the first begins its part of the log with a line that says so (`logs` shows the
# attempts apart): printed by the wrapper once its agent really runs (a warm wrapper may be
# dropped and made again while its task waits), and not in the agent's environment.
HEADER_VAR = "KUGETSU_LOG_HEADER"
EXIT_BLANK = b" " * 15 + b"\n"  # what an exit file holds until its wrapper writes a status
TOKEN_VAR = "KUGETSU_TASK_TOKEN"
# cgroup mode (usage.py): the cgroup.procs files the wrapper writes itself into, first of all,
# so that its agent and everything the agent starts are counted and bounded by the kernel.
CGROUP_VAR = "KUGETSU_CGROUP_PROCS"
_TOKEN_B = TOKEN_VAR.encode() + b"="
# What of the service's environment an agent gets. kugetsu's own namespace is an allow-list:
# of the KUGETSU_* variables (the store URL, the bot's and the MCP server's tokens, the
# service's plumbing, and whatever a later version adds) an agent gets only those kugetsu
# sets for its task (agent_env). The rest of the environment is the agent's to use (PATH,
# HOME, its provider's API key, proxies, locale), less libpq's password, which the service's
# own store connection may be reading. The preset's `env` can pass anything on purpose.
_OURS = "KUGETSU_"
_DB_SECRETS = frozenset({"PGPASSWORD"})


def which(command: str, path: str | None = None) -> str | None:
    """shutil.which on POSIX, where the agent's command will be run from: the first
    executable file named `command` on `path` (default $PATH), or `command` itself when it
    names a path. Without shutil, whose import (bz2, lzma, fnmatch) cost 3 ms of every
    delegate."""
    if os.sep in command:
        return command if _executable(command) else None
    if path is None:
        path = os.environ.get("PATH", os.defpath)
    if not path:
        return None
    for directory in path.split(os.pathsep):
        candidate = os.path.join(directory, command)
        if _executable(candidate):
            return candidate
    return None


def _executable(path: str) -> bool:
    return os.access(path, os.X_OK) and not os.path.isdir(path)


def marker(home: Home, task_id: int) -> str:
    """The wrapper's $0: names the task in `ps`. Only a label: a restarted service takes a
    process for a task's only when it is the same user's and carries the task's token."""
    return f"kugetsu[{home.key}]#{task_id}"


def new_token() -> str:
    """A task's token: put in its agent's environment, inherited by everything the agent
    starts, readable in /proc only by the same user. It is how kugetsu finds the processes a
    task started, also those that left its process group, and how a restarted service tells
    its wrappers from a forged marker."""
    return os.urandom(16).hex()


class Spawned(msgspec.Struct):
    pid: int
    start: int | None
    popen: Any  # subprocess.Popen: the spawner reaps it to learn how the wrapper ended
    gate: int | None = None  # a warm wrapper's pipe: write a line to start it, close to drop it
    exit_file: Path | None = None
    argv: list[str] = []  # what it runs: a warm wrapper whose task's command changed since (`edit`) is stale
    env: dict[str, str] = {}  # the task's own variables it runs with (a failover changes them with the preset)
    looked: bool = True  # `start` was read (a warm wrapper's is read as it is let go: start_of)


def agent_env(home: Home, task_id: int, name: str, token: str | None, env: dict[str, str],
              depth: int = 0) -> dict[str, str]:
    """The environment an agent runs with: the service's own, less kugetsu's variables and
    secrets (see _OURS), plus the preset's variables and the task's identity. KUGETSU_TASK_ID
    and KUGETSU_TASK_NAME also tell a `kugetsu delegate` or `kugetsu mcp` the agent runs that
    it runs inside this task (admission.check_nesting); KUGETSU_DEPTH says how many tasks deep (1: a
    task delegated from outside). None of them is a secret: set here for each agent, whatever
    the service's own environment held."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(_OURS) and k not in _DB_SECRETS}
    store = os.environ.get(STORE_ENV)
    if store:  # so that `kugetsu` run by the agent uses the same queue; its password stays here
        base[STORE_ENV] = redact_url(store, mask=None)
    out = {**base, **env, "KUGETSU_TASK_ID": str(task_id), "KUGETSU_TASK_NAME": name, "KUGETSU_HOME": str(home.root),
           "KUGETSU_DEPTH": str(depth + 1)}
    if token:
        out[TOKEN_VAR] = token
    return out


def spawn(
    home: Home, task_id: int, name: str, argv: list[str], cwd: str, env: dict[str, str],
    warm: bool = False, token: str | None = None, depth: int = 0, confine: dict[str, str] | None = None,
    header: str | None = None, spares: SpareExits | None = None,
) -> Spawned:
    """Start the task's wrapper: running at once, or (warm) waiting for `release`. `header`:
    the line its log gets before its agent's output (HEADER_VAR). `spares`: exit files used
    again (spares.py), one of which becomes this task's."""
    import subprocess  # only the service spawns; the CLI never pays for this import

    log = home.log(task_id)
    exit_file = home.exit_file(task_id)
    # Blanks, which read as "no status yet": created (and their space allocated) here, so that
    # the wrapper only writes over them when its agent ends, full disk or not.
    if spares is None or not spares.take(task_id, exit_file):
        fd = open_file(exit_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, EXIT_BLANK)
        except BaseException:
            os.close(fd)
            exit_file.unlink(missing_ok=True)
            raise
        os.close(fd)
    full_env = agent_env(home, task_id, name, token, env, depth)
    full_env.update((f"KUGETSU_ARG_{i}", arg) for i, arg in enumerate(argv))
    full_env.update(confine or {})
    if header:
        full_env[HEADER_VAR] = header
    gate_r, gate_w = os.pipe() if warm else (None, None)  # not inheritable: only this wrapper gets it
    try:
        fd = open_file(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    except BaseException:
        exit_file.unlink(missing_ok=True)
        for end in (gate_r, gate_w):
            if end is not None:
                os.close(end)
        raise
    try:
        popen = subprocess.Popen(
            ["/bin/sh", "-c", WRAPPER, marker(home, task_id), str(exit_file), "warm" if warm else "now", str(len(argv))],
            cwd=cwd,
            env=full_env,
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
    if warm:
        return Spawned(popen.pid, None, popen, gate_w, exit_file, list(argv), dict(env), looked=False)
    return Spawned(popen.pid, process_start(popen.pid), popen, gate_w, exit_file, list(argv), dict(env))


def start_of(spawned: Spawned) -> int | None:
    """The wrapper's start time (None: it has exited). A warm one's is read when it is let go,
    not as it is spawned: read right after the spawn, /proc/PID/stat waits on the new
    program's memory map (0.39 ms a spawn here, against 0.04 for a process that waits), and
    until this service reaps its child, the pid is that child's and no other's."""
    if not spawned.looked:
        spawned.start, spawned.looked = process_start(spawned.pid), True
    return spawned.start


def release(spawned: Spawned) -> None:
    """Let a warm wrapper run its agent now (ProcessLookupError: it has exited meanwhile)."""
    assert spawned.gate is not None
    try:
        if start_of(spawned) is None:
            raise ProcessLookupError(f"the wrapper of pid {spawned.pid} has exited")
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


def agent_pid(wrapper: int | None, start: int | None) -> int | None:
    """The agent's pid: the child of the task's wrapper (the pid kugetsu records is the
    wrapper's, which outlives the agent to record its status), while both run."""
    if wrapper is None or not alive(wrapper, start):
        return None
    try:
        with open(f"/proc/{wrapper}/task/{wrapper}/children", "rb") as f:
            children = f.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def read_exit(home: Home, task_id: int) -> int | None:
    """The agent's exit status as its wrapper recorded it, or None (no file, or blanks)."""
    try:
        fd = open_file(home.exit_file(task_id), os.O_RDONLY)
    except OSError:
        return None
    try:
        words = os.read(fd, 64).split()
    finally:
        os.close(fd)
    try:
        code = int(words[0]) if words else None
    except ValueError:
        return None
    # What a wrapper writes is a wait status (0-255, or 128+signal); a number beyond any (the
    # file written over by someone else) is no status at all, not one the index cannot hold.
    return code if code is None or -(1 << 31) <= code < 1 << 31 else None


def exit_time(home: Home, task_id: int) -> datetime | None:
    """When the wrapper wrote the agent's exit status (the exit file's mtime)."""
    try:
        st = os.stat(home.exit_file(task_id), follow_symlinks=False)
        return datetime.fromtimestamp(st.st_mtime, timezone.utc)
    except (OSError, OverflowError, ValueError):  # no file, or an mtime no datetime holds (set by hand)
        return None


# ---- identity: a pid is never trusted without its start time and uid ----------------------


def _leads_group(pid: int) -> bool:
    """Is the process its group's leader (as a wrapper is: it starts a new session)?"""
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if there is no such
    (living) process. Read from /proc: the CLI cannot afford to import psutil for this."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and ')': split after its last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # zombie or dead: it has exited
        return None
    return int(fields[19])


def environment_variable(pid: int, name: str) -> str | None:
    """One variable of a process's environment as it was started (/proc/PID/environ), or
    None: not set, no such process, or not ours to read (another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    want = name.encode() + b"="
    for entry in data.split(b"\0"):
        if entry.startswith(want):
            return entry[len(want) :].decode(errors="surrogateescape")
    return None


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] == b"Z"


def alive(pid: int | None, start: int | None) -> bool:
    """Is `pid` still the very process that was started at `start`?"""
    return pid is not None and start is not None and process_start(pid) == start


def owned(pid: int, token: str | None) -> bool:
    """Is the process this user's, and does it carry `token` in its environment? What a
    marker in `ps` only claims, this proves: another user can neither read a token nor put
    one in a process of ours."""
    if not token:
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        return token_of(pid) == token
    except OSError:
        return False


def token_of(pid: int) -> str | None:
    """The task token in the process's environment (None: none, gone, or not ours to read)."""
    env = environ(pid)
    return None if env is None else token_in(env)


def environ(pid: int) -> bytes | None:
    """/proc/PID/environ (None: gone, or not ours to read). Empty for a process caught in the
    middle of an exec (its new program's environment is not set up yet: seen in 5 % of the
    looks at an orphan right after its parent's exit), or one started with none."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return None


def token_in(env: bytes) -> str | None:
    env = b"\0" + env  # every variable now starts after a NUL
    at = env.find(b"\0" + _TOKEN_B)
    if at < 0:
        return None
    value = env[at + 1 + len(_TOKEN_B) :].split(b"\0", 1)[0]
    return value.decode("ascii", "replace") or None


def signal_pid(pid: int, start: int | None, sig: signal.Signals) -> bool:
    """Signal one process, only if it is still the one seen at `start`."""
    if not alive(pid, start):
        return False
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


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
    except PermissionError:  # not ours after all (never the case for a pid we verified)
        return False


def signal_tree(pid: int | None, start: int | None, token: str | None, sig: signal.Signals,
                spare_wrapper: bool = False) -> int:
    """Signal everything a task runs, once each: its process group (if its leader is still
    the process started) and every process of this user that carries its token but left the
    group (a daemonised helper, a `setsid` child). `spare_wrapper`: every one but the wrapper
    (the group's leader), which records the agent's exit status and traps only TERM, INT and
    HUP: `kill -s USR1` is for the agent, and must not end the wrapper. Returns how many got
    it. A /proc scan: for a command, never the service's loop."""
    if not alive(pid, start):
        pid = None
    if pid is not None and not spare_wrapper:
        sent = int(kill_group(pid, start, sig))
        members = {p: st for p, st in scan_token(token).items() if _pgid(p) != pid} if token else {}
    else:
        sent = 0
        members = tree(pid, token)
        members.pop(pid or 0, None)
    return sent + sum(signal_pid(p, st, sig) for p, st in members.items())


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def tree(pid: int | None, token: str | None) -> dict[int, int]:
    """pid -> start of every process of a task: those of its process group `pid` and those
    carrying its token (one pass over /proc)."""
    found = scan_token(token) if token else {}
    if pid is not None:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and int(entry.name) not in found and _pgid(int(entry.name)) == pid:
                start = process_start(int(entry.name))
                if start is not None:
                    found[int(entry.name)] = start
    return found


def group_alive(pgid: int) -> bool:
    """Is any process left in the process group? (The group's leader must be reaped first:
    a zombie still counts.) A group id is not reused while the group has a member."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # somebody is there; not ours to signal, but the group is not empty


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


# ---- the processes a task started -------------------------------------------------------------


def become_subreaper() -> bool:
    """Make the calling process (the service) the reaper of its descendants' orphans: what
    an agent leaves running when it exits, or starts with setsid or a double fork, becomes
    the service's child instead of init's, so the service sees it at once (own_children)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def trim_heap() -> bool:
    """Give the kernel back the heap's free pages (glibc's malloc_trim): what the buffers of a
    long queue's index (its read, its encoding, the decoded tasks of an index read afresh: 14
    MB each at 50,000 queued) used stays in the heap once freed, glibc's threshold for giving
    such blocks back rising to the largest one freed (~35 MB of RSS at 50,000 queued, used
    again only by the next such commit). A few ms, so not after every commit (Service._trim).
    False where there is no glibc (musl has no malloc_trim: its own policy stays)."""
    global _libc
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None)
        return bool(_libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


_libc = None


def own_children() -> list[int]:
    """pids of the children of the calling process's main thread (the group's leader, whose
    thread id is the pid): every process the service spawns (from its loop, on that thread)
    and every orphan handed to it as the subreaper, which the kernel gives to the reaper's
    first live thread, the leader (kernel/exit.c, find_alive_thread). A child of another thread
    (a worktree's git) is neither. One read: a read per thread (~10 of them) was ~0.1 ms of
    every agent's exit, on the path to its successor's start."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/children", "rb") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def users_pids(limit: int | None = None) -> Iterator[int]:
    """The pids of this user's processes but this one, from one pass over /proc (`limit`:
    looking at that many entries at most)."""
    uid = os.getuid()
    me = os.getpid()
    for n, entry in enumerate(os.scandir("/proc")):
        if limit is not None and n >= limit:
            return
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        yield int(entry.name)


def scan_token(token: str) -> dict[int, int]:
    """pid -> start of every living process of this user that carries `token`: one pass over
    /proc (for a worker thread; the service's loop never scans /proc)."""
    found = {}
    blank = []  # no environment yet: caught mid-exec (see environ); looked at again at the end
    for pid in users_pids():
        env = environ(pid)
        if env == b"":
            blank.append(pid)
        elif env is not None and token_in(env) == token:
            found[pid] = process_start(pid)
    for pid in blank:
        if token_of(pid) == token:
            found[pid] = process_start(pid)
    return {pid: start for pid, start in found.items() if start is not None}


def find_wrappers(home: Home, tokens: dict[int, str | None]) -> dict[int, tuple[int, int]]:
    """task id -> (pid, start) of this home's living wrappers, for the tasks in `tokens`:
    one pass over /proc. The marker on the command line only finds candidates; a candidate
    counts only if it is this user's and carries its task's token."""
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
            task_id, pid = int(argv[3][len(prefix):]), int(entry.name)
            if task_id not in tokens or not owned(pid, tokens[task_id]) or not _leads_group(pid):
                continue  # (the agent's process keeps the wrapper's command line from fork to exec)
            start = process_start(pid)
            if start is not None:
                found[task_id] = (pid, start)
    return found
