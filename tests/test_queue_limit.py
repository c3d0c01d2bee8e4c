"""`queue --limit N` and the MCP queue tool's `limit`: the first N queued tasks in start order
(that match a filter), at their true positions, and how many more wait after them. A long
queue is listed without sorting what is not shown, and an agent's context gets a bounded
answer. Real CLI, real MCP SDK client."""

from __future__ import annotations

import os
import re
from datetime import datetime, timedelta, timezone

from test_mcp import connect, text

from kugetsu.core.models import Index, Task
from kugetsu.frontends.mcp import tools_read
from kugetsu.store.protocol import encode_index


def _queued(kg, n: int, sources: tuple[str, ...] = ("pm",)) -> None:
    """n queued tasks written straight into index.json (no service: autostart off), the first
    with priority low, so that fifo and priority orders differ from the ids'."""
    kg.config(autostart=False, max_agents=1, max_queue=n + 10)
    kg.home.ensure()
    now = datetime.now(timezone.utc)
    index = Index(next_id=n + 1)
    for i in range(1, n + 1):
        index.queued.append(Task(id=i, name=f"t{i}", command=["true"], cwd="/", created_at=now, token=os.urandom(16).hex(),
                                 expires_at=now + timedelta(hours=1), source=sources[i % len(sources)],
                                 priority="low" if i == 1 else "normal"))
    kg.home.index.write_bytes(encode_index(index))


def test_queue_limit_lists_the_first_in_start_order_and_counts_the_rest(kg):
    _queued(kg, 30, sources=("pm", "ci"))
    whole = kg.json("queue")["queued"]
    limited = kg.json("queue", "--limit", "5")
    assert limited["queued"] == whole[:5] and limited["more_queued"] == 25
    assert [t["position"] for t in limited["queued"]] == [1, 2, 3, 4, 5]
    assert "more_queued" not in kg.json("queue", "--limit", "30")  # nothing left out: nothing said
    out = kg.ok("queue", "--limit", "3")
    assert "... and 27 more queued" in out and len(re.findall(r"^ +\d+ +\d+ +t\d+ ", out, re.M)) == 3
    # A filter first, then the limit: the first ones that match, at their true positions.
    ci = kg.json("queue", "--source", "ci", "--limit", "4")
    assert ci["queued"] == [t for t in whole if t["source"] == "ci"][:4] and ci["more_queued"] == 11
    # Under priority, a plain sort still: t1 (low) goes last, and a limit does not change that.
    kg.config(autostart=False, max_agents=1, max_queue=40, strategy="priority")
    assert [t["name"] for t in kg.json("queue", "--limit", "2")["queued"]] == ["t2", "t3"]
    assert kg.json("queue")["queued"][-1]["name"] == "t1"


def test_queue_limit_refuses_what_is_not_a_count(kg):
    _queued(kg, 3)
    before = kg.home.index.read_bytes()
    for bad in ("0", "x", "-2", "²"):
        r = kg.run("queue", "--limit", bad)
        assert r.returncode == 2 and "--limit" in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
    assert kg.home.index.read_bytes() == before


async def test_the_mcp_queue_tool_is_bounded_by_default_and_takes_a_limit(kg):
    _queued(kg, tools_read.QUEUE_LIMIT + 25)
    async with connect(kg) as c:
        r = await c.call_tool("queue", {})
        got = r.structured_content
        assert len(got["queued"]) == tools_read.QUEUE_LIMIT and got["more_queued"] == 25
        assert got == kg.json("queue", "--limit", str(tools_read.QUEUE_LIMIT))
        assert "... and 25 more queued" in text(r)
        r = await c.call_tool("queue", {"limit": 2})
        assert [t["position"] for t in r.structured_content["queued"]] == [1, 2]
        assert r.structured_content["more_queued"] == tools_read.QUEUE_LIMIT + 23
        r = await c.call_tool("queue", {"limit": 0})
        assert r.is_error  # refused by the tool's schema, nothing listed
        res = await c.read_resource("kugetsu://queue")
        assert '"more_queued": 25' in res.contents[0].text.replace('":25', '": 25')
