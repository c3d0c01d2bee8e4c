#!/usr/bin/env python3
"""The file store's cost against the queue's length (issue 31).

    python tools/bench/filestore.py [--sizes 100,1000,5000,20000,50000] [--cli 50000] [--reps 5]

transaction  one warm file-store transaction (the service's kind: its Store committed the
             index before) that flips `paused`, median ms, at each size
idle txn     a warm transaction that changes nothing (the service's safety-net tick, a `wait`
             poll): it should encode and write nothing
cold txn     the same from a fresh Store (a CLI command's kind: it decodes the index)
CLI          delegate, queue --json, capacity --json at --cli queued (no service), beside a bare
             `python -c pass`, interleaved; medians in ms and the ratio to python

The index is run.py's build_index (n queued, one running, min(500, n/2) finished).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402

from common import PY, Kg  # noqa: E402
from run import build_index, timed  # noqa: E402
from kugetsu.paths import Home  # noqa: E402
from kugetsu.store.files import Store  # noqa: E402


def flip(store: Store) -> float:
    t0 = time.perf_counter()
    with store.transaction() as txn:
        txn.index.paused = not txn.index.paused
    return (time.perf_counter() - t0) * 1000


def idle(store: Store) -> float:
    t0 = time.perf_counter()
    with store.transaction():
        pass
    return (time.perf_counter() - t0) * 1000


def transactions(n: int, reps: int, holder: psutil.Process) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        home = Home(Path(tmp) / "home")
        build_index(home, n, holder)
        warm = Store(home)
        warm.append_commits()  # the service's kind: its commits are records in index.journal
        flip(warm)
        hot = [flip(warm) for _ in range(reps)]
        still = [idle(warm) for _ in range(reps)]
        cold = [flip(Store(home)) for _ in range(reps)]
        return statistics.median(hot), statistics.median(still), statistics.median(cold)


def cli(n: int, reps: int, holder: psutil.Process) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        kg = Kg(Path(tmp), max_agents=1, max_queue=n + 10 * reps + 10, autostart=False)
        build_index(kg.home, n, holder)
        out: dict[str, list[float]] = {"python": [], "delegate": [], "queue --json": [], "capacity --json": []}
        for _ in range(reps):  # interleaved, so noise hits all four alike
            out["python"] += timed([PY, "-c", "pass"], kg.env, 1)
            out["delegate"] += timed(kg.argv("delegate", "--", "true"), kg.env, 1)
            out["queue --json"] += timed(kg.argv("queue", "--json"), kg.env, 1)
            out["capacity --json"] += timed(kg.argv("capacity", "--json"), kg.env, 1)
        return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100,1000,5000,20000,50000")
    ap.add_argument("--cli", type=int, default=50000, help="queued tasks for the CLI rows (0: none)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    holder = subprocess.Popen(["sleep", "3600"])
    try:
        proc = psutil.Process(holder.pid)
        print(f"{'queued':>8} {'txn warm ms':>12} {'txn idle ms':>12} {'txn cold ms':>12}")
        for n in [int(s) for s in args.sizes.split(",") if s]:
            hot, still, cold = transactions(n, args.reps, proc)
            print(f"{n:>8,} {hot:>12.1f} {still:>12.1f} {cold:>12.1f}", flush=True)
        if args.cli:
            res = cli(args.cli, args.reps, proc)
            print(f"CLI @ {args.cli:,} queued (median ms, x python)")
            for k, v in res.items():
                print(f"  {k:<16} {v:8.1f}  {v / res['python']:5.1f}x")
    finally:
        holder.kill()
        holder.wait()


if __name__ == "__main__":
    main()
