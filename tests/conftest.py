"""Fixtures that drive the real thing: a temp KUGETSU_HOME, the real CLI in subprocesses,
real agent processes that record their own start and end times, the real service."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Both stores encode only the queued tasks a transaction assigned to (kugetsu/store/tracking.py):
# under test they also check that against a full encoding, so a change made in place fails.
os.environ["KUGETSU_PG_VERIFY"] = "1"

from kugetsu.paths import Home  # noqa: E402
from torture import raw_index  # noqa: E402
from pg import pg_url  # noqa: E402,F401  (the cluster tests' real PostgreSQL)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)  # the injected clock of the pure tests (pm, policy, store)

# Everything the tests talk to is on 127.0.0.1 (the fake Bot API server): never through a
# proxy that a CI machine may set for the package registries.
for _var in ("NO_PROXY", "no_proxy"):
    os.environ[_var] = ",".join(filter(None, ["127.0.0.1,localhost", os.environ.get(_var)]))


def wait_for(condition: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


async def wait_for_async(condition: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    """wait_for, for a test whose event loop must keep running meanwhile (an in-process service)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return value


@contextlib.asynccontextmanager
async def service_in_process(home: Home) -> AsyncIterator[None]:
    """The real service, run on the test's own event loop (so that a test can patch what it
    calls), stopped at the end. Tests look at what it does (wrappers, the index, events,
    the agents' own times), not at its fields."""
    from kugetsu.service.daemon import Service

    svc = Service(home)
    serving = asyncio.create_task(svc.main())
    try:
        yield
    finally:
        svc.stop()
        await serving


class Kugetsu:
    """The real `kugetsu` command against one temp home."""

    def __init__(self, home: Path):
        self.home = Home(home)
        self.env = {
            **os.environ,
            "KUGETSU_HOME": str(home),
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        # Run the CLI as installed, with its bytecode cache: without it (PYTHONDONTWRITEBYTECODE
        # is set on our CI machines) every call recompiles the package, ~50 ms each.
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.rec = home.parent / "rec"
        self.rec.mkdir(exist_ok=True)

    def run(self, *args: str, input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kugetsu", *args],
            env=self.env, input=input, capture_output=True, text=True, timeout=timeout,
        )

    def ok(self, *args: str, **kw: object) -> str:
        r = self.run(*args, **kw)  # type: ignore[arg-type]
        assert r.returncode == 0, f"kugetsu {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def json(self, *args: str) -> object:
        return json.loads(self.ok(*args, "--json"))

    def config(self, **values: object) -> None:
        self.home.root.mkdir(mode=0o700, exist_ok=True)
        self.home.config.write_text(json.dumps(values))

    # ---- agents that record themselves ------------------------------------------------

    def agent(self, name: str, seconds: float = 0.0, code: int = 0, gate: Path | None = None) -> list[str]:
        """argv of an agent that appends `start <t>` and `end <t>` to rec/<name>; with a
        gate, it also waits until that file exists before it ends."""
        script = (
            'echo "start $(date +%s.%N)" >> "$0"; sleep "$1"; '
            'while [ -n "$3" ] && [ ! -e "$3" ]; do sleep 0.05; done; '
            'echo "end $(date +%s.%N)" >> "$0"; exit "$2"'
        )
        return ["sh", "-c", script, str(self.rec / name), str(seconds), str(code), str(gate or "")]

    def delegate(self, name: str, seconds: float = 0.0, code: int = 0, *extra: str, gate: Path | None = None) -> str:
        return self.ok("delegate", name, *extra, "--", *self.agent(name, seconds, code, gate))

    def times(self, name: str) -> dict[str, float]:
        try:
            lines = (self.rec / name).read_text().split("\n")
        except FileNotFoundError:
            return {}
        return {k: float(v) for k, v in (line.split() for line in lines if line.strip())}

    def events(self, kind: str | None = None) -> list[dict]:
        """The events in events.jsonl(.1), oldest first; only those of type `kind` if given.
        The index is committed a moment before its events are appended (the outbox): this
        waits (briefly) until every committed event is in the file, so a test that saw a state
        in the index also sees its event."""
        from torture import events

        deadline = time.monotonic() + 2
        while True:
            evs = events(self.home)
            try:
                committed = self.index()["next_seq"] - 1
            except (FileNotFoundError, ValueError, KeyError):
                committed = 0
            if (evs[-1]["seq"] if evs else 0) >= committed or time.monotonic() > deadline:
                return [e for e in evs if kind is None or e["type"] == kind]
            time.sleep(0.01)

    def index(self) -> dict:
        """index.json as plain JSON, every task with all its fields (the file leaves defaults out)."""
        return raw_index(self.home)

    def wrappers(self) -> dict[int, tuple[int, int]]:
        """task id -> (pid, start) of this home's living wrappers that are truly its tasks'
        (runner.find_wrappers, with the tokens from the index)."""
        from kugetsu.service import runner

        try:
            index = self.index()
        except FileNotFoundError:
            return {}
        tokens = {t["id"]: t.get("token") for k in ("active", "queued", "finished") for t in index[k]}
        return runner.find_wrappers(self.home, tokens)

    def task(self, ref: str) -> dict:
        return self.json("status", ref)  # type: ignore[return-value]

    def wait_state(self, ref: str, *states: str, timeout: float = 15) -> dict:
        return wait_for(
            lambda: (t := self.task(ref))["state"] in states and t, timeout, f"{ref} to be {states}"
        )  # type: ignore[return-value]

    def service_pid(self) -> int | None:
        try:
            return int(self.home.service_pid.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def cleanup(self) -> None:
        """Stop the service and every agent group of this home, whatever the test left."""
        self.run("shutdown", timeout=30)
        pid = self.service_pid()
        if pid:
            _kill(pid, signal.SIGKILL)
        for pid in agent_wrappers(self.home):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def agent_wrappers(home: Home) -> list[int]:
    """pids of living task wrappers of this home (their $0 is kugetsu[<home key>]#<id>)."""
    want = f"kugetsu[{home.key}]#".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                stat = (entry / "stat").read_bytes()
            except OSError:
                continue
            if len(argv) > 3 and argv[3].startswith(want) and b") Z" not in stat:
                found.append(int(entry.name))
    return found


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def processes_under(root: Path) -> list[int]:
    """pids of processes whose KUGETSU_HOME lies under `root` (services and agents)."""
    want = f"KUGETSU_HOME={root}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(v.startswith(want) for v in env):
                found.append(int(entry.name))
    return found


@pytest.fixture(autouse=True, scope="session")
def no_process_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Whatever a test started under the session's temp dir (a service autostarted by an
    in-process call, an agent) is killed at the end, so runs never pile up processes."""
    yield
    for pid in processes_under(tmp_path_factory.getbasetemp()):
        _kill(pid, signal.SIGKILL)


@pytest.fixture
def ram_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A temp dir in RAM (/dev/shm, when it has room), for tests that write hundreds of MB of
    agent output: their writeback then stalls no fsync of the tests running beside them (a
    service's commit behind it missed a deadline test's budget by 0.7 s in CI, once, while
    200 MB logs were being written). Elsewhere, an ordinary temp dir."""
    import shutil
    import tempfile

    try:
        st = os.statvfs("/dev/shm")
        room = st.f_bavail * st.f_frsize
    except OSError:
        room = 0
    if room < 2 * 1024**3:
        yield tmp_path_factory.mktemp("ram")
        return
    path = Path(tempfile.mkdtemp(prefix="kugetsu-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        for pid in processes_under(path):
            _kill(pid, signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kg(tmp_path: Path) -> Iterator[Kugetsu]:
    k = Kugetsu(tmp_path / "home")
    yield k
    k.cleanup()
