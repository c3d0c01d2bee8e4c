"""`kugetsu demo`: the whole job on a throw-away home with a simulated agent.

Seven tasks, two slots: watch positions move, a running task cancelled and its slot handed
on at once, a queued task expire, one agent fail, one hit its provider's usage limit (it goes
back to the queue, its preset is held while the other agents go on, and at the reset time it
resumes its session), then a summary. Needs nothing but kugetsu.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kugetsu.app import control, delegation, reading, transaction, verbs

from kugetsu.core import admission

from kugetsu.frontends import render
from kugetsu.config.load import save_raw, validate
from kugetsu.config.units import format_duration
from kugetsu.paths import Home
from kugetsu.store.files import open_store

# name, seconds of work, fails, queue expiry
PLAN = [
    ("issue-1", 5, False, None),
    ("issue-2", 8, False, None),
    ("issue-3", 4, False, None),
    ("issue-4", 3, False, 4.0),
    ("issue-5", 3, True, None),
    ("issue-6", 3, False, None),
]
CANCEL = ("issue-2", 2.0)  # cancelled while running, 2 s in
# Delegated first, to the `sim-claude` preset: its simulated provider refuses it 1 s in, with
# a reset time RESET seconds ahead.
LIMITED = ("issue-7", 3)
RESET = 4


def preset() -> dict[str, object]:
    """A simulated provider with a usage limit, as a real preset would describe it."""
    me = [sys.executable, "-m", "kugetsu.frontends.demo"]
    return {"command": [*me, "limited", "{prompt}"], "limit": {"patterns": [r"usage limit reached"]},
            "session_pattern": r"session id: (\S+)", "resume": [*me, "resume", "{session}"]}


def limited() -> int:
    """The simulated agent's first run: its provider's usage limit, 1 s in."""
    print("session id: demo-7f3a", flush=True)
    print("[1/5] reading the issue", flush=True)
    time.sleep(1)
    print(f"usage limit reached; try again in {RESET} seconds", flush=True)
    return 1


def resumed(session: str) -> int:
    print(f"resuming session {session}", flush=True)
    return agent(LIMITED[1], False)


def agent(seconds: float, fail: bool) -> int:
    """The simulated coding agent: prints its steps, works a while, sometimes fails."""
    steps = ["reading the issue", "planning", "editing files", "running tests", "writing the summary"]
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {step}", flush=True)
        time.sleep(seconds / len(steps))
    if fail:
        print("tests failed: 2 of 31", flush=True)
        return 1
    print("done: all tests pass", flush=True)
    return 0


def run_demo() -> int:
    root = Path(tempfile.mkdtemp(prefix="kugetsu-demo-"))
    home = Home(root / "home")
    home.ensure()
    raw = {"max_agents": 2, "autostart": False, "kill_grace": "2s", "agents": {"sim-claude": preset()}}
    save_raw(home, raw)
    cfg = validate(raw)
    env = {**os.environ, "KUGETSU_HOME": str(home.root)}
    service = subprocess.Popen([sys.executable, "-m", "kugetsu", "serve"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    started = time.monotonic()
    say = _printer(started)
    try:
        _wait(lambda: control.service_pid(home) is not None, 10)
        say(f"throw-away home {home.root}, max_agents 2, seven tasks\n")
        adm = delegation.delegate(home, cfg, admission.Request(cwd=str(root), name=LIMITED[0], source="demo", agent="sim-claude",
                                                 prompt="fix the flaky test"))
        say(f"$ kugetsu delegate {LIMITED[0]} --source demo --agent sim-claude --prompt 'fix the flaky test'")
        _said(adm)
        for name, seconds, fail, expiry in PLAN:
            req = admission.Request(cwd=str(root), name=name, source="demo", expire_after=expiry,
                             command=[sys.executable, "-m", "kugetsu.frontends.demo", str(seconds), "fail" if fail else "ok"])
            adm = delegation.delegate(home, cfg, req)
            # The command as a user would type it (the simulated agent abbreviated), and what it prints.
            expire = f" --expire-after {format_duration(expiry)}" if expiry else ""
            say(f"$ kugetsu delegate {name} --source demo{expire} -- <simulated agent: {seconds}s"
                + (", fails>" if fail else ">"))
            _said(adm)
        seen = 0
        cancelled = False
        while True:
            index = open_store(home).read()
            events = open_store(home).read_events(seen)
            for event in events:
                seen = event.seq
                if event.type not in ("queued", "config"):
                    say(f"{event.type:<9} {event.name or ''}" + (f"  slot {event.slot}" if event.slot else "")
                        + (f"  ({event.reason})" if event.reason else ""))
            if events and index.live():
                print(_frame(index, cfg), flush=True)
            if not cancelled and time.monotonic() - started >= CANCEL[1]:
                cancelled = True
                say(f"$ kugetsu cancel {CANCEL[0]}")
                verbs.cancel(home, [CANCEL[0]], reason="cancelled by the demo")
            if cancelled and not index.live():
                break
            if time.monotonic() - started > 45:
                say("the demo ran too long; stopping")
                break
            time.sleep(0.25)
        index = open_store(home).read()
        print("\nSUMMARY\n" + render.finished_table(sorted(index.finished, key=lambda t: t.id), transaction.now()))
        counts: dict[str, int] = {}
        for t in index.finished:
            counts[t.state.value] = counts.get(t.state.value, 0) + 1
        print("\n" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
              + f" in {time.monotonic() - started:.1f}s; at most {peak_running(index)} running at once (max_agents 2).")
        return 0
    finally:
        control.send(home, b"shutdown")
        try:
            service.wait(10)
        except subprocess.TimeoutExpired:
            service.kill()
        for task in open_store(home).read().active:  # nothing is left behind, even after Ctrl-C
            if task.run.pid:
                try:
                    os.killpg(task.run.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(root, ignore_errors=True)


def _said(adm: delegation.Admission) -> None:
    """What `delegate` printed, under the command, as every delegate of the demo shows it."""
    print(" " * 9 + render.admitted(adm.task, adm.position, adm.queued, adm.max_agents, adm.waiting_for), flush=True)


def _printer(started: float):
    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {text}", flush=True)

    return say


def _frame(index, cfg) -> str:
    """The live queue, as `kugetsu queue` shows it, indented under the event lines."""
    now = transaction.now()
    view = reading.listing(cfg, index, at=now).view  # the one queue view every front end renders
    parts = [render.summary(view.capacity)]
    if view.running:
        parts.append(render.running_table(view.running, now))
    if view.queued:
        parts.append(render.queued_table(view.queued, view.positions, now, view.waiting_for))
    return "\n".join("          " + line for part in parts for line in part.splitlines()) + "\n"


def peak_running(index) -> int:
    """The most tasks that ever ran at once, from their recorded start and end times."""
    edges = sorted(
        [(t.started_at, 1) for t in index.finished if t.started_at]
        + [(t.finished_at, -1) for t in index.finished if t.started_at and t.finished_at]
    )
    peak = running = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def _wait(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("the demo service did not start")
        time.sleep(0.05)


if __name__ == "__main__":
    if sys.argv[1] == "limited":
        raise SystemExit(limited())
    if sys.argv[1] == "resume":
        raise SystemExit(resumed(sys.argv[2]))
    raise SystemExit(agent(float(sys.argv[1]), sys.argv[2] == "fail"))
