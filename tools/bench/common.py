"""What the benchmark's parts share: kugetsu driven through its CLI on a temp home (`Kg`),
the task script's time stamps, percentiles, waiting, a CPU/RSS sampler, and the command line
of a part run on its own. Below run.py and its parts (deadlines.py, lockhold.py, cluster.py,
floor.py), so that run.py can import its parts and they need nothing of run.py.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from kugetsu.core.models import task_record  # noqa: E402
from kugetsu.paths import Home  # noqa: E402

PY = sys.executable
# One line per event, appended by the task itself: "<s|e> <tag> <epoch seconds>".
TASK_SCRIPT = 'echo "s $1 $(date +%s.%N)" >> "$0"; echo "e $1 $(date +%s.%N)" >> "$0"'
BLOCKER_SCRIPT = 'read x < "$0"; echo "$(date +%s.%N)" > "$1"'


# ---- helpers -----------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))
    return s[k]


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def read_stamps(path: Path) -> tuple[dict[str, float], dict[str, float]]:
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return starts, ends
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3:
            (starts if parts[0] == "s" else ends)[parts[1]] = float(parts[2])
    return starts, ends


def release(fifo: Path) -> None:
    """Let the blocker end: it blocks reading the fifo."""
    with open(fifo, "w") as f:
        f.write("go\n")


class Sampler:
    """Samples a process's CPU time and RSS in a thread until stopped."""

    def __init__(self, pid: int, every: float = 0.05):
        self.proc = psutil.Process(pid)
        self.every = every
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _cpu(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def __enter__(self) -> "Sampler":
        self.cpu0, self.t0 = self._cpu(), time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(self.every)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu = self._cpu() - self.cpu0
        self.wall = time.monotonic() - self.t0
        self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)

    @property
    def cpu_share(self) -> float:
        """CPU time / wall time: 1.0 = one core busy."""
        return self.cpu / self.wall if self.wall else 0.0


def sweep(var: str, value: str) -> int:
    """Kill every process whose environment has var=value, and wait for them: what a scenario
    started, found by the variable it gave them all (a kugetsu home's service, its wrappers and
    agents carry KUGETSU_HOME; a tsp server and its jobs TS_SOCKET). A scenario's own clean-up
    asks politely first; this is what makes sure, whatever raced it (a service still coming up
    when `shutdown` was sent, an agent the service was stopped before it could signal).
    Returns how many were left."""
    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    left = []
    for p in psutil.process_iter():
        if p.pid in me:
            continue
        try:
            if p.environ().get(var) == value:
                left.append(p)
        except psutil.Error:  # gone, a zombie, or not ours to read
            continue
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    return len(left)


# Homes whose scenario has not cleaned up yet: swept at exit, whatever ended the bench.
_LIVE: dict[str, str] = {}


def track(var: str, value: str) -> None:
    """What a scenario's processes will carry (see sweep): swept at exit if not by `finish`."""
    _LIVE[value] = var


def finish(var: str, value: str) -> None:
    """The end of a tracked scenario: nothing it started is left."""
    sweep(var, value)
    _LIVE.pop(value, None)


@atexit.register
def _sweep_live() -> None:
    for value, var in list(_LIVE.items()):
        sweep(var, value)


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP end the bench as Ctrl-C does (KeyboardInterrupt), so that every
    scenario's `finally` runs and nothing it started outlives it (Python's default for them
    is to die on the spot)."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def part_main(doc: str, quick_help: str, measure, rows, footer) -> int:
    """The command line of a part of this bench run on its own (deadlines.py, lockhold.py):
    `measure(quick)` -> results; `rows(results)` -> (name, ms); `footer(results)` -> a note."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    args = ap.parse_args()
    exit_on_signals()
    res = measure(args.quick)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    table = rows(res)
    width = max(len(name) for name, _ in table)
    for name, value in table:
        print(f"{name:<{width}}  {value:8.1f} ms")
    print(footer(res))
    return 0


# ---- kugetsu side ------------------------------------------------------------------------


class Kg:
    def __init__(self, root: Path, **config: object):
        self.root = root
        self.home = Home(root / "home")
        self.home.ensure()
        self.home.config.write_text(json.dumps(config))
        self.env = {**os.environ, "KUGETSU_HOME": str(self.home.root), "PYTHONPATH": str(REPO)}
        # Measure kugetsu as installed: with its bytecode cache (see compile_package).
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        track("KUGETSU_HOME", str(self.home.root))

    def argv(self, *args: str) -> list[str]:
        return [PY, "-m", "kugetsu", *args]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            raise RuntimeError(f"kugetsu {' '.join(args)} -> {r.returncode}: {r.stderr.strip()}")
        return r

    def start_service(self) -> int:
        self.run("serve", "--detach")
        return self.service_pid()

    def service_pid(self) -> int:
        return int(self.home.service_pid.read_text())

    def delegate(self, name: str, argv: list[str]) -> None:
        self.run("delegate", name, "--", *argv)

    def index(self) -> dict:
        """The committed index (index.json and, while the service runs, the journal's records
        after it) as plain JSON, every task with all its fields (the file leaves defaults out)."""
        from kugetsu.store.files import Store
        from kugetsu.store.protocol import encode_index

        raw = json.loads(encode_index(Store(self.home).read()))
        for part in ("active", "queued", "finished"):
            raw[part] = [task_record(t) for t in raw[part]]
        return raw

    def stop(self, cancel: bool = True) -> None:
        """End the scenario: its agents too (a service that stops leaves agents running, by
        design; a bench's `sleep 3600` holder must not outlive it), then the service. Without
        `cancel` (a queue of 50,000 takes long to cancel) the sweep below ends the agents."""
        if cancel:
            self.run("cancel", "--all", check=False)
        self.run("shutdown", check=False)
        try:
            os.kill(self.service_pid(), signal.SIGKILL)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            pass
        # Whatever the above raced: a service autostarted by the last command and not yet
        # listening when `shutdown` came (cluster.py's admission left one), an agent whose
        # cancel the service had no time to carry out (deadlines.py's `sleep 3600` holder).
        finish("KUGETSU_HOME", str(self.home.root))
