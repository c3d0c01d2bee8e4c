"""Budgets (issue 30) through the real CLI, the real service and real agent processes: fake
agents that print Claude Code's stream-json (a turn's usage per assistant message, the cost in
the last `result`), so the service reads their usage as it reads the real one's."""

from __future__ import annotations

import sys

import anyio

from conftest import wait_for
from test_cluster import machines  # noqa: F401  (a fixture: homes sharing one PostgreSQL)

# A stream-json agent: TURNS assistant messages of TOKENS tokens in (10 out) each, TURN_SLEEP
# apart, then a result with the whole usage and COST; exit CODE. It records each turn.
AGENT = r"""
import json, os, sys, time
rec = open(sys.argv[1], "a")
turns, tokens = int(os.environ["TURNS"]), int(os.environ["TOKENS"])
say = lambda obj: print(json.dumps(obj), flush=True)
say({"type": "system", "subtype": "init", "session_id": "0f6c1b2e-1111-2222-3333-444455556666", "model": "fake"})
for i in range(turns):
    say({"type": "assistant", "message": {"id": f"msg_{i}", "content": [{"type": "text", "text": f"turn {i}"}],
                                          "usage": {"input_tokens": tokens, "output_tokens": 10}}})
    rec.write(f"turn {i}\n"); rec.flush()
    time.sleep(float(os.environ.get("TURN_SLEEP", "0")))
say({"type": "result", "subtype": "success", "is_error": os.environ.get("CODE", "0") != "0",
     "session_id": "0f6c1b2e-1111-2222-3333-444455556666", "result": "done",
     "usage": {"input_tokens": tokens * turns, "output_tokens": 10 * turns},
     "total_cost_usd": float(os.environ.get("COST", "0"))})
rec.write("end\n")
sys.exit(int(os.environ.get("CODE", "0")))
"""


def preset(kg, turns: int = 1, tokens: int = 100, cost: float = 0.0, sleep: float = 0.0, code: int = 0, **extra) -> dict:
    script = kg.rec / "claude_like.py"
    script.write_text(AGENT)
    env = {"TURNS": str(turns), "TOKENS": str(tokens), "COST": str(cost), "TURN_SLEEP": str(sleep), "CODE": str(code)}
    return {"command": [sys.executable, str(script), str(kg.rec / "{name}"), "{prompt}"], "env": env,
            "output": "claude", **extra}


def lines(kg, name: str) -> list[str]:
    path = kg.rec / name
    return path.read_text().splitlines() if path.exists() else []


def test_a_token_budget_stops_a_run_mid_way_from_its_streamed_usage(kg):
    kg.config(agents={"fake": preset(kg, turns=40, tokens=1000, sleep=0.2)})
    kg.ok("delegate", "big", "--agent", "fake", "--prompt", "go", "--max-tokens", "2500", "--retries", "2")
    kg.wait_state("big", "failed", timeout=30)
    task = kg.task("big")
    assert task["reason"].startswith("budget 2,500 tokens exceeded: "), task["reason"]
    used = int(task["reason"].rsplit(": ", 1)[1].split()[0].replace(",", ""))
    assert 2500 < used <= 8080  # stopped within a few turns of passing it (a read a second)
    assert "end" not in lines(kg, "big") and len(lines(kg, "big")) < 40
    assert task["usage"]["input_tokens"] >= 3000 and task["attempts"] == []  # not retried: over budget
    [failed] = kg.events("failed")
    assert failed["reason"] == task["reason"]


def test_a_cost_reported_at_the_end_applies_from_the_next_start(kg):
    kg.config(agents={"fake": preset(kg, cost=2.13, code=1)})
    kg.ok("delegate", "dear", "--agent", "fake", "--prompt", "go", "--budget-usd", "2", "--retries", "3")
    kg.wait_state("dear", "failed", timeout=20)
    task = kg.task("dear")
    assert task["reason"] == "budget 2.00 USD exceeded: 2.13 USD"
    assert task["usage"]["cost_usd"] == 2.13 and task["attempts"] == []  # its retries were not used
    assert lines(kg, "dear").count("end") == 1
    out = kg.run("delegate", "--agent", "fake", "--prompt", "go", "--budget-usd", "0")
    assert out.returncode == 2 and "must be more than 0" in out.stderr


def test_a_source_over_its_daily_budget_starts_nothing_more_and_a_preset_over_its_own_fails_over(kg):
    kg.config(max_agents=1, budgets={"sources": {"pm": {"usd": 20}}, "agents": {"fake": {"tokens": 250}}},
              agents={"fake": preset(kg, cost=15.0, tokens=100), "other": preset(kg, cost=1.0)})
    for name in ("a", "b"):  # pm: 15.00 then 30.00 USD; fake: 110 then 220 tokens
        kg.ok("delegate", name, "--agent", "fake", "--source", "pm", "--prompt", "go")
        kg.wait_state(name, "succeeded", timeout=20)
    out = kg.ok("delegate", "c", "--agent", "other", "--source", "pm", "--prompt", "go")
    assert "waiting for: budget pm 30.00/20.00 USD, resets 00:00" in out
    kg.ok("delegate", "d", "--agent", "fake", "--prompt", "go")  # source cli has no budget; fake: 330 tokens
    kg.wait_state("d", "succeeded", timeout=20)
    kg.ok("delegate", "e", "--agent", "fake,other", "--prompt", "go")  # fake is over its own: on other
    kg.wait_state("e", "succeeded", timeout=20)
    e = kg.task("e")
    assert e["agent"] == "other" and e["fallback_from"] == "fake"
    kg.ok("delegate", "f", "--agent", "fake", "--prompt", "go")
    queued = kg.json("queue")["queued"]
    assert [(t["name"], t["position"], t["waiting_for"]) for t in queued] == [
        ("c", 1, "budget pm 30.00/20.00 USD, resets 00:00"), ("f", 2, "budget fake 330/250 tokens, resets 00:00")]
    assert lines(kg, "c") == [] and lines(kg, "f") == []
    # Usage summed in stats: by source, by agent (with the fallback counted), by day.
    by_source = kg.json("stats", "--by", "source")["rows"]
    assert by_source["pm"]["usage"]["cost_usd"] == 30.0 and by_source["pm"]["usage"]["input_tokens"] == 200
    assert by_source["cli"]["usage"]["cost_usd"] == 16.0
    by_agent = kg.json("stats", "--by", "agent")["rows"]
    assert by_agent["fake"]["usage"]["cost_usd"] == 45.0 and by_agent["fake"]["usage"]["output_tokens"] == 30
    assert by_agent["other"]["fallbacks"] == 1 and by_agent["other"]["usage"]["cost_usd"] == 1.0
    [(day, row)] = kg.json("stats", "--by", "day")["rows"].items()
    assert row["usage"]["cost_usd"] == 46.0 and len(day) == 10
    text = kg.ok("stats", "--by", "agent")
    assert "TOKENS IN" in text and "$45.00" in text


def fallback_then_own(kg) -> None:
    """pm's a runs on other while fake is held (a fallback), then b on fake itself."""
    kg.ok("hold", "fake")
    kg.ok("delegate", "a", "--agent", "fake,other", "--source", "pm", "--prompt", "go")
    kg.wait_state("a", "succeeded", timeout=20)
    kg.ok("release", "fake")
    kg.ok("delegate", "b", "--agent", "fake", "--source", "pm", "--prompt", "go")
    kg.wait_state("b", "succeeded", timeout=20)


def test_usage_and_fallbacks_are_counted_in_metrics(kg):
    from test_metrics import endpoint, scrape, value

    kg.config(metrics={"listen": "127.0.0.1:0"}, agents={"fake": preset(kg, cost=0.5, tokens=100, turns=2),
                                                         "other": preset(kg, cost=0.25, tokens=7)})
    kg.ok("serve", "--detach")  # counters count from the service's start
    url = endpoint(kg)
    fallback_then_own(kg)
    samples = wait_for(lambda: (s := scrape(url)) and value(s, "kugetsu_agent_cost_usd_total", agent="fake") and s,
                       15, "the page to count b's cost")
    assert value(samples, "kugetsu_source_tokens_total", source="pm", direction="in") == 207
    assert value(samples, "kugetsu_source_tokens_total", source="pm", direction="out") == 30
    assert value(samples, "kugetsu_source_cost_usd_total", source="pm") == 0.75
    assert value(samples, "kugetsu_agent_tokens_total", agent="other", direction="in") == 7
    assert value(samples, "kugetsu_agent_cost_usd_total", agent="fake") == 0.5
    assert value(samples, "kugetsu_tasks_fallback_started_total", agent="other", fallback_from="fake") == 1


async def test_mcp_delegates_with_a_fallback_and_a_budget_and_capacity_shows_the_budgets(kg):
    from test_mcp import connect

    kg.config(budgets={"sources": {"pm": {"usd": 1}}},
              agents={"fake": preset(kg, cost=1.5), "other": preset(kg, cost=0.1)})
    kg.ok("hold", "fake")
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"name": "a", "prompt": "go", "agent": "fake", "fallback": ["other"],
                                           "source": "pm", "budget_usd": 5, "max_tokens": 1000})
        assert r.structured_content["admitted"] is True
        await anyio.to_thread.run_sync(lambda: kg.wait_state("a", "succeeded", timeout=20))
        r = await c.call_tool("status", {"task": "a"})
        task = r.structured_content
        assert (task["agent"], task["fallback_from"], task["budget_usd"], task["max_tokens"]) == ("other", "fake", 5, 1000)
        kg.ok("release", "fake")
        r = await c.call_tool("delegate", {"name": "b", "prompt": "go", "agent": "fake", "source": "pm"})
        await anyio.to_thread.run_sync(lambda: kg.wait_state("b", "succeeded", timeout=20))
        r = await c.call_tool("capacity", {})
    [budget] = r.structured_content["budgets"]
    assert budget["name"] == "pm" and budget["over"] is True and budget["spent_usd"] == 1.6
    assert "budgets today: pm 1.60/1.00 USD (over" in text_of(r)


async def test_mcp_stats_sums_usage_and_fallbacks_by_source_agent_and_day(kg):
    """Usage totals (issue 30) where a PM agent looks: the stats tool is `kugetsu stats --json`."""
    from test_mcp import connect

    kg.config(agents={"fake": preset(kg, cost=0.5, tokens=100), "other": preset(kg, cost=0.25, tokens=7)})
    fallback_then_own(kg)
    async with connect(kg) as c:
        r = await c.call_tool("stats", {"by": "agent"})
        assert not r.is_error, text_of(r)
        rows = r.structured_content["rows"]
        assert rows["other"]["fallbacks"] == 1 and rows["other"]["usage"]["input_tokens"] == 7
        assert rows["fake"]["usage"]["cost_usd"] == 0.5 and r.structured_content["total"]["usage"]["cost_usd"] == 0.75
        assert "TOKENS IN" in text_of(r) and "$0.75" in text_of(r)
        r = await c.call_tool("stats", {"by": "source", "since": "1h"})
        assert r.structured_content["rows"]["pm"]["usage"]["output_tokens"] == 20
        assert r.structured_content["window_seconds"] == 3600
        r = await c.call_tool("stats", {"by": "day"})
        assert list(r.structured_content["rows"].values())[0]["usage"]["cost_usd"] == 0.75
        r = await c.call_tool("stats", {"by": "colour"})
        assert r.is_error
        r = await c.call_tool("stats", {"since": "soon"})
        assert r.is_error and "Traceback" not in text_of(r)


def text_of(result) -> str:
    return "\n".join(c.text for c in result.content)


def test_failover_and_a_source_budget_across_the_machines_of_a_cluster(machines):
    import json

    a, b = machines("m1", slots=1), machines("m2", slots=1)
    agents = {"fake": preset(a, cost=0.8, tokens=100), "other": preset(a, cost=0.1, tokens=10)}
    a.ok("config", "set", "agents", json.dumps(agents))
    a.ok("config", "set", "budgets", json.dumps({"sources": {"pm": {"usd": 1}}}))
    b.ok("hold", "fake")  # on one machine: held for the cluster
    a.ok("delegate", "x", "--agent", "fake,other", "--source", "pm", "--prompt", "go")
    x = a.wait_state("x", "succeeded", timeout=30)
    assert (x["agent"], x["fallback_from"]) == ("other", "fake")
    a.ok("release", "fake")
    b.ok("delegate", "y", "--agent", "fake", "--source", "pm", "--host", "m2", "--prompt", "go")
    b.wait_state("y", "succeeded", timeout=30)  # pm: 0.90 USD, under its budget
    a.ok("delegate", "z", "--agent", "other", "--source", "pm", "--host", "m1", "--prompt", "go")
    a.wait_state("z", "succeeded", timeout=30)  # pm: 1.00 USD: spent
    b.ok("delegate", "w", "--agent", "other", "--source", "pm", "--prompt", "go")
    for k in (a, b):  # every machine reads the same day's spending
        [queued] = k.json("queue")["queued"]
        assert (queued["name"], queued["waiting_for"]) == ("w", "budget pm 1.00/1.00 USD, resets 00:00")
    rows = a.json("stats", "--by", "host")["rows"]  # each machine's runs, where they ran
    cost = {"x": 0.1, "y": 0.8, "z": 0.1}
    for host in ("m1", "m2"):
        mine = sum(cost[n] for n in cost if a.task(n)["host"] == host)
        assert round(rows[host]["usage"]["cost_usd"] or 0, 2) == round(mine, 2), (host, rows)


def test_a_window_quota_in_tokens_stops_starts_once_the_agents_reported_it_used_up(kg):
    """limit.window_tokens (issue 30, "a token amount"): the tokens the preset's agents reported
    in the window count; once they reach the quota nothing more of the preset starts until the
    window turns, and the task waiting says so."""
    kg.config(max_agents=1, agents={"fake": preset(kg, tokens=100, limit={"window": "1h", "window_tokens": 150}),
                                    "other": preset(kg)})
    for name in ("a", "b", "c"):
        kg.ok("delegate", name, "--agent", "fake", "--prompt", "go")
    kg.wait_state("b", "succeeded", timeout=20)  # a's 110 tokens: under 150, b starts
    [queued] = kg.json("queue")["queued"]
    assert queued["name"] == "c" and queued["waiting_for"].startswith("fake window quota 220/150 tokens, resets "), queued
    kg.ok("delegate", "d", "--agent", "fake,other", "--prompt", "go")  # failover passes over it
    assert kg.wait_state("d", "succeeded", timeout=20)["agent"] == "other"
    assert lines(kg, "c") == [] and kg.task("c")["state"] == "queued"
