#!/usr/bin/env python3
"""Find the right max_agents for this machine by running the real agent at rising concurrency.

    python tools/parallel-capacity-test/run.py --command "opencode run 'write hello.py'" \\
        --max 8 --repeat 2 --timeout 15m [--apply] [--json]
    python tools/parallel-capacity-test/run.py --synthetic cpu --max 4      # try it anywhere

At each concurrency level c = 1..max, c workers each run the command `repeat` times in a
row (each run in a fresh temporary directory unless --cwd is given). Per level it records
the wall time per run, throughput (runs per minute), failures (exit code != 0), timeouts
(run killed, whole process group, after --timeout), the peak memory of all the runs'
process trees together (RSS, sampled) and the load average.

Recommended max_agents: walking up from level 1, the last level that still qualifies:
throughput at least `--min-gain` (default 10%) above the previous qualifying level, no
timeouts, a failure rate no higher than level 1's, and peak memory under `--mem-share`
(default 80%) of RAM. The walk (and, unless --keep-going, the test) stops at the first
level that times out or runs out of memory.

The command is split with shlex into an argv and run directly: never through a shell.
`--apply` writes the recommendation with the same code path as `kugetsu config set`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from kugetsu.config.units import format_duration, parse_duration  # noqa: E402

# ---- synthetic loads ---------------------------------------------------------------------

CPU_LOAD = """
import sys, time
n = int(sys.argv[1])
x = 0
for i in range(n):
    x += i * i
"""

MEMORY_LOAD = """
import sys, time
mb, hold = int(sys.argv[1]), float(sys.argv[2])
block = bytearray(mb * 1024 * 1024)
for i in range(0, len(block), 4096):  # touch every page so it is really resident
    block[i] = 1
time.sleep(hold)
"""


def calibrate_cpu(seconds: float) -> int:
    """Loop iterations that take about `seconds` of one core here, measured in a child."""
    probe = 2_000_000
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CPU_LOAD, str(probe)], check=True)
    t1 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    startup = time.perf_counter() - t1
    per_iter = max(1e-9, (t1 - t0 - startup) / probe)
    return max(1000, int(seconds / per_iter))


# ---- one level ---------------------------------------------------------------------------


@dataclass
class Level:
    concurrency: int
    runs: int = 0
    failures: int = 0
    timeouts: int = 0
    wall_s: float = 0.0
    run_s: list[float] = field(default_factory=list)
    peak_mem_mb: float = 0.0
    load_avg: float = 0.0
    exit_codes: dict[str, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Runs per minute."""
        return self.runs / self.wall_s * 60 if self.wall_s else 0.0

    @property
    def failure_rate(self) -> float:
        return self.failures / self.runs if self.runs else 0.0

    def summary(self) -> dict:
        out = asdict(self)
        out["run_s"] = [round(x, 3) for x in self.run_s]
        out.update(
            throughput_per_min=round(self.throughput, 2),
            failure_rate=round(self.failure_rate, 3),
            run_s_median=round(statistics.median(self.run_s), 3) if self.run_s else None,
            run_s_max=round(max(self.run_s), 3) if self.run_s else None,
        )
        return out


class Runs:
    """The live runs of a level, for the memory sampler."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pids: set[int] = set()

    def tree_rss(self) -> int:
        with self.lock:
            pids = list(self.pids)
        total = 0
        for pid in pids:
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        return total


def run_once(argv: list[str], cwd: str | None, timeout: float | None, runs: Runs) -> tuple[float, int | None, bool]:
    """(seconds, exit code or None, timed out). The run is the leader of its own process
    group; on timeout the whole group gets SIGTERM, then SIGKILL after 5 s."""
    tmp = None if cwd else tempfile.mkdtemp(prefix="kugetsu-capacity-")
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=cwd or tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        with runs.lock:
            runs.pids.add(proc.pid)
        timed_out = False
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            code = None
        _kill_group(proc.pid, signal.SIGKILL)  # leftovers of the run (grandchildren), if any
        if proc.returncode is None:
            proc.wait()
        with runs.lock:
            runs.pids.discard(proc.pid)
        return time.monotonic() - t0, code, timed_out
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_level(argv: list[str], concurrency: int, repeat: int, cwd: str | None, timeout: float | None) -> Level:
    level = Level(concurrency)
    runs = Runs()
    done = threading.Event()
    peak = 0
    loads: list[float] = []

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, runs.tree_rss())
            loads.append(os.getloadavg()[0])
            done.wait(0.05)

    results: list[tuple[float, int | None, bool]] = []
    results_lock = threading.Lock()

    def worker() -> None:
        for _ in range(repeat):
            r = run_once(argv, cwd, timeout, runs)
            with results_lock:
                results.append(r)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    workers = [threading.Thread(target=worker) for _ in range(concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    level.wall_s = time.monotonic() - t0
    done.set()
    sampler.join()
    for seconds, code, timed_out in results:
        level.runs += 1
        level.run_s.append(seconds)
        if timed_out:
            level.timeouts += 1
        elif code != 0:
            level.failures += 1
        key = "timeout" if timed_out else str(code)
        level.exit_codes[key] = level.exit_codes.get(key, 0) + 1
    level.peak_mem_mb = peak / 2**20
    level.load_avg = max(loads) if loads else os.getloadavg()[0]
    return level


# ---- the recommendation ------------------------------------------------------------------


def recommend(levels: list[Level], min_gain: float, mem_limit_mb: float) -> tuple[int, list[str]]:
    """The recommended max_agents and, per level above the recommendation, why it was not taken."""
    notes: list[str] = []
    if not levels:
        return 1, ["no level ran"]
    base = levels[0]
    if base.timeouts:
        notes.append(f"level 1 timed out {base.timeouts}x: raise --timeout; max_agents 1 is the only safe value")
    if base.peak_mem_mb > mem_limit_mb:
        notes.append(f"level 1 already used {base.peak_mem_mb:.0f} MB, over the {mem_limit_mb:.0f} MB limit")
    if base.runs and base.failures == base.runs:
        notes.append("every run failed at level 1: check the command (its exit code is the verdict)")
    best = base
    for lv in levels[1:]:
        why = None
        if lv.timeouts:
            why = f"{lv.timeouts} timeout(s)"
        elif lv.failure_rate > base.failure_rate:
            why = f"failure rate {lv.failure_rate:.0%} > level 1's {base.failure_rate:.0%}"
        elif lv.peak_mem_mb > mem_limit_mb:
            why = f"peak memory {lv.peak_mem_mb:.0f} MB > limit {mem_limit_mb:.0f} MB"
        elif lv.throughput < best.throughput * (1 + min_gain):
            why = (f"throughput {lv.throughput:.1f}/min is not {min_gain:.0%} above "
                   f"level {best.concurrency}'s {best.throughput:.1f}/min")
        if why:
            notes.append(f"level {lv.concurrency} not taken: {why}")
            break
        best = lv
    return best.concurrency, notes


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="parallel-capacity-test",
        description="Run an agent command at concurrency 1..N and recommend max_agents.",
    )
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--command", help="the agent command, split with shlex (never run through a shell)")
    what.add_argument("--synthetic", choices=("cpu", "memory"), help="built-in load instead of an agent")
    ap.add_argument("--max", type=int, default=max(2, (os.cpu_count() or 2) * 2), help="highest concurrency (default 2 x cores)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per worker at each level (default 1)")
    ap.add_argument("--timeout", default=None, help="per-run timeout: 90s, 15m, 2h or seconds (default: none)")
    ap.add_argument("--cwd", help="run every run here (default: a fresh temporary directory per run)")
    ap.add_argument("--mem-share", type=float, default=0.8, help="peak memory must stay under this share of RAM (default 0.8)")
    ap.add_argument("--min-gain", type=float, default=0.10, help="throughput gain a level must bring (default 0.10 = 10%%)")
    ap.add_argument("--keep-going", action="store_true", help="test every level even after timeouts or memory overrun")
    ap.add_argument("--work", type=float, default=1.0, help="synthetic cpu: seconds of one core per run (default 1.0)")
    ap.add_argument("--mb", type=int, default=256, help="synthetic memory: MB per run (default 256)")
    ap.add_argument("--hold", type=float, default=1.0, help="synthetic memory: seconds to hold it (default 1.0)")
    ap.add_argument("--apply", action="store_true", help="write the recommendation to config (same code path as `kugetsu config set`)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    return ap.parse_args(argv)


def fail(message: str) -> int:
    print(f"parallel-capacity-test: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max < 1 or args.max > 64:
        return fail(f"--max must be 1..64 (max_agents' range), got {args.max}")
    if args.repeat < 1:
        return fail(f"--repeat must be at least 1, got {args.repeat}")
    if not 0 < args.mem_share <= 1:
        return fail(f"--mem-share must be in (0, 1], got {args.mem_share}")
    try:
        timeout = parse_duration(args.timeout, "--timeout") if args.timeout is not None else None
    except ValueError as err:
        return fail(str(err))
    if args.cwd and not os.path.isdir(args.cwd):
        return fail(f"--cwd {args.cwd!r} is not a directory")
    if args.command is not None:
        try:
            command = shlex.split(args.command)
        except ValueError as err:
            return fail(f"cannot split --command: {err}")
        if not command:
            return fail("--command is empty")
        if shutil.which(command[0]) is None and not (os.sep in command[0] and os.access(command[0], os.X_OK)):
            return fail(f"command not found: {command[0]!r} (the command is not run through a shell)")
        label = shlex.join(command)
    elif args.synthetic == "cpu":
        command = [sys.executable, "-c", CPU_LOAD, str(calibrate_cpu(args.work))]
        label = f"synthetic cpu, ~{args.work:g}s of one core per run"
    else:
        command = [sys.executable, "-c", MEMORY_LOAD, str(args.mb), str(args.hold)]
        label = f"synthetic memory, {args.mb} MB held {args.hold:g}s per run"

    total_mb = psutil.virtual_memory().total / 2**20
    mem_limit = total_mb * args.mem_share
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    levels: list[Level] = []
    stopped = None
    for c in range(1, args.max + 1):
        log(f"level {c}/{args.max}: {c} at once x {args.repeat} ...")
        lv = run_level(command, c, args.repeat, args.cwd, timeout)
        levels.append(lv)
        if not args.keep_going and (lv.timeouts or lv.peak_mem_mb > mem_limit) and c < args.max:
            stopped = f"stopped after level {c}: " + ("timeouts" if lv.timeouts else "memory over the limit")
            break
    rec, notes = recommend(levels, args.min_gain, mem_limit)
    if stopped:
        notes.append(stopped + " (--keep-going tests every level)")

    applied = None
    if args.apply:
        from kugetsu.app import config_change
        from kugetsu.errors import KugetsuError
        from kugetsu.paths import default_home

        home = default_home()
        try:
            cfg = config_change.set_config(home, "max_agents", rec)
        except KugetsuError as err:
            return fail(f"could not apply max_agents {rec}: {err}")
        applied = {"config": str(home.config), "max_agents": cfg.max_agents}

    result = {
        "command": label,
        "argv": command if args.command is not None else None,
        "machine": {"nproc": os.cpu_count(), "mem_mb": round(total_mb), "mem_limit_mb": round(mem_limit)},
        "repeat": args.repeat,
        "timeout_s": timeout,
        "levels": [lv.summary() for lv in levels],
        "recommended_max_agents": rec,
        "notes": notes,
        "applied": applied,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"command: {label}")
    print(f"machine: {os.cpu_count()} cores, {total_mb / 1024:.1f} GB RAM (limit {args.mem_share:.0%} = {mem_limit:.0f} MB)"
          + (f"; timeout {format_duration(timeout) if timeout >= 10 else f'{timeout:g}s'}" if timeout else ""))
    header = ["LEVEL", "RUNS", "WALL/RUN med", "max", "RUNS/MIN", "GAIN", "FAILED", "TIMEOUTS", "PEAK MEM", "LOAD"]
    rows = []
    prev = None
    for lv in levels:
        gain = "-" if prev is None or not prev.throughput else f"{lv.throughput / prev.throughput - 1:+.0%}"
        rows.append([
            str(lv.concurrency), str(lv.runs), f"{statistics.median(lv.run_s):.2f}s", f"{max(lv.run_s):.2f}s",
            f"{lv.throughput:.1f}", gain, str(lv.failures), str(lv.timeouts), f"{lv.peak_mem_mb:.0f} MB", f"{lv.load_avg:.2f}",
        ])
        prev = lv
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print(f"\nrecommended max_agents: {rec}")
    for note in notes:
        print(f"  - {note}")
    if applied:
        print(f"applied: max_agents = {applied['max_agents']} in {applied['config']}")
    else:
        print(f"apply it with: kugetsu config set max_agents {rec}   (or rerun with --apply)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
