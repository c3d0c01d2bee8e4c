"""kill -9 at random moments of CLI commands and of the service, during hundreds of transitions.

After every step: index.json parses and validates. At the end: no task lost or duplicated,
no agent run twice, no slot leaked, every agent accounted for (each agent that ran has its
task, with its real exit status), events in order. The seed is printed; set
KUGETSU_TORTURE_SEED to replay one. KUGETSU_TORTURE=long runs ~10x more steps."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import agent_wrappers, wait_for
from torture import check_events, check_home, check_replay, record, size
from kugetsu.core.models import task_record

pytestmark = pytest.mark.torture


def test_kill9_cli_and_service_at_random_moments(kg):
    seed = int(os.environ.get("KUGETSU_TORTURE_SEED") or random.randrange(1 << 30))
    print(f"\nseed {seed}")
    rng = random.Random(seed)
    # A small events_max_size: events.jsonl is rotated several times, under the kills too.
    kg.config(max_agents=2, kill_grace="1s", max_queue=1000, events_max_size="24KiB")
    kg.ok("serve", "--detach")
    issued: dict[str, str] = {}  # name -> "ok" (delegate exited 0) | "killed" (delegate killed)
    cancelled: set[str] = set()
    figures = {"steps": 0, "cli_commands": 0, "cli_kills": 0, "service_kills": 0}
    t0 = time.monotonic()

    kg.env.pop("PYTHONDONTWRITEBYTECODE", None)  # CLI calls as installed (with .pyc): more steps a second

    def launch(*args: str) -> subprocess.Popen:
        figures["cli_commands"] += 1
        return subprocess.Popen([sys.executable, "-m", "kugetsu", *args], env=kg.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    steps = size(40, 400)
    for step in range(steps):
        # A batch of three concurrent commands (they contend for the index lock); each may
        # get SIGKILL at a random moment of its life: start-up is ~100 ms here, a
        # transaction a few ms, and the delays cover both. Sometimes the service dies too.
        figures["steps"] += 1
        batch: list[tuple[subprocess.Popen, str, str, bool]] = []
        for lane in range(3):
            r = rng.random()
            if r < 0.85 or not issued:
                name = f"k{step}-{lane}"
                issued[name] = "pending"
                p = launch("delegate", name, "--", *kg.agent(name, rng.choice([0, 0, 0.05, 0.2])))
                batch.append((p, "delegate", name, rng.random() < 0.25))
            elif r < 0.9:
                name = rng.choice(sorted(issued))
                cancelled.add(name)
                batch.append((launch("cancel", name), "cancel", name, rng.random() < 0.25))
            else:
                batch.append((launch("config", "set", "max_agents", str(rng.randint(1, 3))), "config", "", rng.random() < 0.25))
        service_kill = rng.random() < 0.15
        kills = sorted((time.monotonic() + rng.uniform(0.03, 0.2), i) for i, b in enumerate(batch) if b[3])
        svc_at = time.monotonic() + rng.uniform(0.05, 0.25) if service_kill else None
        while kills or svc_at:
            now = time.monotonic()
            if kills and kills[0][0] <= now:
                batch[kills.pop(0)[1]][0].kill()
                figures["cli_kills"] += 1
            if svc_at and svc_at <= now:
                pid = kg.service_pid()
                if pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        figures["service_kills"] += 1
                    except ProcessLookupError:
                        pass
                svc_at = None
            time.sleep(0.002)
        for p, what, name, killed in batch:
            out, err = p.communicate(timeout=60)
            if p.returncode == -signal.SIGKILL:
                if what == "delegate":
                    issued[name] = "killed"
                continue
            assert "Traceback" not in err, err
            if what == "delegate":
                assert p.returncode == 0, err
                issued[name] = "ok"
            elif what == "cancel":
                assert p.returncode in (0, 1), err  # 1: already final, or never admitted
            else:
                assert p.returncode == 0, err
        check_home(kg.home)  # the index parses and validates after every step

    # Let everything end (any CLI command brings the service back), then account for everything.
    kg.ok("capacity", "--json")
    wait_for(lambda: not kg.index()["active"] and not kg.index()["queued"], 60, "every task to end")
    wait_for(lambda: not agent_wrappers(kg.home), 15, "every agent process to be gone")
    raw = check_home(kg.home)
    # Finished tasks beyond history_limit (500) moved to history.jsonl: the long run has more.
    archived = {t["id"]: t for t in (task_record(json.loads(line)) for line in kg.home.history.read_text().splitlines())} \
        if kg.home.history.exists() else {}  # a line repeated by a crash: the last one counts
    finished = list(archived.values()) + raw["finished"]
    tasks = {t["name"]: t for t in finished}
    names = [t["name"] for t in finished]
    assert len(names) == len(set(names)), "a task was duplicated"
    assert set(names) <= set(issued), f"tasks nobody delegated: {set(names) - set(issued)}"
    missing = [n for n, how in issued.items() if how == "ok" and n not in tasks]
    assert not missing, f"admitted tasks lost: {missing}"
    lost = [n for n, t in tasks.items() if t["state"] == "lost"]
    twice, unaccounted = [], []
    for name, t in tasks.items():
        times = (kg.rec / name).read_text().split() if (kg.rec / name).exists() else []
        if times.count("start") > 1:
            twice.append(name)
        if times:  # the agent ran: its task says so, with its real outcome
            if t["started_at"] is None:
                unaccounted.append(name)
            elif t["state"] == "succeeded":
                assert t["exit_code"] == 0 and times.count("end") == 1, (name, t)
            else:
                assert t["state"] == "cancelled" and name in cancelled, (name, t)
        else:
            assert t["state"] in ("cancelled", "succeeded", "failed", "lost") or t["started_at"] is None, (name, t)
            if t["state"] == "succeeded":
                unaccounted.append(name)  # succeeded without its agent having run
    evs = check_events(kg.home)
    check_replay(evs, 3)  # max_agents varies 1-3 here; a recovered start comes after the exit that freed its slot
    transitions = raw["next_seq"] - 1  # every event committed; the files keep the latest ones
    assert evs and evs[-1]["seq"] == transitions, "the last committed events are missing from events.jsonl"
    assert kg.home.events_old.exists(), "events.jsonl was never rotated"
    cap = kg.json("capacity")
    record(
        "kill9", seed=seed, seconds=round(time.monotonic() - t0, 1), **figures, transitions=transitions,
        tasks=len(tasks), admitted_by_killed_cli=sum(1 for n, h in issued.items() if h == "killed" and n in tasks),
        lost=len(lost), duplicated_runs=len(twice), unaccounted=len(unaccounted), leaked_slots=cap["max_agents"] - cap["free"],
    )
    assert not lost, f"tasks lost: {[(n, tasks[n]['reason']) for n in lost]}"
    assert not twice, f"agents run twice: {twice}"
    assert not unaccounted, f"agents not accounted for: {unaccounted}"
    assert transitions >= size(200, 2000), f"only {transitions} transitions"

    # No slot leaked: every slot is free and really usable.
    assert cap["active"] == 0 and cap["queued"] == 0 and cap["free"] == cap["max_agents"]
    for i in range(cap["max_agents"]):
        assert kg.ok("delegate", f"final{i}", "--", "sleep", "30").startswith(f"started final{i}")
    kg.ok("cancel", "--all")
