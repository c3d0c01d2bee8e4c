"""Failover, usage and budgets with the real agent CLIs (issue 30): the pinned Claude Code and
Codex (tests/agent_clis.json) run by the real service with the built-in presets, against the
fake provider APIs of issue 25 (tests/fakeproviders), which report usage and refuse with real
limits. Claude Code streams each turn's usage, so its budget stops a run mid-way."""

from __future__ import annotations

import time

import pytest

from conftest import wait_for
from fakeproviders.anthropic import Anthropic, subscription_limit, text, tool_use
from fakeproviders.openai import FakeOpenAI, responses_text
from test_agent_claude import claude_env
from test_agent_codex import codex_env

pytestmark = pytest.mark.agent_cli

RUN = 90  # seconds a task of a few agent runs may take on a loaded machine


@pytest.fixture
def anthropic():
    fake = Anthropic()
    yield fake
    fake.close()


@pytest.fixture
def openai():
    with FakeOpenAI() as fake:
        yield fake


def test_claude_is_stopped_mid_run_once_its_streamed_usage_passes_the_task_budget(kg, anthropic, tmp_path):
    env = {**claude_env(kg, anthropic, tmp_path), "ANTHROPIC_API_KEY": "test"}
    kg.config(agents={"claude": {"env": env}})

    def stall(body):  # the turn after the first: the model takes its time (the budget ends it first)
        time.sleep(40)
        return text("too late")

    anthropic.replies.extend([tool_use("Bash", {"command": "sleep 40"}, input_tokens=8000, output_tokens=30), stall])
    began = time.monotonic()
    kg.ok("delegate", "dear", "--agent", "claude", "--prompt", "think hard", "--cwd", str(kg.rec),
          "--max-tokens", "5000")
    task = kg.wait_state("dear", "failed", "succeeded", timeout=RUN)
    assert task["state"] == "failed" and task["reason"].startswith("budget 5,000 tokens exceeded: 8,0"), task
    assert time.monotonic() - began < 35  # stopped, not waited out
    assert task["usage"]["input_tokens"] >= 8000  # what its stream said before it was stopped
    assert "budget 5,000 tokens exceeded" in kg.ok("status", "dear")


def test_claude_held_by_its_limit_fails_over_to_codex_and_both_usages_are_summed(kg, anthropic, openai, tmp_path):
    env = {**claude_env(kg, anthropic, tmp_path), "CLAUDE_CODE_OAUTH_TOKEN": "sk-ant-oat01-test"}
    codex_env(kg, openai, tmp_path)
    kg.config(max_agents=1, default_agent="claude", agents={"claude": {"env": env, "fallback": ["codex"]}})
    reset = int(time.time()) + 120
    anthropic.replies.extend([text("first part done", input_tokens=300, output_tokens=40), subscription_limit(reset)])
    openai.push(responses_text("done by codex", input_tokens=700, output_tokens=25))
    kg.ok("delegate", "a", "--prompt", "first task", "--cwd", str(kg.rec), "--source", "pm")  # claude's preset: fallback codex
    kg.wait_state("a", "succeeded", timeout=RUN)
    kg.ok("delegate", "b", "--agent", "claude", "--prompt", "second task", "--cwd", str(kg.rec), "--source", "pm")
    kg.ok("delegate", "c", "--agent", "claude,codex", "--prompt", "third task", "--cwd", str(kg.rec), "--source", "pm")
    # b hits claude's limit: claude is held; b keeps its session (it waits to resume on claude),
    # c, which allows the fallback and has no session yet, starts on codex meanwhile.
    c = kg.wait_state("c", "succeeded", "failed", timeout=RUN)
    assert c["state"] == "succeeded" and c["agent"] == "codex" and c["fallback_from"] == "claude", c
    assert c["usage"]["input_tokens"] == 700 and c["usage"]["output_tokens"] == 25
    b = kg.task("b")
    assert b["state"] == "queued" and b["agent"] == "claude" and b["attempts"][0]["limit"] is True
    [queued] = kg.json("queue")["queued"]
    assert queued["name"] == "b" and queued["waiting_for"].startswith("claude usage limit, retry at ")
    assert "codex (fallback from claude)" in kg.ok("status", "c")
    rows = kg.json("stats", "--by", "agent")["rows"]
    assert rows["claude"]["usage"]["input_tokens"] == 300 + b["attempts"][0].get("usage", {}).get("input_tokens", 0)
    assert rows["codex"]["usage"]["input_tokens"] == 700 and rows["codex"]["fallbacks"] == 1
    assert kg.json("stats", "--by", "source")["rows"]["pm"]["usage"]["output_tokens"] >= 40 + 25
    kg.ok("cancel", "b")
    wait_for(lambda: kg.task("b")["state"] == "cancelled", 10, "b cancelled")


def test_claudes_reported_tokens_spend_a_sources_daily_budget_and_a_window_quota_gates_starts(kg, anthropic, tmp_path):
    """The budgets and the window quota from what the real Claude Code reports: pm's daily
    budget in tokens is spent by its run (nothing more of pm starts today, by name), and
    claude's window of one start lets no second claude task start (issue 30, items 3 and 4)."""
    env = {**claude_env(kg, anthropic, tmp_path), "ANTHROPIC_API_KEY": "test"}
    kg.config(max_agents=2, budgets={"sources": {"pm": {"tokens": 2000}}},
              agents={"claude": {"env": env, "limit": {"window": "1h", "window_starts": 1}}})
    anthropic.replies.extend([text("done", input_tokens=2500, output_tokens=20)])
    kg.ok("delegate", "a", "--agent", "claude", "--prompt", "first", "--cwd", str(kg.rec), "--source", "pm")
    a = kg.wait_state("a", "succeeded", "failed", timeout=RUN)
    assert a["state"] == "succeeded" and a["usage"]["input_tokens"] >= 2500, a
    kg.ok("delegate", "b", "--agent", "claude", "--prompt", "second", "--cwd", str(kg.rec), "--source", "ops")
    kg.ok("delegate", "c", "--source", "pm", "--", "true")
    queued = {t["name"]: t["waiting_for"] for t in kg.json("queue")["queued"]}
    assert queued["b"].startswith("claude window quota 1/1 starts, resets "), queued
    assert queued["c"].startswith("budget pm 2,5") and queued["c"].endswith("/2,000 tokens, resets 00:00"), queued
    kg.ok("cancel", "b", "c")
