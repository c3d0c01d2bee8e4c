"""The parts of the scale series (scale.py) that are not a drain: the service idle at a depth
(start-up, CPU, RSS, its warm wrappers) beside a tsp server holding what it can, the file
store's own transaction time, and admission from one client (CLI, MCP, tsp). Below scale.py;
uses common.py and run.py (Tsp), and mcp.py's rates (loaded by path: its name is the SDK's).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil

from common import PY, REPO, Kg, Sampler, wait_until
from run import Tsp

from kugetsu.core.models import Index, Task, TaskState
from kugetsu.store.protocol import encode_index

HERE = Path(__file__).resolve().parent
TSP_FITS = 900  # jobs tsp can hold queued: it keeps a connection per job, ~1,000 at most
# Stamps that it is up, then waits for a file to appear (10 ms polls): the task that holds
# the slot(s) while the queue waits behind it.
BLOCKER = 'touch "$1"; while [ ! -e "$0" ]; do sleep 0.01; done'


def queue_home(root: Path, n: int, slots: int, go: Path, up: Path, task: list[str] | None = None,
               ran: float | None = None, **config: object) -> Kg:
    """A home with `slots` blockers (ids 1..slots) and n queued tasks behind them, written into
    index.json while no service runs (n delegations would take minutes at 50,000, and admission
    is measured on its own). Each blocker touches up/<id> when it starts. `task`: the queued
    tasks' argv, its last element followed by the task's number (default `true`). `ran`: the
    home's history, 20 finished runs that took that many seconds each (none by default)."""
    kg = Kg(root, max_agents=slots, max_queue=n + slots + 10, autostart=False, **config)
    up.mkdir()
    now = datetime.now(timezone.utc)
    index = Index(next_id=n + slots + 1)
    for i in range(1, n + slots + 1):
        argv = ["sh", "-c", BLOCKER, str(go), str(up / str(i))] if i <= slots else (task or ["true"]) + ([str(i)] if task else [])
        # A token as admission gives one (runner.new_token): without it the service warms no
        # wrapper for the task, and the drain would measure cold starts only.
        index.queued.append(Task(id=i, name=f"t{i}", command=argv, cwd="/", created_at=now, token=os.urandom(16).hex(),
                                 expires_at=now + timedelta(hours=24), source="bench"))
    if ran is not None:
        for i in range(20):
            index.finished.append(Task(id=index.next_id, name=f"done{i}", command=["true"], cwd="/", created_at=now,
                                       state=TaskState.SUCCEEDED, started_at=now - timedelta(seconds=ran),
                                       finished_at=now, exit_code=0, source="bench"))
            index.next_id += 1
    kg.home.index.write_bytes(encode_index(index))
    return kg


def blockers_up(up: Path, slots: int) -> bool:
    return sum(1 for _ in up.iterdir()) >= slots


def warm_settled(kg: Kg, still: float = 0.2, timeout: float = 120) -> int:
    """Wait until the service's children (its blockers' wrappers and the warm wrappers it spawns
    after its first tick, one a turn of its loop) have not changed for `still` seconds; returns
    how many there are. tsp's queued jobs are each a client process waiting before the bench's
    clock starts (`Tsp.run` returns once it waits); kugetsu's waiting wrappers are its
    service's to spawn: a drain started before they are measures their spawning too (a drain
    of 100 through 4 slots: 0.29-0.46 s, against 0.18-0.20 s from 0.1 s later)."""
    service = psutil.Process(kg.service_pid())
    deadline = time.monotonic() + timeout
    seen, since = None, time.monotonic()
    while True:
        now = sorted(p.pid for p in service.children())
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= still:
            return len(now)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the service's warm wrappers did not settle within {timeout}s")
        time.sleep(0.01)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


def _memory(procs: list[psutil.Process]) -> tuple[int, int, int]:
    """(count, RSS, PSS) of the processes still there."""
    count = rss = pss = 0
    for p in procs:
        try:
            m = p.memory_full_info()
        except psutil.Error:
            continue
        count, rss, pss = count + 1, rss + m.rss, pss + m.pss
    return count, rss, pss


def service_idle(n: int, seconds: float, starts: int = 3) -> dict:
    """kugetsu's service with n queued behind one running blocker (one slot): its start-up
    (from `serve --detach` to the blocker's own start stamp: up, the index read, a task
    running), the median of `starts` starts of the same home as written (one start alone
    varied by +-80 ms on a 2-core VM), then, idle, its CPU share and RSS over `seconds`, and
    its other descendants (warm wrappers: count, RSS, PSS). The home has the history a deep
    queue of agents has: its last runs took 10 minutes each (the warm wrappers follow their
    pace: selection.warm_ahead; with no run to go by, the service warms WARM_AHEAD)."""
    import shutil

    with tempfile.TemporaryDirectory(prefix="kgscale-") as tmp:
        root = Path(tmp)
        go, up = root / "go", root / "up"
        kg = queue_home(root, n, 1, go, up, ran=600.0)
        pristine = root / "pristine"
        shutil.copytree(kg.home.root, pristine)  # each start's home: the one written, no service's trace
        times: list[float] = []
        try:
            for i in range(starts):
                if i:  # the last start's service and blocker gone, the home as it was written
                    go.touch()
                    kg.stop(cancel=False)
                    shutil.rmtree(kg.home.root)
                    shutil.copytree(pristine, kg.home.root)
                    go.unlink()
                    for stamp in up.iterdir():
                        stamp.unlink()
                t0 = time.monotonic()
                kg.run("serve", "--detach")
                wait_until(lambda: blockers_up(up, 1), 120, "the blocker to start")
                times.append(time.monotonic() - t0)
            pid = kg.service_pid()
            time.sleep(1.0)  # past the start's own work
            with Sampler(pid, every=0.5) as s:
                time.sleep(seconds)
            # The service's other children (warm wrappers) and theirs: not its descendants less
            # the blocker's tree read a moment apart, which counted a `sleep` the blocker
            # started in between (a count of 2 for 1 wrapper, one run in two).
            blocker = kg.index()["active"][0]["pid"]
            others = [p for child in psutil.Process(pid).children() if child.pid != blocker for p in _tree(child.pid)]
            count, rss, pss = _memory(others)
            return {"start_s": statistics.median(times), "start_runs_s": times, "cpu_share": s.cpu_share,
                    "rss": s.peak_rss, "wrappers": count, "wrappers_rss": rss, "wrappers_pss": pss}
        finally:
            go.touch()
            kg.stop(cancel=False)


def cli_served(sizes: list[int], reps: int) -> dict:
    """`delegate -- true`, `capacity --json` and `queue --json --limit 20` while the service runs, n queued behind one
    running blocker (the way a PM agent meets it): beside a bare `python -c pass` and the same
    commands kept in the CLI's process (KUGETSU_THIN=0; a checkout without the thin path
    ignores it): those through the service first, then those kept in the CLI, each
    interleaved with python. Also
    the service's CPU time per delegate (what a thin delegate moved into it) and the load."""
    from run import timed

    results: dict = {}
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="kgscale-") as tmp:
            root = Path(tmp)
            go, up = root / "go", root / "up"
            r_n = max(5, reps // 2) if n >= 10000 else reps
            kg = queue_home(root, n, 1, go, up)
            kg.home.config.write_text(json.dumps({"max_agents": 1, "max_queue": n + 3 * r_n + 20, "autostart": False}))
            try:
                kg.run("serve", "--detach")
                wait_until(lambda: blockers_up(up, 1), 120, "the blocker to start")
                service = psutil.Process(kg.service_pid())
                here = {**kg.env, "KUGETSU_THIN": "0"}
                bare, thin, local, cpu, cap, cap_local, listed, listed_local = [], [], [], [], [], [], [], []
                listing = ("queue", "--json", "--limit", "20")
                # Through the service first, then kept in the CLI, each beside python: a delegate
                # kept in the CLI writes index.json whole, which the service then reads again (0.25 s
                # at 50,000), and the request handed to it after one paid for that read.
                for _ in range(r_n):
                    bare += timed([PY, "-c", "pass"], kg.env, 1)
                    before = sum(service.cpu_times()[:2])
                    thin += timed(kg.argv("delegate", "--", "true"), kg.env, 1)
                    cpu.append((sum(service.cpu_times()[:2]) - before) * 1000)
                    cap += timed(kg.argv("capacity", "--json"), kg.env, 1)
                    listed += timed(kg.argv(*listing), kg.env, 1)
                for _ in range(r_n):
                    bare += timed([PY, "-c", "pass"], kg.env, 1)
                    local += timed(kg.argv("delegate", "--", "true"), here, 1)
                    cap_local += timed(kg.argv("capacity", "--json"), here, 1)
                    listed_local += timed(kg.argv(*listing), here, 1)
                results[n] = {"python": bare, "delegate": thin, "in_process": local, "service_cpu": cpu,
                              "capacity": cap, "capacity_in_process": cap_local, "queue": listed,
                              "queue_in_process": listed_local, "load": os.getloadavg()}
            finally:
                go.touch()
                kg.stop(cancel=False)
    return results


@contextmanager
def tsp_blocked(slots: int) -> Iterator[tuple[Tsp, Path, Path, float]]:
    """A private tsp server whose `slots` slots are held by blockers, started (their stamps are
    there), until `go` appears or the block ends. Yields (tsp, a scratch directory, go, the
    seconds from its first command, which starts the server, to the blockers' start)."""
    with tempfile.TemporaryDirectory(prefix="kgscale-") as tmp:
        root = Path(tmp)
        ts = Tsp(root)
        go, up = root / "go", root / "up"
        up.mkdir()
        try:
            t0 = time.monotonic()
            ts.run("-S", str(slots))
            for i in range(slots):
                ts.run("sh", "-c", BLOCKER, str(go), str(up / str(i)))
            wait_until(lambda: blockers_up(up, slots), 60, "the tsp blockers to start")
            yield ts, root, go, time.monotonic() - t0
        finally:
            go.touch()
            ts.stop()


def tsp_idle(n: int, seconds: float) -> dict:
    """tsp with min(n, TSP_FITS) queued behind a blocker: the server's start, CPU share and RSS;
    and its waiting clients (one process per queued job: what it keeps where kugetsu keeps
    wrappers)."""
    with tsp_blocked(1) as (ts, _, _, start):
        for _ in range(min(n, TSP_FITS)):
            ts.run("true")
        pid = ts.server_pid()
        time.sleep(1.0)
        with Sampler(pid, every=0.5) as s:
            time.sleep(seconds)
        clients = [p for p in psutil.process_iter() if p.pid != pid and _env(p).get("TS_SOCKET") == ts.env["TS_SOCKET"]
                   and p.name() in ("tsp", "ts")]
        count, rss, pss = _memory(clients)
        return {"start_s": start, "cpu_share": s.cpu_share, "rss": s.peak_rss, "queued": min(n, TSP_FITS),
                "wrappers": count, "wrappers_rss": rss, "wrappers_pss": pss}


def _env(p: psutil.Process) -> dict:
    try:
        return p.environ()
    except psutil.Error:
        return {}


# In a process of its own (its memory and its imports apart from the bench's): the file
# store's transactions with n queued tasks and 200 finished. Medians in ms.
FILE_WORKER = r"""
import json, statistics, sys, tempfile, timeit
from datetime import datetime, timedelta, timezone
from pathlib import Path
from kugetsu.config.model import Config
from kugetsu.core import admission
from kugetsu.core.models import Task, TaskState
from kugetsu.paths import Home
from kugetsu.store.files import open_store

n = int(sys.argv[1])
now = datetime.now(timezone.utc)
cfg = Config(max_agents=4, max_queue=10**6, history_limit=10**6)

def med(f, k):
    return round(statistics.median(timeit.repeat(f, number=1, repeat=k)) * 1000, 2)

with tempfile.TemporaryDirectory(prefix="kgscale-") as tmp:
    home = Home(Path(tmp) / "home")
    home.ensure()
    store = open_store(home)
    store.append_commits()  # the service's kind: its commits are records in index.journal
    with store.transaction() as txn:
        ix = txn.index
        for i in range(1, n + 201):
            t = Task(id=i, name=f"t{i}", command=["claude", "-p", "a prompt of some length " * 4], cwd="/work/repo",
                     created_at=now, expires_at=now + timedelta(hours=24), source="bench")
            if i <= 200:
                t.state, t.started_at, t.finished_at, t.exit_code = TaskState.SUCCEEDED, now, now, 0
                ix.finished.append(t)
            else:
                ix.queued.append(t)
        ix.next_id = n + 201
    store.read()
    flip = iter(range(10**9))

    def change():
        with store.transaction() as txn:
            txn.index.queued[next(flip) % n].priority = "high" if next(flip) % 2 else "low"

    def admit():
        with store.transaction() as txn:
            admission.admit(txn.index, cfg, txn.now, admission.Request(cwd="/", command=["true"]))

    def fresh():
        open_store(home).read()

    k = 15 if n <= 5000 else 7
    out = {"commit": med(change, k), "admit": med(admit, k), "read": med(fresh, max(3, k // 2)),
           "index_bytes": home.index.stat().st_size}
    print(json.dumps(out))
"""


def file_store(n: int) -> dict:
    r = subprocess.run([PY, "-c", FILE_WORKER, str(n)], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"file store at {n}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _mcp_module():
    """tools/bench/mcp.py (its name is the SDK's: loaded by its path, as it loads run.py)."""
    spec = importlib.util.spec_from_file_location("kugetsu_bench_mcp", HERE / "mcp.py")
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)  # takes this folder off sys.path: it would shadow the SDK
        import mcp  # noqa: F401  (the SDK, imported while nothing shadows it: its calls import it again)
    finally:
        sys.path[:] = path  # the bench's own imports (deadlines.py) need this folder
    return module


def tsp_admission(n: int) -> float:
    """One client enqueueing n jobs one after the other behind a blocker, jobs/s."""
    with tsp_blocked(1) as (ts, _, _, _):
        t0 = time.perf_counter()
        for _ in range(n):
            ts.run("true")
        return n / (time.perf_counter() - t0)


def admission(n_mcp: int, n_cli: int) -> dict:
    """Admission from one client, tasks/s: MCP (one session, sequential calls), the CLI (one
    process after the other), tsp; and where mcp.py has them (a kugetsu with batches), a
    batch of 100 a call and 32 sessions at once."""
    mcp = _mcp_module()
    out = {"mcp": mcp.mcp_rate(n_mcp, 1), "cli": mcp.cli_rate(n_cli, 1), "tsp": tsp_admission(min(n_mcp, TSP_FITS))}
    if "batch" in inspect.signature(mcp.mcp_rate).parameters:
        batched = mcp.mcp_rate(max(n_mcp, 1000) // 100 * 100, 1, batch=100)
        if batched is not None:  # None: this kugetsu's `delegate` takes no batch
            out["mcp_batch"] = batched
    sessions = getattr(mcp, "sessions_rate", None)
    if sessions is not None:
        if "cpu" in inspect.signature(sessions).parameters:  # the server's CPU a task, 1 session and 32
            one: dict = {}
            out["mcp_1_session_http"] = sessions(max(n_mcp, 320) // 4, 1, http=True, cpu=one)
            many: dict = {}
            out["mcp_32_sessions"] = sessions(max(n_mcp, 320), 32, http=True, cpu=many)
            out["mcp_http_server_ms"] = {"1": one.get("server_ms"), "32": many.get("server_ms")}
            out["mcp_http_clients_ms"] = {"1": one.get("clients_ms"), "32": many.get("clients_ms")}
        else:
            out["mcp_32_sessions"] = sessions(max(n_mcp, 320), 32, http=True)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
