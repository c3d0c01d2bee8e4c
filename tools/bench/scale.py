#!/usr/bin/env python3
"""Cost against the queue's depth, side by side with task-spooler (issue 31).

    python tools/bench/scale.py [--sizes 100,1000] [--slots 1,4] [--rounds 3] [--json]

drain   N trivial tasks queued behind one blocker per slot; from the moment the blockers
        are let go to the last task's own end stamp, through S slots, for kugetsu and
        `tsp -S S` in interleaved rounds (kugetsu, tsp, kugetsu, tsp, ...). The table gives
        the medians, kugetsu's time per task, and the ratio kugetsu / tsp.

kugetsu's queue is written straight into index.json while no service runs (admission is
not what this measures: tools/bench/run.py and mcp.py measure it); tsp's is queued with one
`tsp` call a task, its only way (past ~900 jobs, by a thread while it drains: tsp holds
a connection per queued job and blocks clients at its compile-time limit of ~1,000). Both run the same agent: a `sh -c` that stamps its start
and end. The blockers wait for a file to appear (10 ms polls), so both sides start from
the same kind of release.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from run import TASK_SCRIPT, Kg, Tsp, read_stamps, wait_until, compile_package

from kugetsu.core.models import Index, Task
from kugetsu.store.protocol import encode_index

TSP_FITS = 900  # jobs queued before the go; tsp blocks clients somewhat below 1,000
# Waits for the go file, then stamps its own end (its task's slot frees right after).
BLOCKER = 'while [ ! -e "$0" ]; do sleep 0.01; done'


def _go(go: Path) -> float:
    at = time.time()
    go.touch()
    return at


def drain_kugetsu(n: int, slots: int) -> float:
    with tempfile.TemporaryDirectory(prefix="kgscale-") as tmp:
        root = Path(tmp)
        kg = Kg(root, max_agents=slots, max_queue=n + slots + 10, autostart=False)
        stamps, go = root / "stamps", root / "go"
        now = datetime.now(timezone.utc)
        index = Index(next_id=n + slots + 1)
        for i in range(1, n + slots + 1):
            blocker = i <= slots
            argv = ["sh", "-c", BLOCKER, str(go)] if blocker else ["sh", "-c", TASK_SCRIPT, str(stamps), str(i)]
            index.queued.append(Task(id=i, name=f"t{i}", command=argv, cwd="/", created_at=now,
                                     expires_at=now + timedelta(hours=24), source="bench"))
        kg.home.index.write_bytes(encode_index(index))
        kg.start_service()
        try:
            wait_until(lambda: len(kg.index()["active"]) == slots, 60, "the blockers to start")
            t0 = _go(go)
            wait_until(lambda: len(read_stamps(stamps)[1]) == n, 600, "kugetsu drain")
            return max(read_stamps(stamps)[1].values()) - t0
        finally:
            kg.stop()


def drain_tsp(n: int, slots: int) -> float:
    with tempfile.TemporaryDirectory(prefix="kgscale-") as tmp:
        root = Path(tmp)
        ts = Tsp(root)
        stamps, go = root / "stamps", root / "go"
        try:
            ts.run("-S", str(slots))
            for _ in range(slots):
                ts.run("sh", "-c", BLOCKER, str(go))
            # tsp holds a connection per queued job and cannot hold more than about 1,000
            # (its compile-time MAXCONN): what does not fit is fed by a thread while it drains,
            # each client blocking until a connection frees (tsp's own back-pressure).
            fits = min(n, TSP_FITS - slots)
            for i in range(fits):
                ts.run("sh", "-c", TASK_SCRIPT, str(stamps), str(i))
            feeder = threading.Thread(target=lambda: [ts.run("sh", "-c", TASK_SCRIPT, str(stamps), str(i))
                                                      for i in range(fits, n)])
            feeder.start()
            t0 = _go(go)
            wait_until(lambda: len(read_stamps(stamps)[1]) == n, 600, "tsp drain")
            feeder.join()
            return max(read_stamps(stamps)[1].values()) - t0
        finally:
            ts.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100,1000", help="queue depths, comma-separated (e.g. 100,1000,10000)")
    ap.add_argument("--slots", default="1,4", help="slot counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per side")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    slot_counts = [int(s) for s in args.slots.split(",")]
    compile_package()
    load = os.getloadavg()[0]
    out = []
    for n in sizes:
        for slots in slot_counts:
            k, t = [], []
            for r in range(args.rounds):
                print(f"drain {n} x {slots} slots, round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                k.append(drain_kugetsu(n, slots))
                t.append(drain_tsp(n, slots))
            km, tm = statistics.median(k), statistics.median(t)
            out.append({"tasks": n, "slots": slots, "kugetsu_s": km, "tsp_s": tm, "ratio": km / tm,
                        "kugetsu_rounds": k, "tsp_rounds": t})
    if args.json:
        print(json.dumps({"load_at_start": load, "rows": out}, indent=2))
        return 0
    print(f"load at start {load:.2f}, {args.rounds} interleaved rounds, medians")
    print(f"{'drain':<28}{'kugetsu':>10}{'tsp':>10}{'per task':>10}{'ratio':>8}  rounds (kugetsu / tsp)")
    for row in out:
        rounds = "/".join(f"{x:.2f}" for x in row["kugetsu_rounds"]) + "  " + "/".join(f"{x:.2f}" for x in row["tsp_rounds"])
        print(f"{row['tasks']:>6,} tasks, {row['slots']} slot(s)     {row['kugetsu_s']:>9.2f}s{row['tsp_s']:>9.2f}s"
              f"{row['kugetsu_s'] * 1000 / row['tasks']:>8.2f}ms{row['ratio']:>8.2f}  {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
