"""`kugetsu mcp` as an agent uses it: the MCP SDK's own client talking to a real `python -m
kugetsu mcp` subprocess (stdio, or streamable HTTP), against a temp home, with the real
service and real agent processes. No handler is called directly."""

from __future__ import annotations

import functools
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from conftest import REPO, processes_under, wait_for, wait_for_async
from rawclient import closed_by_server

mcp = pytest.importorskip("mcp", reason="the MCP SDK is in the test extra: pip install -e '.[test]'")
from mcp import Client, StdioServerParameters  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared._httpx_utils import create_mcp_http_client  # noqa: E402
from mcp.types import ResourceUpdatedNotification  # noqa: E402

TOOLS = {"capacity", "delegate", "queue", "status", "cancel", "wait", "logs", "priority", "schedules", "stats"}


@asynccontextmanager
async def connect(kg, mode: str = "legacy", **kw):
    """A client session with `kugetsu mcp` over stdio. "legacy" is the initialize handshake
    that Claude Code and opencode speak; "auto" negotiates the 2026 protocol."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "kugetsu", "mcp"], env=kg.env, cwd=str(kg.rec))
    async with Client(params, mode=mode, **kw) as client:
        yield client


until = functools.partial(wait_for_async, timeout=20.0)  # a loaded 2-core machine: generous deadlines


def text(result) -> str:
    return "\n".join(c.text for c in result.content)


_MEASURED = ("rss", "procs", "peak_memory", "cpu_seconds")


def unmeasured(doc: dict) -> dict:
    """A task's (or a queue's) JSON without what the service measured of a running task: two
    reads a moment apart may straddle its next measurement (usage.json), and then differ."""
    if "active" in doc:
        return {**doc, "active": [unmeasured(t) for t in doc["active"]]}
    return {k: v for k, v in doc.items() if k not in _MEASURED}


def gated(gate: Path, *lines: str, code: int = 0) -> list[str]:
    """An agent that prints `lines`, waits for `gate` to exist, exits `code`."""
    script = 'for l in "$@"; do echo "$l"; done; while [ ! -e "$0" ]; do sleep 0.02; done; exit ' + str(code)
    return ["sh", "-c", script, str(gate), *lines]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it exited since it was listed
        return b""


def mcp_server_pid(kg) -> int:
    pids = [p for p in processes_under(kg.home.root) if b"mcp" in _cmdline(p).split(b"\0")]
    assert len(pids) == 1, pids
    return pids[0]


def pidfds(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:
            pass
    return count


# ---- the tools -------------------------------------------------------------------------------


async def test_tools_schemas_and_the_instructions_in_the_readme(kg):
    kg.config(autostart=False)
    async with connect(kg) as c:
        tools = {t.name: t for t in (await c.list_tools()).tools}
        instructions = c.instructions
        r = await c.call_tool("delegate", {"name": "a", "command": ["true"]})
        task = r.structured_content["task"]
    assert set(tools) == TOOLS
    for tool in tools.values():
        assert tool.output_schema and tool.output_schema["type"] == "object", tool.name
        assert len(tool.description) > 100, tool.name  # written for an LLM: when to call, what comes back
    # The task schema and the CLI's task JSON name the same fields (a new field is not left out).
    assert set(tools["status"].output_schema["properties"]) == set(task) == set(kg.json("status", "a"))
    assert "back-pressure, not an error" in tools["delegate"].description
    assert "\n    " not in tools["delegate"].description  # no indentation: tokens for nothing
    assert tools["status"].annotations.read_only_hint and tools["cancel"].annotations.destructive_hint
    # README's "PM agent instructions" are the server's own instructions, word for word.
    readme = (REPO / "README.md").read_text()
    block = re.search(r"### PM agent instructions\n.*?```text\n(.*?)```", readme, re.S)
    assert block, "README has no PM agent instructions block"
    assert block.group(1).strip() == instructions.strip()


async def test_every_tool_answers_with_the_clis_json_and_text(kg, tmp_path):
    kg.config(max_agents=1)
    gate = tmp_path / "gate"
    async with connect(kg) as c:
        r = await c.call_tool("capacity", {})
        assert not r.is_error
        assert r.structured_content == kg.json("capacity") == {
            "max_agents": 1, "active": 0, "queued": 0, "free": 1, "max_queue": 50, "paused": False, "paused_groups": [],
            "holds": {}}
        assert text(r) == "0/1 running, 1 free, 0 queued (max 50)"

        r = await c.call_tool("delegate", {"name": "a", "source": "pm", "command": gated(
            gate, *(f"line {i}" for i in range(1, 501)))})
        assert (text(r), r.structured_content["admitted"]) == ("started a (#1), slot 1/1", True)
        assert r.structured_content["task"]["source"] == "pm" and r.structured_content["task"]["cwd"] == str(kg.rec)
        r = await c.call_tool("delegate", {"name": "b", "command": ["true"], "expire_after": "1h", "timeout": 90})
        assert text(r) == "queued b (#2), position 1 of 1"
        assert r.structured_content["task"] == kg.json("status", "b")
        assert r.structured_content["task"]["timeout"] == 90 and r.structured_content["task"]["position"] == 1
        kg.wait_state("a", "running")
        await until(lambda: "line 500" in kg.ok("logs", "a"), what="a's output")
        await until(lambda: kg.task("a")["pid"], what="a's pid")

        r = await c.call_tool("status", {"task": "a"})
        assert unmeasured(r.structured_content) == unmeasured(kg.json("status", "a"))
        assert re.search(r"^state +running$", text(r), re.M)
        r = await c.call_tool("queue", {})
        assert unmeasured(r.structured_content) == unmeasured(kg.json("queue"))
        assert "RUNNING" in text(r) and re.search(r"^\s+1\s+2\s+b\s+normal", text(r), re.M)
        r = await c.call_tool("queue", {"finished": True})
        assert unmeasured(r.structured_content) == unmeasured(kg.json("queue", "--all"))

        r = await c.call_tool("logs", {"task": "a", "lines": 3})
        assert text(r) == kg.ok("logs", "a", "--lines", "3") == "line 498\nline 499\nline 500\n"
        size = len(kg.ok("logs", "a").encode())
        assert r.structured_content == {"id": 1, "name": "a", "state": "running", "text": text(r), "size": size,
                                        "truncated": True}
        r = await c.call_tool("logs", {"task": "1", "max_bytes": 100})  # bounded: whole lines within the cap
        assert len(text(r)) <= 100 and text(r).endswith("line 500\n") and text(r).startswith("line ")
        r = await c.call_tool("logs", {"task": "b"})
        assert text(r) == "(no output yet: b is queued)" and r.structured_content["size"] == 0

        r = await c.call_tool("priority", {"task": "b", "level": "high"})
        assert text(r) == "b (#2) priority high, position 1"
        assert r.structured_content == kg.json("status", "b") and r.structured_content["priority"] == "high"

        r = await c.call_tool("wait", {"tasks": ["a"], "timeout": "1s"})  # `kugetsu wait` exits 124 here
        assert not r.is_error and "timed out after 1s" in text(r)
        assert (r.structured_content["done"], r.structured_content["all_succeeded"]) == (False, False)
        assert r.structured_content["tasks"][0]["state"] == "running"

        r = await c.call_tool("cancel", {"tasks": ["b"]})
        assert text(r) == "cancelled b (#2)"
        assert r.structured_content == {"tasks": [kg.json("status", "b")]}

        gate.touch()
        r = await c.call_tool("wait", {"tasks": ["a", "#2"]})
        assert text(r) == "a (#1) succeeded\nb (#2) cancelled: cancelled by mcp (read its logs)"
        assert (r.structured_content["done"], r.structured_content["all_succeeded"]) == (True, False)
        assert r.structured_content["tasks"] == [kg.json("status", "a"), kg.json("status", "b")]

        # A running task cancelled: the call returns once it is final, its slot handed on.
        await c.call_tool("delegate", {"name": "c", "command": ["sleep", "60"]})
        await c.call_tool("delegate", {"name": "d", "command": ["true"]})
        r = await c.call_tool("cancel", {"tasks": ["c"]})
        assert text(r) == "cancelled c (#3)" and r.structured_content["tasks"][0]["state"] == "cancelled"
        r = await c.call_tool("wait", {"tasks": ["d"], "timeout": "30s"})
        assert r.structured_content["all_succeeded"]


ERRORS = [
    ("status", {"task": "nope"}, "no task 'nope'"),
    ("logs", {"task": "42"}, "no task '42'"),
    ("wait", {"tasks": ["nope"]}, "no task 'nope'"),
    ("cancel", {"tasks": ["nope"]}, "no task 'nope'"),
    ("priority", {"task": "nope", "level": "high"}, "no task 'nope'"),
    ("cancel", {}, "name the tasks to cancel"),
    ("delegate", {"command": ["true"], "timeout": "soon"}, "timeout: 'soon' is not a duration"),
    ("delegate", {"command": ["true"], "expire_after": 0}, "expire_after: must be more than 0"),
    ("wait", {"tasks": ["x"], "timeout": "5w"}, "timeout: '5w' is not a duration"),
    ("delegate", {"name": "-x", "command": ["true"]}, "invalid task name '-x'"),
    ("delegate", {"name": "x", "command": ["true"]}, "a task named 'x' is already queued or running"),
    ("delegate", {}, "nothing to run"),
    ("delegate", {"prompt": "hi", "agent": "nobody"}, "unknown agent preset 'nobody'"),
    ("delegate", {"command": ["no-such-program-kg"]}, "command not found: 'no-such-program-kg'"),
    ("delegate", {"command": ["true"], "cwd": "/no/such/dir"}, "'/no/such/dir' is not a directory"),
    ("delegate", {"command": ["true"], "group": "gpu"}, "unknown group 'gpu'"),
    ("delegate", {"command": ["true"], "source": ""}, "source must be 1-64 printable characters"),
    ("priority", {"task": "x", "level": "asap"}, "level"),  # the schema's own check, still a tool result
]


async def test_errors_are_tool_results_with_clear_text_and_write_nothing(kg):
    kg.config(autostart=False)
    kg.ok("delegate", "x", "--", "true")
    before = kg.home.index.read_bytes()
    async with connect(kg) as c:
        for tool, args, message in ERRORS:
            r = await c.call_tool(tool, args)
            assert r.is_error and message in text(r), (tool, args, text(r))
            assert "Traceback" not in text(r)
    assert kg.home.index.read_bytes() == before


async def test_errors_on_tasks_in_the_wrong_state(kg):
    kg.config(autostart=False, max_agents=1)
    async with connect(kg) as c:
        await c.call_tool("delegate", {"name": "a", "command": ["true"]})  # running (no service to end it)
        r = await c.call_tool("priority", {"task": "a", "level": "high"})
        assert r.is_error and "only a queued task's priority can change" in text(r)
        await c.call_tool("delegate", {"name": "b", "command": ["true"]})
        await c.call_tool("cancel", {"tasks": ["b"]})
        r = await c.call_tool("cancel", {"tasks": ["b"]})
        assert r.is_error and text(r) == "task b (#2) is already cancelled"


async def test_queue_full_is_a_normal_result_that_says_to_back_off(kg):
    kg.config(autostart=False, max_agents=1, max_queue=2, max_queued_per_source=3)
    async with connect(kg) as c:
        for name in ("t1", "t2", "t3"):
            r = await c.call_tool("delegate", {"name": name, "command": ["true"], "source": "pm"})
            assert r.structured_content["admitted"]
        r = await c.call_tool("delegate", {"name": "t4", "command": ["true"], "source": "pm"})
        assert not r.is_error  # back-pressure, not a failure: exit 3 for the CLI
        assert r.structured_content == {
            "admitted": False, "task": None, "retry_after": 60,
            "rejected": "queue full: 2/2 waiting, 1/1 running; try again when a task finishes",
            "message": "rejected: queue full: 2/2 waiting, 1/1 running; try again when a task finishes",
            "advice": "Nothing was queued. Back off: try again in about 60s (or after one of your tasks ends);"
                      " do not retry at once."}
        assert text(r).startswith("rejected: queue full: 2/2 waiting") and "Nothing was queued" in text(r)
        assert "try again in about 60s" in text(r) and "do not retry at once" in text(r)
        assert [t["name"] for t in kg.index()["queued"]] == ["t2", "t3"]
        assert kg.run("delegate", "t4", "--", "true").returncode == 3  # the CLI agrees

        kg.ok("config", "set", "max_queue", "10")
        kg.ok("config", "set", "max_queued_per_source", "2")
        r = await c.call_tool("delegate", {"name": "t5", "command": ["true"], "source": "pm"})
        assert not r.is_error and not r.structured_content["admitted"]
        assert r.structured_content["rejected"].startswith("source pm already has 2 queued tasks (limit 2)")
        r = await c.call_tool("delegate", {"name": "t5", "command": ["true"], "source": "bob"})
        assert r.structured_content["admitted"] and "position 3 of 3" in text(r)


async def test_concurrent_delegates_are_admitted_as_if_one_after_the_other(kg):
    """Calls in flight share transactions (one fsync'd write per batch): each still gets
    its own answer, as sequential calls would have."""
    kg.config(autostart=False, max_agents=2, max_queue=10,
              agents={"pf": {"command": ["cat", "{prompt_file}"]}})
    names = [f"t{i:02}" for i in range(16)] + ["t05"]
    results: dict[int, object] = {}
    async with connect(kg) as c:
        async def one(i: int, name: str) -> None:
            args = {"name": name, "agent": "pf", "prompt": f"prompt of call {i}"} if i % 3 == 0 else \
                {"name": name, "command": ["true"]}
            results[i] = await c.call_tool("delegate", args)

        async with anyio.create_task_group() as tg:
            for i, name in enumerate(names):
                tg.start_soon(one, i, name)
    admitted = {i: r.structured_content["task"] for i, r in results.items()
                if not r.is_error and r.structured_content["admitted"]}
    rejected = [r for r in results.values() if not r.is_error and not r.structured_content["admitted"]]
    errors = [r for r in results.values() if r.is_error]
    assert len(admitted) == 12  # 2 slots + 10 queued
    assert all(r.structured_content["rejected"].startswith("queue full: 10/10 waiting") for r in rejected)
    assert all("a task named 't05' is already queued or running" in text(r) for r in errors)
    assert len(admitted) + len(rejected) + len(errors) == len(names)
    assert sum(1 for t in admitted.values() if t["name"] == "t05") <= 1
    index = kg.index()
    assert sorted(t["id"] for t in index["active"] + index["queued"]) == sorted(t["id"] for t in admitted.values())
    order = {t["id"]: pos for pos, t in enumerate(index["queued"], 1)}  # fifo: the queue is in start order
    for i, task in admitted.items():
        assert task["name"] == names[i]  # each call got its own task
        assert task["position"] == order.get(task["id"])  # as of its admission: later ones are behind it
        assert (task["state"] == "running") == (task["position"] is None)
        assert task["command"] == (["cat", "{prompt_file}"] if i % 3 == 0 else ["true"])
        if i % 3 == 0:
            assert kg.home.prompt_file(task["id"]).read_text() == f"prompt of call {i}"
    assert len({t["slot"] for t in admitted.values() if t["slot"]}) == 2
    queued = kg.events("queued")
    assert [e["task"] for e in queued] == sorted(t["id"] for t in admitted.values())
    # ... and calls in flight went in together: a transaction's events share its time.
    assert len({e["at"] for e in queued}) < len(queued)


# ---- wait: progress and cancellation --------------------------------------------------------


async def test_wait_sends_progress_as_state_and_position_change(kg, tmp_path):
    kg.config(max_agents=1)
    gate_a, gate_c = tmp_path / "gate-a", tmp_path / "gate-c"
    seen: list[tuple[float, str]] = []

    async def progress(value, total, message):
        seen.append((value, message))

    async with connect(kg) as c:
        await c.call_tool("delegate", {"name": "a", "command": gated(gate_a)})
        await c.call_tool("delegate", {"name": "b", "command": ["true"]})
        await c.call_tool("delegate", {"name": "c", "command": gated(gate_c)})
        result = {}

        async def waiter():
            result["r"] = await c.call_tool("wait", {"tasks": ["c"]}, progress_callback=progress)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await until(lambda: seen, what="the first progress")
            assert seen[0][1] == "0 of 1 final: c queued, position 2"
            await anyio.to_thread.run_sync(kg.ok, "cancel", "b")
            await until(lambda: "c queued, position 1" in seen[-1][1], what="c to move up")
            gate_a.touch()
            await until(lambda: "c running (slot 1)" in seen[-1][1], what="c to start")
            gate_c.touch()
        r = result["r"]
    messages = [m for _, m in seen]
    assert messages[-1] == "1 of 1 final: c succeeded"
    values = [v for v, _ in seen]
    assert values == sorted(set(values)), "progress must increase with each notification"
    assert text(r) == "c (#3) succeeded" and r.structured_content["all_succeeded"]


async def test_cancelling_wait_stops_waiting_and_never_touches_the_task(kg, tmp_path):
    gate = tmp_path / "gate"
    seen = []

    async def progress(value, total, message):
        seen.append(message)

    async with connect(kg) as c:
        await c.call_tool("delegate", {"name": "a", "command": gated(gate)})
        task = await until(lambda: (t := kg.task("a"))["pid"] and t, what="a to run")
        server = mcp_server_pid(kg)
        assert pidfds(server) == 0
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: c.call_tool("wait", {"tasks": ["a"]}, progress_callback=progress))
                await until(lambda: seen, what="the wait to report")
                # It waits on a's process (a pidfd), not by polling.
                await until(lambda: pidfds(server) == 1, what="the wait to watch a's process")
                scope.cancel()
        assert scope.cancelled_caught
        # The server stopped waiting: it lets go of a's process while a still runs.
        await until(lambda: pidfds(server) == 0, what="the cancelled wait to let go of a's process")
        r = await c.call_tool("status", {"task": "a"})
        assert (r.structured_content["state"], r.structured_content["pid"]) == ("running", task["pid"])
        assert r.structured_content["reason"] is None and not kg.events("cancelled")
        gate.touch()
        r = await c.call_tool("wait", {"tasks": ["a"], "timeout": "30s"})
        assert r.structured_content["all_succeeded"]


# ---- a PM agent's day ------------------------------------------------------------------------


async def test_pm_scenario_delegates_backs_off_waits_and_reads_the_failed_log(kg, tmp_path):
    """Capacity 2, max_queue 4, eight issues: what INSTRUCTIONS tell a PM agent to do."""
    kg.config(max_agents=2, max_queue=4)
    gate = tmp_path / "gate"  # the work takes time: all of it ends when the gate opens
    issues = [f"issue-{i}" for i in range(1, 9)]

    def agent(name: str) -> list[str]:
        code = 3 if name == "issue-5" else 0
        script = ('echo "start $(date +%s.%N)" >> "$2"; echo "$1: working";'
                  ' while [ ! -e "$0" ]; do sleep 0.02; done;'
                  f' echo "$1: {"tests failed" if code else "done"}"; echo "end $(date +%s.%N)" >> "$2"; exit {code}')
        return ["sh", "-c", script, str(gate), name, str(kg.rec / name)]

    rejected = []
    async with connect(kg) as c:
        cap = (await c.call_tool("capacity", {})).structured_content
        assert (cap["free"], cap["max_queue"]) == (2, 4)
        pending = list(issues)
        delegated: list[str] = []
        while pending:
            name = pending[0]
            r = await c.call_tool("delegate", {"name": name, "source": "pm", "command": agent(name)})
            assert not r.is_error, text(r)
            if r.structured_content["admitted"]:
                delegated.append(pending.pop(0))
                continue
            rejected.append((name, r.structured_content["rejected"]))
            # Back off: instead of retrying at once, wait for the oldest of its own tasks not
            # yet waited for (the work goes on meanwhile: here, its gate opens).
            gate.touch()
            r = await c.call_tool("wait", {"tasks": [delegated[len(rejected) - 1]], "timeout": "60s"})
            assert r.structured_content["done"]
        r = await c.call_tool("wait", {"tasks": issues, "timeout": "120s"})
        out = r.structured_content
        assert out["done"] and not out["all_succeeded"]
        states = {t["name"]: t["state"] for t in out["tasks"]}
        assert states == {name: "failed" if name == "issue-5" else "succeeded" for name in issues}
        assert "issue-5 (#5) failed: exit code 3 (read its logs)" in text(r)
        log = await c.call_tool("logs", {"task": "issue-5"})
        assert text(log) == "issue-5: working\nissue-5: tests failed\n"
    # 2 running and 4 queued: the 7th was refused, and none was lost or run twice.
    assert rejected and rejected[0] == ("issue-7", "queue full: 4/4 waiting, 2/2 running; try again when a task"
                                        " finishes")
    spans = [kg.times(name) for name in issues]
    assert all(set(s) == {"start", "end"} for s in spans)
    for s in spans:  # at most 2 at once: no start while two others were in their span
        assert sum(1 for o in spans if o["start"] <= s["start"] < o["end"]) <= 2


# ---- resources -------------------------------------------------------------------------------


def recording_updates():
    """The URIs of the resources/updated notifications as they come, and the client's message
    handler that records them."""
    updates: list[str] = []

    async def on_message(message):
        if isinstance(message, ResourceUpdatedNotification):
            updates.append(message.params.uri)

    return updates, on_message


async def test_resources_read_and_notify_subscribers_when_they_change(kg, tmp_path):
    gate = tmp_path / "gate"
    updates, on_message = recording_updates()
    async with connect(kg, message_handler=on_message) as c:
        await c.call_tool("delegate", {"name": "a", "command": gated(gate)})
        resources = [str(r.uri) for r in (await c.list_resources()).resources]
        templates = [t.uri_template for t in (await c.list_resource_templates()).resource_templates]
        assert resources == ["kugetsu://queue"] and templates == ["kugetsu://task/{task}"]
        await until(lambda: kg.task("a")["pid"], what="a's pid")
        queue = json.loads((await c.read_resource("kugetsu://queue")).contents[0].text)
        assert unmeasured(queue) == unmeasured(kg.json("queue"))
        task = json.loads((await c.read_resource("kugetsu://task/a")).contents[0].text)
        assert unmeasured(task) == unmeasured(kg.json("status", "a"))
        with pytest.raises(mcp.MCPError, match="no task 'nope'"):
            await c.read_resource("kugetsu://task/nope")
        with warnings.catch_warnings():  # resources/subscribe is what 2025-era clients (Claude Code, opencode) send
            warnings.simplefilter("ignore")
            await c.subscribe_resource("kugetsu://task/a")
            await c.subscribe_resource("kugetsu://task/2")
        assert not updates
        gate.touch()
        await until(lambda: "kugetsu://task/a" in updates, what="a's update")
        assert "kugetsu://task/2" not in updates and "kugetsu://queue" not in updates  # not subscribed, or unchanged
        await c.call_tool("delegate", {"name": "b", "command": ["true"]})
        await until(lambda: "kugetsu://task/2" in updates, what="the update of #2, which did not exist before")


async def test_resources_notify_listen_streams_of_the_2026_protocol(kg, tmp_path):
    gate = tmp_path / "gate"
    async with connect(kg, mode="auto") as c:
        assert c.protocol_version >= "2026"
        await c.call_tool("delegate", {"name": "a", "command": gated(gate)})
        events = []
        async with c.listen(resource_subscriptions=["kugetsu://task/1", "kugetsu://queue"]) as sub:
            gate.touch()
            with anyio.fail_after(20):
                async for event in sub:
                    events.append(event.uri)
                    if event.uri == "kugetsu://task/1":
                        break
        assert "kugetsu://task/1" in events
        r = await c.call_tool("status", {"task": "a"})
        assert r.structured_content["state"] == "succeeded"


async def test_resources_notify_in_a_cluster_too(kg, tmp_path, pg_url):
    """In a cluster there is no index.json whose change the watcher could see: it asks the
    store (the queue row's version), like every other waiter."""
    kg.config(store=pg_url, host="m1")
    kg.ok("serve", "--detach")  # no autostart in a cluster
    gate = tmp_path / "gate"
    updates, on_message = recording_updates()
    async with connect(kg, message_handler=on_message) as c:
        await c.call_tool("delegate", {"name": "a", "command": gated(gate)})
        await until(lambda: kg.task("a")["pid"], what="a's pid")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            await c.subscribe_resource("kugetsu://task/a")
            await c.subscribe_resource("kugetsu://queue")
        gate.touch()
        await until(lambda: "kugetsu://task/a" in updates, what="a's update")
        await until(lambda: "kugetsu://queue" in updates, what="the queue's update")


# ---- HTTP --------------------------------------------------------------------------------------


def start_http(kg, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kugetsu", "mcp", *args], env=kg.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stderr], [], [], 0.5)[0]:
            line = proc.stderr.readline()
            if m := re.search(r"at (http://\S+/mcp)", line):
                return proc, m.group(1).replace("0.0.0.0", "127.0.0.1")
    proc.kill()
    raise AssertionError(f"kugetsu mcp --http did not come up: {line}{proc.stderr.read()}")


def post(url: str, token: str | None) -> int:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"}).encode()
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers, method="POST"), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.parametrize("bind", ["127.0.0.1:0", "0.0.0.0:0 --allow-remote"])
async def test_http_needs_the_bearer_token(kg, bind):
    kg.config(autostart=False)
    token = "t0k3n-" + os.urandom(8).hex()
    kg.ok("config", "set", "mcp.token", "-", input=token)
    assert token not in kg.ok("config", "show") and token not in kg.ok("config", "get", "mcp.token")
    proc, url = start_http(kg, "--http", *bind.split())
    try:
        assert await anyio.to_thread.run_sync(post, url, None) == 401
        assert await anyio.to_thread.run_sync(post, url, "wrong") == 401
        assert await anyio.to_thread.run_sync(post, url, token[:-1]) == 401
        headers = {"Authorization": f"Bearer {token}"}
        async with Client(streamable_http_client(url, http_client=create_mcp_http_client(headers=headers)),
                          mode="legacy") as c:
            r = await c.call_tool("delegate", {"name": "h", "command": ["true"], "cwd": str(kg.rec)})
            assert text(r) == "started h (#1), slot 1/3"
            assert (await c.call_tool("capacity", {})).structured_content == kg.json("capacity")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("args,message", [
    (["--http", "0.0.0.0:8765"], "refusing to listen on 0.0.0.0, which is not a loopback address"),
    (["--http", "192.0.2.7:8765"], "refusing to listen on 192.0.2.7"),
    (["--http", "example.com:8765"], "refusing to listen on example.com"),
    (["--http", "127.0.0.1"], "is not HOST:PORT, e.g. 127.0.0.1:8765"),
    (["--http", "127.0.0.1:8765"], "needs a bearer token"),  # none set
    (["--allow-remote"], "--allow-remote goes with --http"),
])
def test_http_refuses_remote_binds_and_a_missing_token(kg, args, message):
    r = kg.run("mcp", *args, timeout=60)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    if "needs a bearer token" in message:
        assert "kugetsu config set mcp.token -" in r.stderr


@pytest.mark.parametrize("where", ["config", "env"])
@pytest.mark.parametrize("weak, message", [
    ("a", "is 1 characters long, too short"),
    (" ", "is blank"),
    ("fifteen-chars-x", "is 15 characters long, too short"),
])
def test_http_refuses_a_weak_token(kg, where, weak, message):
    """A token anyone could guess keeps nobody out: refused before anything listens."""
    kg.config(autostart=False)
    env = dict(kg.env)
    if where == "config":
        kg.ok("config", "set", "mcp.token", "-", input=weak)
    else:
        env["KUGETSU_MCP_TOKEN"] = weak
    try:
        r = subprocess.run([sys.executable, "-m", "kugetsu", "mcp", "--http", "127.0.0.1:0"], env=env,
                           capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"kugetsu mcp --http started with the token {weak!r}") from None
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "at least 16" in r.stderr and "openssl rand -hex 32 | kugetsu config set mcp.token -" in r.stderr
    assert "Traceback" not in r.stderr and "serving" not in r.stderr


def test_http_drops_requests_whose_headers_never_end(kg):
    """An idle connection, and a request whose headers come a byte at a time (slowloris),
    are closed once the header time is up; a real client is served meanwhile."""
    from kugetsu.frontends import guard

    kg.config(autostart=False)
    token = os.urandom(16).hex()
    kg.ok("config", "set", "mcp.token", "-", input=token)
    proc, url = start_http(kg, "--http", "127.0.0.1:0")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()
        deadline = started + guard.HEADER_TIMEOUT + 10
        while not (closed_by_server(idle) and closed_by_server(slow)):
            assert time.monotonic() < deadline, "a connection whose request never came whole was kept open"
            try:
                slow.sendall(b"X")
            except OSError:
                pass
            time.sleep(0.1)
        assert time.monotonic() - started < guard.HEADER_TIMEOUT + 5
        idle.close()
        slow.close()
        assert post(url, token) != 401  # a whole request is still answered (by MCP: past the token)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_http_a_request_whose_body_cannot_be_read_is_a_400_and_no_traceback(kg):
    """A whole head, then a body uvicorn cannot read (bad chunking), in one packet: uvicorn
    answers 400 itself while the token check already runs for the head; that check's 401
    then had no connection to go to, and h11's refusal was a traceback on stderr for every
    such request (found by the listener fuzz in test_torture_fuzz)."""
    kg.config(autostart=False)
    kg.ok("config", "set", "mcp.token", "-", input=os.urandom(16).hex())
    proc, url = start_http(kg, "--http", "127.0.0.1:0")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n")
                answer = b""
                while chunk := s.recv(4096):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 400 "), answer
        assert post(url, None) == 401  # still serving
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err


def test_without_the_sdk_it_says_how_to_install(kg):
    hide = "import sys; sys.modules['mcp'] = None; from kugetsu.frontends.cli.main import main; sys.exit(main(['mcp']))"
    r = subprocess.run([sys.executable, "-c", hide], env=kg.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "kugetsu mcp needs the MCP Python SDK (mcp>=2.3,<3)" in r.stderr and "pip install" in r.stderr
    assert "Traceback" not in r.stderr


async def test_delegate_with_retries(kg):
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"name": "r", "command": ["sh", "-c", "exit 5"], "retries": 1,
                                           "retry_delay": "1s"})
        assert r.structured_content["task"]["retries"] == 1 and r.structured_content["task"]["retry_delay"] == 1.0
        r = await c.call_tool("wait", {"tasks": ["r"], "timeout": "20s"})
        [task] = r.structured_content["tasks"]
    assert task["state"] == "failed" and task["attempt"] == 2 and task["attempts"][0]["exit_code"] == 5


async def test_delegate_declares_memory_slots_and_max_procs(kg):
    """Resources (issue 29) through MCP as through the CLI: declared, counted, refused when
    they could never fit."""
    kg.config(max_agents=2, max_memory="1G")
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"name": "m", "command": ["sleep", "30"], "memory": "800M", "max_procs": 40})
        task = r.structured_content["task"]
        assert (task["memory"], task["max_procs"], task["slots"]) == (800 * 1024**2, 40, 1)
        r = await c.call_tool("delegate", {"name": "n", "command": ["true"], "memory": "300M"})
        assert "waiting for: memory (800.0M of 1.0G in use, it needs 300.0M)" in r.content[0].text
        r = await c.call_tool("delegate", {"name": "s", "command": ["true"], "slots": 3})
        assert r.is_error and "a task of 3 slots could never start: max_agents is 2" in r.content[0].text
        r = await c.call_tool("delegate", {"name": "x", "command": ["true"], "memory": "lots"})
        assert r.is_error and "is not a size" in r.content[0].text
        await c.call_tool("cancel", {"tasks": ["m", "n"]})


async def test_a_running_tasks_measured_use_in_status_queue_and_its_resource(kg):
    """Measured use (issue 29) where an agent looks: the status and queue tools and the
    task's resource, as `kugetsu status` has it (its rss, processes and peak)."""
    from test_resources import grown, hog

    kg.config(resources={"mode": "sampling", "interval": "0.1s"})
    async with connect(kg) as c:
        await c.call_tool("delegate", {"name": "m", "command": hog(kg, "m", 40, 30), "memory": "300M"})
        await until(lambda: grown(kg, "m") >= 40, what="the hog to grow")
        await until(lambda: (kg.task("m").get("rss") or 0) > 35 * 1024**2, what="a measurement")
        task = (await c.call_tool("status", {"task": "m"})).structured_content
        assert task["rss"] > 35 * 1024**2 and task["procs"] >= 1 and task["peak_memory"] >= task["rss"] - 1024**2
        [running] = (await c.call_tool("queue", {})).structured_content["active"]
        assert running["rss"] > 35 * 1024**2 and running["memory"] == 300 * 1024**2
        task = json.loads((await c.read_resource("kugetsu://task/m")).contents[0].text)
        assert task["rss"] > 35 * 1024**2 and task["procs"] >= 1, task
        queue = json.loads((await c.read_resource("kugetsu://queue")).contents[0].text)
        assert queue["active"][0]["rss"] > 35 * 1024**2
        await c.call_tool("cancel", {"tasks": ["m"]})


# ---- as real clients see it (issue 25, item 6) --------------------------------------------


async def test_what_the_model_must_do_is_in_the_structured_result_too(kg):
    """Claude Code shows the model the structured content, not the text: the advice to back
    off (and what to do next) must be there too, short, and the same words as the text."""
    kg.config(autostart=False, max_agents=1, max_queue=1)
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"name": "a", "command": ["true"]})
        assert r.structured_content["message"] == text(r).split("\n")[0] == "started a (#1), slot 1/1"
        assert "wait" in r.structured_content["advice"]
        await c.call_tool("delegate", {"name": "b", "command": ["true"]})
        r = await c.call_tool("delegate", {"name": "c", "command": ["true"]})
        out = r.structured_content
        assert not out["admitted"] and out["retry_after"] == 60
        assert "Back off" in out["advice"] and "do not retry at once" in out["advice"] and out["advice"] in text(r)
        assert out["message"].startswith("rejected: queue full")
        r = await c.call_tool("wait", {"tasks": ["b"], "timeout": "1s"})
        assert not r.structured_content["done"] and "call wait again" in r.structured_content["advice"]
        tools = {t.name: t for t in (await c.list_tools()).tools}
    assert {"message", "advice"} <= set(tools["delegate"].output_schema["properties"])


async def test_argument_errors_are_one_clear_line(kg):
    kg.config(autostart=False)
    kg.ok("delegate", "x", "--", "true")
    before = kg.home.index.read_bytes()
    async with connect(kg) as c:
        for tool, args, want in [
            ("status", {}, "status: argument task is missing"),
            ("logs", {"task": "x", "lines": -1}, "logs: argument lines: must be 0 or more"),
            ("logs", {"task": "x", "max_bytes": "lots"}, "logs: argument max_bytes: must be an integer"),
            ("priority", {"task": "x", "level": "asap"}, "priority: argument level: must be one of urgent, high,"
                                                          " normal, low"),
            ("queue", {"finished": "maybe"}, "queue: argument finished: must be true or false"),
            ("cancel", {"tasks": "x"}, "cancel: argument tasks: must be a list"),
            ("delegate", {"command": ["true"], "timout": 5},
             "delegate: unknown argument 'timout' (did you mean timeout?); it takes:"),
            ("status", {"task": "x", "verbose": True}, "status: unknown argument 'verbose'; it takes: task"),
        ]:
            r = await c.call_tool(tool, args)
            assert r.is_error, (tool, args)
            assert text(r).startswith(want), (tool, args, text(r))
            assert "\n" not in text(r) and "pydantic" not in text(r) and "validation error" not in text(r)
    assert kg.home.index.read_bytes() == before


async def test_task_ids_are_accepted_as_numbers(kg):
    """Every id in every result is a number: a model passes it back as one."""
    kg.config(autostart=False, max_agents=1)
    async with connect(kg) as c:
        await c.call_tool("delegate", {"name": "a", "command": ["true"]})
        r = await c.call_tool("delegate", {"name": "b", "command": ["true"]})
        assert not r.is_error
        r = await c.call_tool("status", {"task": 2})
        assert not r.is_error and r.structured_content["name"] == "b"
        r = await c.call_tool("logs", {"task": 2})
        assert not r.is_error and r.structured_content["id"] == 2
        r = await c.call_tool("priority", {"task": 2, "level": "high"})
        assert not r.is_error and r.structured_content["priority"] == "high"
        r = await c.call_tool("cancel", {"tasks": [2]})
        assert not r.is_error and r.structured_content["tasks"][0]["state"] == "cancelled"
        r = await c.call_tool("status", {"task": True})
        assert r.is_error and text(r).startswith("status: argument task: must be a task id or name")


async def test_a_prompt_beside_a_command_is_said_to_be_unused(kg):
    kg.config(autostart=False)
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"name": "a", "command": ["true"], "prompt": "fix issue 7"})
    assert not r.is_error and r.structured_content["admitted"]
    assert "the prompt is not used" in text(r) and "the prompt is not used" in r.structured_content["advice"]
    cli = kg.run("delegate", "b", "--prompt", "fix issue 7", "--", "true")
    assert cli.returncode == 0 and "warning: the prompt is not used" in cli.stderr


EMPTY_PROMPT = "the prompt is empty: an agent given nothing to do would start for nothing"


@pytest.mark.parametrize("prompt", ["", " \n\t"])
async def test_an_empty_prompt_is_refused_by_every_front_end(kg, prompt):
    kg.config(autostart=False, agents={"echo": {"command": ["echo", "{prompt}"]}}, default_agent="echo")
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"name": "a", "prompt": prompt})
    assert r.is_error and text(r).startswith(EMPTY_PROMPT), text(r)
    cli = kg.run("delegate", "b", "--prompt", prompt)
    assert cli.returncode == 2 and EMPTY_PROMPT in cli.stderr
    assert not kg.home.index.exists() or kg.index()["queued"] == []


def _walk(schema, path=""):
    """Every sub-schema of a JSON schema, with its path."""
    if not isinstance(schema, dict):
        yield path, schema
        return
    yield path, schema
    for key in ("properties", "$defs", "patternProperties"):
        for name, sub in schema.get(key, {}).items():
            yield from _walk(sub, f"{path}.{key}.{name}")
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for i, sub in enumerate(schema.get(key, [])):
            yield from _walk(sub, f"{path}.{key}[{i}]")
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            yield from _walk(schema[key], f"{path}.{key}")


CONSTRAINS = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "items", "not"}


async def test_schemas_pass_strict_validation(kg):
    """What the Inspector's --strict (core/json/schemaLint.ts) finds: a `type` array, a bare
    boolean schema, a remote $ref, a schema that constrains nothing."""
    kg.config(autostart=False)
    async with connect(kg) as c:
        tools = (await c.list_tools()).tools
    problems = []
    for tool in tools:
        for kind, schema in (("input", tool.input_schema), ("output", tool.output_schema)):
            for path, sub in _walk(schema):
                if isinstance(sub, bool):
                    problems.append(f"{tool.name} {kind}{path}: bare {sub}")
                elif isinstance(sub.get("type"), list):
                    problems.append(f"{tool.name} {kind}{path}: type {sub['type']}")
                elif not CONSTRAINS & set(sub):
                    problems.append(f"{tool.name} {kind}{path}: constrains nothing")
                elif str(sub.get("$ref", "#")).startswith("#") is False:
                    problems.append(f"{tool.name} {kind}{path}: remote $ref")
                elif kind == "output" and {"type": "null"} in sub.get("anyOf", [])[1:]:
                    # a client's validator tries the branches in order, and most fields are null
                    problems.append(f"{tool.name} {kind}{path}: null is not the first branch")
    assert problems == []


def test_the_official_inspector_strict_finds_nothing(kg):
    from agentclis import agent_cli

    inspector = agent_cli("inspector")
    kg.config(autostart=False)
    r = subprocess.run([str(inspector), "--cli", "--strict", "--method", "tools/list", "--",
                        sys.executable, "-m", "kugetsu", "mcp"], env=kg.env, cwd=str(kg.rec),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {t["name"] for t in json.loads(r.stdout)["tools"]} == TOOLS
    assert "schemaFindings" not in json.loads(r.stdout)
    assert "Warning:" not in r.stderr and "Error:" not in r.stderr, r.stderr[-3000:]


def _raw_initialize(kg) -> tuple[float, float, dict]:
    """Start `kugetsu mcp`, send initialize as a client does the moment it started it, and
    time (spawn -> initialize answered, initialize answered -> tools/list answered)."""
    proc = subprocess.Popen([sys.executable, "-m", "kugetsu", "mcp"], env=kg.env, cwd=str(kg.rec),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"}}}).encode() + b"\n")
        proc.stdin.flush()
        init = json.loads(proc.stdout.readline())
        t1 = time.monotonic()
        proc.stdin.write(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n'
                         b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}\n')
        proc.stdin.flush()
        listed = json.loads(proc.stdout.readline())
        t2 = time.monotonic()
        assert listed["id"] == 1 and len(listed["result"]["tools"]) == len(TOOLS)
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read().decode()
        assert err == "", err  # the SDK agreed with the early answer (it says so on stderr if not)
        return t1 - t0, t2 - t1, init
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_initialize_is_answered_before_the_sdk_is_loaded(kg):
    """A client's first model turn must not wait for the SDK's import (~1 s on 2 cores): the
    handshake is answered from a lean module while the rest loads. Timed against itself (the
    time to the handshake against the time the tools then take), so a loaded machine slows
    both alike."""
    kg.config(autostart=False)
    init, rest, answer = _raw_initialize(kg)
    assert answer["id"] == 0 and answer["result"]["protocolVersion"] == "2025-06-18"
    assert answer["result"]["serverInfo"]["name"] == "kugetsu"
    assert init < rest, (init, rest)


async def test_the_early_initialize_answer_is_the_sdks(kg):
    """The lean answer says what the SDK would: the real client, both protocol eras."""
    kg.config(autostart=False, max_agents=4)
    async with connect(kg) as c:
        legacy = c.server_capabilities, c.instructions
        assert (await c.call_tool("capacity", {})).structured_content["free"] == 4
    async with connect(kg, mode="auto") as c:
        assert (await c.call_tool("capacity", {})).structured_content["free"] == 4
        modern = c.server_capabilities, c.instructions
    assert legacy[1] == modern[1] and legacy[0].tools and legacy[0].resources.subscribe


# A task's agent that is itself an MCP client: it starts `kugetsu mcp` as Claude Code would
# in a project where `claude mcp add kugetsu` was run, lists the tools, tries to delegate a
# task running this same script, and tries the CLI too; it records what it saw.
NESTED_AGENT = r'''
import json, os, subprocess, sys, anyio
from mcp import Client, StdioServerParameters

async def main():
    out = {"depth": os.environ.get("KUGETSU_DEPTH")}
    params = StdioServerParameters(command=sys.executable, args=["-m", "kugetsu", "mcp"], env=dict(os.environ))
    async with Client(params, mode="legacy") as c:
        out["tools"] = sorted(t.name for t in (await c.list_tools()).tools)
        child = os.environ["KUGETSU_TASK_NAME"] + "-sub"
        r = await c.call_tool("delegate", {"name": child, "command": [sys.executable, sys.argv[0], sys.argv[1]],
                                           "agent": sys.argv[1]})
        out["delegate"] = {"error": r.is_error, "text": "\n".join(x.text for x in r.content)}
    cli = subprocess.run([sys.executable, "-m", "kugetsu", "delegate", child + "-cli", "--", "true"],
                         capture_output=True, text=True)
    out["cli"] = {"code": cli.returncode, "stderr": cli.stderr}
    with open(os.path.join(REC, os.environ["KUGETSU_TASK_NAME"] + ".json"), "w") as f:
        json.dump(out, f)

anyio.run(main)
'''


def _nested(kg, tmp_path, **preset) -> Path:
    script = tmp_path / "nested_agent.py"
    script.write_text(f"REC = {str(kg.rec)!r}\n" + NESTED_AGENT)
    kg.config(max_agents=4, agents={"nester": {"command": [sys.executable, str(script), "nester"], **preset}})
    return script


def _seen(kg, name: str) -> dict:
    path = kg.rec / f"{name}.json"
    # Two SDK imports per level (the agent's client, its server): slow on a loaded machine.
    wait_for(lambda: path.exists() or kg.task(name)["state"] not in ("queued", "running"), 180.0, f"{name}'s record")
    assert path.exists(), kg.ok("logs", name)
    return json.loads(path.read_text())


READ_ONLY = ["capacity", "logs", "queue", "schedules", "stats", "status", "wait"]


def test_a_workers_kugetsu_mcp_is_read_only_by_default(kg, tmp_path):
    """`claude mcp add kugetsu` in a project gives every worker started there kugetsu's tools:
    by default a worker's server serves only the readers, and delegating is refused with a
    message that says why and what allows it; the CLI refuses it too."""
    _nested(kg, tmp_path)
    kg.ok("delegate", "outer", "--agent", "nester", "--prompt", "go")
    seen = _seen(kg, "outer")
    assert seen["depth"] == "1" and seen["tools"] == READ_ONLY
    assert seen["delegate"]["error"] and "runs inside kugetsu task outer (#1)" in seen["delegate"]["text"]
    assert "nesting" in seen["delegate"]["text"]
    assert seen["cli"]["code"] == 2 and "runs inside kugetsu task outer (#1)" in seen["cli"]["stderr"]
    kg.wait_state("outer", "succeeded", timeout=120)
    assert [t["name"] for t in kg.json("queue", "--all")["finished"]] == ["outer"]


def test_a_preset_with_nesting_may_delegate_down_to_its_depth(kg, tmp_path):
    """nesting: 1 lets its agents delegate one level down; the tasks they delegate may not
    delegate again (the limit is inherited, whatever the children's presets say)."""
    _nested(kg, tmp_path, nesting=1)
    kg.ok("delegate", "outer", "--agent", "nester", "--prompt", "go")
    outer = _seen(kg, "outer")
    assert outer["depth"] == "1" and outer["tools"] == sorted(TOOLS)
    assert not outer["delegate"]["error"], outer
    assert outer["cli"]["code"] == 0, outer["cli"]
    inner = _seen(kg, "outer-sub")
    assert inner["depth"] == "2" and inner["tools"] == READ_ONLY
    assert inner["delegate"]["error"] and "depth" in inner["delegate"]["text"], inner
    assert inner["cli"]["code"] == 2
    for name in ("outer", "outer-sub"):
        kg.wait_state(name, "succeeded", timeout=120)
