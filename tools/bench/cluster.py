#!/usr/bin/env python3
"""Cluster mode beside the file store, in one run (issue 15): the same scenarios on one
machine's files and on PostgreSQL.

    python tools/bench/cluster.py [--json] [--quick] [--pg postgresql://127.0.0.1/postgres]

  admission   8 processes delegating 5 tasks each at once into a paused queue, tasks/s
  promotion   one slot, 30 trivial tasks: the end of one to the start of the next, from the
              tasks' own timestamps (p50 / p95 ms)
  drain       N trivial tasks (300; --quick 60) queued while paused, then resumed: from the
              first start to the last end. The file store with one machine of 6 slots; the
              cluster with one machine of 6 slots and with 3 machines of 2 slots (three homes,
              three services, on this one box: they share its 2 cores, so this measures the
              coordination, not more hardware)
  wait        `kugetsu wait` on a task that ends 0.3 s later: from the agent's own end stamp to
              the wait's return (the CLI's exit included), median of 7. The file store; the
              cluster with the waiter on the machine that runs the task; and on another machine

A database of its own is created on the given server and dropped afterwards.

    python tools/bench/cluster.py --scale [--sizes 100,1000,5000,20000] [--before DIR] [--min]

The cluster store's own cost by queue length (issue 26: "a cluster store that grows with the
queue"), in-process on PgStore, with N queued tasks (and 200 finished): `commit`, one
change by a long-lived client (a service) after its own last commit; `other`, the same
right after another client committed (what every machine does after each NOTIFY); `read`,
a new client's read of the state (a CLI call); `admit`, admission.admit of one task in a
transaction, and `admit_rules` the same rules on a copy of the queue outside any store (their
own share); `tick`, a transaction that finishes one running task (archiving the oldest
finished one) and starts one queued (core.lifecycle); `tick_read`, the read by one client
right after another's tick (what a machine does after the NOTIFY). Medians in ms; the last
line is the largest size's cost over the smallest's. With --before DIR (a checkout of an older kugetsu, e.g.
`git worktree add /tmp/kg-before <commit>`), the same run on it, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, TASK_SCRIPT, Kg, pct, read_stamps, wait_until  # noqa: E402

import psycopg  # noqa: E402


class Db:
    def __init__(self, admin: str):
        self.admin = admin
        self.name = f"kgbench_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{self.name}"')
        self.url = admin.rsplit("/", 1)[0] + "/" + self.name

    def drop(self) -> None:
        with psycopg.connect(self.admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE "{self.name}" WITH (FORCE)')


def machines(root: Path, url: str | None, slots: list[int], **shared: object) -> list[Kg]:
    """Homes (each a machine when `url`): the first one sets the shared config."""
    if url is None:
        return [Kg(root / "m0", max_agents=slots[0], max_queue=100000, history_limit=100000, **shared)]
    out = []
    for i, n in enumerate(slots):
        kg = Kg(root / f"m{i}", store=url, host=f"m{i}", host_max_agents=n)
        out.append(kg)
    out[0].run("config", "set", "max_agents", str(sum(slots)))
    out[0].run("config", "set", "max_queue", "100000")
    out[0].run("config", "set", "history_limit", "100000")
    for key, value in shared.items():
        out[0].run("config", "set", key, json.dumps(value))
    return out


def state(kg: Kg) -> dict:
    return json.loads(kg.run("queue", "--json").stdout)


def admission(root: Path, url: str | None, procs: int = 8, each: int = 5) -> float:
    kg = machines(root, url, [2])[0]
    try:
        kg.run("pause")  # on a file store this autostarts a service: stopped below
        script = " ".join(f"{PY} -m kugetsu delegate -- true >/dev/null || exit 1;" for _ in range(each))
        t0 = time.monotonic()
        ps = [subprocess.Popen(["sh", "-c", script], env=kg.env) for _ in range(procs)]
        codes = [p.wait() for p in ps]
        wall = time.monotonic() - t0
        assert codes == [0] * procs, codes
        assert len(state(kg)["queued"]) == procs * each
        return procs * each / wall
    finally:
        kg.stop()


def _queue(kgs: list[Kg], stamps: Path, n: int) -> None:
    kgs[0].run("pause")
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: kgs[i % len(kgs)].run("delegate", f"t{i}", "--", "sh", "-c", TASK_SCRIPT, str(stamps), str(i)),
                      range(n)))


def run_drain(root: Path, url: str | None, slots: list[int], n: int) -> dict:
    kgs = machines(root, url, slots)
    stamps = root / "stamps"
    try:
        for kg in kgs:
            kg.start_service()
        _queue(kgs, stamps, n)
        kgs[0].run("resume")
        wait_until(lambda: len(read_stamps(stamps)[1]) == n, 300, "the drain")
        starts, ends = read_stamps(stamps)
        order = sorted(starts, key=starts.get)
        gaps = [starts[b] - ends[a] for a, b in zip(order, order[1:])]
        return {"drain_s": max(ends.values()) - min(starts.values()), "gaps_ms": [g * 1000 for g in gaps]}
    finally:
        for kg in kgs:
            kg.stop()


def wait_latency(root: Path, url: str | None, remote: bool = False, rounds: int = 7) -> list[float]:
    kgs = machines(root, url, [2, 1] if remote else [2])
    kgs[0].start_service()  # m0 runs the tasks; a remote waiter's home (m1) runs no service
    waiter, pin = kgs[-1], (["--host", "m0"] if remote else [])
    stamp = 'sleep 0.3; date +%s.%N > "$0"'
    out = []
    try:
        for i in range(rounds):
            end = root / f"end{i}"
            waiter.run("delegate", f"w{i}", *pin, "--", "sh", "-c", stamp, str(end))
            waiter.run("wait", f"w{i}")
            out.append((time.time() - float(end.read_text())) * 1000)
    finally:
        for kg in kgs:
            kg.stop()
    return out


@contextmanager
def scratch(admin: str, cluster: bool) -> Iterator[tuple[Path, str | None]]:
    """A temporary directory for the homes, and for a cluster scenario a database of its own
    (its URL; None for the file store), both gone afterwards."""
    db = Db(admin) if cluster else None
    try:
        with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
            yield Path(tmp), db.url if db else None
    finally:
        if db:
            db.drop()


def measure(admin: str, quick: bool) -> dict:
    n = 60 if quick else 300
    out: dict = {"n": n}
    with scratch(admin, True) as (tmp, url):
        out["admission_file"] = admission(tmp / "a", None)
        out["admission_cluster"] = admission(tmp / "b", url)
    for label, cluster, remote in (("wait_file", False, False), ("wait_cluster", True, False),
                                   ("wait_cluster_remote", True, True)):
        with scratch(admin, cluster) as (tmp, url):
            out[label] = wait_latency(tmp, url, remote)
    for label, cluster, slots, count in (("promotion_file", False, [1], 30), ("promotion_cluster", True, [1], 30),
                                         ("drain_file_1x6", False, [6], n), ("drain_cluster_1x6", True, [6], n),
                                         ("drain_cluster_3x2", True, [2, 2, 2], n)):
        with scratch(admin, cluster) as (tmp, url):
            out[label] = run_drain(tmp, url, slots, count)
    return out


SCALE_WORKER = r"""
import json, os, statistics, sys, time
from datetime import datetime, timezone
from kugetsu.core import admission as admission_rules  # the name `admission` is this bench's scenario
from kugetsu.store.postgres import PgStore
from kugetsu.config.model import Config
from kugetsu.core import lifecycle
from kugetsu.core.models import Task, TaskState

url, n = sys.argv[1], int(sys.argv[2])
now = datetime.now(timezone.utc)
cfg = Config(max_agents=4, max_queue=10**6, history_limit=10**6)

STAT = min if os.environ.get("KGBENCH_STAT") == "min" else statistics.median

def med(f, k):
    xs = []
    for _ in range(k):
        t = time.perf_counter(); f(); xs.append((time.perf_counter() - t) * 1000)
    return round(STAT(xs), 2)

a, b = PgStore(url), PgStore(url)
with a.transaction() as txn:
    ix = txn.index
    for i in range(1, n + 201):
        t = Task(id=i, name=f"t{i}", command=["claude", "-p", "a prompt of some length " * 4], cwd="/work/repo",
                 created_at=now, expires_at=now, token="0" * 32)
        if i <= 200:
            t.state, t.finished_at = TaskState.SUCCEEDED, now
            ix.finished.append(t)
        else:
            ix.queued.append(t)
    ix.next_id = n + 201
a.read(); b.read()
flip = iter(range(10**6))

def change(store):
    with store.transaction() as txn:
        txn.index.queued[next(flip) % n].priority = "high" if next(flip) % 2 else "low"

def other():
    change(b)
    change(a)

def fresh():
    c = PgStore(url); c.read(); c.close()

def admit():
    with a.transaction() as txn:
        admission_rules.admit(txn.index, cfg, txn.now, admission_rules.Request(cwd="/", command=["true"]))

def tick(store):
    with store.transaction() as txn:
        ix = txn.index
        if ix.active:
            txn.emit(lifecycle.finish(ix, ix.active[0], txn.now, 0))
            txn.archive.extend(lifecycle.trim_history(ix, 200))
        txn.emit(lifecycle.start(ix, ix.queued[0], txn.now))

def after_tick():  # b ticks (not timed), then a reads what it did: the read after the NOTIFY
    tick(b)
    t = time.perf_counter(); a.read()
    return (time.perf_counter() - t) * 1000

out = {"commit": med(lambda: change(a), 15), "other": med(other, 9), "read": med(fresh, 5), "admit": med(admit, 9)}
out["other"] = round(out["other"] - out["commit"], 2)  # b's commit is not a's cost
a.read()
out["tick"] = med(lambda: tick(a), 9)
# admission's own rules on the same queue, outside any store (the share of `admit` that is not the store's)
import msgspec
from kugetsu.core.models import Index
alone = msgspec.json.decode(msgspec.json.encode(a.read()), type=Index)
out["admit_rules"] = med(lambda: admission_rules.admit(alone, cfg, now, admission_rules.Request(cwd="/", command=["true"])), 9)
out["tick_read"] = round(STAT([after_tick() for _ in range(9)]), 2)
print(json.dumps(out))
a.close(); b.close()
"""


KINDS = ("commit", "other", "read", "admit", "admit_rules", "tick", "tick_read")


def scale(admin: str, sizes: list[int], trees: dict[str, Path]) -> dict:
    """The --scale series: {tree label: {size: {what: ms}}}; the trees take turns per size."""
    out: dict = {label: {} for label in trees}
    for n in sizes:
        for label, tree in trees.items():
            db = Db(admin)
            try:
                # cwd: the tree itself (`python -c` puts the working directory first on sys.path).
                r = subprocess.run([PY, "-c", SCALE_WORKER, db.url, str(n)], capture_output=True, text=True, cwd=tree,
                                   env={**os.environ, "PYTHONPATH": str(tree)}, timeout=1800)
                if r.returncode:
                    raise SystemExit(f"{label} at {n}: {r.stderr[-2000:]}")
                out[label][n] = json.loads(r.stdout.strip().splitlines()[-1])
            finally:
                db.drop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a drain of 60 instead of 300")
    ap.add_argument("--pg", default="postgresql://127.0.0.1:5432/postgres", help="a server where a database may be made")
    ap.add_argument("--scale", action="store_true", help="the store's own cost by queue length (see above)")
    ap.add_argument("--sizes", default="100,1000,5000,20000")
    ap.add_argument("--before", type=Path, help="an older checkout to measure beside this one (--scale)")
    ap.add_argument("--min", action="store_true", help="--scale: the fastest of each series, not the median"
                    " (on a machine others load, the median measures them)")
    args = ap.parse_args()
    if args.scale:
        trees = {"this": Path(__file__).resolve().parents[2]}
        if args.before:
            trees = {"before": args.before.resolve(), **trees}
        sizes = [int(x) for x in args.sizes.split(",")]
        if args.min:
            os.environ["KGBENCH_STAT"] = "min"
        res = scale(args.pg, sizes, trees)
        if args.json:
            print(json.dumps(res, indent=1))
            return 0
        print(f"{'ms (min)' if args.min else 'ms (median)':<17}" + "".join(f"{label + ' ' + what:>17}" for what in KINDS for label in trees))
        for n in sizes:
            print(f"{n:>7} queued  " + "".join(f"{res[label][n].get(what, float('nan')):>17.1f}" for what in KINDS
                                                for label in trees))
        if len(sizes) > 1:
            lo, hi = sizes[0], sizes[-1]
            print(f"{hi} / {lo}      " + "".join(f"{res[label][hi].get(what, 0) / max(res[label][lo].get(what, 0), 1e-9):>16.1f}x"
                                                 for what in KINDS for label in trees))
        return 0
    res = measure(args.pg, args.quick)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"admission, tasks/s      file {res['admission_file']:7.1f}   cluster {res['admission_cluster']:7.1f}"
          f"   ratio {res['admission_cluster'] / res['admission_file']:.2f}")
    for kind in ("file", "cluster"):
        g = res[f"promotion_{kind}"]["gaps_ms"]
        print(f"promotion {kind:<8}     p50 {statistics.median(g):6.1f} ms   p95 {pct(g, 95):6.1f} ms")
    for label, where in (("wait_file", "file"), ("wait_cluster", "cluster, same machine"),
                         ("wait_cluster_remote", "cluster, another machine")):
        print(f"wait returns after the end, {where:<24} median {statistics.median(res[label]):6.1f} ms"
              f"   max {max(res[label]):6.1f} ms")
    base = res["drain_file_1x6"]["drain_s"]
    for label in ("drain_file_1x6", "drain_cluster_1x6", "drain_cluster_3x2"):
        d = res[label]["drain_s"]
        print(f"{label:<22} {res['n']} tasks {d:6.2f} s   vs file 1x6 {d / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
