#!/usr/bin/env python3
"""The floor of kugetsu's promotion design, side by side with task-spooler (`tsp -S 1`).

    python tools/bench/floor.py [--rounds N]

The same 100-task drain as run.py, but with no kugetsu at all: a small asyncio loop
pre-starts every task's wrapper (kugetsu's own `runner.spawn`, warm: waiting on its pipe),
watches each with a pidfd and, at each exit, lets the next one go (`runner.release`). No index, no
transaction, no spawn during the drain: what is left is the design itself (an `sh`
wrapper that outlives the service, a pidfd, a Python loop). Variant `+ commit` also
writes 100 KB (index.json with 100 queued tasks) after each release the way the store
commits it (temp file, fsync, rename, directory fsync): the price of a durable record.

If the floor is about 1.0, no bookkeeping, however quick, brings kugetsu under tsp on
this benchmark; see docs/proof.md ("What is left").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (the same task script, stamps and tsp side as the main benchmark)

from kugetsu.service import runner  # noqa: E402
from kugetsu.paths import Home, atomic_write  # noqa: E402

N = 100


class NoSampler:
    cpu_share = 0.0
    peak_rss = 0


def drain_floor(commit: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="kgfloor-") as tmp:
        root = Path(tmp)
        stamps, bend, fifo = root / "stamps", root / "blocker_end", root / "fifo"
        os.mkfifo(fifo)
        home = Home(root / "home")
        home.ensure()

        def warm(task_id: int, argv: list[str]) -> runner.Spawned:
            return runner.spawn(home, task_id, f"t{task_id}", argv, tmp, {}, warm=True)

        chain = [warm(0, ["sh", "-c", run.BLOCKER_SCRIPT, str(fifo), str(bend)])]
        chain += [warm(i + 1, ["sh", "-c", run.TASK_SCRIPT, str(stamps), str(i)]) for i in range(N)]
        record = os.urandom(50_000).hex().encode()  # 100 KB: index.json with 100 queued tasks

        async def main() -> None:
            loop = asyncio.get_running_loop()
            done = asyncio.Event()

            def start(k: int) -> None:
                fd = os.pidfd_open(chain[k].pid)
                loop.add_reader(fd, ended, k, fd)
                runner.release(chain[k])

            def ended(k: int, fd: int) -> None:
                loop.remove_reader(fd)
                os.close(fd)
                if k + 1 < len(chain):
                    start(k + 1)
                else:
                    done.set()
                chain[k].popen.wait()
                if commit:
                    atomic_write(root / "index.json", record)

            start(0)
            await asyncio.to_thread(run.release, fifo)
            await done.wait()

        asyncio.run(main())
        return run._drain_result(stamps, bend, N, NoSampler())  # type: ignore[arg-type]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if not shutil.which("tsp"):
        print("task-spooler (tsp) is not installed: nothing to compare with", file=sys.stderr)
        return 1
    sides: dict[str, list[dict]] = {"floor": [], "floor + commit": [], "kugetsu": [], "tsp": []}
    for r in range(args.rounds):  # interleaved, as the machine is noisy
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        sides["floor"].append(drain_floor(commit=False))
        sides["floor + commit"].append(drain_floor(commit=True))
        sides["kugetsu"].append(run.drain_kugetsu(N))
        sides["tsp"].append(run.drain_tsp(N))
    tsp = statistics.median(d["drain_s"] for d in sides["tsp"])
    print(f"drain of {N} tasks at one slot, median of {args.rounds} interleaved rounds")
    for name, runs in sides.items():
        drain = statistics.median(d["drain_s"] for d in runs)
        gaps = [g for d in runs for g in d["gaps_ms"][1:]]
        print(f"  {name:15} {drain * 1000:6.1f} ms  ratio to tsp {drain / tsp:.2f}"
              f"  promotion p50 {statistics.median(gaps):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
