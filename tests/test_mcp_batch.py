"""delegate with `tasks` (a list admitted in one transaction, all or none) and concurrent
sessions of one server sharing transactions, through the MCP SDK's own client and a real
`python -m kugetsu mcp` (stdio, or streamable HTTP)."""

from __future__ import annotations

import json

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


async def in_sessions(kg, sessions: int, work) -> None:
    """`work(k, client)` in each of `sessions` client sessions of one `kugetsu mcp --http`,
    all at once; the server is stopped after."""
    token = "a-test-token-0123456789abcdef"
    kg.ok("config", "set", "mcp.token", token)
    proc, url = start_http(kg, "--http", "127.0.0.1:0")
    try:
        async def session(k: int) -> None:
            # A connection a request: the server closes a kept-alive one whose next head has
            # not come 5 s after the last response (guard.HEADER_TIMEOUT), which a client on
            # a loaded machine can take, sending into a closing socket (ReadError).
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120,
                                      limits=httpx2.Limits(max_keepalive_connections=0))
            async with Client(streamable_http_client(url, http_client=http), mode="legacy") as c:
                await work(k, c)

        async with anyio.create_task_group() as tg:
            for k in range(sessions):
                tg.start_soon(session, k)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_concurrent_sessions_of_one_server_are_all_admitted_at_distinct_positions(kg):
    kg.config(autostart=False, max_agents=1, max_queue=500)
    sessions, each = 16, 5
    results: list = []

    async def work(k: int, c) -> None:
        async with anyio.create_task_group() as tg:  # each session's calls in flight at once too
            for j in range(each):
                tg.start_soon(one, c, f"s{k}-{j}")

    async def one(c, name: str) -> None:
        results.append(await c.call_tool("delegate", {"name": name, "command": ["true"], "cwd": str(kg.rec)}))

    await in_sessions(kg, sessions, work)
    assert all(not r.is_error and r.structured_content["admitted"] for r in results), [text(r) for r in results]
    tasks = [r.structured_content["task"] for r in results]
    assert len({t["id"] for t in tasks}) == sessions * each == len(live(kg))
    queued = [t["position"] for t in tasks if t["state"] == "queued"]
    # Under fifo a position, once given, stays: each call got its own.
    assert sorted(queued) == list(range(1, sessions * each))


async def test_sessions_calls_are_admitted_once_each_in_order_per_session(kg):
    """Sessions of one server, each one call after the other, share transactions: every
    call's task is admitted exactly once, and each session's tasks in the order it sent
    them (ids, positions and the queue's order under fifo)."""
    kg.config(autostart=False, max_agents=1, max_queue=500)
    sessions, each = 12, 8
    got: dict[int, list[dict]] = {k: [] for k in range(sessions)}

    async def work(k: int, c) -> None:
        for j in range(each):
            r = await c.call_tool("delegate", {"name": f"s{k}-{j}", "command": ["true"], "cwd": str(kg.rec)})
            assert not r.is_error and r.structured_content["admitted"], text(r)
            got[k].append(r.structured_content["task"])

    await in_sessions(kg, sessions, work)
    tasks = live(kg)
    assert sorted(t["name"] for t in tasks) == sorted(f"s{k}-{j}" for k in range(sessions) for j in range(each))
    assert len({t["id"] for t in tasks}) == sessions * each  # each once
    by_id = {t["id"]: t for t in tasks}
    order = [t["id"] for t in kg.index()["queued"]]  # fifo: the queue in start order
    for k, answers in got.items():
        assert [t["name"] for t in answers] == [f"s{k}-{j}" for j in range(each)]
        ids = [t["id"] for t in answers]
        assert ids == sorted(ids) and all(by_id[i]["name"] == t["name"] for i, t in zip(ids, answers))
        queued = [i for i in ids if i in order]
        assert [order.index(i) for i in queued] == sorted(order.index(i) for i in queued)


async def test_a_refused_call_in_flight_fails_none_of_its_neighbours(kg):
    """Calls in flight at once, singles and lists, share the server's turns: a refused single
    (a name taken) and a refused list (one bad item) fail alone; the single calls beside them
    and a good list go in, each once."""
    kg.config(autostart=False, max_agents=1, max_queue=200)
    kg.ok("delegate", "taken", "--", "true")
    results: dict[str, object] = {}
    async with connect(kg) as c:
        async def call(key: str, args: dict) -> None:
            results[key] = await c.call_tool("delegate", args)

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(call, f"one-{i}", {"name": f"one-{i}", "command": ["true"]})
                if i == 5:
                    tg.start_soon(call, "bad-single", {"name": "taken", "command": ["true"]})
                    tg.start_soon(call, "bad-list", {"tasks": [{"name": "l-a"}, {"name": "taken"}],
                                                     "command": ["true"]})
                if i == 10:
                    tg.start_soon(call, "good-list", {"tasks": [{"name": f"g-{j}"} for j in range(5)],
                                                      "command": ["true"]})
    assert results["bad-single"].is_error and "'taken' is already queued or running" in text(results["bad-single"])
    assert results["bad-list"].is_error and text(results["bad-list"]).startswith("tasks[1]: ")
    good = results["good-list"]
    assert not good.is_error and [t["task"]["name"] for t in good.structured_content["tasks"]] == \
        [f"g-{j}" for j in range(5)]
    for i in range(20):
        r = results[f"one-{i}"]
        assert not r.is_error and r.structured_content["task"]["name"] == f"one-{i}", text(r)
    names = [t["name"] for t in live(kg)]
    assert sorted(names) == sorted(["taken", *(f"one-{i}" for i in range(20)), *(f"g-{j}" for j in range(5))])
    assert "l-a" not in names  # the refused list: none of it


async def test_the_servers_admissions_see_every_other_writer(kg):
    """The server keeps the index it committed last for its next admission: a change made
    by another writer in between (the CLI's delegate, cancel, priority, a config change) is
    seen all the same: ids never reused, names checked, positions and limits as they are."""
    kg.config(autostart=False, max_agents=1, max_queue=5)
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"name": "a", "command": ["true"]})
        assert r.structured_content["task"]["id"] == 1
        kg.ok("delegate", "b", "--", "true")  # another writer between two of the server's
        r = await c.call_tool("delegate", {"name": "b", "command": ["true"]})
        assert r.is_error and "'b' is already queued or running" in text(r)
        r = await c.call_tool("delegate", {"name": "c", "command": ["true"]})
        assert r.structured_content["task"]["id"] == 3 and "position 2 of 2" in text(r)
        kg.ok("cancel", "b")
        r = await c.call_tool("delegate", {"name": "d", "command": ["true"]})
        assert r.structured_content["task"]["id"] == 4 and "position 2 of 2" in text(r)
        kg.ok("config", "set", "max_queue", "2")  # under the index lock: the next admission sees it
        r = await c.call_tool("delegate", {"name": "e", "command": ["true"]})
        assert not r.structured_content["admitted"] and r.structured_content["rejected"].startswith("queue full")
        kg.home.index.unlink()  # moved away: ids still never reused
        r = await c.call_tool("delegate", {"name": "f", "command": ["true"]})
        assert r.structured_content["task"]["id"] == 5, text(r)
    assert [t["name"] for t in live(kg)] == ["f"]


async def test_each_item_of_a_batch_says_why_it_waits_as_the_queue_does(kg):
    kg.config(autostart=False, max_agents=2, max_queue=100, groups={"gpu": {"max_agents": 1}})
    items = [{"name": "g0", "group": "gpu"}, {"name": "g1", "group": "gpu"}, {"name": "d1", "delay": "1h"},
             {"name": "d2", "delay": "2h"}, {"name": "p1"}, {"name": "p2"}, {"name": "g2", "group": "gpu"}]
    async with connect(kg) as c:
        r = await c.call_tool("delegate", {"tasks": items, "command": ["true"]})
        assert not r.is_error, text(r)
    got = {i["task"]["name"]: i["message"] for i in r.structured_content["tasks"]}
    assert got["g0"].startswith("started g0") and got["p1"].startswith("started p1")
    shown = {t["name"]: t for t in kg.json("queue")["queued"]}
    assert set(shown) == {"g1", "d1", "d2", "p2", "g2"}
    for name, task in shown.items():
        why = f"; waiting for: {task['waiting_for']}" if task.get("waiting_for") else ""
        assert got[name] == f"queued {name} (#{task['id']}), position {task['position']} of 5{why}"
    assert "group gpu full" in got["g1"] and "group gpu full" in got["g2"] and "starts at" in got["d2"]


async def test_the_admitter_lets_go_of_its_store_when_idle_and_opens_it_again(kg):
    """In-process (the idle time is a constructor argument): the index kept for the next
    admission is let go once none came for a while; the next admission opens the store again
    and sees the queue as it is, another writer's tasks included."""
    from conftest import wait_for_async

    from kugetsu.core import admission
    from kugetsu.frontends.mcp.tools_tasks import Admitter

    kg.config(autostart=False, max_agents=1, max_queue=10)
    admitter = Admitter(kg.home, forget_after=0.2)

    def request(name: str) -> admission.Request:
        return admission.Request(cwd=str(kg.rec), name=name, command=["true"], source="mcp")

    first = await admitter.admit(request("a"))
    assert first.task.id == 1 and admitter._store is not None
    await wait_for_async(lambda: admitter._store is None, 30, "the idle admitter to let go of its store")
    kg.ok("delegate", "b", "--", "true")
    again = await admitter.admit(request("c"))
    assert again.task.id == 3 and again.position == 2 and again.queued == 2
    assert [t["name"] for t in live(kg)] == ["a", "b", "c"]


async def test_the_admitter_appends_to_the_journal_and_folds_it_when_it_lets_go(kg):
    """A long-lived writer: its admissions are records in index.journal (index.json is not
    written whole at each call), folded into index.json once it lets go of the store (idle, or
    the server's end); meanwhile every reader and writer sees them."""
    from conftest import wait_for_async

    from kugetsu.core import admission
    from kugetsu.frontends.mcp.tools_tasks import Admitter

    kg.config(autostart=False, max_agents=1, max_queue=10)
    kg.ok("delegate", "first", "--", "true")  # index.json, written whole by a command
    index_json = kg.home.index.stat()
    # Idle for 3 s, it lets go: long enough that a loaded machine (CI) does not let go between
    # the two admissions and the looks below (0.5 s did, once, in a full run under load)
    admitter = Admitter(kg.home, forget_after=3)

    def request(name: str) -> admission.Request:
        return admission.Request(cwd=str(kg.rec), name=name, command=["true"], source="mcp")

    for name in ("a", "b"):
        await admitter.admit(request(name))
    assert kg.home.journal.exists()
    assert (kg.home.index.stat().st_ino, kg.home.index.stat().st_size) == (index_json.st_ino, index_json.st_size)
    assert [t["name"] for t in live(kg)] == ["first", "a", "b"]  # a reader replays the records
    await wait_for_async(lambda: admitter._store is None, 30, "the idle admitter to let go of its store")
    assert not kg.home.journal.exists()
    assert _in_index_json(kg) == ["first", "a", "b"]
    await admitter.admit(request("c"))
    assert kg.home.journal.exists()
    admitter.close()  # the server's end
    assert not kg.home.journal.exists() and _in_index_json(kg) == ["first", "a", "b", "c"]


def _in_index_json(kg) -> list[str]:
    """The running and queued tasks' names that index.json alone holds."""
    index = json.loads(kg.home.index.read_bytes())
    return [t["name"] for t in index["active"] + index["queued"]]


async def test_the_servers_delegates_are_in_index_json_once_it_ends_and_read_if_it_was_killed(kg):
    """`kugetsu mcp` (the real server over stdio): its delegates are journal records while it
    runs, folded into index.json as it ends; killed (-9) before that, its journal is replayed
    by every reader and folded by the next command that writes."""
    import os
    import signal

    from conftest import wait_for_async
    from test_mcp import mcp_server_pid

    kg.config(autostart=False, max_agents=1, max_queue=10)
    async with connect(kg) as client:
        for name in ("a", "b"):
            assert not (await client.call_tool("delegate", {"name": name, "command": ["true"]})).is_error
        assert kg.home.journal.exists() and [t["name"] for t in live(kg)] == ["a", "b"]
    await wait_for_async(lambda: not kg.home.journal.exists(), what="the ended server's fold")
    assert _in_index_json(kg) == ["a", "b"]
    async with connect(kg) as client:
        assert not (await client.call_tool("delegate", {"name": "c", "command": ["true"]})).is_error
        os.kill(mcp_server_pid(kg), signal.SIGKILL)
        assert kg.home.journal.exists() and _in_index_json(kg) == ["a", "b"]
        assert [t["name"] for t in live(kg)] == ["a", "b", "c"]  # replayed
        kg.ok("delegate", "d", "--", "true")  # a command writes index.json whole
        assert not kg.home.journal.exists() and _in_index_json(kg) == ["a", "b", "c", "d"]
