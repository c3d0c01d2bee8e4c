"""A PM agent delegating through `kugetsu mcp` (issue 25): the real Claude Code CLI and the real
opencode (pinned in tests/agent_clis.json) run as the PM, with the real `python -m kugetsu mcp`
as their MCP server (Claude Code's --mcp-config; opencode.json's `mcp`), against the fake
Anthropic and OpenAI APIs on 127.0.0.1 (tests/fakeproviders/).

The fakes script the model's turns as calls of the kugetsu tools, named as each client offers
them (Claude Code: mcp__kugetsu__capacity; opencode: kugetsu_capacity), and record every
request: what the client passed to the model as each tool's result is what the tests assert
on, beside kugetsu's own state (the CLI's --json). Claude Code 2.1.331 passes the structured
content (the JSON), opencode 1.18.33 the text: kugetsu's advice must be in both. The scenario is back-pressure: a full queue rejects the PM's delegate with advice to
back off; once the queue has room, the same delegate is admitted and `wait` reports its success.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agentclis import agent_cli
from conftest import REPO, wait_for
from fakeproviders.anthropic import Anthropic, text, tool_use
from fakeproviders.openai import KEY, FakeOpenAI, chat_call, chat_text, side_request

pytestmark = pytest.mark.agent_cli

RUN = 180  # seconds for a PM run of several turns, each an MCP call, on a loaded 2-core machine

# kugetsu's own words (kugetsu/frontends/mcp/server.py), as the model must be shown them.
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


def nth_result(results, tool: str, n: int, timeout: float) -> str:
    """The n-th (from 1) result of `tool` the model was shown, once it was."""
    return wait_for(lambda: len(got := results().get(tool, [])) >= n and got, timeout, f"{tool}'s result {n}")[n - 1]


def full_queue(kg, tmp_path) -> Path:
    """One slot, taken by `long` until the gate (returned) exists, and a queue of one, taken
    by `filler`: the next delegate is rejected."""
    kg.config(max_agents=1, max_queue=1)
    gate = tmp_path / "gate"
    kg.delegate("long", gate=gate)
    kg.wait_state("long", "running", timeout=60)
    kg.delegate("filler")
    assert kg.json("capacity")["queued"] == 1
    return gate


def work_is_queued(kg) -> None:
    """The admitted `work`: the PM's (its source), first in the queue behind `long`, not run yet."""
    t = kg.task("work")
    assert (t["state"], t["source"], t["position"]) == ("queued", "pm", 1), t
    assert not (kg.rec / "work").exists()


def work_runs_after_the_pm_waits(kg, pm: subprocess.Popen[str], gate: Path, waiting, timeout: float) -> tuple[str, str]:
    """Once the PM called wait (`waiting()`: only its last words are left in the script),
    `long` ends, `work` runs in its slot; the PM's output when it is done."""
    work_is_queued(kg)
    wait_for(waiting, timeout, "the PM's wait call")
    work_is_queued(kg)
    gate.touch()
    return pm.communicate(timeout=timeout)


@contextlib.contextmanager
def ended(pm: subprocess.Popen[str], room: threading.Event):
    """Whatever the test saw, the held turn is let go and the PM does not outlive the test."""
    try:
        yield
    finally:
        room.set()
        if pm.poll() is None:
            pm.kill()
            pm.communicate()


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


@pytest.mark.timeout(600)
def test_a_claude_code_pm_backs_off_when_the_queue_is_full_then_delegates_and_waits(kg, api, tmp_path):
    gate = full_queue(kg, tmp_path)

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
    with ended(pm, room):
        # Claude Code offers the model kugetsu's tools under its MCP names.
        offered = wait_for(lambda: api.conversation() and {t["name"] for t in api.conversation()[0]["tools"]},
                           RUN, "Claude Code's first request")
        assert {"mcp__kugetsu__capacity", "mcp__kugetsu__delegate", "mcp__kugetsu__wait"} <= offered, offered

        # The first delegate: rejected, nothing queued, and the model is told to back off.
        refused = nth_result(lambda: tool_results(api), "mcp__kugetsu__delegate", 1, RUN)
        [capacity] = tool_results(api)["mcp__kugetsu__capacity"]
        # Claude Code hands the model the structured content (the CLI's --json), not the text.
        assert json.loads(capacity) == {"max_agents": 1, "active": 1, "queued": 1, "free": 0, "max_queue": 1,
                                        "paused": False, "paused_groups": [], "holds": {}}, capacity
        refused = json.loads(refused)
        assert refused["admitted"] is False and refused["task"] is None, refused
        assert refused["advice"] == BACK_OFF and refused["retry_after"] == 60, refused
        assert refused["message"].startswith("rejected: "), refused
        assert [t["name"] for t in kg.json("queue")["queued"]] == ["filler"]
        assert not (kg.rec / "work").exists()

        # The test makes room (cancels the queued task through the CLI); the PM delegates again.
        kg.ok("cancel", "filler")
        room.set()
        admitted = json.loads(nth_result(lambda: tool_results(api), "mcp__kugetsu__delegate", 2, RUN))
        assert admitted["admitted"] is True and admitted["message"] == "queued work (#3), position 1 of 1", admitted
        assert admitted["task"]["name"] == "work" and "call wait with 'work'" in admitted["advice"], admitted
        # The PM waits; the long task ends, `work` runs (a real process) and succeeds.
        out, err = work_runs_after_the_pm_waits(kg, pm, gate, lambda: len(api.replies) == 1, RUN)
    assert pm.returncode == 0, (out, err)
    assert json.loads(out)["result"] == "work succeeded."
    [waited] = tool_results(api)["mcp__kugetsu__wait"]
    waited = json.loads(waited)
    assert waited["done"] is True and waited["all_succeeded"] is True and waited["advice"] is None, waited
    assert [(t["name"], t["state"]) for t in waited["tasks"]] == [("work", "succeeded")], waited
    assert kg.task("work")["state"] == "succeeded"
    assert set(kg.times("work")) == {"start", "end"}  # it really ran
    assert kg.task("filler")["state"] == "cancelled" and not (kg.rec / "filler").exists()


# ---- opencode --------------------------------------------------------------------------------


class HeldOpenAI(FakeOpenAI):
    """The fake OpenAI API whose `hold`-th scripted turn (counted from 1, side requests not
    counted) waits, outside the fake's lock, until `room` is set: the model thinking."""

    def __init__(self, hold: int, room: threading.Event):
        super().__init__()
        self.hold, self.room, self.seen = hold, room, 0

    def _take(self, path, body):
        if not side_request(body):
            self.seen += 1
            if self.seen == self.hold:
                self.room.wait(RUN)
        return super()._take(path, body)


def opencode_results(api: FakeOpenAI) -> dict[str, list[str]]:
    """Tool name -> the contents opencode sent the model as its results, in order."""
    bodies = [b for b in api.bodies("chat") if not side_request(b)]
    if not bodies:
        return {}
    names: dict[str, str] = {}
    out: dict[str, list[str]] = {}
    for m in bodies[-1].get("messages", []):
        for call in m.get("tool_calls") or []:
            names[call["id"]] = call["function"]["name"]
        if m.get("role") == "tool":
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(c.get("text", "") for c in content if isinstance(c, dict))
            out.setdefault(names.get(m.get("tool_call_id"), "?"), []).append(str(content))
    return out


@pytest.mark.timeout(900)
def test_an_opencode_pm_backs_off_when_the_queue_is_full_then_delegates_and_waits(kg, tmp_path):
    run = 420  # an opencode start alone takes 20-130 s at load 20 on 2 cores
    binary = agent_cli("opencode")
    gate = full_queue(kg, tmp_path)
    room = threading.Event()
    work = {"name": "work", "source": "pm", "command": kg.agent("work")}
    with HeldOpenAI(3, room) as api:
        api.push(chat_call("kugetsu_capacity", {}), chat_call("kugetsu_delegate", work),
                 chat_call("kugetsu_delegate", work), chat_call("kugetsu_wait", {"tasks": ["work"], "timeout": "5m"}),
                 chat_text("work succeeded."))
        config = tmp_path / "opencode.json"
        config.write_text(json.dumps({
            "provider": {"fake": {"npm": "@ai-sdk/openai-compatible", "name": "Fake",
                                  "options": {"baseURL": api.base_url, "apiKey": KEY},
                                  "models": {"fake-model": {"name": "Fake"}}}},
            "model": "fake/fake-model", "small_model": "fake/fake-model", "autoupdate": False, "share": "disabled",
            "mcp": {"kugetsu": {"type": "local", "command": [sys.executable, "-m", "kugetsu", "mcp"], "environment": {
                "KUGETSU_HOME": str(kg.home.root), "PYTHONPATH": kg.env["PYTHONPATH"]}}}}))
        xdg = tmp_path / "opencode-xdg"
        env = {k: v for k, v in kg.env.items() if not k.startswith(("OPENAI_", "OPENCODE_"))}
        env.update({"OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_MODELS_FETCH": "1",
                    "OPENCODE_DISABLE_AUTOUPDATE": "1", "HOME": str(tmp_path / "opencode-home"),
                    "XDG_CONFIG_HOME": str(xdg / "config"), "XDG_DATA_HOME": str(xdg / "data"),
                    "XDG_CACHE_HOME": str(xdg / "cache"), "XDG_STATE_HOME": str(xdg / "state")})
        pm = subprocess.Popen([str(binary), "run", "--format", "json", "Delegate issue work to kugetsu and report."],
                              cwd=kg.rec, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        with ended(pm, room):
            refused = nth_result(lambda: opencode_results(api), "kugetsu_delegate", 1, run)
            offered = {t["function"]["name"] for b in api.bodies("chat") if not side_request(b) for t in b.get("tools", [])}
            assert {"kugetsu_capacity", "kugetsu_delegate", "kugetsu_wait"} <= offered, offered
            # opencode hands the model the text content: the CLI's words, then the advice.
            [capacity] = opencode_results(api)["kugetsu_capacity"]
            assert capacity == "1/1 running, 0 free, 1 queued (max 1)", capacity
            assert refused.startswith("rejected: queue full: ") and refused.endswith(f". {BACK_OFF}"), refused
            assert [t["name"] for t in kg.json("queue")["queued"]] == ["filler"]
            kg.ok("cancel", "filler")
            room.set()
            admitted = nth_result(lambda: opencode_results(api), "kugetsu_delegate", 2, run)
            assert admitted == "queued work (#3), position 1 of 1", admitted
            out, err = work_runs_after_the_pm_waits(kg, pm, gate, lambda: len(api.queue) == 1, run)
        assert pm.returncode == 0, (out, err)
        [waited] = opencode_results(api)["kugetsu_wait"]
    assert waited == "work (#3) succeeded", waited
    assert kg.task("work")["state"] == "succeeded"
    assert set(kg.times("work")) == {"start", "end"}  # it really ran
    assert kg.task("filler")["state"] == "cancelled" and not (kg.rec / "filler").exists()
