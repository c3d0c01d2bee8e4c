"""Provider limits and retries through the real CLI, the real service and real agent
processes: fake agents that print a real-looking limit message and exit 1, and record their
own start times and arguments."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import wait_for

# An agent that records `start <time> <args...>`; its first LIMITED runs print a session id
# and a usage-limit message (with the reset time `$RESET` seconds ahead, a whole second, when
# RESET is set) and exit 1; the runs after that succeed.
AGENT = r"""
rec="$1"; shift
count="${COUNT:-$rec.n}"  # runs so far: of this task, or of the whole preset (COUNT)
n=$(cat "$count" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "$count"
echo "start $(date +%s.%N) $*" >> "$rec"
if [ "$n" -le "${LIMITED:-0}" ]; then
  echo "working on it"
  echo "session id: 0f6c1b2e-1111-2222-3333-44445555666$n"
  while [ -n "$GATE" ] && [ ! -e "$GATE" ]; do sleep 0.02; done
  if [ -n "$RESET" ]; then
    at=$(( $(date +%s) + RESET ))
    echo "reset $at" >> "$rec"
    echo "Claude AI usage limit reached|$at"
  else
    echo "Error: 429 Too Many Requests: rate limit exceeded"
  fi
  exit 1
fi
sleep "${SLEEP:-0}"
echo "end $(date +%s.%N)" >> "$rec"
exit "${CODE:-0}"
"""


def preset(kg, name: str, limited: int = 0, reset: int | None = None, sleep: float = 0, code: int = 0,
           gate: Path | None = None, **extra) -> dict:
    env = {"LIMITED": str(limited), "SLEEP": str(sleep), "CODE": str(code), "GATE": str(gate or ""),
           "COUNT": str(kg.rec / f"{name}.n")}
    if reset is not None:
        env["RESET"] = str(reset)
    script = kg.rec / "agent.sh"
    script.write_text(AGENT)
    rec = str(kg.rec / "{name}")
    return {"command": ["sh", str(script), rec, "{prompt}"], "env": env,
            "limit": {"patterns": [r"usage limit reached", r"429 Too Many Requests"]},
            "session_pattern": r"session id: (\S+)", "resume": ["sh", str(script), rec, "--resume", "{session}"],
            **extra}


def runs(kg, name: str) -> list[tuple[float, list[str]]]:
    """(start time, argv) of each run the agent recorded."""
    try:
        lines = (kg.rec / name).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [(float(parts[1]), parts[2:]) for parts in (line.split() for line in lines) if parts[0] == "start"]


def recorded(kg, name: str, key: str) -> list[float]:
    lines = (kg.rec / name).read_text().splitlines()
    return [float(line.split()[1]) for line in lines if line.startswith(key + " ")]


def test_a_limit_requeues_in_place_holds_the_preset_and_resumes_the_session_at_the_reset_time(kg):
    gate = kg.rec / "gate"
    kg.config(max_agents=1, agents={
        "fake": preset(kg, "fake", limited=1, reset=3, gate=gate),
        "other": preset(kg, "other", sleep=0.3),
    })
    kg.ok("delegate", "a", "--agent", "fake", "--prompt", "do a")
    kg.ok("delegate", "b", "--agent", "fake", "--prompt", "do b")
    kg.ok("delegate", "c", "--agent", "other", "--prompt", "do c")
    gate.touch()  # a hits the limit now
    # a hit its provider's limit: not failed, back in the queue ahead of b; c (another
    # preset) starts meanwhile.
    wait_for(lambda: runs(kg, "c"), 10, "c to start while fake is held")
    a = kg.task("a")
    assert a["state"] == "queued" and a["attempt"] == 2 and a["exit_code"] is None
    assert a["attempts"][0]["exit_code"] == 1 and a["attempts"][0]["limit"] is True
    assert a["session"] == "0f6c1b2e-1111-2222-3333-444455556661"
    queue = kg.json("queue")
    assert [(t["name"], t["position"]) for t in queue["queued"]] == [("a", 1), ("b", 2)]
    assert queue["queued"][0]["waiting_for"].startswith("fake usage limit, retry at ")
    assert kg.json("capacity")["holds"]["fake"]["queued"] == 2
    text = kg.ok("queue")
    assert "held: fake usage limit until" in text and "2 tasks waiting" in text
    [held] = kg.events("held")
    assert held["reason"].startswith("fake usage limit: 2 tasks held until ")
    [requeued] = kg.events("requeued")
    assert requeued["name"] == "a" and "fake usage limit" in requeued["reason"]
    assert not kg.events("failed")
    # At the reset time, to within 100 ms, a starts again and continues its session.
    kg.wait_state("b", "succeeded", timeout=20)
    [reset] = recorded(kg, "a", "reset")
    (_, first), (second_start, second) = runs(kg, "a")
    assert first == ["do", "a"] and second == ["--resume", "0f6c1b2e-1111-2222-3333-444455556661"]
    assert 0 <= second_start - reset < 0.1, f"resumed {second_start - reset:.3f}s after the reset time"
    assert runs(kg, "b")[0][0] > second_start  # b stayed behind a
    assert kg.task("a")["state"] == "succeeded"
    assert [e["type"] for e in kg.events() if e["type"] in ("held", "released")] == ["held", "released"]
    assert kg.json("capacity")["holds"] == {} and kg.json("queue")["holds"] == {}


def test_backoff_when_the_output_gives_no_reset_time(kg):
    kg.config(agents={"fake": preset(kg, "fake", limited=2, limit={
        "patterns": ["429 Too Many Requests"], "backoff": "1s", "max_backoff": "1h"})})
    kg.ok("delegate", "a", "--agent", "fake", "--prompt", "go")
    task = kg.wait_state("a", "succeeded", timeout=20)
    ends = [a["ended_at"] for a in task["attempts"]]
    starts = [t for t, _ in runs(kg, "a")]
    assert len(starts) == 3 and [a["limit"] for a in task["attempts"]] == [True, True]
    from datetime import datetime

    gaps = [starts[i + 1] - datetime.fromisoformat(ends[i]).timestamp() for i in range(2)]
    # 1 s, then doubled to 2 s: released at the hold's end, not a reconcile (5 s) later. The
    # lateness itself is the deadline bench's (tools/bench/deadlines.py): a loaded CI run
    # released the second 145 ms late.
    assert 1.0 <= gaps[0] < 1.5 and 2.0 <= gaps[1] < 2.5, gaps
    assert kg.index()["strikes"] == {}  # a run served in full: the next hit starts at 1 s again


def test_retries_count_and_stop(kg):
    kg.config(agents={"fake": preset(kg, "fake", code=3)})
    kg.ok("delegate", "a", "--agent", "fake", "--prompt", "go", "--retries", "2", "--retry-delay", "1s")
    task = kg.wait_state("a", "failed", timeout=20)
    assert task["attempt"] == 3 and task["exit_code"] == 3
    assert [(a["exit_code"], a.get("limit", False)) for a in task["attempts"]] == [(3, False), (3, False)]
    starts = [t for t, _ in runs(kg, "a")]
    assert len(starts) == 3 and all(b - a >= 1.0 for a, b in zip(starts, starts[1:]))
    assert [e["reason"].split("; ")[1][:10] for e in kg.events("requeued")] == ["retry 1 of", "retry 2 of"]
    assert len(kg.events("failed")) == 1
    # `kugetsu retry` admits it again as a new task, linked to it.
    new = json.loads(kg.ok("retry", "a", "--json"))
    assert new["id"] != task["id"] and new["retry_of"] == task["id"] and new["name"] == "a"
    kg.wait_state(str(new["id"]), "failed", timeout=20)
    assert kg.run("retry", "nosuch").returncode == 1


def test_a_cancelled_task_is_not_retried(kg):
    kg.config(agents={"fake": preset(kg, "fake", sleep=30)})
    kg.ok("delegate", "a", "--agent", "fake", "--prompt", "go", "--retries", "3")
    wait_for(lambda: runs(kg, "a"), 10, "a to start")
    kg.ok("cancel", "a")
    assert kg.task("a")["state"] == "cancelled" and len(runs(kg, "a")) == 1


def test_hold_and_release_by_hand(kg):
    kg.config(agents={"other": preset(kg, "other")})
    assert kg.ok("hold", "other").strip() == "other held by hand: 0 tasks held until released"
    out = kg.ok("delegate", "x", "--agent", "other", "--prompt", "go")
    assert out.strip() == "queued x (#1), position 1 of 1; waiting for: other held by hand"
    assert kg.json("capacity")["holds"]["other"]["until"] is None
    assert kg.ok("release", "other").strip() == "other released: 1 task may start"
    kg.wait_state("x", "succeeded")
    kg.ok("hold", "other", "--until", "2s")
    until = kg.index()["holds"]["other"]["until"]
    kg.ok("delegate", "y", "--agent", "other", "--prompt", "go")
    kg.wait_state("y", "succeeded", timeout=10)
    from datetime import datetime

    assert 0 <= runs(kg, "y")[0][0] - datetime.fromisoformat(until).timestamp() < 0.1
    # Bad input: a clear line, the right code, nothing written.
    before = Path(kg.home.index).read_bytes()
    r = kg.run("hold", "nosuch")
    assert r.returncode == 2 and "unknown agent preset 'nosuch'" in r.stderr
    r = kg.run("hold", "other", "--until", "bogus")
    assert r.returncode == 2 and "neither a time" in r.stderr
    r = kg.run("release", "other")
    assert r.returncode == 1 and "agent other is not held" in r.stderr
    assert Path(kg.home.index).read_bytes() == before


def test_a_hold_and_the_task_it_holds_survive_a_restart_of_the_service(kg):
    kg.config(agents={"fake": preset(kg, "fake", limited=1, reset=600)})
    kg.ok("delegate", "a", "--agent", "fake", "--prompt", "go")
    wait_for(lambda: kg.index()["holds"], 10, "fake to be held")
    kg.ok("shutdown")
    kg.ok("serve", "--detach")  # the last run's exit file is still there: booked already, not an end
    a = kg.task("a")
    assert a["state"] == "queued" and a["attempt"] == 2 and len(runs(kg, "a")) == 1
    assert "fake" in kg.json("capacity")["holds"]
    kg.ok("release", "fake")
    assert kg.wait_state("a", "succeeded")["attempt"] == 2
    assert runs(kg, "a")[1][1][0] == "--resume"
