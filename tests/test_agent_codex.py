"""The real Codex CLI through kugetsu (issue 25): the pinned @openai/codex (tests/agent_clis.json,
installed from npm by tests/agentclis.py) run by the real service with the built-in `codex`
preset as shipped, against a fake OpenAI Responses API on 127.0.0.1
(tests/fakeproviders/openai.py) replaying what OpenAI sends: streamed turns with usage, tool
calls (apply_patch, exec_command), and 429 refusals with their bodies and headers.

Codex is pointed at the fake the way a user points it at a provider: a config.toml in its
CODEX_HOME naming a model provider with the fake's base_url, and OPENAI_API_KEY, both in the
service's environment (so the preset itself is the built-in one).
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
from conftest import wait_for
from fakeproviders.openai import (KEY, FakeOpenAI, insufficient_quota, rate_limit, responses_call,
                                  responses_custom_call, responses_text, usage_limit)

pytestmark = pytest.mark.agent_cli

RUN = 90  # seconds a task of a few Codex runs may take on a loaded machine
ZONE = "Asia/Kolkata"  # UTC+5:30: Codex prints a reset in its zone, kugetsu reads it in its own


@pytest.fixture
def api():
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
def codex(kg, api, tmp_path):
    """kg with the real `codex` on its PATH, its CODEX_HOME naming the fake as its provider."""
    codex_env(kg, api, tmp_path)
    return kg


def codex_env(kg, api, tmp_path) -> None:
    """The real `codex` on kg's PATH, its CODEX_HOME naming the fake `api` as its provider."""
    binary = agent_cli("codex")
    for var in [v for v in kg.env if v.startswith(("OPENAI_", "CODEX_"))]:
        del kg.env[var]  # the machine's own credentials are not the test's
    home = tmp_path / "codex-home"
    home.mkdir()
    # Codex retries a refused request itself (request_max_retries, default 4, with backoff):
    # none here, so that a test of a 429 takes a second, not a minute.
    (home / "config.toml").write_text(
        'model = "gpt-5.5"\nmodel_provider = "fake"\n[model_providers.fake]\nname = "fake"\n'
        f'base_url = "{api.base_url}"\nwire_api = "responses"\nenv_key = "OPENAI_API_KEY"\n'
        "request_max_retries = 0\nstream_max_retries = 0\n")
    kg.env.update({"PATH": f"{binary.parent}{os.pathsep}{kg.env['PATH']}", "CODEX_HOME": str(home),
                   "OPENAI_API_KEY": KEY, "TZ": ZONE})



def said(body: dict) -> list[str]:
    """What a Responses request sent, in order: user texts, tool calls and their outputs."""
    out = []
    for item in body.get("input", []):
        kind = item.get("type")
        if kind == "message" and item.get("role") == "user":
            out += [c.get("text", "").strip() for c in item.get("content", []) if c.get("type") == "input_text"]
        elif kind in ("function_call", "custom_tool_call"):
            out.append(f"call {item['name']}")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append("output")
    return out


def test_codex_edits_files_in_its_worktree_only_and_its_usage_is_recorded(codex, api, tmp_path):
    r = git_repo(tmp_path)
    patch = "*** Begin Patch\n*** Add File: hello.txt\n+hello from codex\n*** End Patch\n"
    api.push(responses_custom_call("apply_patch", patch, input_tokens=1000, output_tokens=30),
             # the sandbox: its worktree yes; the checkout it came from, /tmp and $HOME no
             responses_call("exec_command", {"cmd": f"echo made > made.txt; echo x > {r}/escaped.txt; "
                                                    f"echo y > /tmp/kugetsu-codex-escaped-{os.getpid()}.txt"},
                            input_tokens=1200, output_tokens=20, cached=900),
             responses_text("Wrote hello.txt.", input_tokens=1300, output_tokens=12, cached=1100))
    codex.ok("delegate", "hello", "--agent", "codex", "--worktree", "--cwd", str(r), "--prompt", "write hello.txt")
    task = codex.wait_state("hello", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded", (task, codex.ok("logs", "hello", "--raw"))
    tree = Path(task["worktree"])
    assert (tree / "hello.txt").read_text() == "hello from codex\n"
    assert (tree / "made.txt").read_text() == "made\n"
    assert not (r / "hello.txt").exists() and not (r / "escaped.txt").exists()
    assert not Path(f"/tmp/kugetsu-codex-escaped-{os.getpid()}.txt").exists()
    assert re.fullmatch(r"[0-9a-f-]{36}", task["session"])
    # the turn's usage, as Codex summed it (cached input apart from the rest)
    assert task["usage"] == {"input_tokens": 3500 - 2000, "output_tokens": 62, "cache_read_tokens": 2000}
    shown = codex.ok("logs", "hello")
    assert "Wrote hello.txt." in shown and "add " in shown and "1,500 tokens in" in shown, shown
    # Each command Codex reports is shown as one. (Codex 0.169.0 does not always report its
    # exec_command runs in `exec --json`: the command ran, sandboxed, and its session file has
    # the call, while the stream had no command_execution item, from one hour to the next on
    # one machine. kugetsu shows what the stream says.)
    events = [json.loads(line) for line in codex.ok("logs", "hello", "--raw").splitlines() if line.startswith("{")]
    ran = [e for e in events if e.get("type") == "item.completed" and e["item"].get("type") == "command_execution"]
    assert shown.count("> $ ") == len(ran), (shown, events)
    assert '"type"' not in shown
    assert "write hello.txt" in said(api.bodies("responses")[0])


def test_a_usage_limit_with_a_curly_apostrophe_holds_codex_until_its_reset_and_resumes(codex, api):
    codex.config(max_agents=1, agents={"other": {"command": ["sh", "-c", 'date +%s.%N > "$0"', str(codex.rec / "other")]}})
    resets_at = int(time.time()) + 2 * 3600 + 17 * 60
    api.push(responses_call("exec_command", {"cmd": "echo one > one.txt"}, input_tokens=80, output_tokens=20),
             usage_limit(resets_at),
             responses_text("Finished where I left off.", input_tokens=300, output_tokens=9))
    codex.ok("delegate", "a", "--agent", "codex", "--prompt", "write one.txt then two.txt", "--cwd", str(codex.rec))
    codex.ok("delegate", "b", "--agent", "codex", "--prompt", "second task", "--cwd", str(codex.rec))
    codex.ok("delegate", "c", "--agent", "other")
    # `You’ve hit your usage limit. ... try again at 9:47 PM.`: not a failure; a is back in the
    # queue ahead of b, codex held until that minute, and c (another preset) runs meanwhile.
    # c's process starts inside the transaction that requeues a, whose commit the service may
    # hold for a moment (COMMIT_DELAY) for the exits that follow: c's file alone can come first.
    wait_for(lambda: (codex.rec / "other").exists() and codex.task("c")["state"] != "queued", RUN,
             "c to run while codex is held")
    a = codex.task("a")
    assert a["state"] == "queued" and a["attempts"][0]["limit"] is True, (a, codex.ok("logs", "a", "--raw"))
    assert "You’ve hit your usage limit" in codex.ok("logs", "a", "--raw")
    [held] = codex.events("held")
    minute = datetime.fromtimestamp(resets_at - resets_at % 60, timezone.utc)
    assert datetime.fromisoformat(held["value"]["until"]) == minute, held
    assert [t["name"] for t in codex.json("queue")["queued"]] == ["a", "b"]
    assert codex.task("b")["state"] == "queued"
    # Released by hand (the reset is hours away): the same thread resumes, and the API sees
    # the earlier conversation before the resume's prompt.
    codex.ok("release", "codex")
    task = codex.wait_state("a", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded" and task["attempt"] == 2, task
    assert task["command"][:3] == ["codex", "exec", "resume"] and task["session"] in task["command"]
    resumed = [b for b in api.bodies("responses") if "Continue where you left off." in said(b)][0]
    s = said(resumed)
    assert s.index("write one.txt then two.txt") < s.index("call exec_command") < s.index("output") \
        < s.index("Continue where you left off."), s
    assert (codex.rec / "one.txt").read_text() == "one\n"
    # Codex counts the thread: the resumed run's count holds the refused run's first response
    assert task["usage"]["input_tokens"] == 80 + 300 and task["attempts"][0].get("usage") is None
    codex.wait_state("b", "succeeded", timeout=RUN)


@pytest.mark.parametrize("refusal", [insufficient_quota, rate_limit], ids=["insufficient_quota", "rate_limit"])
def test_quota_and_rate_limit_hold_codex_with_a_backoff_and_resume(codex, api, refusal):
    codex.config(agents={"codex": {"limit": {"backoff": "2s"}}})
    api.push(refusal(), responses_text("Served."))
    codex.ok("delegate", "q", "--agent", "codex", "--prompt", "quota work", "--cwd", str(codex.rec))
    task = codex.wait_state("q", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded" and [x["limit"] for x in task["attempts"]] == [True], task
    [held] = codex.events("held")
    assert "codex usage limit" in held["reason"]
    assert "Continue where you left off." in said(api.bodies("responses")[-1])
    assert "quota work" in said(api.bodies("responses")[-1])


def test_a_long_run_cut_short_by_a_limit_still_resumes_its_thread(codex, api):
    # Codex names its thread only in the first line of a run; a run that printed more than the
    # 16 KiB kugetsu reads at its end must still resume that thread, not start over.
    api.push(responses_call("exec_command", {"cmd": "head -c 40000 /dev/zero | tr '\\0' x"}),
             usage_limit(int(time.time()) + 3 * 3600),
             responses_text("Resumed."))
    codex.ok("delegate", "long", "--agent", "codex", "--prompt", "print a lot", "--cwd", str(codex.rec))
    wait_for(lambda: codex.task("long")["attempts"], RUN, "long to hit the limit")
    assert codex.home.log(codex.task("long")["id"]).stat().st_size > 20000
    codex.ok("release", "codex")
    task = codex.wait_state("long", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded" and task["command"][:3] == ["codex", "exec", "resume"], task
    s = said(api.bodies("responses")[-1])
    assert s.index("print a lot") < s.index("call exec_command") < s.index("Continue where you left off."), s


def test_a_reset_printed_to_the_minute_that_has_come_backs_off_instead_of_holding_a_day(codex, api):
    # Codex prints `try again at 5:16 PM` for a reset at 17:16:59: read at 17:16:30 that
    # minute is just past, which means "shortly" (the preset's backoff), not tomorrow.
    codex.config(agents={"codex": {"limit": {"backoff": "2s"}}})

    def refuse(body):
        now = int(time.time())
        return usage_limit(now - now % 60 + 59)

    api.push(refuse, responses_text("Served."))
    started = time.time()
    codex.ok("delegate", "m", "--agent", "codex", "--prompt", "minute work", "--cwd", str(codex.rec))
    task = codex.wait_state("m", "succeeded", "failed", timeout=RUN)
    assert task["state"] == "succeeded" and [x["limit"] for x in task["attempts"]] == [True], task
    [held] = codex.events("held")
    assert datetime.fromisoformat(held["value"]["until"]).timestamp() < started + 120, held
