"""`kugetsu doctor`: everything that can be wrong with an installation, each with its fix.

It only looks: it creates no home, starts no service, writes no file (a healthy running
service gets one wake-up datagram, which is how its socket is seen to answer). A broken
config or index is a finding, not a stop: the other checks go on with the defaults.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from kugetsu.app import control

from kugetsu.service import runner
from kugetsu.config.load import load_config, read_raw, store_url
from kugetsu.config.model import Config, total_memory
from kugetsu.config.units import format_duration, format_size
from kugetsu.errors import KugetsuError, Unreachable
from kugetsu.core.models import Index
from kugetsu.paths import Home, read_file
from kugetsu.store.files import open_store, store_at

DISK_MIN = 64 << 20  # free bytes below which the home's disk is a problem (a tenth of a small disk)
CLOCK_SLACK = 5.0  # seconds a recorded time may lie ahead of the clock (another machine, NTP slew)
CLOCK_ERROR_SHOWN = timedelta(days=1)  # how long a clock error the service corrected is reported
EXITED_UNBOOKED = 10.0  # seconds an agent's end may stay unrecorded before the service is not answering
TELEGRAM_TIMEOUT = 20.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None
    warning: bool = False  # not a problem, but worth a look (shown with its fix)


def run(home: Home, env: dict[str, str] | None = None) -> list[Check]:
    """Every check, in an order that reads top-down (files, service, machine, agents, bot)."""
    env = dict(os.environ if env is None else env)
    checks = [_home(home)]
    url = store_url(home)
    if url is not None:  # cluster mode: the database first, everything else depends on it
        checks.append(_cluster(home, url))
    cfg, cfg_check = _config(home)
    checks.append(cfg_check)
    index, index_check = _index(home)
    checks.append(index_check)
    checks += [_socket(home), _service(home, cfg, index), _disk(home), _proc(), _subreaper(), _git(cfg, index),
               _resources(home, cfg)]
    service_path = _service_path(home)
    checks += _agents(home, cfg, index, service_path or env.get("PATH", os.defpath), service_path is not None)
    checks += [_telegram(cfg), _clock(home, index)]
    return checks


def _guard(name: str, look: Callable[[], Check]) -> Check:
    try:
        return look()
    except KugetsuError as err:
        return Check(name, False, str(err))
    except OSError as err:
        return Check(name, False, f"{err.filename}: {err.strerror}" if err.filename else str(err))


# ---- files ------------------------------------------------------------------------------


def _home(home: Home) -> Check:
    root = home.root
    fix = "set KUGETSU_HOME to a directory of yours (mode 0700), or move this one away and let kugetsu make it"
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return Check("home", True, f"{root} does not exist yet: the first command that writes creates it")
    if stat.S_ISLNK(st.st_mode):
        return Check("home", False, f"{root} is a symbolic link; kugetsu never follows one", fix)
    if not stat.S_ISDIR(st.st_mode):
        return Check("home", False, f"{root} is not a directory", fix)
    if st.st_uid != os.geteuid():
        return Check("home", False, f"{root} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})", fix)
    mode = stat.S_IMODE(st.st_mode)
    if not os.access(root, os.W_OK | os.X_OK):
        return Check("home", False, f"{root}: no write permission (mode {mode:04o})", f"chmod 700 {root}")
    note = "" if not mode & 0o077 else " (others have access: kugetsu sets 0700 at its next write)"
    return Check("home", True, f"{root}, mode {mode:04o}{note}")


def _cluster(home: Home, url: str) -> Check:
    """Cluster mode: the database answers, and how its machines stand."""
    from kugetsu.cluster.db import redact
    from kugetsu.errors import Unreachable

    try:
        rows = store_at(home, url).machine_rows() or []
    except Unreachable as err:
        return Check("cluster", False, str(err).split(". Running agents")[0],
                     "start PostgreSQL (or reach it: network, firewall), or fix the URL:"
                     " `kugetsu config set store postgresql://...` (env KUGETSU_STORE wins)")
    up = [r.name for r in rows if not r.gone]
    gone = [r.name for r in rows if r.gone]
    detail = f"{redact(url)} answers; machines: {', '.join(up) or 'none yet'}" + (f"; gone: {', '.join(gone)}" if gone else "")
    return Check("cluster", True, detail)


def _config(home: Home) -> tuple[Config, Check]:
    try:
        cfg = load_config(home)
    except Unreachable:
        return Config(), Check("config", False, "the cluster's shared config is in the database, which does not answer"
                               " (the other checks use the defaults)", "see `cluster` above")
    except KugetsuError as err:
        message = str(err).partition("\n")[0]
        return Config(), Check("config", False, message + " (the other checks use the defaults)",
                               "fix the file (`kugetsu config check` re-checks it), or move it away to use the defaults")
    if not os.path.lexists(home.config):
        return cfg, Check("config", True, f"no {home.config}: every key has its default")
    return cfg, Check("config", True, f"{home.config}: valid")


def _index(home: Home) -> tuple[Index, Check]:
    try:
        index = open_store(home).read()
    except Unreachable:
        return Index(), Check("index", False, "the queue is in the cluster's database, which does not answer",
                              "see `cluster` above")
    except KugetsuError as err:
        return Index(), Check("index", False, str(err).partition("\n")[0],
                              "repair it by hand, or move it away to start with an empty queue (running agents are not"
                              " affected; new ids stay above the old ones)")
    except OSError as err:
        return Index(), Check("index", False, f"{home.index}: {err.strerror}")
    return index, Check("index", True, f"{home.index}: {len(index.active)} running, {len(index.queued)} queued,"
                                       f" {len(index.finished)} finished")


def _socket(home: Home) -> Check:
    def look() -> Check:
        return Check("socket", True, f"{home.socket}")  # the property checks a deep home's runtime dir

    return _guard("socket", look)


# ---- the service ------------------------------------------------------------------------


def _service(home: Home, cfg: Config, index: Index) -> Check:
    pid = _pid_file(home)
    holds = control.service_holds_lock(home)
    live = len(index.live())
    start = "`kugetsu serve --detach`"
    if pid is not None and (runner.process_start(pid) is None or not holds):
        return Check("service", False,
                     f"service.pid names pid {pid}, which is not running: the service stopped without cleaning up"
                     f" (crashed or killed){_while(live)}. Its last words: {_last_line(home.service_log)}",
                     f"{start} starts it again (its log: {home.service_log})")
    if pid is None and holds:
        return Check("service", True, "starting (it holds the service lock and has not written service.pid yet)")
    if pid is None:
        if live:
            return Check("service", False, f"not running{_while(live)}: queued tasks do not start and ends go unrecorded",
                         f"{start}" + ("" if cfg.autostart else " (autostart is off)"))
        how = "the CLI starts it when needed (autostart)" if cfg.autostart else f"autostart is off: {start} when needed"
        return Check("service", True, f"not running, nothing to do; {how}")
    state = _process_state(pid)
    if state in ("T", "t", "Z"):
        return Check("service", False, f"the service (pid {pid}) is {'stopped' if state != 'Z' else 'a zombie'}",
                     f"`kill -CONT {pid}`, or `kill {pid}` and {start}")
    sent = control._send(home, b"wake")  # noqa: SLF001  (a wake-up is harmless; it proves the socket answers)
    if sent is not True:
        why = "nobody listens on it" if sent is False else str(sent)
        return Check("service", False, f"the service (pid {pid}) runs but its socket {home.socket} does not answer ({why})",
                     f"`kugetsu shutdown` (or `kill {pid}`), then {start}")
    late = _unbooked_exits(home, index)
    if late:
        return Check("service", False, f"the service (pid {pid}) is not booking ends: {late}",
                     f"look at {home.service_log}; `kugetsu shutdown && kugetsu serve --detach` (agents keep running)")
    changed = _read_at_start_since(home)
    if changed:
        return Check("service", True, f"running (pid {pid}), answering on {home.socket}; {', '.join(changed)} changed"
                     " since it started, which it reads only then",
                     "`kugetsu shutdown && kugetsu serve --detach` applies it (agents keep running)", warning=True)
    return Check("service", True, f"running (pid {pid}), answering on {home.socket}")


def _read_at_start_since(home: Home) -> list[str]:
    """Keys the service reads when it starts (config.AT_START) set since it started (its
    pid file's time), by the last `config` events: the change waits for a restart."""
    from kugetsu.config.keys import applies_at_start
    from kugetsu.store.files import open_store

    try:
        since = os.stat(home.service_pid).st_mtime
        events = open_store(home).tail_events(500)
    except (OSError, KugetsuError):
        return []
    keys: list[str] = []
    for e in events:
        if e.type == "config" and e.key and applies_at_start(e.key) and e.at.timestamp() > since and e.key not in keys:
            keys.append(e.key)
    return keys


def _pid_file(home: Home) -> int | None:
    try:
        return int(read_file(home.service_pid).strip())
    except (OSError, ValueError):
        return None


def _while(live: int) -> str:
    return f" while {live} task{'s are' if live != 1 else ' is'} queued or running" if live else ""


def _last_line(path: os.PathLike[str]) -> str:
    from kugetsu.paths import read_tail

    lines = read_tail(path, 2048).decode(errors="replace").strip().splitlines()
    return repr(lines[-1][-200:]) if lines else "(no log)"


def _process_state(pid: int) -> str | None:
    try:
        data = read_file(f"/proc/{pid}/stat")
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()[0].decode()


def _unbooked_exits(home: Home, index: Index) -> str | None:
    """A running task whose agent recorded its exit a while ago: the service should have
    booked it within milliseconds."""
    now = datetime.now(timezone.utc)
    for task in index.active:
        if task.run.pid is None or task.run.ended_at is not None or runner.alive(task.run.pid, task.run.pid_start):
            continue
        ended = runner.exit_time(home, task.id)
        if ended is not None and (now - ended).total_seconds() > EXITED_UNBOOKED:
            ago = format_duration((now - ended).total_seconds())
            return f"{task.name} (#{task.id}) ended {ago} ago and is still running in the index"
    return None


def _service_path(home: Home) -> str | None:
    """The running service's PATH: it is the service that starts agents, not this shell."""
    pid = _pid_file(home)
    if pid is None or runner.process_start(pid) is None:
        return None
    try:
        environ = read_file(f"/proc/{pid}/environ")
    except OSError:
        return None
    for item in environ.split(b"\0"):
        if item.startswith(b"PATH="):
            return item[5:].decode(errors="replace")
    return None


# ---- the machine ------------------------------------------------------------------------


def _disk(home: Home) -> Check:
    where = home.root
    while not where.exists() and where != where.parent:
        where = where.parent
    st = os.statvfs(where)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    need = min(DISK_MIN, total // 10)
    fix = (f"free space on the file system of {where}: `kugetsu clean`, `kugetsu worktrees prune`,"
           f" remove {home.events_old.name} or move {home.history.name} away")
    if free < need or (st.f_files and st.f_favail == 0):
        what = "no inodes left" if st.f_files and st.f_favail == 0 else f"{format_size(free)} free of {format_size(total)}"
        full = "full" if free < st.f_frsize * 4 or st.f_favail == 0 else "nearly full"
        return Check("disk", False, f"{where}: {full}, {what}: commits fail (nothing new starts)", fix)
    return Check("disk", True, f"{format_size(free)} free of {format_size(total)}")


def _proc() -> Check:
    fix = "kugetsu needs Linux 5.3 or later with /proc mounted (in a container: do not mask /proc)"
    try:
        read_file("/proc/self/stat")
    except OSError as err:
        return Check("proc", False, f"/proc is not readable ({err.strerror})", fix)
    try:
        fd = os.pidfd_open(os.getpid())
    except (OSError, AttributeError) as err:
        return Check("proc", False, f"pidfd_open is not available ({getattr(err, 'strerror', None) or err}):"
                     " the service cannot watch agents' exits", fix)
    os.close(fd)
    return Check("proc", True, "/proc readable, pidfds available")


def _resources(home: Home, cfg: Config) -> Check:
    """How per-task limits are enforced here (README, "Resources"), and the memory budget."""
    from kugetsu.service import usage
    from kugetsu.core.policy import short_size

    budget = cfg.memory_budget
    how = f"max_memory {short_size(budget)}" + ("" if cfg.max_memory is not None else
                                               f" (RAM {short_size(total_memory())} less memory_reserve)")
    sampling = (f"sampling every {cfg.resources.interval}: a task over its memory limit is stopped at the next look"
                " (it may go beyond it until then), a fork storm is ended, not prevented")
    if cfg.resources.mode == "sampling":
        return Check("resources", True, f"{how}; {sampling} (resources.mode sampling)")
    base = usage.cgroup_base(home)
    if base is None:
        ok = cfg.resources.mode == "auto"
        return Check("resources", ok, f"{how}; no cgroup where it may set memory and pids limits: {sampling}",
                     None if ok else "run the service as root on a machine with cgroup v1 memory and pids, or in a"
                     " delegated cgroup v2 subtree (systemd Delegate=yes), or set resources.mode to sampling")
    version = "v2" if base.v2 else "v1"
    return Check("resources", True, f"{how}; cgroup mode ({version}): the kernel bounds each task with limits"
                 " (memory: its OOM killer; processes: forks refused), and the task is then stopped")


def _subreaper() -> Check:
    """PR_SET_CHILD_SUBREAPER, tried on this process and undone at once."""
    if not runner.become_subreaper():
        return Check("subreaper", False, "this system refuses PR_SET_CHILD_SUBREAPER: processes that agents leave"
                     " behind are found only by a /proc scan, at the task's end",
                     "Linux 3.4 or later, outside a sandbox that filters prctl")
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER off again
    return Check("subreaper", True, "the service can be the child subreaper")


def _git(cfg: Config, index: Index) -> Check:
    found = runner.which("git")
    if found:
        return Check("git", True, found)
    wanted = cfg.worktrees.enabled or any(p.worktree for p in cfg.agents.values()) or any(t.repo for t in index.live())
    if wanted:
        return Check("git", False, "git is not on PATH, and worktrees are in use: worktree tasks fail to start",
                     "install git (e.g. `apt-get install git`)")
    return Check("git", True, "not found; needed only for --worktree tasks")


# ---- agents -------------------------------------------------------------------------------


def _agents(home: Home, cfg: Config, index: Index, path: str, services: bool) -> list[Check]:
    """Each preset's command, found on the PATH the service starts agents with. A built-in
    preset nobody uses (not the default, not in config.json, no live task) may be missing."""
    try:
        configured = set(read_raw(home).get("agents") or {})
    except (KugetsuError, OSError, AttributeError):
        configured = set()
    used = {t.agent for t in index.live()}
    out = []
    for name, preset in sorted(cfg.agents.items()):
        exe = preset.command[0]
        found = runner.which(exe, preset.env.get("PATH", path))
        label = f"agent {name}"
        if found:
            out.append(_agent_version(label, exe, found, preset.output, {**os.environ, "PATH": path, **preset.env}))
            continue
        why = [w for w, yes in (("the default agent", name == cfg.default_agent), ("in config.json", name in configured),
                                ("used by a live task", name in used)) if yes]
        if not why:
            out.append(Check(label, True, f"{exe} not installed (a built-in preset nobody uses)"))
            continue
        fix = (f"install {exe}, or point the preset at it: kugetsu config set agents.{name}"
               f" '{{\"command\": [\"/path/to/{exe}\", ...]}}'")
        if name == cfg.default_agent:
            fix += ", or pick another: kugetsu config set default_agent NAME"
        where = "the service's PATH" if services else "PATH"
        out.append(Check(label, False, f"{exe!r} is not on {where} ({', '.join(why)}):"
                                       f" its tasks are refused at delegate", fix))
    return out


def _agent_version(label: str, exe: str, found: str, output: str, env: dict[str, str]) -> Check:
    """A known agent CLI (by its preset's output kind, else its name): its version, and a
    warning when it is newer than the one verified (its wording may have changed)."""
    from kugetsu.agents import VERIFIED, version_tuple

    kind = output if output in VERIFIED else os.path.basename(exe)
    if kind not in VERIFIED:
        return Check(label, True, f"{exe} -> {found}")
    import subprocess

    try:
        done = subprocess.run([found, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=10, env=env)
        said = (done.stdout or done.stderr).strip()
    except (OSError, subprocess.SubprocessError):
        said = ""
    version, verified = version_tuple(said), version_tuple(VERIFIED[kind])
    if version is None:
        return Check(label, True, f"{exe} -> {found} (its version could not be read)")
    shown = ".".join(map(str, version))
    if verified is not None and version > verified:
        return Check(label, True, f"{exe} -> {found}, version {shown}, newer than the {VERIFIED[kind]} verified",
                     f"if its limits, sessions or usage stop being recognised, tune agents.{label.split()[-1]}"
                     " (limit.patterns, session_pattern, output): README, Agents", warning=True)
    return Check(label, True, f"{exe} -> {found}, version {shown}")


# ---- Telegram and the clock ------------------------------------------------------------


def _telegram(cfg: Config) -> Check:
    from kugetsu.frontends.telegram import resolve_token

    token = resolve_token(cfg)
    if not token:
        return Check("telegram", True, "off (no token)")
    import asyncio
    import logging

    from kugetsu.frontends.telegram.check import connected  # python-telegram-bot only with a token

    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs URLs, token inside

    async def identify() -> str:
        async with connected(cfg, token) as bot:
            return f"token valid, bot @{bot.username}"

    try:
        detail = asyncio.run(asyncio.wait_for(identify(), TELEGRAM_TIMEOUT))
    except KugetsuError as err:
        return Check("telegram", False, str(err), "`kugetsu telegram check` after the fix (docs/telegram.md)")
    except TimeoutError:
        return Check("telegram", False, f"the Bot API at {cfg.telegram.api_base_url} did not answer within"
                     f" {TELEGRAM_TIMEOUT:.0f}s", "check the network and telegram.api_base_url")
    if not cfg.telegram.allowed_chat_ids:
        detail += "; telegram.allowed_chat_ids is empty, so it answers nobody"
    return Check("telegram", True, detail)


def _clock(home: Home, index: Index) -> Check:
    """The clock against what it wrote before: a recorded time ahead of now means the clock
    was set back (expiries, timeouts and durations are then off)."""
    now = datetime.now(timezone.utc)
    fix = "set the clock right and keep it synchronised (NTP, e.g. `timedatectl set-ntp true`)"
    if now.year < 2020:
        return Check("clock", False, f"the clock says {now:%Y-%m-%d}", fix)
    wrong = index.clock_error
    if wrong is not None and now - wrong.found_at < CLOCK_ERROR_SHOWN:
        from kugetsu.core.skew import describe_clock_error

        return Check("clock", False, f"{describe_clock_error(wrong)} (found {wrong.found_at:%Y-%m-%d %H:%M} UTC)",
                     "check the clock of whatever ran that command (faketime, a container's or a VM's clock,"
                     " NTP); this note goes after a day")
    times = [t for task in index.all_tasks() for t in (task.created_at, task.started_at, task.finished_at) if t]
    try:
        last = open_store(home).tail_events(1)
    except (OSError, KugetsuError):  # unreadable, or the cluster's database away: said above
        last = []
    times += [e.at for e in last]
    latest = max(times, default=None)
    if latest is not None and latest > now + timedelta(seconds=CLOCK_SLACK):
        ahead = format_duration((latest - now).total_seconds())
        mark = index.clock
        if mark is not None and mark.at > now + timedelta(seconds=CLOCK_SLACK):
            # The last writer's clock was ahead of this one: one of the two is wrong, and
            # only the writer is named (the service corrects such times when it runs).
            return Check("clock", False, f"{mark.by} wrote {mark.at:%Y-%m-%d %H:%M:%S} UTC, {ahead} ahead of this"
                         " clock: either that command ran with a wrong clock or this clock was set back", fix)
        return Check("clock", False, f"the clock is {ahead} behind the latest time kugetsu recorded"
                     f" ({latest:%Y-%m-%d %H:%M:%S} UTC): it was set back", fix)
    return Check("clock", True, f"{now:%Y-%m-%d %H:%M:%S} UTC, not behind what kugetsu recorded")


# ---- output --------------------------------------------------------------------------------


def report(checks: list[Check]) -> dict[str, Any]:
    problems = sum(1 for c in checks if not c.ok)
    return {"ok": not problems, "problems": problems, "checks": [asdict(c) for c in checks]}


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{'warning' if c.ok and c.warning else 'ok' if c.ok else 'PROBLEM':7}  {c.name:{width}}  {c.detail}")
        if (not c.ok or c.warning) and c.fix:
            lines.append(f"{'':7}  {'':{width}}  fix: {c.fix}")
    problems = sum(1 for c in checks if not c.ok)
    lines.append("")
    lines.append("no problems found" if not problems else f"{problems} problem{'s' if problems != 1 else ''} found")
    return "\n".join(lines)
