"""Where kugetsu keeps its files (docs/architecture.md §3)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kugetsu.errors import DiskFull, KugetsuError, UsageError

try:  # the builtin SHA-256: hashlib would load OpenSSL first, 2 ms of every CLI command
    from _sha256 import sha256  # Python 3.11
except ImportError:
    try:
        from _sha2 import sha256  # type: ignore[no-redef]  # 3.12+
    except ImportError:
        from hashlib import sha256

# sun_path is 108 bytes on Linux and 104 on macOS; keep a margin.
_MAX_SOCKET_PATH = 100


class Home:
    """The files of one KUGETSU_HOME. Creating the object touches nothing on disk."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().absolute()
        self.config = self.root / "config.json"
        self.index = self.root / "index.json"
        self.journal = self.root / "index.journal"  # the commits since index.json was written whole (store/journal.py)
        self.head = self.root / "index.head"  # what `capacity` needs of index.json, a cache beside it (store/head.py)
        self.lock = self.root / "index.lock"
        self.events = self.root / "events.jsonl"
        self.events_old = self.root / "events.jsonl.1"  # the previous events.jsonl, once it grew past events_max_size
        self.history = self.root / "history.jsonl"
        self.logs = self.root / "logs"
        self.service_pid = self.root / "service.pid"
        self.service_lock = self.root / "service.lock"
        self.service_log = self.root / "service.log"
        self.usage = self.root / "usage.json"  # the service's last measurement of the running tasks (usage.py)
        self.machine_id = self.root / "machine-id"  # cluster mode: this home's identity (cluster/hosts.py)
        self._runtime_socket: Path | None = None  # a deep home's socket, once its dir is checked

    @property
    def key(self) -> str:
        """A short stable hash of the home, for names that must be unique per home."""
        return sha256(str(self.root).encode()).hexdigest()[:12]

    @property
    def socket(self) -> Path:
        """The wake-up socket: in the home when the path is short enough, else in the user's
        runtime dir, which must be ours alone (UsageError, exit 2, saying what to do)."""
        path = self.root / "kugetsu.sock"
        if len(os.fsencode(path)) <= _MAX_SOCKET_PATH:
            return path
        if self._runtime_socket is None:
            sock = self._runtime_dir() / f"{self.key}.sock"
            if len(os.fsencode(sock)) > _MAX_SOCKET_PATH:  # a deep runtime dir too (a deep TMPDIR)
                raise UsageError(
                    f"cannot place the service's socket for {self.root}: {sock} is longer than"
                    f" {_MAX_SOCKET_PATH} bytes, the most a Unix socket path may be; set XDG_RUNTIME_DIR to a"
                    " short directory of yours with mode 0700, or use a shorter KUGETSU_HOME")
            self._runtime_socket = sock
        return self._runtime_socket

    @property
    def handoff(self) -> Path | None:
        """The service's delegate socket (frontends/cli/thin.py), beside the wake-up socket in
        the home; None for a home too deep for it (its delegates run in the CLI's process)."""
        path = self.root / "delegate.sock"
        return path if len(os.fsencode(path)) <= _MAX_SOCKET_PATH else None

    def _runtime_dir(self) -> Path:
        """<runtime dir>/kugetsu, made private if missing. Another user who owns (or can write)
        it could take the socket's name, or read the wake-ups; so it is checked, not trusted."""
        import warnings

        import platformdirs  # only for deep homes: it costs ~30 ms to import

        fix = (
            "set XDG_RUNTIME_DIR to a directory of yours with mode 0700, or use a shorter KUGETSU_HOME"
            f" (the socket lives in the home when its path is at most {_MAX_SOCKET_PATH} bytes)"
        )
        try:
            with warnings.catch_warnings():  # its fallback notice is noise: the checks below are ours
                warnings.simplefilter("ignore")
                base = Path(platformdirs.user_runtime_dir(ensure_exists=False))
        except PermissionError as err:  # platformdirs >= 4.4 refuses a foreign /tmp/runtime-<uid>
            problem = str(err).split(";")[0]  # its own advice follows; ours is more complete
            raise UsageError(f"cannot place the service's socket for {self.root}: {problem}; {fix}") from None
        for d in (base, base / "kugetsu"):
            private_dir(d, "the service's socket directory", fix, strict=True)
        return base / "kugetsu"

    def log(self, task_id: int) -> Path:
        return self.logs / f"{task_id}.log"

    def mirror_log(self, task_id: int) -> Path:
        """Cluster mode: the output of a task that ran on another machine, as shipped from
        there. Its directory is made (private, never through a link) on first use."""
        self.ensure()
        mirror = self.root / "mirror"
        private_dir(mirror, "the mirror of other machines' output", f"remove it (kugetsu makes a new one), or {_HOME_FIX}")
        return mirror / f"{task_id}.log"

    def prompt_file(self, task_id: int) -> Path:
        """The prompt of a preset with {prompt_file}: 0600, so it is not in the agent's argv."""
        return self.logs / f"{task_id}.prompt"

    def exit_file(self, task_id: int) -> Path:
        """Written by the task's wrapper with the agent's exit status; outlives the service."""
        return self.logs / f"{task_id}.exit"

    def ensure(self) -> None:
        """Create the home and logs directories, private to the user (0700). One that is a
        symlink or another user's is refused (UsageError, exit 2), never followed or chmodded."""
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass  # a file where a directory belongs: private_dir names it
        except OSError as err:
            raise UsageError(_cannot_create(self.root, err)) from None
        private_dir(self.root, "KUGETSU_HOME", _HOME_FIX)
        private_dir(self.logs, "the home's logs directory", f"remove it (kugetsu makes a new one), or {_HOME_FIX}")


_HOME_FIX = "set KUGETSU_HOME to a directory of yours that kugetsu may create or use (default ~/.kugetsu)"


def _cannot_create(root: Path, err: OSError) -> str:
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(root) else ""
    return f"cannot create {root} (KUGETSU_HOME): {err.strerror}{where}; {_HOME_FIX}"


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(home: Home, what: object) -> DiskFull:
    """The error for a write that found the disk (or the quota) full; `what`: what was written."""
    return DiskFull(f"disk full: {what}; nothing was written. Free some space in {home.root} and try again.")


def explain(home: Home, err: OSError) -> KugetsuError:
    """An OSError that reached the command line, as one line that says what to do: a full
    disk (exit 1), a symlink or an unusable directory inside the home (exit 2), else the
    path and the system's reason (exit 1)."""
    name = err.filename
    if err.errno in DISK_FULL:
        return disk_full(home, f"writing {os.fsdecode(name)}" if name else "a write failed")
    inside = name is not None and (Path(os.fsdecode(name)) == home.root or home.root in Path(os.fsdecode(name)).parents)
    if err.errno == errno.ELOOP and inside:
        return UsageError(f"{name} is a symbolic link; kugetsu never follows a link inside its home that it did not"
                          " make (another user may have planted it): remove it, and try again")
    if inside and err.errno in (errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS):
        if err.errno == errno.ENOTDIR:
            why = f"{_file_in_the_way(Path(os.fsdecode(name)))} is not a directory; move it away, or"
        else:
            why = f"{name}: {err.strerror};"
        return UsageError(f"cannot use {home.root} (KUGETSU_HOME): {why} {_HOME_FIX}")
    return KugetsuError(f"{name}: {err.strerror}" if name else str(err.strerror or err))


def private_dir(path: Path, what: str, fix: str, *, strict: bool = False) -> None:
    """Make `path` a directory of ours alone: created 0700 if missing; refused (UsageError,
    exit 2: the path and `what` it is, what is wrong, then `fix`) if it is a symlink, not a
    directory, another user's, or (`strict`) writable by others, who may have put things in
    it already. Never follows a link: the checks and the chmod are on a descriptor opened
    O_NOFOLLOW."""
    where = f"{path} ({what})"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except NotADirectoryError:
        raise UsageError(f"cannot create {where}: {_file_in_the_way(path)} is not a directory;"
                         f" move it away, or {fix}") from None
    except OSError as err:
        raise UsageError(f"cannot create {where}: {err.strerror}; {fix}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP or os.path.islink(path):
            raise UsageError(f"{where} is a symbolic link; kugetsu never follows a link it did not make"
                             f" (another user may have planted it); {fix}") from None
        if err.errno == errno.ENOTDIR:
            raise UsageError(f"{where}: {_file_in_the_way(path)} is not a directory; move it away, or {fix}") from None
        raise UsageError(f"cannot use {where}: {err.strerror}; {fix}") from None
    try:
        st = os.fstat(fd)
        uid = os.geteuid()
        if st.st_uid != uid:
            raise UsageError(f"{where} belongs to uid {st.st_uid}, not to you (uid {uid}); {fix}")
        mode = stat.S_IMODE(st.st_mode)
        if strict and mode & 0o022:
            raise UsageError(f"{where} is writable by other users (mode {mode:04o}); {fix}")
        if mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _file_in_the_way(path: Path) -> Path:
    """The first part of `path` that exists and is not a directory."""
    return next((p for p in (*reversed(path.parents), path) if os.path.lexists(p) and not p.is_dir()), path)


def default_home() -> Home:
    return Home(os.environ.get("KUGETSU_HOME") or Path.home() / ".kugetsu")


def open_file(path: os.PathLike[str] | str, flags: int, mode: int = 0o600) -> int:
    """os.open for a file inside KUGETSU_HOME: never through a symlink (O_NOFOLLOW: a link
    planted there fails with ELOOP instead of redirecting kugetsu's write), never inherited
    by an agent (O_CLOEXEC), created private (0600)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def write_new(path: Path, data: bytes, name: object = None, durable: bool = True) -> None:
    """Create `path` afresh with `data`, fsync'd (unless not `durable`), 0600: a stale file of
    that name is removed first (a planted link too: unlink removes the link, never its target),
    then the file is made with O_EXCL|O_NOFOLLOW. On any failure (a full disk too) it is removed
    again and the error raised, naming `name` (default `path`) when the system named no file."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    try:
        fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as err:
        _discard(path, err, name or path)
        raise


def _discard(path: Path, err: BaseException, name: object) -> None:
    try:
        path.unlink()
    except OSError:
        pass
    if isinstance(err, OSError) and err.filename is None:
        err.filename = str(name)  # os.write's errors name no file: say which one it was


def atomic_write(path: Path, data: bytes, durable: bool = True) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new file, never a torn one:
    temp file in the same directory (made afresh by write_new, never through a planted link),
    fsync, rename, fsync of the directory. On any failure the temp file is removed. Not
    `durable` (a cache that names what it was made from: store/head.py): neither fsync, so a
    reader never sees half of it, but a crash may leave the old file or an empty one."""
    tmp = path.with_name(f".{path.name}.tmp")
    write_new(tmp, data, name=path, durable=durable)
    try:
        os.replace(tmp, path)
    except BaseException as err:
        _discard(tmp, err, path)
        raise
    if not durable:
        return
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def nofollow(path: str, flags: int) -> int:
    """An opener for the builtin open(), for files inside KUGETSU_HOME: open(p, "rb", opener=nofollow)."""
    return open_file(path, flags)


def read_file(path: os.PathLike[str] | str) -> bytes:
    """Path.read_bytes() of a file inside KUGETSU_HOME, never through a symlink."""
    with open(path, "rb", opener=nofollow) as f:
        return f.read()


def read_head(path: os.PathLike[str], beyond: int, most: int) -> bytes:
    """The whole lines in the first `most` bytes of a file longer than `beyond` bytes; b""
    for a shorter one (its tail holds them already)."""
    try:
        with open(path, "rb", opener=nofollow) as f:
            if os.fstat(f.fileno()).st_size <= beyond:
                return b""
            data = f.read(most)
    except FileNotFoundError:
        return b""
    return data[: data.rfind(b"\n") + 1]


def read_tail(path: os.PathLike[str], size: int) -> bytes:
    """The last `size` bytes of a file, from its first whole line; b"" if there is no file."""
    try:
        with open(path, "rb", opener=nofollow) as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - size))
            data = f.read(size)  # bounded, even when the file grows meanwhile
    except FileNotFoundError:
        return b""
    if len(data) >= size:  # drop the partial first line
        data = data[data.find(b"\n") + 1 :]
    return data
