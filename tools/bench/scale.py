#!/usr/bin/env python3
"""Cost against the queue's depth, side by side with task-spooler (issue 31): one table, each
row at queue depths 100, 1,000, 10,000 and 50,000, with the issue's budgets and whether they
are met.

    python tools/bench/scale.py [--sizes 100,1000,10000,50000] [--quick] [--json] [--only drain,cli,...]

drain      N trivial tasks queued behind one blocker per slot; from the moment the blockers
           are let go (kugetsu: once its service's warm wrappers are up, as tsp's waiting
           clients are: depth.warm_settled) to the end stamp of the C-th task (C = --cap, or
           N if smaller: at 50,000 a whole drain takes hours, and what grows with the queue
           shows per task),
           through S slots, kugetsu and `tsp -S S` in interleaved rounds (kugetsu, tsp, ...).
           Medians; time per task; ratio kugetsu / tsp [<= 1.5]; kugetsu's time per task at
           the deepest queue against at the shallowest, over the same first tasks (as many
           as the shallowest drained) [no worse: <= 1.1, noise allowed].
           tsp holds ~900 queued jobs at most (a connection each): deeper, it is fed by a
           thread while it drains, so its depth stays ~900.
promotion  from the same 1-slot drains: one task's end stamp to the next one's start stamp,
           p50 [<= tsp's, at ~1,000 deep: the issue's depth 900] and p95 [<= 10 ms], while
           the queue is N deep (tsp: at most ~900).
cli        `delegate`, `capacity --json`, `queue --json` at N queued (no service), beside a bare
           `python -c pass`, interleaved (run.py's cli_latency) [delegate, capacity <= 3x]; then
           `delegate`, `capacity --json` and `queue --json --limit 20` with the service running (through it:
           frontends/cli/thin.py), beside python and the same kept in the CLI's process
           (depth.cli_served) [<= 3x].
service    kugetsu's service with N queued behind one running task: start-up (`serve --detach`
           to the task's own start stamp; the median of 3 starts of the same home) [< 0.5 s], idle CPU [< 1 % of a core], RSS
           [< 100 MB]; its warm wrappers (descendants other than the task: count, PSS)
           [<= 1: the next promotion's; the home's last runs took 10 minutes each]. Beside a tsp server holding min(N, 900) jobs and its
           waiting clients (a process per queued job).
deadlines  at --deadline-queue queued (10,000): the latest queue expiry and run timeout
           (deadlines.py) [<= 50 ms].
admission  one client, tasks/s: MCP, one session, sequential calls [>= 1,000/s]; the CLI, one
           process after the other; tsp; (mcp.py's batch path when it has one).
store      the file store's transactions in-process at 100 / 1,000 / 5,000 / 20,000 queued:
           a change, an admission, a fresh read (ms) [flat: at the largest <= 2x the smallest].

kugetsu's queues are written straight into index.json while no service runs (admission is
measured on its own). Everything a scenario starts is ended when it ends, Ctrl-C included.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TASK_SCRIPT, exit_on_signals, pct, read_stamps, wait_until  # noqa: E402
from run import cli_latency, compile_package, machine  # noqa: E402

import deadlines  # noqa: E402
import depth  # noqa: E402
from depth import TSP_FITS, blockers_up, queue_home  # noqa: E402

PARTS = ("store", "cli", "service", "admission", "deadlines", "drain")


def _go(go: Path) -> float:
    at = time.time()
    go.touch()
    return at


def _wait_ends(stamps: Path, count: int, timeout: float, what: str) -> list[float]:
    """The first `count` end stamps, sorted; polled every 50 ms (the figures are the tasks' own
    stamps, not this poll's)."""
    deadline = time.monotonic() + timeout
    while True:
        ends = read_stamps(stamps)[1]
        if len(ends) >= count:
            return sorted(ends.values())[:count]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what} ({len(ends)} of {count})")
        time.sleep(0.05)


def _result(stamps: Path, t0: float, count: int) -> dict:
    ends = _wait_ends(stamps, count, 5, "the stamps")
    starts, by_tag = read_stamps(stamps)
    order = sorted(starts, key=starts.get)[:count]
    gaps = [starts[b] - by_tag[a] for a, b in zip(order, order[1:]) if a in by_tag]
    # ends_s: each end from the clock's start, for the same first tasks at every depth (table)
    return {"drain_s": ends[-1] - t0, "tasks": count, "gaps_ms": [g * 1000 for g in gaps],
            "ends_s": [round(e - t0, 6) for e in ends]}


def drain_kugetsu(n: int, slots: int, cap: int) -> dict:
    count = min(n, cap)
    with tempfile.TemporaryDirectory(prefix="kgscale-") as tmp:
        root = Path(tmp)
        stamps, go, up = root / "stamps", root / "go", root / "up"
        kg = queue_home(root, n, slots, go, up, task=["sh", "-c", TASK_SCRIPT, str(stamps)])
        try:
            kg.run("serve", "--detach")
            wait_until(lambda: blockers_up(up, slots), 600, "the blockers to start")
            depth.warm_settled(kg)  # as tsp's waiting clients are, before its clock starts
            t0 = _go(go)
            _wait_ends(stamps, count, 3600, f"kugetsu's drain of {count}")
            return _result(stamps, t0, count)
        finally:
            go.touch()
            kg.stop(cancel=False)


def drain_tsp(n: int, slots: int, cap: int) -> dict:
    count = min(n, cap)
    with depth.tsp_blocked(slots) as (ts, root, go, _):
        stamps = root / "stamps"
        # tsp holds a connection per queued job and cannot hold more than about 1,000 (its
        # compile-time MAXCONN): what does not fit is fed by a thread while it drains, each
        # client blocking until a connection frees (tsp's own back-pressure).
        fits = min(n, TSP_FITS - slots)
        for i in range(fits):
            ts.run("sh", "-c", TASK_SCRIPT, str(stamps), str(i))
        feeder = threading.Thread(target=lambda: [ts.run("sh", "-c", TASK_SCRIPT, str(stamps), str(i))
                                                  for i in range(fits, count)], daemon=True)
        feeder.start()
        t0 = _go(go)
        _wait_ends(stamps, count, 3600, f"tsp's drain of {count}")
        feeder.join(60)
        return _result(stamps, t0, count)


# ---- the series ----------------------------------------------------------------------------


def measure(args: argparse.Namespace, log, res: dict) -> dict:
    """Fills `res` part by part; `args.save`, when given, is rewritten after each step, so that
    a run stopped half-way (50,000 takes long) still leaves its figures (see --table)."""
    res.update({"machine": machine(), "sizes": args.sizes, "cap": args.cap, "rounds": args.rounds,
                "deep_rounds": args.deep_rounds})

    def save() -> None:
        res["load_at_end"] = os.getloadavg()
        if args.save:
            args.save.write_text(json.dumps(res, indent=1))

    if "store" in args.only:
        res["store"] = {}
        for n in args.store_sizes:
            log(f"file store transactions at {n:,} queued")
            res["store"][n] = depth.file_store(n)
            save()
    if "cli" in args.only:
        log("CLI latency at " + ", ".join(f"{n:,}" for n in args.sizes))
        res["cli"] = cli_latency(args.sizes, args.cli_reps)
        save()
        log("CLI delegate with the service running at " + ", ".join(f"{n:,}" for n in args.sizes))
        res["cli_served"] = depth.cli_served(args.sizes, args.cli_reps)
        save()
    if "service" in args.only:
        res["service"] = {}
        for n in args.sizes:
            log(f"service idle at {n:,} queued: kugetsu, tsp")
            res["service"][n] = {"kugetsu": depth.service_idle(n, args.idle), "tsp": depth.tsp_idle(n, args.idle)}
            save()
    if "admission" in args.only:
        log("admission from one client: MCP, CLI, tsp")
        res["admission"] = depth.admission(args.mcp_tasks, args.cli_tasks)
        save()
    if "deadlines" in args.only:
        log(f"deadlines at {args.deadline_queue:,} queued")
        res["deadlines"] = deadlines.measure(args.deadline_queue, args.timed)
        save()
    if "drain" in args.only:
        res["drain"] = {}
        for n in args.sizes:
            for slots in args.slots:
                k: list[dict] = []
                t: list[dict] = []
                res["drain"][f"{n}x{slots}"] = {"tasks": n, "slots": slots, "kugetsu": k, "tsp": t}
                rounds = args.rounds if n < 10000 else args.deep_rounds
                for r in range(rounds):  # interleaved: a burst of load elsewhere falls on both
                    log(f"drain {min(n, args.cap):,} of {n:,} x {slots} slot(s), round {r + 1}/{rounds}")
                    k.append(drain_kugetsu(n, slots, args.cap))
                    t.append(drain_tsp(n, slots, args.cap))
                    save()
    save()
    return res


# ---- the table -----------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(res: dict) -> list[dict]:
    """Rows: metric, kugetsu, peer, unit, ratio, budget, met (True/False/None)."""
    rows: list[dict] = []

    def row(metric: str, k: float | None, peer: float | None, unit: str, budget: str = "", met: bool | None = None) -> None:
        ratio = k / peer if k is not None and peer else None
        rows.append({"metric": metric, "kugetsu": k, "peer": peer, "unit": unit, "ratio": ratio, "budget": budget, "met": met})

    drain = {key: d for key, d in res.get("drain", {}).items() if d["kugetsu"] and d["tsp"]}
    for key, d in drain.items():
        n, slots = d["tasks"], d["slots"]
        count = d["kugetsu"][0]["tasks"]
        k = _med([x["drain_s"] for x in d["kugetsu"]]) * 1000 / count
        t = _med([x["drain_s"] for x in d["tsp"]]) * 1000 / count
        what = f"drain @{n:,}, {slots} slot(s), ms/task" + (f" (first {count:,})" if count < n else "")
        row(what, k, t, "ms", "<= 1.5x tsp", k / t <= 1.5)
    for slots in sorted({d["slots"] for d in drain.values()}):
        by_depth = {d["tasks"]: d["kugetsu"] for d in drain.values() if d["slots"] == slots}
        if len(by_depth) < 2:
            continue
        lo, hi = min(by_depth), max(by_depth)
        # The same work at both depths: the first tasks of the deep drain, as many as the shallow
        # one drained (a drain of 1,000 costs more a task than one of 100 through tsp too, on
        # these machines: its logs and stamps pile up), so that what differs is the queue behind.
        first = by_depth[lo][0]["tasks"]
        if all("ends_s" in x and len(x["ends_s"]) >= first for x in by_depth[hi]):
            k = _med([x["ends_s"][first - 1] for x in by_depth[hi]]) * 1000 / first
            s = _med([x["drain_s"] for x in by_depth[lo]]) * 1000 / first
            row(f"drain per task, first {first:,} @{hi:,} vs @{lo:,}, {slots} slot(s)", k, s, "ms", "no worse: <= 1.1x",
                k <= 1.1 * s)
        per = {n: _med([x["drain_s"] / x["tasks"] for x in runs]) * 1000 for n, runs in by_depth.items()}
        row(f"  whole drains @{hi:,} vs @{lo:,} ({by_depth[hi][0]['tasks']:,} vs {by_depth[lo][0]['tasks']:,} tasks)",
            per[hi], per[lo], "ms", "", None)
    for key, d in drain.items():
        if d["slots"] != 1:
            continue
        n = d["tasks"]
        kg = [g for x in d["kugetsu"] for g in x["gaps_ms"]]
        ts = [g for x in d["tsp"] for g in x["gaps_ms"]]
        tsp_ok = n <= TSP_FITS + 100  # deeper, tsp's queue is not as deep: no peer
        p50t = pct(ts, 50) if tsp_ok else None
        # The p50 budget is at depth 900 (where tsp's queue is as deep as ours): the
        # deepest drain tsp can hold. Shallower, the two are side by side, without a budget.
        budgeted = tsp_ok and n > TSP_FITS // 2
        row(f"promotion p50 @{n:,}" + ("" if tsp_ok else " (tsp holds ~900: no peer)"), pct(kg, 50), p50t, "ms",
            "<= tsp" if budgeted else "", (pct(kg, 50) <= p50t) if budgeted else None)
        row(f"promotion p95 @{n:,}", pct(kg, 95), pct(ts, 95) if tsp_ok else None, "ms", "<= 10 ms", pct(kg, 95) <= 10)
    cli = res.get("cli", {})
    for n, c in cli.items():
        py = _med(c["python"])
        for cmd in ("delegate", "capacity", "queue"):
            k = _med(c[cmd])
            budget, met = ("<= 3x python", k <= 3 * py) if cmd != "queue" else ("bounded by output", None)
            row(f"CLI {cmd}{'' if cmd == 'delegate' else ' --json'} @{int(n):,} (vs python -c pass)", k, py, "ms", budget, met)
    for n, c in res.get("cli_served", {}).items():
        py = _med(c["python"])
        k = _med(c["delegate"])
        row(f"CLI delegate, service running @{int(n):,} (vs python -c pass)", k, py, "ms", "<= 3x python", k <= 3 * py)
        row(f"  kept in the CLI's process (KUGETSU_THIN=0) @{int(n):,}", _med(c["in_process"]), py, "ms", "", None)
        row(f"  the service's CPU per delegate @{int(n):,}", _med(c["service_cpu"]), None, "ms", "", None)
        if "capacity" in c:  # a kugetsu whose service answers `capacity` (frontends/cli/thin.py)
            k = _med(c["capacity"])
            row(f"CLI capacity --json, service running @{int(n):,}", k, py, "ms", "<= 3x python", k <= 3 * py)
            row(f"  kept in the CLI's process (KUGETSU_THIN=0) @{int(n):,}", _med(c["capacity_in_process"]), py, "ms",
                "", None)
        if "queue" in c:  # a kugetsu whose service answers `queue --limit`
            k = _med(c["queue"])
            row(f"CLI queue --json --limit 20, service running @{int(n):,}", k, py, "ms", "bounded: <= 3x python",
                k <= 3 * py)
            row(f"  kept in the CLI's process (KUGETSU_THIN=0) @{int(n):,}", _med(c["queue_in_process"]), py, "ms", "", None)
    for n, s in res.get("service", {}).items():
        k, t = s["kugetsu"], s["tsp"]
        n = int(n)
        runs = k.get("start_runs_s", [k["start_s"]])
        row(f"service start-up @{n:,}, median of {len(runs)} ({min(runs) * 1000:.0f}-{max(runs) * 1000:.0f}) (tsp: empty)",
            k["start_s"] * 1000, t["start_s"] * 1000, "ms", "< 500 ms", k["start_s"] < 0.5)
        row(f"service idle CPU @{n:,} (tsp @{t['queued']:,})", k["cpu_share"] * 100, t["cpu_share"] * 100, "%", "~0: < 1 %",
            k["cpu_share"] < 0.01)
        row(f"service RSS @{n:,}", k["rss"] / 2**20, t["rss"] / 2**20, "MB", "< 100 MB", k["rss"] < 100 * 2**20)
        row(f"warm wrappers @{n:,}, count (tsp: waiting clients)", k["wrappers"], t["wrappers"], "", "<= 1", k["wrappers"] <= 1)
        row(f"warm wrappers @{n:,}, PSS (RSS {k['wrappers_rss'] / 2**20:.0f} MB)", k["wrappers_pss"] / 2**20,
            t["wrappers_pss"] / 2**20, "MB")
    if "deadlines" in res:
        d = res["deadlines"]
        for kind, key in (("expiry", "expiry_ms"), ("run timeout", "timeout_ms")):
            late = max(d[key])
            row(f"{kind} lateness max @{d['queue']:,} queued ({len(d[key]):,})", late, None, "ms", "<= 50 ms", late <= 50)
    if "admission" in res:
        a = res["admission"]
        row("admission, one client, MCP (tasks/s)", a["mcp"], a["tsp"], "/s", ">= 1,000/s", a["mcp"] >= 1000)
        if "mcp_batch" in a:
            row("admission, one client, MCP batch of 100 (tasks/s)", a["mcp_batch"], a["tsp"], "/s", ">= 1,000/s",
                a["mcp_batch"] >= 1000)
        if "mcp_32_sessions" in a and "mcp_1_session_http" in a:
            # Against one session of the same transport (HTTP costs the SDK more a call than stdio);
            # the 32 clients run in this process, on the server's 2 cores: collapse shows in the
            # server's own CPU a task, which group commit should hold or lower.
            row("admission, MCP over HTTP, 32 sessions (vs one) (tasks/s)", a["mcp_32_sessions"],
                a["mcp_1_session_http"], "/s")
            srv, clients = a["mcp_http_server_ms"], a["mcp_http_clients_ms"]
            if srv.get("1") and srv.get("32"):
                row("  the server's CPU a task, 32 sessions (vs one)", srv["32"], srv["1"], "ms",
                    "no collapse: <= one session's", srv["32"] <= srv["1"] * 1.1)
                row("  the 32 clients' CPU a task (vs one), this process", clients["32"], clients["1"], "ms")
        elif "mcp_32_sessions" in a:
            row("admission, MCP, 32 sessions at once (tasks/s)", a["mcp_32_sessions"], a["mcp"], "/s",
                "no collapse: >= one session", a["mcp_32_sessions"] >= a["mcp"])
        py = _med(next(iter(cli.values()))["python"]) if cli else None
        row("admission, one client, CLI (tasks/s)", a["cli"], a["tsp"], "/s",
            "interpreter-bound: >= 1/(3x python)" if py else "", (a["cli"] >= 1000 / (3 * py)) if py else None)
    store = res.get("store", {})
    if store:
        sizes = sorted(int(n) for n in store)
        for n in sizes:
            s = store[n] if n in store else store[str(n)]
            row(f"file store @{n:,}: change / admit / read", s["commit"], None, "ms",
                f"admit {s['admit']:.1f}, read {s['read']:.1f} ms, {s['index_bytes'] / 2**20:.1f} MB")
        lo, hi = (store.get(sizes[0]) or store[str(sizes[0])]), (store.get(sizes[-1]) or store[str(sizes[-1])])
        if len(sizes) > 1:
            row(f"file store change @{sizes[-1]:,} vs @{sizes[0]:,}", hi["commit"], lo["commit"], "ms", "flat: <= 2x",
                hi["commit"] <= 2 * lo["commit"])
    return rows


def render(res: dict, rows: list[dict]) -> str:
    m = res["machine"]
    out = [f"machine: {m['nproc']} cores, {m['cpu']}, Python {m['python']}, {m['tsp'] or 'no tsp'};"
           f" load {m['load_avg'][0]:.2f} at start, {res['load_at_end'][0]:.2f} at the end;"
           f" drains: {res['rounds']} interleaved round(s) ({res['deep_rounds']} at 10,000 and deeper), medians,"
           f" first {res['cap']:,} tasks of each queue", ""]

    def fmt(v: float | None) -> str:
        if v is None or v != v:
            return "-"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"

    cells = [("metric", "kugetsu", "tsp / peer", "ratio", "budget", "")]
    for r in rows:
        cells.append((r["metric"], f"{fmt(r['kugetsu'])} {r['unit']}".strip(),
                      "-" if r["peer"] is None else f"{fmt(r['peer'])} {r['unit']}".strip(),
                      "-" if r["ratio"] is None else f"{r['ratio']:.2f}", r["budget"],
                      {True: "met", False: "not met", None: ""}[r["met"]]))
    widths = [max(len(c[i]) for c in cells) for i in range(6)]
    for i, c in enumerate(cells):
        out.append("  ".join(x.ljust(w) if j in (0, 4, 5) else x.rjust(w) for j, (x, w) in enumerate(zip(c, widths))).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--sizes", type=ints, help="queue depths (default 100,1000,10000,50000; quick 100,1000)")
    ap.add_argument("--slots", type=ints, default=[1, 4], help="slot counts of the drains (default 1,4)")
    ap.add_argument("--rounds", type=int, help="interleaved drain rounds per side (default 3, quick 1)")
    ap.add_argument("--deep-rounds", type=int, help="drain rounds at 10,000 queued and deeper (default 1)")
    ap.add_argument("--cap", type=int, help="tasks drained at each depth (default 300, quick 100)")
    ap.add_argument("--idle", type=float, help="seconds the idle service is sampled (default 12, quick 4)")
    ap.add_argument("--deadline-queue", type=int, help="queue of the deadlines part (default 10000, quick 1000)")
    ap.add_argument("--timed", type=int, help="agents with a run timeout in it (default 20, quick 5)")
    ap.add_argument("--store-sizes", type=ints, help="file store depths (default 100,1000,5000,20000; quick 100,1000)")
    ap.add_argument("--mcp-tasks", type=int, help="MCP (and tsp) admissions (default 300, quick 100)")
    ap.add_argument("--cli-tasks", type=int, help="CLI admissions (default 30, quick 10)")
    ap.add_argument("--cli-reps", type=int, help="CLI calls of each kind per depth (default 10, quick 4)")
    ap.add_argument("--only", type=lambda s: s.split(","), default=list(PARTS), help="parts: " + ",".join(PARTS))
    ap.add_argument("--quick", action="store_true", help="smaller everything: a smoke run")
    ap.add_argument("--json", action="store_true", help="print the results and the table as JSON")
    ap.add_argument("--save", type=Path, help="also write the JSON to this file, after each step")
    ap.add_argument("--table", type=Path, nargs="+", help="print the table of --save files (of runs stopped half-way"
                    " too; parts in later files replace those in earlier ones)")
    args = ap.parse_args()
    if args.table:
        res = {}
        for path in args.table:
            res.update(json.loads(path.read_text()))
        print(render(res, table(res)))
        return 0
    q = args.quick
    defaults = {"sizes": ([100, 1000] if q else [100, 1000, 10000, 50000]), "rounds": 1 if q else 3, "deep_rounds": 1, "cap": 100 if q else 300,
                "idle": 4 if q else 12, "deadline_queue": 1000 if q else 10000, "timed": 5 if q else 20,
                "store_sizes": [100, 1000] if q else [100, 1000, 5000, 20000], "mcp_tasks": 100 if q else 300,
                "cli_tasks": 10 if q else 30, "cli_reps": 4 if q else 10}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.only) - set(PARTS)
    if unknown:
        ap.error(f"unknown part(s) {', '.join(sorted(unknown))}; parts: {', '.join(PARTS)}")
    exit_on_signals()
    compile_package()
    log = lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    res: dict = {}
    try:
        measure(args, log, res)
    except KeyboardInterrupt:
        log("stopped: the table of what was measured")
    rows = table(res)
    doc = {**res, "table": rows}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(render(res, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
