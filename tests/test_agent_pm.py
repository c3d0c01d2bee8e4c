"""A PM agent delegating through `kugetsu mcp` (issue 25): the real Claude Code CLI (pinned in
tests/agent_clis.json) runs as the PM, with the real `python -m kugetsu mcp` as its MCP server
(--mcp-config), against the fake Anthropic API on 127.0.0.1 (tests/fakeproviders/anthropic.py).

The fake scripts the model's turns as calls of the kugetsu tools, named as Claude Code offers
them (mcp__kugetsu__capacity, ...), and records every request: what Claude Code passed to the
model as each tool's result is what the test asserts on, beside kugetsu's own state (the CLI's
--json). The scenario is back-pressure: a full queue rejects the PM's delegate with advice to
back off; once the queue has room, the same delegate is admitted and `wait` reports its success.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from agentclis import agent_cli
from conftest import REPO, wait_for
from fakeproviders.anthropic import Anthropic, text, tool_use

pytestmark = pytest.mark.agent_cli

RUN = 180  # seconds for a PM run of several turns, each an MCP call, on a loaded 2-core machine

# kugetsu's own words (kugetsu/mcp/server.py), as the model must be shown them.
BACK_OFF = "Nothing was queued. Back off: try again in about 60s (or after one of your tasks ends); do not retry at once."


@pytest.fixture
def api():
    fake = Anthropic()
    yield fake
    fake.close()


def tool_results(api: Anthropic) -> dict[str, list[str]]:
    """Tool name -> the contents Claude Code sent the model as its results, in order (from the
    latest request, which carries the whole conversation)."""
    conversation = api.conversation()
    if not conversation:
        return {}
    names: dict[str, str] = {}
    out: dict[str, list[str]] = {}
    for message in conversation[-1]["messages"]:
        if not isinstance(message["content"], list):
            continue
        for block in message["content"]:
            if block.get("type") == "tool_use":
                names[block["id"]] = block["name"]
            elif block.get("type") == "tool_result":
                content = block.get("content")
                if isinstance(content, list):
                    content = "\n".join(c.get("text", "") for c in content if isinstance(c, dict))
                out.setdefault(names.get(block["tool_use_id"], "?"), []).append(str(content))
    return out


def run_claude_pm(kg, api, tmp_path, prompt: str) -> subprocess.Popen[str]:
    """The real Claude Code in print mode as the PM, its only MCP server `kugetsu mcp` on the
    test's home, the kugetsu tools allowed (print mode asks no one for permission)."""
    binary = agent_cli("claude")
    server_env = {"KUGETSU_HOME": str(kg.home.root), "PYTHONPATH": kg.env["PYTHONPATH"]}
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"kugetsu": {
        "type": "stdio", "command": sys.executable, "args": ["-m", "kugetsu", "mcp"], "env": server_env}}}))
    env = {k: v for k, v in kg.env.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update({"ANTHROPIC_BASE_URL": api.url, "ANTHROPIC_API_KEY": "test",
                "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"), "HOME": str(tmp_path / "claude-home"),
                "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "CLAUDE_CODE_MAX_RETRIES": "0",
                # Every tool offered up front: deferred behind a tool search, MCP tools are not
                # callable until the model searched for them, a turn this script does not play.
                "ENABLE_TOOL_SEARCH": "false", "MCP_TIMEOUT": "120000", "MCP_TOOL_TIMEOUT": "600000"})
    return subprocess.Popen(
        [str(binary), "-p", prompt, "--output-format", "json", "--mcp-config", str(config), "--strict-mcp-config",
         "--allowedTools", "mcp__kugetsu"],
        cwd=kg.rec, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_claude_code_pm_backs_off_when_the_queue_is_full_then_delegates_and_waits(kg, api, tmp_path):
    kg.config(max_agents=1, max_queue=1)
    gate = tmp_path / "gate"
    kg.delegate("long", gate=gate)
    kg.wait_state("long", "running", timeout=60)
    kg.delegate("filler")
    assert kg.json("capacity")["queued"] == 1  # the queue is full: max_queue 1

    room = threading.Event()  # the model "thinks" (its request is held) until the queue has room

    def after_backing_off(body):
        room.wait(RUN)
        return tool_use("mcp__kugetsu__delegate", work)

    work = {"name": "work", "source": "pm", "command": kg.agent("work")}
    api.replies.extend([
        tool_use("mcp__kugetsu__capacity", {}),
        tool_use("mcp__kugetsu__delegate", work),
        after_backing_off,
        tool_use("mcp__kugetsu__wait", {"tasks": ["work"], "timeout": "5m"}),
        text("work succeeded."),
    ])
    pm = run_claude_pm(kg, api, tmp_path, "Delegate issue `work` to kugetsu and report when it is done.")
    try:
        # Claude Code offers the model kugetsu's tools under its MCP names.
        offered = wait_for(lambda: api.conversation() and {t["name"] for t in api.conversation()[0]["tools"]},
                           RUN, "Claude Code's first request")
        assert {"mcp__kugetsu__capacity", "mcp__kugetsu__delegate", "mcp__kugetsu__wait"} <= offered, offered

        # The first delegate: rejected, nothing queued, and the model is told to back off.
        [refused] = wait_for(lambda: tool_results(api).get("mcp__kugetsu__delegate"), RUN, "the first delegate's result")
        [capacity] = tool_results(api)["mcp__kugetsu__capacity"]
        # Claude Code hands the model the structured content (the CLI's --json), not the text.
        assert json.loads(capacity) == {"max_agents": 1, "active": 1, "queued": 1, "free": 0, "max_queue": 1,
                                        "paused": False, "paused_groups": []}, capacity
        refused = json.loads(refused)
        assert refused["admitted"] is False and refused["task"] is None, refused
        assert refused["advice"] == BACK_OFF and refused["retry_after"] == 60, refused
        assert refused["message"].startswith("rejected: "), refused
        assert [t["name"] for t in kg.json("queue")["queued"]] == ["filler"]
        assert not (kg.rec / "work").exists()

        # The test makes room (cancels the queued task through the CLI); the PM delegates again.
        kg.ok("cancel", "filler")
        room.set()
        [_, admitted] = wait_for(lambda: len(tool_results(api).get("mcp__kugetsu__delegate", [])) == 2
                                 and tool_results(api)["mcp__kugetsu__delegate"], RUN, "the second delegate's result")
        admitted = json.loads(admitted)
        assert admitted["admitted"] is True and admitted["message"] == "queued work (#3), position 1 of 1", admitted
        assert admitted["task"]["name"] == "work" and "call wait with 'work'" in admitted["advice"], admitted
        queued = kg.task("work")
        assert (queued["state"], queued["source"], queued["position"]) == ("queued", "pm", 1), queued

        # The PM waits; the long task ends, `work` runs (a real process) and succeeds.
        wait_for(lambda: len(api.replies) == 1, RUN, "the PM's wait call")  # only its last words are left
        assert kg.task("work")["state"] == "queued" and not (kg.rec / "work").exists()
        gate.touch()
        out, err = pm.communicate(timeout=RUN)
    finally:
        room.set()
        if pm.poll() is None:
            pm.kill()
            pm.communicate()
    assert pm.returncode == 0, (out, err)
    assert json.loads(out)["result"] == "work succeeded."
    [waited] = tool_results(api)["mcp__kugetsu__wait"]
    waited = json.loads(waited)
    assert waited["done"] is True and waited["all_succeeded"] is True and waited["advice"] is None, waited
    assert [(t["name"], t["state"]) for t in waited["tasks"]] == [("work", "succeeded")], waited
    assert kg.task("work")["state"] == "succeeded"
    assert set(kg.times("work")) == {"start", "end"}  # it really ran
    assert kg.task("filler")["state"] == "cancelled" and not (kg.rec / "filler").exists()
