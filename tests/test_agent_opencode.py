"""The real opencode through kugetsu (issue 25): the pinned opencode-ai (tests/agent_clis.json,
installed from npm by tests/agentclis.py) run by the real service with the built-in `opencode`
preset as shipped (its JSON events, kugetsu's plugin), against a fake OpenAI-compatible chat
completions API on 127.0.0.1 (tests/fakeproviders/openai.py): streamed turns with usage, tool
calls (write), and 429 refusals with OpenAI's bodies and headers.

opencode is pointed at the fake as a user points it at any OpenAI-compatible provider: an
opencode.json (OPENCODE_CONFIG) with a provider on @ai-sdk/openai-compatible, in the service's
environment; offline (OPENCODE_DISABLE_MODELS_FETCH: models.dev is not reachable here), in its
own HOME and XDG directories. An opencode start takes seconds, tens of them on a loaded
machine: waits have generous deadlines.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from agentclis import agent_cli, git_repo
from conftest import wait_for
from fakeproviders.openai import KEY, FakeOpenAI, chat_call, chat_text, cwd_of, insufficient_quota, rate_limit

pytestmark = pytest.mark.agent_cli

RUN = 420  # seconds a task of two opencode runs may take on a loaded machine (one start: 20-130 s at load 20 on 2 cores)


@pytest.fixture
def api():
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
def opencode(kg, api, tmp_path):
    """kg with the real `opencode` on its PATH, its config naming the fake as its provider."""
    binary = agent_cli("opencode")
    for var in [v for v in kg.env if v.startswith(("OPENAI_", "OPENCODE_"))]:
        del kg.env[var]
    config = tmp_path / "opencode.json"
    config.write_text(json.dumps({
        "provider": {"fake": {"npm": "@ai-sdk/openai-compatible", "name": "Fake",
                              "options": {"baseURL": api.base_url, "apiKey": KEY},
                              "models": {"fake-model": {"name": "Fake"}}}},
        "model": "fake/fake-model", "small_model": "fake/fake-model", "autoupdate": False, "share": "disabled"}))
    xdg = tmp_path / "opencode-xdg"
    kg.env.update({"PATH": f"{binary.parent}{os.pathsep}{kg.env['PATH']}", "OPENCODE_CONFIG": str(config),
                   "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
                   "HOME": str(tmp_path / "opencode-home"), "XDG_CONFIG_HOME": str(xdg / "config"),
                   "XDG_DATA_HOME": str(xdg / "data"), "XDG_CACHE_HOME": str(xdg / "cache"),
                   "XDG_STATE_HOME": str(xdg / "state")})
    return kg



def write(name: str, content: str, **usage: int):
    """A turn calling opencode's write tool on a file in the agent's working directory (as it
    told the model in its system prompt)."""
    return lambda body: chat_call("write", {"filePath": f"{cwd_of(body)}/{name}", "content": content}, **usage)


def said(body: dict) -> list[str]:
    """What a chat request sent after its system prompt, in order."""
    out = []
    for m in body.get("messages", [])[1:]:
        content = m.get("content")
        if m.get("tool_calls"):
            out += [f"call {c['function']['name']}" for c in m["tool_calls"]]
        elif m.get("role") == "tool":
            out.append("output")
        elif isinstance(content, list):
            out += [c.get("text", "") for c in content if isinstance(c, dict) and c.get("type") == "text"]
        elif isinstance(content, str):
            out.append(content)
    return [t.strip().strip('"') for t in out]  # opencode 1.18 sends a user's text in quotes


def turns(api) -> list[dict]:
    return [b for b in api.bodies("chat") if "title generator" not in json.dumps(b.get("messages", [])[:1])]


@pytest.mark.timeout(900)
def test_opencode_edits_files_in_its_worktree_and_its_usage_is_recorded(opencode, api, tmp_path):
    r = git_repo(tmp_path)
    api.push(write("hello.txt", "hello from opencode\n", prompt_tokens=1000, completion_tokens=30),
             chat_text("Wrote hello.txt.", prompt_tokens=1200, completion_tokens=12, cached=1000))
    opencode.ok("delegate", "hello", "--agent", "opencode", "--worktree", "--cwd", str(r), "--prompt", "write hello.txt")
    task = opencode.wait_state("hello", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded", (task, opencode.ok("logs", "hello", "--raw")[-3000:])
    assert (Path(task["worktree"]) / "hello.txt").read_text() == "hello from opencode\n"
    assert not (r / "hello.txt").exists()
    assert re.fullmatch(r"ses_[A-Za-z0-9]+", task["session"])
    usage = task["usage"]
    assert usage["input_tokens"] + usage.get("cache_read_tokens", 0) == 2200 and usage["output_tokens"] == 42, usage
    shown = opencode.ok("logs", "hello")
    assert "> write(" in shown and "Wrote hello.txt." in shown and "[done]" in shown, shown
    assert '"type"' not in shown


@pytest.mark.timeout(900)
def test_a_long_retry_after_ends_opencode_at_once_holds_the_preset_and_resumes_the_session(opencode, api):
    opencode.config(max_agents=1, agents={"other": {"command": ["sh", "-c", 'date +%s.%N > "$0"', str(opencode.rec / "other")]}})
    refused: list[float] = []

    def refuse(body):
        refused.append(time.time())
        return insufficient_quota(headers={"retry-after": "3600"})

    api.push(write("a.txt", "one\n", prompt_tokens=80, completion_tokens=20), refuse,
             chat_text("Finished where I left off.", prompt_tokens=300, completion_tokens=9))
    opencode.ok("delegate", "a", "--agent", "opencode", "--prompt", "write a.txt then b.txt", "--cwd", str(opencode.rec))
    opencode.ok("delegate", "c", "--agent", "other")
    # Left to itself, opencode would sleep an hour before its retry, printing nothing. The
    # plugin ends the run at once; kugetsu holds the preset until then; c runs meanwhile.
    # c's process starts inside the transaction that requeues a, whose commit the service may
    # hold for a moment (COMMIT_DELAY) for the exits that follow: c's file alone can come first.
    wait_for(lambda: (opencode.rec / "other").exists() and opencode.task("c")["state"] != "queued", RUN,
             "c to run while opencode is held")
    a = opencode.task("a")
    assert a["state"] == "queued" and a["attempts"][0]["limit"] is True, (a, opencode.ok("logs", "a", "--raw")[-3000:])
    assert a["attempts"][0]["exit_code"] == 75
    [held] = opencode.events("held")
    until = datetime.fromisoformat(held["value"]["until"])
    when = datetime.fromtimestamp(refused[0], timezone.utc) + timedelta(seconds=3600)
    assert abs(until - when) < timedelta(seconds=10), (until, when)
    assert (opencode.rec / "a.txt").read_text() == "one\n"
    opencode.ok("release", "opencode")
    task = opencode.wait_state("a", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded" and task["attempt"] == 2, task
    assert task["command"][:2] == ["opencode", "run"] and task["session"] in task["command"]
    s = said(turns(api)[-1])
    assert s.index("write a.txt then b.txt") < s.index("call write") < s.index("output") \
        < s.index("Continue where you left off."), s
    assert task["usage"]["input_tokens"] == 80 + 300, task["usage"]


@pytest.mark.timeout(900)
def test_a_rate_limit_opencode_gives_up_on_holds_with_a_backoff_and_resumes(opencode, api):
    # A 429 with a short wait: opencode's own retries (5 at most in 1.18), then its error event
    # (status 429): kugetsu holds the preset for its backoff, then resumes the session.
    opencode.config(agents={"opencode": {"limit": {"backoff": "2s"}}})
    api.push(*[rate_limit(retry_after=0) for _ in range(6)], chat_text("Served."))
    opencode.ok("delegate", "r", "--agent", "opencode", "--prompt", "rate limited work", "--cwd", str(opencode.rec))
    task = opencode.wait_state("r", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded" and [x["limit"] for x in task["attempts"]] == [True], (
        task, opencode.ok("logs", "r", "--raw")[-3000:])
    assert "opencode usage limit" in opencode.events("held")[0]["reason"]
    s = said(turns(api)[-1])
    assert s.index("rate limited work") < s.index("Continue where you left off."), s


@pytest.mark.timeout(900)
def test_a_write_outside_its_directory_is_denied_and_fails_the_task(opencode, api, tmp_path):
    # In `run`, opencode rejects what its permissions would ask about (a file outside its
    # directory) and the run ends with exit 0: kugetsu fails the task, saying what was denied.
    outside = tmp_path / "outside.txt"
    api.push(chat_call("write", {"filePath": str(outside), "content": "no\n"}), chat_text("I could not."))
    opencode.ok("delegate", "d", "--agent", "opencode", "--prompt", "write outside", "--cwd", str(opencode.rec))
    task = opencode.wait_state("d", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "failed" and task["exit_code"] == 0, task
    assert f"opencode was denied permission: write: {outside}" in task["reason"]
    assert not outside.exists()
