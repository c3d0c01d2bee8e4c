#!/usr/bin/env python3
"""How late kugetsu's deadlines fire: queue expiries and run timeouts, under load.

    python tools/bench/deadlines.py [--json] [--quick]

A queue of 2,000 tasks (400 with --quick) waits behind one running task in a one-slot
group; half of them expire, in bursts of 10 tasks due at the same instant, 100 ms apart.
Meanwhile 20 agents (5) run beside the queue with run timeouts that fall due among the
bursts. Lateness is read from kugetsu's own records, never from this script's polling:

  expiry   the `expired` event's `at` minus the task's expires_at
  timeout  the agent's own clock when SIGTERM reached it, minus the task's started_at (its
           process's real start, which the timeout counts from) + timeout

The queue is written into index.json directly, as kugetsu encodes it (2,000 delegations
would take minutes and are not what is measured); the timed agents are delegated through
the CLI. Also run by tools/bench/run.py, whose table shows these rows.
"""

from __future__ import annotations

import json

import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Kg, part_main, pct, wait_until  # noqa: E402

from kugetsu.core.models import Index, Task, task_record  # noqa: E402
from kugetsu.store.files import decode_events  # noqa: E402
from kugetsu.store.protocol import encode_index

BURST = 10  # expiries due at the same instant
BURST_EVERY = 0.1  # seconds between bursts
LEAD = 8.0  # seconds from writing the index to the first burst: service start, delegations
# Records the moment SIGTERM reaches it (its own clock: bash reads it without a fork), then
# exits; `wait` keeps it idle.
TIMED_SCRIPT = 'trap \'echo "$EPOCHREALTIME" > "$0"; exit 143\' TERM; sleep 600 & wait'


def build_queue(kg: Kg, n: int, expiring: int, first_due: datetime) -> dict[int, datetime]:
    """n queued tasks in group q: the first one (a long sleep) takes the group's slot at the
    service's first tick, `expiring` others are due in bursts from `first_due`, the rest
    wait for a day. Returns task id -> expires_at of the expiring ones."""
    now = datetime.now(timezone.utc)
    index = Index(next_id=n + 1)
    due: dict[int, datetime] = {}
    for i in range(1, n + 1):
        expires = now + timedelta(hours=24)
        if 2 <= i < 2 + expiring:
            expires = first_due + timedelta(seconds=BURST_EVERY * ((i - 2) // BURST))
            due[i] = expires
        command = ["sleep", "3600"] if i == 1 else ["true"]
        index.queued.append(Task(
            id=i, name=f"issue-{i}", command=command, cwd="/", created_at=now, group="q", source="pm",
            expires_at=None if i == 1 else expires, prompt=f"Fix issue {i}: the login form rejects valid e-mail addresses",
        ))
    kg.home.index.write_bytes(encode_index(index))
    return due


def measure(n: int = 2000, timed: int = 20) -> dict:
    expiring = n // 2
    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        root = Path(tmp)
        kg = Kg(root, max_agents=timed + 4, max_queue=n + 10, groups={"q": {"max_agents": 1}}, autostart=False)
        first_due = datetime.now(timezone.utc) + timedelta(seconds=LEAD)
        due = build_queue(kg, n, expiring, first_due)
        window = BURST_EVERY * (expiring // BURST)
        kg.start_service()
        try:
            stamps = root / "stamps"
            stamps.mkdir()
            wait_until(lambda: kg.index()["active"], 20, "the queue's holder to start")
            left = (first_due - datetime.now(timezone.utc)).total_seconds()
            # Timeouts spread over the bursts' window, counted from each agent's start.
            timeouts = {f"timed-{i}": round(left + 1 + window * i / timed, 2) for i in range(timed)}
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda name: kg.run("delegate", name, "--timeout", str(timeouts[name]), "--",
                                                  "bash", "-c", TIMED_SCRIPT, str(stamps / name)), timeouts))
            events: list = []

            def expired() -> bool:
                events[:] = decode_events(kg.home.events.read_bytes())
                done = {e.name for e in events if e.type in ("expired", "failed")}
                return sum(1 for e in events if e.type == "expired") >= expiring and set(timeouts) <= done

            wait_until(expired, LEAD + window + max(timeouts.values()) + 60, "every expiry and timeout")
        finally:
            kg.stop()
        late_expiry = [(e.at - due[e.task]).total_seconds() * 1000 for e in events if e.type == "expired"]
        # A run timeout counts from the process's real start (started_at, set by the service
        # when it spawns), which may be later than the `started` event of the CLI's decision.
        # (Finished tasks past history_limit are in history.jsonl.)
        history = (kg.home.root / "history.jsonl")
        tasks = kg.index()["finished"] + ([task_record(json.loads(line)) for line in history.read_text().splitlines()]
                                         if history.exists() else [])
        started = {t["name"]: datetime.fromisoformat(t["started_at"]) for t in tasks if t["name"] in timeouts}
        late_timeout = []
        for name, seconds in timeouts.items():
            term = float((stamps / name).read_text())
            late_timeout.append((term - (started[name] + timedelta(seconds=seconds)).timestamp()) * 1000)
    return {"queue": n, "expiries": len(late_expiry), "timeouts": len(late_timeout),
            "expiry_ms": late_expiry, "timeout_ms": late_timeout}


def rows(res: dict) -> list[tuple[str, float]]:
    out = []
    for kind, key in (("expiry", "expiry_ms"), ("run timeout", "timeout_ms")):
        values = res[key]
        what = f"{res['expiries']:,} expiries, {res['queue']:,} queued" if kind == "expiry" else f"{res['timeouts']} agents"
        out += [(f"{kind} lateness p50 ({what})", statistics.median(values)),
                (f"{kind} lateness p95", pct(values, 95)), (f"{kind} lateness max", max(values))]
    return out


def main() -> int:
    t0 = time.monotonic()
    return part_main(__doc__, "400 queued, 200 expiries, 5 timeouts",
                     lambda quick: measure(400, 5) if quick else measure(), rows,
                     lambda res: f"({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
