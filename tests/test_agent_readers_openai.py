"""kugetsu/agents/codex.py and opencode.py: what the end of a log says, on the lines the real
CLIs printed (Codex 0.169.0 `exec --json`, opencode 1.18.33 `run --format json`, captured
against tests/fakeproviders/openai.py), and that no input makes them raise."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings, strategies as st

from kugetsu.agents import codex, opencode, read, render
from kugetsu.agents.report import Usage

NOW = datetime(2026, 11, 24, 17, 30, tzinfo=timezone.utc)
TID = "01a20e8d-20f9-72e3-9bb8-6478cd35f082"
LIMIT = ("You’ve hit your usage limit. Upgrade to Pro (https://chatgpt.com/explore/pro), visit "
         "https://chatgpt.com/settings/usage to purchase more credits or try again at {when}.")


def cx(*objs: dict) -> str:
    return "\n".join(json.dumps(o) for o in objs) + "\n"


def started(tid: str = TID) -> dict:
    return {"type": "thread.started", "thread_id": tid}


def failed(message: str) -> list[dict]:
    return [{"type": "error", "message": message}, {"type": "turn.failed", "error": {"message": message}}]


def completed(i: int, o: int, cached: int = 0) -> dict:
    return {"type": "turn.completed", "usage": {"input_tokens": i, "cached_input_tokens": cached,
                                                "cache_write_input_tokens": 0, "output_tokens": o,
                                                "reasoning_output_tokens": 0}}


def test_codex_run_session_and_usage():
    tail = ("WARNING: proceeding, even though we could not create PATH aliases\nReading additional input from stdin...\n"
            + cx(started(), {"type": "turn.started"},
                 {"type": "item.completed", "item": {"id": "item_0", "type": "file_change",
                                                     "changes": [{"path": "/w/hello.txt", "kind": "add"}], "status": "completed"}},
                 {"type": "item.completed", "item": {"id": "item_1", "type": "agent_message", "text": "patched"}},
                 completed(1200, 40, cached=1000)))
    report = codex.read(tail, NOW)
    assert report.session == TID and not report.limited and report.error is None
    assert report.usage == Usage(input_tokens=200, output_tokens=40, cache_read_tokens=1000)


def test_codex_usage_limit_with_its_curly_apostrophe_is_a_limit_whose_clock_time_pm_reads():
    report = codex.read(cx(started(), {"type": "turn.started"}, *failed(LIMIT.format(when="6:12 PM"))), NOW)
    assert report.limited and report.session == TID and report.usage is None
    assert report.reset_at is None and "try again at 6:12 PM" in report.limit_text  # pm: limits.reset_time


def test_codex_usage_limit_days_away_carries_its_date():
    local = datetime(2026, 11, 27, 17, 26).astimezone(timezone.utc)  # the machine's zone, as Codex prints it
    report = codex.read(cx(started(), *failed(LIMIT.format(when="Nov 27th, 2026 5:26 PM"))), NOW)
    assert report.limited and report.reset_at == local
    assert codex.dated_reset("try again at Feb 30th, 2027 5:26 PM", NOW) is None
    assert codex.dated_reset("try again at Nov 2nd, 2020 5:26 PM", NOW) is None  # past


def test_codex_quota_and_rate_limit_are_limits_other_failures_are_errors():
    for message in ("Quota exceeded. Check your plan and billing details.",
                    "exceeded retry limit, last status: 429 Too Many Requests"):
        report = codex.read(cx(started(), *failed(message)), NOW)
        assert report.limited and report.reset_at is None and report.limit_text == message
    report = codex.read(cx(started(), *failed("unexpected status 400 Bad Request: model not found")), NOW)
    assert not report.limited and report.error == "unexpected status 400 Bad Request: model not found"
    # a warning item is not a failure
    warn = {"type": "item.completed", "item": {"id": "item_0", "type": "error", "message": "Model metadata not found"}}
    assert codex.read(cx(started(), warn, completed(10, 1)), NOW).error is None


def test_codex_only_the_last_run_counts():
    # The log of a task holds each run (a resume is appended): the limited run's message is
    # not the successful resume's, and Codex counts the whole thread, so a run's own usage is
    # the difference from the same thread's last count before it (a refused run has none).
    tail = cx(started(), completed(500, 50), started(), *failed(LIMIT.format(when="6:12 PM")), started(), completed(880, 81))
    report = codex.read(tail, NOW)
    assert not report.limited and report.error is None and report.usage == Usage(input_tokens=380, output_tokens=31)
    other = "11111111-2222-3333-4444-555555555555"  # a run started over (a retry): a new thread, its own count
    assert codex.read(tail + cx(started(other), completed(70, 7)), NOW).usage == Usage(input_tokens=70, output_tokens=7)


def test_codex_render():
    assert codex.render(json.dumps(started())) == f"[codex session {TID}]"
    assert codex.render(json.dumps({"type": "turn.started"})) is None
    assert codex.render(json.dumps({"type": "item.completed", "item": {"type": "agent_message", "text": "hi"}})) == "hi"
    cmd = {"type": "item.completed", "item": {"type": "command_execution", "command": "/bin/bash -lc 'ls'", "exit_code": 2}}
    assert codex.render(json.dumps(cmd)) == "> $ /bin/bash -lc 'ls'  (exit 2)"
    assert codex.render(json.dumps(completed(1200, 40, cached=1000))).startswith("[done] 200 tokens in, 40 out, 1,000 cached")
    assert codex.render(json.dumps(failed("Quota exceeded.")[1])) == "[error: Quota exceeded.]"
    assert codex.render("plain text\n") == "plain text\n"


OC_SID = "ses_df1696546ffewjWe3Pw2wymoiB"


def oc(kind: str, **fields: object) -> dict:
    return {"type": kind, "timestamp": 1795541101355, "sessionID": OC_SID, **fields}


def step(i: int, o: int, reason: str = "stop", cost: float = 0.0, read_: int = 0) -> dict:
    return oc("step_finish", part={"type": "step-finish", "reason": reason, "cost": cost,
                                   "tokens": {"total": i + o, "input": i, "output": o, "reasoning": 0,
                                              "cache": {"write": 0, "read": read_}}})


def api_error(status: int, body: dict, headers: dict | None = None, ts: int = 1795541194208) -> dict:
    return {"type": "error", "timestamp": ts, "sessionID": OC_SID,
            "error": {"name": "APIError", "data": {"message": body["error"]["message"], "statusCode": status,
                                                   "isRetryable": True, "responseHeaders": headers or {},
                                                   "responseBody": json.dumps(body)}}}


QUOTA = {"error": {"message": "You exceeded your current quota, please check your plan and billing details.",
                   "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}}


def test_opencode_run_session_usage_and_denials():
    write = oc("tool_use", part={"type": "tool", "tool": "write", "state": {
        "status": "completed", "input": {"filePath": "/w/hello.txt", "content": "hi"}, "output": "Wrote file successfully."}})
    denied = oc("tool_use", part={"type": "tool", "tool": "write", "state": {
        "status": "error", "input": {"filePath": "/elsewhere/x.txt"},
        "error": "The user rejected permission to use this specific tool call."}})
    tail = cx(oc("step_start"), write, step(100, 20, "tool-calls", 0.001), oc("step_start"), denied,
              step(150, 10, "tool-calls", 0.002, read_=90))
    report = opencode.read(tail, NOW)
    assert report.session == OC_SID and not report.limited and report.error is None
    assert report.usage == Usage(input_tokens=250, output_tokens=30, cache_read_tokens=90, cost_usd=0.003)
    assert report.denied == ["write: /elsewhere/x.txt"]


def test_opencode_429_is_a_limit_reset_from_its_headers():
    at = datetime.fromtimestamp(1795541194.208, timezone.utc)
    report = opencode.read(cx(step(1, 1), api_error(429, QUOTA, {"retry-after": "3600"})), at - timedelta(seconds=5))
    assert report.limited and report.limit_text.startswith("You exceeded your current quota")
    assert report.reset_at == at + timedelta(seconds=3600)
    hdrs = {"x-ratelimit-reset-requests": "1m30s", "x-ratelimit-reset-tokens": "6m0s"}
    assert opencode.read(cx(api_error(429, QUOTA, hdrs)), at).reset_at == at + timedelta(minutes=6)
    usage_limit = {"error": {"type": "usage_limit_reached", "message": "The usage limit has been reached",
                             "resets_at": 1795550000}}
    assert opencode.read(cx(api_error(429, usage_limit)), at).reset_at == datetime.fromtimestamp(1795550000, timezone.utc)
    # no reset given, or one already past: None (pm backs off)
    assert opencode.read(cx(api_error(429, QUOTA)), at).reset_at is None
    assert opencode.read(cx(api_error(429, QUOTA, {"retry-after": "1"})), at + timedelta(seconds=5)).reset_at is None


def test_opencode_kugetsu_plugin_gave_up_with_when_it_would_retry():
    nxt = 1795545008390
    line = oc("error", error={"name": "KugetsuGaveUp", "data": {"message": "You exceeded your current quota",
                                                                "next": nxt, "attempt": 1}})
    report = opencode.read(cx(line), NOW)
    assert report.limited and report.reset_at == datetime.fromtimestamp(nxt / 1000, timezone.utc)


def test_opencode_other_errors_and_the_last_run():
    bad = {"type": "error", "sessionID": OC_SID, "error": {"name": "ProviderAuthError",
                                                          "data": {"message": "bad key", "providerID": "x"}}}
    report = opencode.read(cx(bad), NOW)
    assert not report.limited and report.error == "bad key"
    # resumed after a limit: the run after the error is the one read
    report = opencode.read(cx(step(500, 5), api_error(429, QUOTA), oc("step_start"), step(300, 30)), NOW)
    assert not report.limited and report.error is None and report.usage == Usage(input_tokens=300, output_tokens=30, cost_usd=0.0)


def test_opencode_render():
    assert opencode.render(json.dumps(oc("text", part={"type": "text", "text": "hello"}))) == "hello"
    assert opencode.render(json.dumps(oc("step_start"))) is None
    assert opencode.render(json.dumps(step(100, 20, "tool-calls"))) is None
    assert opencode.render(json.dumps(step(100, 20))).startswith("[done] 100 tokens in, 20 out")
    assert opencode.render(json.dumps(api_error(429, QUOTA))).startswith("[error (429): You exceeded your current quota")
    tool = oc("tool_use", part={"tool": "bash", "state": {"status": "error", "input": {"command": "ls /"}, "error": "no"}})
    assert opencode.render(json.dumps(tool)) == "> bash(ls /)\n  ! no"


def test_dispatch_by_kind():
    assert read("codex", cx(started()), NOW).session == TID
    assert read("opencode", cx(step(1, 1)), NOW).session == OC_SID
    assert render("codex", json.dumps({"type": "item.completed", "item": {"type": "agent_message", "text": "x"}})) == "x"


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(["type", "item", "error", "usage", "part", "data", "message", "thread_id",
                                          "sessionID", "timestamp", "tokens", "state", "statusCode", "responseHeaders",
                                          "responseBody", "next", "text", "changes", "cache", "input"]), inner, max_size=5),
                     max_leaves=20)
_kinds = st.sampled_from(["thread.started", "turn.completed", "turn.failed", "error", "item.completed", "step_finish",
                          "tool_use", "text", "KugetsuGaveUp"])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_kinds, _json), max_size=6), st.text(max_size=40))
def test_readers_never_raise(objs, noise):
    tail = noise + "\n" + "\n".join(json.dumps({"type": k, **(v if isinstance(v, dict) else {"x": v})}) for k, v in objs)
    for module in (codex, opencode):
        module.read(tail, NOW)
        for line in tail.splitlines():
            module.render(line)


def test_hostile_values_are_read_as_nothing_said():
    huge = {"error": {"type": "usage_limit_reached", "message": "limit", "resets_in_seconds": 1e300}}
    report = opencode.read(cx(api_error(429, huge, {"retry-after-ms": "1e308", "x-ratelimit-reset-tokens": "9e300s"})), NOW)
    assert report.limited and report.reset_at is None
    for module, line in ((codex, started("--dangerously-bypass-approvals-and-sandbox")),
                         (opencode, oc("step_start") | {"sessionID": "--auto"})):
        assert module.read(cx(line), NOW).session is None  # it would become an option of the resume
    assert codex.read(cx(started(), completed(10**30, 5)), NOW).usage == Usage(output_tokens=5)
