"""Where kugetsu keeps its files (DESIGN section 3)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# sun_path is 108 bytes on Linux and 104 on macOS; keep a margin.
_MAX_SOCKET_PATH = 100


class Home:
    """The files of one KUGETSU_HOME. Creating the object touches nothing on disk."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().absolute()
        self.config = self.root / "config.json"
        self.index = self.root / "index.json"
        self.lock = self.root / "index.lock"
        self.events = self.root / "events.jsonl"
        self.events_old = self.root / "events.jsonl.1"  # the previous events.jsonl, once it grew past events_max_size
        self.history = self.root / "history.jsonl"
        self.logs = self.root / "logs"
        self.service_pid = self.root / "service.pid"
        self.service_lock = self.root / "service.lock"
        self.service_log = self.root / "service.log"

    @property
    def key(self) -> str:
        """A short stable hash of the home, for names that must be unique per home."""
        return hashlib.sha256(str(self.root).encode()).hexdigest()[:12]

    @property
    def socket(self) -> Path:
        """The wake-up socket: in the home when the path is short enough, else in the runtime dir."""
        path = self.root / "kugetsu.sock"
        if len(os.fsencode(path)) <= _MAX_SOCKET_PATH:
            return path
        import platformdirs  # only for deep homes: it costs ~30 ms to import

        return Path(platformdirs.user_runtime_dir("kugetsu", ensure_exists=False)) / f"{self.key}.sock"

    def log(self, task_id: int) -> Path:
        return self.logs / f"{task_id}.log"

    def exit_file(self, task_id: int) -> Path:
        """Written by the task's wrapper with the agent's exit status; outlives the service."""
        return self.logs / f"{task_id}.exit"

    def ensure(self) -> None:
        """Create the home and logs directories, private to the user (0700)."""
        for d in (self.root, self.logs):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if d.stat().st_mode & 0o077:
                d.chmod(0o700)


def default_home() -> Home:
    return Home(os.environ.get("KUGETSU_HOME") or Path.home() / ".kugetsu")


def open_file(path: os.PathLike[str] | str, flags: int, mode: int = 0o600) -> int:
    """os.open for a file inside KUGETSU_HOME: never through a symlink (O_NOFOLLOW: a link
    planted there fails with ELOOP instead of redirecting kugetsu's write), never inherited
    by an agent (O_CLOEXEC), created private (0600)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new file, never a torn one:
    temp file in the same directory, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written temp file behind
        raise
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_tail(path: os.PathLike[str], size: int) -> bytes:
    """The last `size` bytes of a file, from its first whole line; b"" if there is no file."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - size))
            data = f.read()
    except FileNotFoundError:
        return b""
    if len(data) >= size:  # drop the partial first line
        data = data[data.find(b"\n") + 1 :]
    return data
