"""The service's control: its single-instance lock, and starting, stopping and waking it.

Every front end that changes the index wakes the service through here (one datagram on its
Unix socket); the CLI starts it when none runs (config `autostart`); the service takes its
lock here too, so that the rules of "at most one service per home" live in one place.
"""

from __future__ import annotations

import errno
import os

from kugetsu.service import runner
from kugetsu.config.model import Config
from kugetsu.errors import KugetsuError
from kugetsu.core.models import Index
from kugetsu.paths import Home, open_file, read_file


def wake(home: Home, cfg: Config | None = None, index: Index | None = None, message: bytes = b"wake") -> bool:
    """Tell the service the index changed. Starts it if it is not running, autostart is on
    and `index` (as committed) has work for it: a queued or running task. A command that
    left nothing to run (`cancel --all` of nothing, `config set` in a fresh home) starts
    no service, so that a clean-up script's `shutdown` is not raced by one coming up.
    Returns whether a service got the message (or is coming up).

    Called after a commit: the change stands whatever happens here, so a failure is a
    warning on stderr, never an error that would make the caller report a committed
    change as failed."""
    sent = _send(home, message)
    if sent is True:
        return True
    if isinstance(sent, KugetsuError):  # no socket directory we can use: a service could not bind either
        _warn_unwoken(sent)
        return False
    # In a cluster the machines that run agents run `kugetsu serve` (docs/architecture.md §10): a
    # command on any other machine must not make it one, and the database wakes the others.
    if cfg is not None and cfg.autostart and not cfg.clustered and (index is None or index.live()):
        try:
            # A new service replaces whatever sits at the socket's path (it holds the lock).
            if start_service(home) is not None or sent is False:
                return True
        except (KugetsuError, OSError) as err:
            _warn_unwoken(err)
            return False
    if sent is not False:  # a socket is there, and it refused the message
        _warn_unwoken(sent)
    return False


def check_wakeable(home: Home) -> None:
    """Before a command writes: the service's socket must have a directory of ours (UsageError,
    exit 2, with what to do), so that a refusal comes before the change, not after it."""
    home.socket  # noqa: B018  (the property checks the runtime dir of a deep home)


def ensure_service(home: Home, cfg: Config, index: Index, queued: int = 0) -> None:
    """For read-only commands: if there is live work (or a schedule to fire) and no service (it
    crashed), bring it back. `queued`: the queued tasks when `index` was read without them
    (read_head)."""
    if queued or index.live() or any(not s.paused for s in index.schedules.values()):
        check_wakeable(home)
        wake(home, cfg)


def send(home: Home, message: bytes, warn: bool = True) -> bool:
    """One datagram to the service; False if none got it. Never raises: a socket that cannot
    be used is a warning on stderr (unless not `warn`: a caller that tries again) and False."""
    sent = _send(home, message)
    if isinstance(sent, Exception):
        if warn:
            _warn_unwoken(sent)
        return False
    return sent


def _send(home: Home, message: bytes) -> bool | Exception:
    """True: sent; False: no service listens; else what went wrong."""
    try:
        path = str(home.socket)
    except KugetsuError as err:
        return err
    if not os.path.lexists(path):
        return False  # what sendto says (ENOENT), without importing socket
    import socket  # only here: 10+ ms of import the read-only commands skip

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.sendto(message, path)
        return True
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ECONNREFUSED):
            return False
        if err.errno == errno.EAGAIN:  # its queue is full of wake-ups already
            return True
        if err.filename is None:
            err.filename = path
        return err
    finally:
        sock.close()


def _warn_unwoken(err: BaseException) -> None:
    import sys

    what = f"{err.filename}: {err.strerror}" if isinstance(err, OSError) and err.filename else str(err)
    print(f"kugetsu: warning: could not reach the service: {what}. What was done stands; the service"
          " acts on it once it is reachable (`kugetsu serve --detach` starts it)", file=sys.stderr)


LOCK_FD_ENV = "KUGETSU_SERVICE_LOCK_FD"


class AlreadyRunning(KugetsuError):
    pass


def take_service_lock(home: Home) -> int:
    """For the service: the single-instance lock, inherited from the CLI that started it
    (start_service), or taken here. Raises AlreadyRunning when another service holds it."""
    import fcntl

    inherited = os.environ.pop(LOCK_FD_ENV, None)
    if inherited is not None:
        fd = int(inherited)
        os.set_inheritable(fd, False)  # agents must never hold it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # already ours: a no-op that proves it
        return fd
    fd = open_file(home.service_lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
    pid = service_pid(home)
    raise AlreadyRunning(
        f"a kugetsu service is already running for {home.root}"
        + (f" (pid {pid})" if pid else " (starting)")
        + "; `kugetsu shutdown` stops it"
    )


def start_service(home: Home) -> int | None:
    """Start `kugetsu serve` detached (own session, no terminal); returns its pid, or None
    if a service is already up or coming up.

    The service lock is taken here and its descriptor handed to the child, so it is held
    without a gap from this decision until the service exits: two CLIs that find no service
    at the same moment cannot start two."""
    import subprocess
    import sys

    home.ensure()
    lock = open_file(home.service_lock, os.O_RDWR | os.O_CREAT)
    try:
        if not _take(lock):
            return None
        log = open_file(home.service_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kugetsu.service", "serve"],  # the service without the CLI (service/__main__.py)
                env={**os.environ, "KUGETSU_HOME": str(home.root), LOCK_FD_ENV: str(lock)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                cwd="/",
                pass_fds=(lock,),
            )
        finally:
            os.close(log)
    finally:
        os.close(lock)  # the child's copy keeps the lock
    return proc.pid


def _take(lock: int) -> bool:
    """Take the service lock if no service holds it. A `service_holds_lock` probe holds it
    shared for microseconds: a few quick retries tell that apart from a service, which
    holds it for good. Only reached when the service did not answer, so the wait is rare."""
    import fcntl
    import time

    for attempt in range(5):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt < 4:
                time.sleep(0.005)
    return False


def service_holds_lock(home: Home) -> bool:
    """Does a service, starting, running or still stopping, hold the service lock? A
    stopping service removes service.pid before it lets go of the lock (never the other
    way round: it must not delete a successor's pid file), so "stopped" means this is False."""
    import fcntl

    try:
        fd = open_file(home.service_lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def service_pid(home: Home) -> int | None:
    try:
        pid = int(read_file(home.service_pid).strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if runner.process_start(pid) is not None else None
