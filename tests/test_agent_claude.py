"""The real Claude Code CLI through kugetsu (issue 25): the pinned @anthropic-ai/claude-code
(tests/agent_clis.json, installed from npm by tests/agentclis.py) run by the real service with
the built-in `claude` preset, against a fake Anthropic Messages API on 127.0.0.1
(tests/fakeproviders/anthropic.py) that replays what the API sends: streamed turns with usage,
tool calls, and 429 refusals with their real headers and bodies.

The preset is pointed at the fake through its env (ANTHROPIC_BASE_URL, a key or an OAuth token,
its own config dir), as a user would point it at a proxy. Each test takes a few seconds: a
Claude Code start is 1-3 s on an idle machine, so waits have generous deadlines.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from agentclis import agent_cli, git_repo
from fakeproviders.anthropic import Anthropic, api_rate_limit, subscription_limit, text, tool_use, workdir
from conftest import wait_for

pytestmark = pytest.mark.agent_cli

RUN = 90  # seconds a task of a few Claude Code runs may take on a loaded machine


@pytest.fixture
def api():
    fake = Anthropic()
    yield fake
    fake.close()


def claude_env(kg, api, tmp_path) -> dict[str, str]:
    """The real `claude` on kg's PATH; the preset env that points it at the fake API `api`."""
    binary = agent_cli("claude")
    for var in [v for v in kg.env if v.startswith(("ANTHROPIC_", "CLAUDE_"))]:
        del kg.env[var]  # the machine's own credentials are not the test's
    kg.env["PATH"] = f"{binary.parent}{os.pathsep}{kg.env['PATH']}"
    return {"ANTHROPIC_BASE_URL": api.url, "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"),
            "HOME": str(tmp_path / "claude-home"), "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


@pytest.fixture
def claude(kg, api, tmp_path):
    """kg with the real `claude` on its PATH and the built-in preset's env pointed at the fake
    API; returns a function that writes the config (auth: "subscription" or "api_key")."""
    base = claude_env(kg, api, tmp_path)

    def configure(auth: str = "api_key", limit: dict | None = None, **config: object) -> None:
        secret = {"CLAUDE_CODE_OAUTH_TOKEN": "sk-ant-oat01-test"} if auth == "subscription" else {"ANTHROPIC_API_KEY": "test"}
        preset: dict = {"env": {**base, **secret}}
        if limit:
            preset["limit"] = limit
        agents = {"claude": preset, **config.pop("agents", {})}  # type: ignore[dict-item]
        kg.config(agents=agents, **config)

    return configure



def write(name: str, content: str, **usage: int):
    """A turn calling Write on a file in the agent's working directory (the fake reads it from
    the system prompt, as the model would)."""
    return lambda body: tool_use("Write", {"file_path": f"{workdir(body)}/{name}", "content": content}, **usage)


def prompts(body: dict) -> list[str]:
    """The texts of a request's messages, in order (the conversation the agent sent)."""
    out = []
    for m in body["messages"]:
        content = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        for block in content:
            if block.get("type") == "text":
                out.append(block["text"].strip())
            elif block.get("type") == "tool_use":
                out.append(f"tool_use {block['name']}")
            elif block.get("type") == "tool_result":
                out.append("tool_result")
    return out


def test_claude_edits_files_in_its_worktree_and_its_usage_is_recorded(kg, api, claude, tmp_path):
    claude()
    r = git_repo(tmp_path)
    api.replies.extend([write("hello.txt", "hello from claude\n", input_tokens=120, output_tokens=30,
                              cache_read_input_tokens=1000, cache_creation_input_tokens=50),
                        text("Wrote hello.txt.", input_tokens=150, output_tokens=12)])
    kg.ok("delegate", "hello", "--agent", "claude", "--worktree", "--cwd", str(r), "--prompt", "write hello.txt")
    task = kg.wait_state("hello", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded", task
    assert (Path(task["worktree"]) / "hello.txt").read_text() == "hello from claude\n"
    assert not (r / "hello.txt").exists()  # in its worktree, not in the checkout
    assert re.fullmatch(r"[0-9a-f-]{36}", task["session"])
    usage = task["usage"]
    assert {k: usage[k] for k in ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")} == {
        "input_tokens": 270, "output_tokens": 42, "cache_read_tokens": 1000, "cache_write_tokens": 50}
    raw = kg.ok("logs", "hello", "--raw")
    result = json.loads([line for line in raw.splitlines() if '"type":"result"' in line][-1])
    assert usage["cost_usd"] == result["total_cost_usd"] > 0  # the agent's own figure
    assert "usage" in kg.ok("status", "hello") and "270 tokens in" in kg.ok("status", "hello")
    # `kugetsu logs`: what a person reads, not the JSON stream.
    shown = kg.ok("logs", "hello")
    assert "> Write(" in shown and "Wrote hello.txt." in shown and "270 tokens in" in shown, shown
    assert '"type"' not in shown
    [first, _] = api.conversation()
    assert "write hello.txt" in prompts(first)


def test_a_subscription_limit_holds_the_preset_until_its_reset_and_resumes_the_same_session(kg, api, claude):
    claude(auth="subscription", max_agents=1,
           agents={"other": {"command": ["sh", "-c", 'date +%s.%N > "$0"', str(kg.rec / "other")]}})
    reset: list[int] = []

    def refuse(body):
        reset.append(int(time.time()) + 6)
        return subscription_limit(reset[0])

    api.replies.extend([write("a.txt", "one\n", input_tokens=80, output_tokens=20), refuse,
                        text("Finished where I left off.", input_tokens=300, output_tokens=9)])
    kg.ok("delegate", "a", "--agent", "claude", "--prompt", "write a.txt then b.txt", "--cwd", str(kg.rec))
    kg.ok("delegate", "b", "--agent", "claude", "--prompt", "second task", "--cwd", str(kg.rec))
    kg.ok("delegate", "c", "--agent", "other")
    # a hit the limit: back in the queue ahead of b, the preset held until the reset the API
    # gave (to the second, from the stream), and c (another preset) runs meanwhile.
    # c's process starts inside the transaction that requeues a, whose commit the service may
    # hold for a moment (COMMIT_DELAY) for the exits that follow: c's file alone can come first.
    wait_for(lambda: (kg.rec / "other").exists() and kg.task("c")["state"] != "queued", RUN,
             "c to run while claude is held")
    a = kg.task("a")
    assert a["state"] == "queued" and a["attempts"][0]["limit"] is True, a
    assert a["attempts"][0]["exit_code"] == 1 and "claude usage limit" in a["attempts"][0]["reason"]
    assert a["attempts"][0]["usage"]["input_tokens"] == 80
    [held] = kg.events("held")
    assert held["value"]["until"] == datetime.fromtimestamp(reset[0], timezone.utc).isoformat()
    assert float((kg.rec / "other").read_text()) < reset[0]
    assert [t["name"] for t in kg.json("queue")["queued"]] == ["a", "b"]
    # At the reset it resumes the same session: the API sees the earlier conversation.
    task = kg.wait_state("a", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded" and task["attempt"] == 2, task
    resumed = api.turns()[2]
    assert resumed["at"] >= reset[0]
    said = prompts(resumed["body"])
    assert said.index("write a.txt then b.txt") < said.index("tool_use Write") < said.index("tool_result") \
        < said.index("Continue where you left off."), said
    assert task["usage"]["input_tokens"] == 80 + 300  # both runs
    assert (kg.rec / "a.txt").read_text() == "one\n"
    kg.wait_state("b", "succeeded", timeout=RUN)


def test_a_weekly_limit_shows_its_date_and_release_resumes(kg, api, claude):
    claude(auth="subscription")
    reset = int(time.time()) + 3 * 86400 + 600
    api.replies.extend([subscription_limit(reset, "seven_day"), text("Done after the week.")])
    kg.ok("delegate", "w", "--agent", "claude", "--prompt", "weekly work", "--cwd", str(kg.rec))
    wait_for(lambda: kg.task("w")["attempts"], RUN, "w to hit the weekly limit")
    local = datetime.fromtimestamp(reset, timezone.utc).astimezone()
    shown = f"until {local.strftime('%b')} {local.day} {local.strftime('%H:%M:%S' if local.second else '%H:%M')}"
    assert shown in kg.ok("queue"), kg.ok("queue")
    kg.ok("release", "claude")
    task = kg.wait_state("w", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded", task
    said = prompts(api.conversation()[-1])  # the same session: its first prompt, then the resume's
    assert said.index("weekly work") < said.index("Continue where you left off."), said


@pytest.mark.parametrize("refusal", ["429", "529"])
def test_an_api_rate_limit_is_left_to_kugetsu_not_retried_by_claude(kg, api, claude, refusal):
    # With an API key, a 429 is `API Error: Request rejected (429) · ...` (an overloaded API:
    # `API Error: 529 Overloaded`); Claude Code left to itself retries it for minutes while it
    # holds its slot.
    from fakeproviders.anthropic import error

    claude(limit={"backoff": "1s"})
    api.replies.extend([api_rate_limit() if refusal == "429" else error(529, "overloaded_error", "Overloaded"),
                        text("Served.")])
    kg.ok("delegate", "r", "--agent", "claude", "--prompt", "rate limited", "--cwd", str(kg.rec))
    task = kg.wait_state("r", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded" and [a["limit"] for a in task["attempts"]] == [True], task
    assert len(api.turns()) == 2  # one refused request, one served: no retries of its own
    assert "held until" in kg.events("requeued")[0]["reason"]


def test_a_run_denied_permission_fails_instead_of_passing_for_a_success(kg, api, claude):
    claude()
    api.replies.extend([tool_use("Bash", {"command": "curl -s http://127.0.0.1:9/x > out.txt"}),
                        text("I could not run that.")])
    kg.ok("delegate", "d", "--agent", "claude", "--prompt", "fetch it", "--cwd", str(kg.rec))
    task = kg.wait_state("d", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "failed" and task["exit_code"] == 0, task
    assert "claude was denied permission: Bash: curl -s http://127.0.0.1:9/x" in task["reason"]
    assert "denied: Bash" in kg.ok("logs", "d")


def test_in_text_mode_a_reset_printed_to_the_minute_that_has_come_backs_off_instead_of_a_day(kg, api, claude):
    # The prose fallback: a preset without the structured output reads Claude Code's words.
    # The API's reset is now, Claude prints it to the minute ("resets 5:36pm (UTC)"), and that
    # minute has begun when kugetsu reads it: try again shortly, not at 5:36pm tomorrow.
    flags = ["--permission-mode", "acceptEdits"]
    claude(auth="subscription", limit={"backoff": "1s"},
           agents={"prose": {"command": ["claude", "-p", "{prompt}", *flags], "output": "text"}})
    config = json.loads(kg.home.config.read_text())
    config["agents"]["prose"]["env"] = config["agents"]["claude"]["env"]
    config["agents"]["prose"]["limit"] = {"patterns": [r"(?i)you've hit your [\w -]{0,30}\blimit\b"], "backoff": "1s"}
    kg.home.config.write_text(json.dumps(config))
    api.replies.extend([lambda body: subscription_limit(int(time.time())), text("Done now.")])
    kg.ok("delegate", "p", "--agent", "prose", "--prompt", "prose please", "--cwd", str(kg.rec))
    task = kg.wait_state("p", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded" and [a["limit"] for a in task["attempts"]] == [True], task
    [held] = kg.events("held")
    assert "limit: 1 task held until" in held["reason"]
    until = datetime.fromisoformat(held["value"]["until"])
    assert (until - datetime.fromisoformat(held["at"])).total_seconds() <= 2  # the backoff, not a day
    assert "You've hit your" in kg.ok("logs", "p")


def test_limit_words_in_what_the_agent_read_are_not_its_own_limit(kg, api, claude):
    # The stream holds everything the agent read: a file quoting a limit message must not
    # turn a server error into a week-long hold. The patterns read the agent's own words.
    claude()
    (kg.rec / "notes.txt").write_text("Seen yesterday: You've hit your weekly limit · resets Nov 27, 3pm (UTC)\n")
    from fakeproviders.anthropic import error

    api.replies.extend([tool_use("Bash", {"command": f"cat {kg.rec / 'notes.txt'}"}),
                        error(500, "api_error", "Internal server error")])
    kg.ok("delegate", "n", "--agent", "claude", "--prompt", "read the notes", "--cwd", str(kg.rec))
    task = kg.wait_state("n", "failed", "queued", timeout=RUN)
    assert task["state"] == "failed" and task["exit_code"] == 1, task
    assert task["reason"].startswith("exit code 1: API Error: 500"), task["reason"]
    assert "You've hit your weekly limit" in kg.ok("logs", "n", "--raw")  # it was read, as a tool result
    assert not kg.events("held")
