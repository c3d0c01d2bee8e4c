#!/usr/bin/env python3
"""Admission through MCP against admission through the CLI, in tasks/s.

    python tools/bench/mcp.py [--json] [--quick] [--tasks N]

A PM agent that shells out pays a Python start per call; `kugetsu mcp` is one long-lived
process. Both paths run the same admission (delegation.delegate: a locked, fsync'd transaction)
on a throw-away home with autostart off, so no service and no agent competes for the CPU
(a service would start a warm wrapper per queued task) and max_queue above the count:

  mcp, sequential    one stdio client session (the SDK's own client, `python -m kugetsu
                     mcp`), N delegates of `true`, each awaited before the next (a PM agent)
  mcp, 8 in flight   the same session, 8 calls at a time
  cli, sequential    `kugetsu delegate -- true`, one process after the other
  cli, 20 procs      20 processes delegating at once (tools/bench/run.py's admission row)

The session's start (~1 s: the SDK's import) is not counted: it is paid once a session.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import anyio

HERE = Path(__file__).resolve().parent
# This file is named like the SDK it drives: its folder (sys.path[0] when run) must not
# shadow `mcp`; run.py is loaded by its path instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def _load_run():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kugetsu_bench_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_run = _load_run()
PY, Kg = _run.PY, _run.Kg


def home(root: Path, n: int) -> Kg:
    return Kg(root, autostart=False, max_agents=1, max_queue=n + 100)


def mcp_rate(n: int, in_flight: int) -> float:
    from mcp import Client, StdioServerParameters

    async def main() -> float:
        with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
            kg = home(Path(tmp), n)
            params = StdioServerParameters(command=PY, args=["-m", "kugetsu", "mcp"], env=kg.env, cwd=tmp)
            async with Client(params, mode="legacy") as client:
                first = await client.call_tool("delegate", {"command": ["true"]})  # warm: the first call's imports
                assert not first.is_error, first.content
                limit = anyio.Semaphore(in_flight)
                failed = []

                async def one() -> None:
                    async with limit:
                        r = await client.call_tool("delegate", {"command": ["true"], "source": "bench"})
                        if r.is_error or not r.structured_content["admitted"]:
                            failed.append(r.content[0].text)

                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for _ in range(n):
                        tg.start_soon(one)
                wall = time.perf_counter() - t0
            assert not failed, failed[:3]
            index = kg.index()
            ids = [t["id"] for t in index["active"] + index["queued"]]
            assert len(ids) == len(set(ids)) == n + 1, "admission lost or duplicated tasks"
            return n / wall

    return anyio.run(main)


def cli_rate(n: int, procs: int) -> float:
    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        kg = home(Path(tmp), n)
        kg.run("delegate", "--", "true")  # warm: bytecode, home made
        each = n // procs
        wall = _run.delegating(kg, procs, each)
        assert len(kg.index()["queued"]) == procs * each
        return procs * each / wall


def measure(tasks: int, quick: bool) -> dict:
    load = os.getloadavg()[0]
    rounds = 1 if quick else 3
    rows: dict[str, list[float]] = {"mcp, sequential": [], "mcp, 8 in flight": [], "cli, sequential": [],
                                    "cli, 20 procs": []}
    for _ in range(rounds):  # interleaved: a burst of load elsewhere falls on every row alike
        rows["mcp, sequential"].append(mcp_rate(tasks, 1))
        rows["mcp, 8 in flight"].append(mcp_rate(tasks, 8))
        rows["cli, sequential"].append(cli_rate(max(20, tasks // 10), 1))
        rows["cli, 20 procs"].append(cli_rate(100, 20))
    return {
        "tasks": tasks, "rounds": rounds, "cpus": os.cpu_count(), "load_at_start": load, "load_at_end": os.getloadavg()[0],
        "tasks_per_s": {k: sorted(v)[len(v) // 2] for k, v in rows.items()}, "all": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    ap.add_argument("--quick", action="store_true", help="one round instead of three (median)")
    ap.add_argument("--tasks", type=int, default=300, help="delegates per MCP round (default 300)")
    args = ap.parse_args()
    res = measure(args.tasks, args.quick)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"admission, {args.tasks} tasks through MCP; {res['cpus']} cores, load {res['load_at_start']:.2f} at start,"
          f" {res['load_at_end']:.2f} at the end; median of {res['rounds']}")
    width = max(len(k) for k in res["tasks_per_s"])
    for name, rate in res["tasks_per_s"].items():
        print(f"{name:<{width}}  {rate:8.1f} tasks/s")
    mcp_seq, cli_seq = res["tasks_per_s"]["mcp, sequential"], res["tasks_per_s"]["cli, sequential"]
    print(f"mcp / cli, sequential: {mcp_seq / cli_seq:.1f}x (budget: mcp >= 200 tasks/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
