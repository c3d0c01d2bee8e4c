#!/usr/bin/env python3
"""kugetsu benchmark, side by side with task-spooler (`tsp`) in the same run.

    python tools/bench/run.py [--json] [--quick] [--rounds N]

Every figure that has a peer is measured for both in the same run, interleaved, and the
table gives the ratio kugetsu / peer (lower is better for times, higher for rates). The
machine is assumed noisy: read the ratios, not the absolute numbers.

What is measured (issue 2 budgets in brackets):
  drain        100 trivial commands queued behind a blocker at one slot; from the
               blocker's own end timestamp to the last task's own end timestamp
               [kugetsu / tsp <= 1.0]
  promotion    exit of one task to start of the next, from the tasks' timestamps
               [p95 <= 50 ms]
  admission    20 processes delegating 5 tasks each at once, tasks/s
  CLI latency  delegate, queue --json, capacity --json with 10 / 1,000 / 10,000 queued tasks
               (and up to 500 finished), beside a bare `python -c pass` [median <= 150 ms at
               1,000; issue 14: <= 3x python at 1,000 queued, <= 6x at 10,000]
  footprint    index bytes per task; service RSS and CPU idle and while draining
               [idle < 1% of one CPU, <= 60 MB RSS]
  deadlines    lateness of queue expiries (1,000 in a 2,000-task queue, in bursts) and of
               run timeouts, from kugetsu's own records (tools/bench/deadlines.py)
               [max <= 50 ms]
  lock hold    how long the service holds the index lock per transaction during a drain of
               worktree tasks (tools/bench/lockhold.py): the longest a CLI command can wait

kugetsu runs from this checkout (PYTHONPATH = repo root) with the current interpreter;
each scenario has its own throw-away KUGETSU_HOME. task-spooler runs with a private
TS_SOCKET and TMPDIR, and its server is killed afterwards: a user's own tsp queue is
never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from kugetsu.core.models import Index, Run, Task, TaskState  # noqa: E402
from kugetsu.paths import Home  # noqa: E402
from kugetsu.store.protocol import encode_index  # noqa: E402

# The helpers the parts share live in common.py (run.py imports its parts; they import common).
from common import (BLOCKER_SCRIPT, PY, TASK_SCRIPT, Kg, Sampler, exit_on_signals, finish, pct, read_stamps,  # noqa: E402,F401
                    release, track, wait_until)


# ---- task-spooler side -------------------------------------------------------------------


class Tsp:
    def __init__(self, root: Path):
        self.dir = root / "tsp"
        self.dir.mkdir()
        self.env = {**os.environ, "TS_SOCKET": str(self.dir / "socket"), "TMPDIR": str(self.dir)}
        self.env.pop("TS_MAXCONN", None)
        track("TS_SOCKET", self.env["TS_SOCKET"])

    def run(self, *args: str) -> str:
        r = subprocess.run(["tsp", *args], env=self.env, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"tsp {' '.join(args)} -> {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def server_pid(self) -> int:
        sock = self.env["TS_SOCKET"]
        for p in psutil.process_iter(["name", "pid"]):
            try:
                if p.info["name"] in ("tsp", "ts") and p.environ().get("TS_SOCKET") == sock:
                    if any(c.laddr == sock for c in p.net_connections("unix")):
                        return p.pid
            except psutil.Error:
                continue
        raise RuntimeError("tsp server not found")

    def stop(self) -> None:
        subprocess.run(["tsp", "-K"], env=self.env, capture_output=True, timeout=30)
        # `tsp -K` ends the server, not its running jobs (a blocker polling for a file that will
        # never come would spin forever): they carry our TS_SOCKET.
        finish("TS_SOCKET", self.env["TS_SOCKET"])


# ---- scenarios ---------------------------------------------------------------------------


def drain_kugetsu(n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        root = Path(tmp)
        kg = Kg(root, max_agents=1, max_queue=n + 10)
        stamps, fifo, bend = root / "stamps", root / "fifo", root / "blocker_end"
        os.mkfifo(fifo)
        pid = kg.start_service()
        try:
            kg.delegate("blocker", ["sh", "-c", BLOCKER_SCRIPT, str(fifo), str(bend)])
            # Admission is not what this scenario measures: delegate from 4 threads.
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: kg.delegate(f"t{i}", ["sh", "-c", TASK_SCRIPT, str(stamps), str(i)]), range(n)))
            assert len(kg.index()["queued"]) == n, "tasks did not queue behind the blocker"
            with Sampler(pid) as s:
                release(fifo)
                wait_until(lambda: len(read_stamps(stamps)[1]) == n, 120, "kugetsu drain")
            wait_until(lambda: not kg.index()["active"] and not kg.index()["queued"], 30, "kugetsu index to settle")
            bad = [t for t in kg.index()["finished"] if t["state"] != "succeeded"]
            assert not bad, f"tasks did not succeed: {bad[:1]}"
            return _drain_result(stamps, bend, n, s)
        finally:
            kg.stop()


def drain_tsp(n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        root = Path(tmp)
        ts = Tsp(root)
        stamps, fifo, bend = root / "stamps", root / "fifo", root / "blocker_end"
        os.mkfifo(fifo)
        try:
            ts.run("-S", "1")
            pid = ts.server_pid()
            ts.run("sh", "-c", BLOCKER_SCRIPT, str(fifo), str(bend))
            for i in range(n):
                ts.run("sh", "-c", TASK_SCRIPT, str(stamps), str(i))
            with Sampler(pid) as s:
                release(fifo)
                wait_until(lambda: len(read_stamps(stamps)[1]) == n, 120, "tsp drain")
            return _drain_result(stamps, bend, n, s)
        finally:
            ts.stop()


def _drain_result(stamps: Path, bend: Path, n: int, s: Sampler) -> dict:
    starts, ends = read_stamps(stamps)
    wait_until(lambda: bend.exists() and bend.read_text().strip(), 5, "blocker end stamp")
    blocker_end = float(bend.read_text())
    order = sorted(starts, key=starts.get)
    gaps = [starts[order[0]] - blocker_end] + [starts[b] - ends[a] for a, b in zip(order, order[1:])]
    return {
        "drain_s": max(ends.values()) - blocker_end,
        "gaps_ms": [g * 1000 for g in gaps],
        "server_cpu_share": s.cpu_share,
        "server_peak_rss": s.peak_rss,
    }


def delegating(kg: Kg, procs: int, each: int) -> float:
    """`procs` processes at once, each running `kugetsu delegate -- true` `each` times one
    after the other; the wall time (tools/bench/mcp.py compares MCP with it)."""
    script = " ".join(f"{PY} -m kugetsu delegate -- true >/dev/null || exit 1;" for _ in range(each))
    t0 = time.monotonic()
    ps = [subprocess.Popen(["sh", "-c", script], env=kg.env) for _ in range(procs)]
    codes = [p.wait() for p in ps]
    wall = time.monotonic() - t0
    assert codes == [0] * procs, f"delegates failed: {codes}"
    return wall


def admission_kugetsu(procs: int, each: int) -> float:
    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        root = Path(tmp)
        kg = Kg(root, max_agents=1, max_queue=procs * each + 10)
        fifo = root / "fifo"
        os.mkfifo(fifo)
        kg.start_service()
        try:
            kg.delegate("blocker", ["sh", "-c", BLOCKER_SCRIPT, str(fifo), str(root / "bend")])
            wall = delegating(kg, procs, each)
            idx = kg.index()
            ids = [t["id"] for t in idx["queued"]]
            assert len(ids) == len(set(ids)) == procs * each, "admission lost or duplicated tasks"
            release(fifo)
            return procs * each / wall
        finally:
            kg.stop()


def admission_tsp(procs: int, each: int) -> float:
    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        root = Path(tmp)
        ts = Tsp(root)
        fifo = root / "fifo"
        os.mkfifo(fifo)
        try:
            ts.run("-S", "1")
            ts.run("sh", "-c", BLOCKER_SCRIPT, str(fifo), str(root / "bend"))
            script = " ".join("tsp true >/dev/null || exit 1;" for _ in range(each))
            t0 = time.monotonic()
            ps = [subprocess.Popen(["sh", "-c", script], env=ts.env) for _ in range(procs)]
            codes = [p.wait() for p in ps]
            wall = time.monotonic() - t0
            assert codes == [0] * procs, f"tsp enqueues failed: {codes}"
            queued = [l for l in ts.run("-l").splitlines()[1:] if " queued " in l]
            assert len(queued) == procs * each, f"tsp queued {len(queued)}"
            release(fifo)
            return procs * each / wall
        finally:
            ts.stop()


def build_index(home: Home, n: int, holder: psutil.Process) -> int:
    """An index with n queued tasks (issue 14's figure), one running (a real process) and,
    before them, min(500, n/2) finished ones (history_limit's worth, as a busy home has).
    Written directly, as kugetsu itself encodes it."""
    now = datetime.now(timezone.utc)
    tasks: list[Task] = []
    finished_n = min(500, n // 2)
    total = finished_n + 1 + n
    for i in range(1, total + 1):
        tasks.append(Task(
            id=i, name=f"issue-{i}", command=["opencode", "run", f"Fix issue {i}: the login form rejects valid e-mail addresses"],
            cwd="/home/user/project", created_at=now - timedelta(seconds=total - i), agent="opencode", source="pm",
            expires_at=now + timedelta(hours=24), log=str(home.log(i)),
            prompt=f"Fix issue {i}: the login form rejects valid e-mail addresses",
        ))
    index = Index(next_id=total + 1)
    for t in tasks[:finished_n]:
        t.state, t.started_at, t.finished_at, t.exit_code, t.run = TaskState.SUCCEEDED, now, now, 0, Run(pid=4242)
        index.finished.append(t)
    run = tasks[finished_n]
    run.state, run.started_at, run.run = TaskState.RUNNING, now, Run(slot=1)
    run.run.pid, run.run.pid_start = holder.pid, int(open(f"/proc/{holder.pid}/stat").read().rsplit(")", 1)[1].split()[19])
    index.active.append(run)
    index.queued = tasks[finished_n + 1 :]
    home.ensure()
    home.index.write_bytes(encode_index(index))
    return total


def timed(argv: list[str], env: dict, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        out.append((time.perf_counter() - t0) * 1000)
        if r.returncode != 0:
            raise RuntimeError(f"{argv[3:]} -> {r.returncode}: {r.stderr.decode().strip()}")
    return out


def cli_latency(sizes: list[int], reps: int) -> dict:
    """No service (autostart off): the figure is the CLI's own cost, as a delegator feels it."""
    results: dict = {}
    holder = subprocess.Popen(["sleep", "3600"])
    try:
        for n in sizes:
            with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
                kg = Kg(Path(tmp), max_agents=1, max_queue=n + 10 * reps + 10, autostart=False)
                total = build_index(kg.home, n, psutil.Process(holder.pid))
                size = kg.home.index.stat().st_size
                r_n = max(5, reps // 2) if n >= 10000 else reps
                bare, dele, queue, cap = [], [], [], []
                for _ in range(r_n):  # interleaved, so noise hits all four alike
                    bare += timed([PY, "-c", "pass"], kg.env, 1)
                    dele += timed(kg.argv("delegate", "--", "true"), kg.env, 1)
                    queue += timed(kg.argv("queue", "--json"), kg.env, 1)
                    cap += timed(kg.argv("capacity", "--json"), kg.env, 1)
                results[n] = {"bytes_per_task": size / total, "python": bare, "delegate": dele, "queue": queue, "capacity": cap}
    finally:
        holder.kill()
        holder.wait()
    return results


def idle_footprint(seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        root = Path(tmp)
        kg = Kg(root, max_agents=3)
        kg.delegate("warm", ["true"])  # autostarts the service, which runs one task
        wait_until(lambda: kg.home.service_pid.exists() and not kg.index()["active"], 20, "service idle")
        ts = Tsp(root)
        ts.run("true")
        ts.run("-w")
        try:
            kpid, tpid = kg.service_pid(), ts.server_pid()
            time.sleep(1.0)
            with Sampler(kpid, every=0.5) as ks, Sampler(tpid, every=0.5) as tsamp:
                time.sleep(seconds)
            return {"kugetsu": (ks.cpu_share, ks.peak_rss), "tsp": (tsamp.cpu_share, tsamp.peak_rss)}
        finally:
            kg.stop()
            ts.stop()


# ---- the table ---------------------------------------------------------------------------


def machine() -> dict:
    model = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    tsp_version = ""
    if shutil.which("tsp"):
        out = subprocess.run(["tsp", "-V"], capture_output=True, text=True)
        tsp_version = (out.stdout or out.stderr).strip().splitlines()[0].split(" - ")[0]
    return {
        "nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
        "kernel": platform.release(), "mem_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg": os.getloadavg(), "tsp": tsp_version,
    }


def compile_package() -> None:
    """Write kugetsu's .pyc files, as `pip install` does. Without them (e.g. with
    PYTHONDONTWRITEBYTECODE=1 in the environment, as on our CI machines) every CLI call
    recompiles the whole package from source, which adds ~50 ms a call."""
    import compileall

    compileall.compile_dir(str(REPO / "kugetsu"), quiet=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ap.add_argument("--quick", action="store_true", help="fewer tasks and repetitions (a smoke run, noisier)")
    ap.add_argument("--rounds", type=int, help="drain rounds per side (default 3, quick 1)")
    args = ap.parse_args()
    exit_on_signals()
    have_tsp = shutil.which("tsp") is not None
    n_drain = 30 if args.quick else 100
    rounds = args.rounds or (1 if args.quick else 3)
    reps = 6 if args.quick else 20
    sizes = [10, 1000] if args.quick else [10, 1000, 10000]
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    compile_package()

    res: dict = {"machine": machine(), "drain_tasks": n_drain, "rounds": rounds}
    kd, td = [], []
    for r in range(rounds):  # interleaved: kugetsu, tsp, kugetsu, tsp, ...
        log(f"drain round {r + 1}/{rounds}: kugetsu")
        kd.append(drain_kugetsu(n_drain))
        if have_tsp:
            log(f"drain round {r + 1}/{rounds}: tsp")
            td.append(drain_tsp(n_drain))
    log("admission")
    ka = [admission_kugetsu(20, 5) for _ in range(1)]
    ta = [admission_tsp(20, 5) for _ in range(1)] if have_tsp else []
    log("CLI latency (" + ", ".join(map(str, sizes)) + " tasks)")
    cli = cli_latency(sizes, reps)
    log("idle footprint")
    idle = idle_footprint(5 if args.quick else 15) if have_tsp else None
    log("deadlines")
    import deadlines  # tools/bench/deadlines.py (this script's directory is on sys.path)

    late = deadlines.measure(400, 5) if args.quick else deadlines.measure()
    log("index lock holds (worktree drain)")
    import lockhold  # tools/bench/lockhold.py

    holds = lockhold.measure(12 if args.quick else 40)

    rows: list[tuple[str, float | None, float | None, str, str]] = []  # name, kugetsu, peer, unit, budget

    def drain_fig(runs: list[dict]) -> float:
        return statistics.median(d["drain_s"] for d in runs) if runs else float("nan")

    def gaps(runs: list[dict]) -> list[float]:
        return [g for d in runs for g in d["gaps_ms"][1:]]  # task-to-task promotions

    k_drain, t_drain = drain_fig(kd), drain_fig(td)
    rows.append((f"drain {n_drain} tasks, 1 slot (median of {rounds})", k_drain * 1000, t_drain * 1000 if td else None, "ms", "ratio <= 1.0"))
    rows.append(("  per task", k_drain * 1000 / n_drain, t_drain * 1000 / n_drain if td else None, "ms", ""))
    kg_gaps, ts_gaps = gaps(kd), gaps(td)
    rows.append(("promotion p50", pct(kg_gaps, 50), pct(ts_gaps, 50) if td else None, "ms", ""))
    rows.append(("promotion p95", pct(kg_gaps, 95), pct(ts_gaps, 95) if td else None, "ms", "p95 <= 50 ms"))
    rows.append(("promotion max", max(kg_gaps), max(ts_gaps) if td else None, "ms", ""))
    rows.append(("first start after blocker ends (median)", statistics.median(d["gaps_ms"][0] for d in kd),
                 statistics.median(d["gaps_ms"][0] for d in td) if td else None, "ms", ""))
    rows.append(("admission, 20 procs x 5 (tasks/s)", statistics.median(ka), statistics.median(ta) if ta else None, "/s", "higher is better"))
    for n in sizes:
        c = cli[n]
        py = statistics.median(c["python"])
        for cmd in ("delegate", "queue", "capacity"):
            label = f"{cmd}{' --json' if cmd != 'delegate' else ''} @ {n:,} queued"
            budget = {1000: "ratio <= 3", 10000: "ratio <= 6"}.get(n, "")
            rows.append((f"{label} median", statistics.median(c[cmd]), py, "ms", budget))
            rows.append((f"{label} p95", pct(c[cmd], 95), pct(c["python"], 95), "ms", ""))
    for n in sizes:
        rows.append((f"index bytes per task @ {n:,} queued", cli[n]["bytes_per_task"], None, "B", ""))
    if idle:
        rows.append(("service CPU idle (% of one core)", idle["kugetsu"][0] * 100, idle["tsp"][0] * 100, "%", "< 1%"))
        rows.append(("service RSS idle", idle["kugetsu"][1] / 2**20, idle["tsp"][1] / 2**20, "MB", "<= 60 MB"))
    rows.append(("service CPU while draining (% of one core)", statistics.median(d["server_cpu_share"] for d in kd) * 100,
                 statistics.median(d["server_cpu_share"] for d in td) * 100 if td else None, "%", ""))
    rows.append(("service peak RSS while draining", max(d["server_peak_rss"] for d in kd) / 2**20,
                 max(d["server_peak_rss"] for d in td) / 2**20 if td else None, "MB", ""))

    for name, value in deadlines.rows(late):
        rows.append((name, value, None, "ms", "max <= 50 ms" if "max" in name else ""))
    for name, value in lockhold.rows(holds):
        rows.append((name, value, None, "ms", ""))

    verdicts = {
        "drain_ratio_le_1": (k_drain / t_drain <= 1.0) if td else None,
        "promotion_p95_le_50ms": pct(kg_gaps, 95) <= 50,
        "cli_median_le_150ms_at_1000": all(statistics.median(cli[1000][c]) <= 150 for c in ("delegate", "queue", "capacity")),
        "idle_cpu_lt_1pct": idle["kugetsu"][0] < 0.01 if idle else None,
        "idle_rss_le_60mb": idle["kugetsu"][1] <= 60 * 2**20 if idle else None,
    }
    res["rows"] = [
        {"metric": m, "kugetsu": k, "peer": p, "ratio": (k / p if p else None), "unit": u, "budget": b}
        for m, k, p, u, b in rows
    ]
    hardening = {"deadline_late_max_le_50ms": max(late["expiry_ms"] + late["timeout_ms"]) <= 50}

    def cli_ratio(n: int, most: float) -> bool | None:
        if n not in cli:
            return None
        py = statistics.median(cli[n]["python"])
        return all(statistics.median(cli[n][c]) <= most * py for c in ("delegate", "queue", "capacity"))

    inside = {
        "drain_ratio_le_1": verdicts["drain_ratio_le_1"],
        "cli_le_3x_python_at_1000_queued": cli_ratio(1000, 3),
        "cli_le_6x_python_at_10000_queued": cli_ratio(10000, 6),
    }
    res["budgets"] = verdicts | hardening | {f"issue14_{k}": v for k, v in inside.items()}
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    m = res["machine"]
    print(f"machine: {m['nproc']} cores, {m['cpu']}, {m['mem_gb']} GB, Linux {m['kernel']}, Python {m['python']},"
          f" {m['tsp'] or 'tsp not installed'}; load avg at start {m['load_avg'][0]:.2f}")
    print("peer: task-spooler (tsp) for drain, promotion, admission and the service rows;"
          " a bare `python -c pass` for CLI latency\n")
    header = ("metric", "kugetsu", "peer", "ratio", "budget")
    table = [header]
    for r in res["rows"]:
        fmt = (lambda v: "-" if v is None else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"))
        table.append((r["metric"], f"{fmt(r['kugetsu'])} {r['unit']}", "-" if r["peer"] is None else f"{fmt(r['peer'])} {r['unit']}",
                      "-" if r["ratio"] is None else f"{r['ratio']:.2f}", r["budget"]))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) if j == 0 or j == 4 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    verdict = (lambda items: ", ".join(f"{k}: {'met' if v else 'MISSED' if v is not None else 'n/a'}" for k, v in items))
    print("\nissue-2 budgets: " + verdict(verdicts.items()))
    print("hardening budgets: " + verdict(hardening.items()))
    print("issue-14 budgets: " + verdict(inside.items()))
    if not have_tsp:
        print("note: task-spooler (tsp) is not installed: peer figures skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
