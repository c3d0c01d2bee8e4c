"""delegate with `tasks` (a list admitted in one transaction, all or none) and concurrent
sessions of one server sharing transactions, through the MCP SDK's own client and a real
`python -m kugetsu mcp` (stdio, or streamable HTTP)."""

from __future__ import annotations

import anyio
import pytest
from test_mcp import connect, start_http, text

mcp = pytest.importorskip("mcp", reason="the MCP SDK is in the test extra: pip install -e '.[test]'")
from mcp import Client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
import httpx2  # noqa: E402  (the SDK's HTTP client)


def live(kg) -> list[dict]:
    try:
        index = kg.index()
    except FileNotFoundError:  # nothing was ever written
        return []
    return index["active"] + index["queued"]


async def test_a_batch_is_admitted_in_one_transaction_with_true_positions(kg):
    kg.config(autostart=False, max_agents=1, max_queue=100, strategy="priority")
    items = [{"name": f"issue-{i}", "command": ["true"]} for i in range(1, 31)]
    items[29]["priority"] = "urgent"  # given last, queued first: positions as the queue has them
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"tasks": items, "source": "pm", "group": None})
        assert not r.is_error, text(r)
        out = r.structured_content
        queue = kg.json("queue")
    assert out["admitted"] and out["task"] is None and out["message"] == "delegated 30 tasks: 1 started, 29 queued"
    got = [t["task"] for t in out["tasks"]]
    assert [t["name"] for t in got] == [f"issue-{i}" for i in range(1, 31)]  # in the order given
    assert len({t["id"] for t in got}) == 30 and {t["source"] for t in got} == {"pm"}  # beside tasks: defaults
    assert got[0]["state"] == "running" and out["tasks"][0]["message"] == "started issue-1 (#1), slot 1/1"
    # Each position is the one the queue shows once the batch is in (the urgent one jumps ahead).
    shown = {t["name"]: t["position"] for t in queue["queued"]}
    assert {t["name"]: t["position"] for t in got[1:]} == shown
    assert shown["issue-30"] == 1 and sorted(shown.values()) == list(range(1, 30))
    assert text(r).splitlines()[0] == out["message"] and "queued issue-30 (#30), position 1 of 29" in text(r)
    # One transaction: one clock reading for all of them.
    assert len({t["created_at"] for t in live(kg)}) == 1


async def test_a_bad_item_is_a_tool_error_naming_it_and_nothing_is_written(kg):
    kg.config(autostart=False, max_agents=1, max_queue=100)
    kg.ok("delegate", "taken", "--", "true")
    before = kg.index()
    ok = {"command": ["true"]}
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"tasks": [{**ok, "name": "a"}, {**ok, "name": "taken"}, {**ok, "name": "c"}]})
        assert r.is_error
        assert text(r).startswith("tasks[1]: ") and "taken" in text(r)
        assert "nothing was delegated (none of the 3 tasks)" in text(r)
        r = await c.call_tool("delegate", {"tasks": [{**ok, "name": "a"}, {**ok, "name": "a"}]})  # a name twice
        assert r.is_error and text(r).startswith("tasks[1]: ")
        r = await c.call_tool("delegate", {"tasks": [ok, {**ok, "cwd": "/nonexistent/dir"}]})  # checked before
        assert r.is_error and text(r).startswith("tasks[1]: ") and "/nonexistent/dir" in text(r)
        r = await c.call_tool("delegate", {"tasks": [ok, {**ok, "priority": "asap"}]})
        assert r.is_error and "argument tasks[1].priority: must be one of urgent, high, normal, low" in text(r)
        r = await c.call_tool("delegate", {"tasks": [ok, {**ok, "nmae": "x"}]})
        assert r.is_error and "tasks[1]: unknown argument 'nmae' (did you mean name?)" in text(r)
        r = await c.call_tool("delegate", {"tasks": []})
        assert r.is_error and "argument tasks: must be a list of at least 1" in text(r)
    assert kg.index() == before


async def test_a_batch_the_queue_cannot_hold_is_rejected_whole(kg):
    kg.config(autostart=False, max_agents=1, max_queue=3)
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"tasks": [{"name": f"t{i}", "command": ["true"]} for i in range(6)]})
        assert not r.is_error  # back-pressure, not a failure
        out = r.structured_content
    assert not out["admitted"] and out["retry_after"] == 60 and out["rejected"].startswith("tasks[4]: queue full")
    assert "Nothing was queued (none of the 6 tasks)" in out["advice"]
    assert live(kg) == []


async def test_concurrent_sessions_of_one_server_are_all_admitted_at_distinct_positions(kg):
    token = "a-test-token-0123456789abcdef"
    kg.config(autostart=False, max_agents=1, max_queue=500)
    kg.ok("config", "set", "mcp.token", token)
    proc, url = start_http(kg, "--http", "127.0.0.1:0")
    sessions, each = 16, 5
    results: list = []
    try:
        async def session(k: int) -> None:
            # A connection a request: the server closes a kept-alive one whose next head has
            # not come 5 s after the last response (guard.HEADER_TIMEOUT), which a client on
            # a loaded machine can take, sending into a closing socket (ReadError).
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120,
                                      limits=httpx2.Limits(max_keepalive_connections=0))
            async with Client(streamable_http_client(url, http_client=http), mode="legacy") as c:
                async with anyio.create_task_group() as tg:  # each session's calls in flight at once too
                    for j in range(each):
                        tg.start_soon(one, c, f"s{k}-{j}")

        async def one(c, name: str) -> None:
            results.append(await c.call_tool("delegate", {"name": name, "command": ["true"], "cwd": str(kg.rec)}))

        async with anyio.create_task_group() as tg:
            for k in range(sessions):
                tg.start_soon(session, k)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert all(not r.is_error and r.structured_content["admitted"] for r in results), [text(r) for r in results]
    tasks = [r.structured_content["task"] for r in results]
    assert len({t["id"] for t in tasks}) == sessions * each == len(live(kg))
    queued = [t["position"] for t in tasks if t["state"] == "queued"]
    # Under fifo a position, once given, stays: each call got its own.
    assert sorted(queued) == list(range(1, sessions * each))
