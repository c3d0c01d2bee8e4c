#!/usr/bin/env python3
"""Admission through MCP against admission through the CLI, in tasks/s.

    python tools/bench/mcp.py [--json] [--quick] [--tasks N]

A PM agent that shells out pays a Python start per call; `kugetsu mcp` is one long-lived
process. Both paths run the same admission (delegation.delegate: a locked, fsync'd transaction)
on a throw-away home with autostart off, so no service and no agent competes for the CPU
(a service would start a warm wrapper per queued task) and max_queue above the count:

  mcp, capacity (floor)  the same session's `capacity` calls, one after the other: a tool's
                     round trip through the SDK with no admission (calls/s, not tasks):
                     what bounds the sequential row
  mcp, sequential    one stdio client session (the SDK's own client, `python -m kugetsu
                     mcp`), N delegates of `true`, each awaited before the next (a PM agent)
  mcp, 8 in flight   the same session, 8 calls at a time
  mcp, batch of 100  the same session, `delegate` with `tasks`: 100 tasks a call, one
                     transaction each (a PM handing out its issues at once)
  mcp, 32 in flight  the same session, 32 calls at a time: calls that arrive together
                     share a transaction (group commit)
  mcp, 32 sessions   32 sessions of one `kugetsu mcp --http` server (one process, as a
                     team of agents shares it), each one call after the other, group
                     commit across sessions. On a loaded machine the server's 5 s limit
                     for a request's head (guard.HEADER_TIMEOUT, armed again after each
                     response on a kept-alive connection) can close a session's connection
                     under it (ReadError): the row is then left out, with the error
  mcp, 32 stdio      32 stdio sessions, each its own `kugetsu mcp` process (each agent
                     starting its own server): the processes take turns at the lock
  cli, sequential    `kugetsu delegate -- true`, one process after the other
  cli, 20 procs      20 processes delegating at once (tools/bench/run.py's admission row)

The session's start (~1 s: the SDK's import) is not counted: it is paid once a session.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
# This file is named like the SDK it drives: its folder (sys.path[0] when run) must not
# shadow `mcp`, so it goes last (after site-packages), where run.py finds its `common`;
# run.py is loaded by its path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]


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


TOKEN = "kugetsu-bench-token-0123456789"


def _admitted(results: list, expect: int) -> None:
    failed = [r.content[0].text for r in results if r.is_error or not r.structured_content.get("admitted", True)]
    assert not failed, failed[:3]
    assert sum(len(r.structured_content.get("tasks") or [None]) for r in results) == expect


def _check(kg: Kg, n: int) -> None:
    index = kg.index()
    ids = [t["id"] for t in index["active"] + index["queued"]]
    assert len(ids) == len(set(ids)) == n, f"admission lost or duplicated tasks: {len(ids)} of {n}"


def mcp_rate(n: int, in_flight: int, batch: int = 0, floor: bool = False) -> float | None:
    """One stdio session; `batch` > 0: `delegate` with `tasks`, that many a call (None when
    the server has no such argument: a kugetsu before it); `floor`: `capacity` calls instead,
    one after the other (a tool's round trip through the SDK, with no admission: the floor of
    the sequential row), calls per second."""
    from mcp import Client, StdioServerParameters

    async def main() -> float | None:
        with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
            kg = home(Path(tmp), n)
            params = StdioServerParameters(command=PY, args=["-m", "kugetsu", "mcp"], env=kg.env, cwd=tmp)
            async with Client(params, mode="legacy") as client:
                first = await client.call_tool("delegate", {"command": ["true"]})  # warm: the first call's imports
                assert not first.is_error, first.content
                if batch:
                    tools = {t.name: t for t in (await client.list_tools()).tools}
                    if "tasks" not in tools["delegate"].input_schema["properties"]:
                        return None
                if floor:
                    t0 = time.perf_counter()
                    for _ in range(n):
                        assert not (await client.call_tool("capacity", {})).is_error
                    return n / (time.perf_counter() - t0)
                limit = anyio.Semaphore(in_flight)
                results: list = []
                item = {"command": ["true"], "source": "bench"}

                async def one(k: int) -> None:
                    async with limit:
                        args = {"tasks": [item] * k} if batch else item
                        results.append(await client.call_tool("delegate", args))

                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for k in ([batch] * (n // batch) if batch else [1] * n):
                        tg.start_soon(one, k)
                wall = time.perf_counter() - t0
            _admitted(results, n)
            _check(kg, n + 1)
            return n / wall

    return anyio.run(main)


def _http_server(kg: Kg) -> tuple[subprocess.Popen, str]:
    """`kugetsu mcp --http` on a free port; its stderr goes to a file (a pipe nobody read
    after the banner would stop the server once full)."""
    env = {**kg.env, "KUGETSU_MCP_TOKEN": TOKEN}
    log = kg.root / "mcp-http.log"
    with log.open("w") as err:
        proc = subprocess.Popen([PY, "-m", "kugetsu", "mcp", "--http", "127.0.0.1:0"], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if m := re.search(r"at (http://\S+/mcp)", log.read_text()):
            return proc, m.group(1)
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"kugetsu mcp --http did not come up: {log.read_text()}")


def sessions_rate(n: int, sessions: int, http: bool, cpu: dict | None = None) -> float:
    """`sessions` client sessions, each one call after the other, n tasks in all: of one
    HTTP server, or each with its own stdio server process. The sessions' starts are not
    counted: all are open before the clock starts. `cpu` (HTTP): gets the server's CPU time a
    task ("server_ms") and the clients' ("clients_ms"), from the clock's start to the last
    answer: on 2 cores the 32 clients of this process take the server's CPU (2-3x its own),
    so whether the server collapses shows in its own time a task, not in the wall rate."""
    import psutil
    from mcp import Client, StdioServerParameters

    each = n // sessions
    proc: subprocess.Popen | None = None

    async def main(kg: Kg, url: str | None) -> float:
        server = psutil.Process(proc.pid) if cpu is not None and proc is not None else None
        spent: dict = {}
        ready, go, opening = [0], anyio.Event(), anyio.Lock()
        ends: list[float] = []
        results: list = []
        item = {"command": ["true"], "source": "bench", "cwd": str(kg.root)}

        async def session() -> None:
            if url is not None:
                import httpx2
                from mcp.client.streamable_http import streamable_http_client

                # A connection a request: the server closes a kept-alive one whose next head
                # has not come 5 s after the last response (guard.HEADER_TIMEOUT), which a
                # client on a loaded machine can take, sending into a closing socket.
                http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120,
                                          limits=httpx2.Limits(max_keepalive_connections=0))
                transport: Any = streamable_http_client(url, http_client=http)
            else:
                transport = StdioServerParameters(command=PY, args=["-m", "kugetsu", "mcp"], env=kg.env,
                                                  cwd=str(kg.root))
            await opening.acquire()  # one at a time: 32 handshakes at once on 2 loaded cores fail
            held = True
            try:
                async with Client(transport, mode="legacy") as c:
                    r = await c.call_tool("capacity", {})  # warm: each session's (and server's) first call
                    assert not r.is_error, r.content
                    ready[0] += 1
                    held = False
                    opening.release()
                    await go.wait()
                    for _ in range(each):
                        results.append(await c.call_tool("delegate", item))
                    ends.append(time.perf_counter())
                    if len(ends) == sessions and server is not None:  # the last answer: before the sessions close
                        spent.update(server=server.cpu_times(), mine=time.process_time())
            finally:
                if held:
                    opening.release()

        async with anyio.create_task_group() as tg:
            for _ in range(sessions):
                tg.start_soon(session)
            while ready[0] < sessions:
                await anyio.sleep(0.05)
            used = server.cpu_times() if server is not None else None
            mine = time.process_time()
            t0 = time.perf_counter()
            go.set()
        if cpu is not None and used is not None and spent:
            now, done = spent["server"], sessions * each
            cpu["server_ms"] = ((now.user + now.system) - (used.user + used.system)) * 1000 / done
            cpu["clients_ms"] = (spent["mine"] - mine) * 1000 / done
        _admitted(results, sessions * each)
        return sessions * each / (max(ends) - t0)

    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        kg = home(Path(tmp), n)
        proc, url = _http_server(kg) if http else (None, None)
        try:
            rate = anyio.run(main, kg, url)
        except BaseException:
            if proc is not None:  # what the server said about it
                print((kg.root / "mcp-http.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        _check(kg, sessions * each)
        return rate


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
    rows: dict[str, list[float]] = {"mcp, capacity (floor)": [], "mcp, sequential": [], "mcp, 8 in flight": [],
                                    "mcp, 32 in flight": [],
                                    "mcp, batch of 100": [],
                                    "mcp, 32 sessions": [], "mcp, 32 stdio": [], "cli, sequential": [],
                                    "cli, 20 procs": []}
    for _ in range(rounds):  # interleaved: a burst of load elsewhere falls on every row alike
        rows["mcp, capacity (floor)"].append(mcp_rate(tasks, 1, floor=True))
        rows["mcp, sequential"].append(mcp_rate(tasks, 1))
        rows["mcp, 8 in flight"].append(mcp_rate(tasks, 8))
        batched = mcp_rate(max(tasks, 1000) // 100 * 100, 1, batch=100)
        if batched is not None:  # a kugetsu without batches (measuring the one before)
            rows["mcp, batch of 100"].append(batched)
        rows["mcp, 32 in flight"].append(mcp_rate(tasks, 32))
        try:
            rows["mcp, 32 sessions"].append(sessions_rate(max(tasks, 32 * 10), 32, http=True))
        except Exception as err:  # noqa: BLE001 (see the docstring: a loaded machine)
            print(f"mcp, 32 sessions: failed ({err!r}); see the docstring", file=sys.stderr)
        rows["mcp, 32 stdio"].append(sessions_rate(max(tasks, 32 * 10), 32, http=False))
        rows["cli, sequential"].append(cli_rate(max(20, tasks // 10), 1))
        rows["cli, 20 procs"].append(cli_rate(100, 20))
    return {
        "tasks": tasks, "rounds": rounds, "cpus": os.cpu_count(), "load_at_start": load, "load_at_end": os.getloadavg()[0],
        "tasks_per_s": {k: sorted(v)[len(v) // 2] for k, v in rows.items() if v}, "all": rows,
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
