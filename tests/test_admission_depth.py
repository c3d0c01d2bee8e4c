"""Admission whose cost does not grow with the queue (issue 31): a batch's admissions, and a
long-lived writer's (the MCP server's) one after the other, ask the whole queue only now and
then, not ~7 times a task. Counted, not timed: every pass a rule's question makes over a list
longer than 100 tasks (core/look.py's _QUESTIONS, its sorts), through the real file store in a
temp home. The answers are the ones a fresh look gives: the tests' stores check every carried
Look against a fresh one (KUGETSU_PG_VERIFY, conftest)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import anyio
import pytest
from test_look_chain import count_passes

from kugetsu.app import delegation
from kugetsu.config.load import load_config
from kugetsu.core import admission
from kugetsu.paths import Home
from kugetsu.store import tracking
from kugetsu.store.files import open_store

DEEP = 3000


@pytest.fixture
def passes(monkeypatch) -> dict[str, int]:
    """Passes over a list of more than 100 tasks (test_look_chain.count_passes). The check of
    every carried Look against a fresh one (KUGETSU_PG_VERIFY) is off here: it asks them all
    afresh (what these tests count); the other tests keep it on."""
    monkeypatch.setattr(tracking, "VERIFY", False)
    return count_passes(monkeypatch)


def _request(name: str | None = None) -> admission.Request:
    return admission.Request(cwd="/", command=["true"], source="pm", name=name)


def _deep_home(kg) -> Home:
    kg.config(autostart=False, max_agents=1, max_queue=DEEP * 2)
    home = kg.home
    delegation.delegate_all(home, load_config(home), [_request() for _ in range(DEEP)])
    return home


def test_a_batch_asks_the_whole_queue_a_few_times_not_a_few_times_a_task(kg, passes):
    home = _deep_home(kg)
    passes.update(questions=0, sorts=0)
    out = delegation.delegate_all(home, load_config(home), [_request(f"issue-{i}") for i in range(50)])
    # where each was put, as the queue has them: the first 3,000 came before
    assert [a.position for a in out] == list(range(DEEP, DEEP + 50))
    assert passes["questions"] <= 7 * 3, passes  # a fresh Look an admission: ~7 * 50 * 2
    assert passes["sorts"] <= 6, passes
    queued = open_store(home).read().queued
    assert [t.name for t in queued[-50:]] == [f"issue-{i}" for i in range(50)]


def test_a_long_lived_writers_admissions_one_after_the_other_carry_their_looks(kg, passes):
    """The MCP server's Admitter: one call after the other, each its own transaction on the
    store it keeps, as a PM agent delegates issue by issue."""
    pytest.importorskip("mcp", reason="the MCP SDK is in the test extra: pip install -e '.[test]'")
    from kugetsu.frontends.mcp.tools_tasks import Admitter

    home = _deep_home(kg)
    admitter = Admitter(home)

    async def admit_all() -> list[delegation.Admission]:
        return [await admitter.admit(_request(f"issue-{i}")) for i in range(40)]

    try:
        anyio.run(admitter.admit, _request("first"))  # the store opened, the queue read once
        passes.update(questions=0, sorts=0)
        out = anyio.run(admit_all)
    finally:
        admitter.close()
    assert [a.position for a in out] == list(range(DEEP + 1, DEEP + 41))
    assert passes["questions"] <= 7 * 3, passes  # a fresh Look an admission: ~7 * 40 * 3
    assert passes["sorts"] <= 6, passes
    assert [t.name for t in open_store(home).read().queued[-41:]] == ["first"] + [f"issue-{i}" for i in range(40)]


def test_a_refused_batch_leaves_the_next_admissions_positions_true(kg):
    """A list refused at its third item writes nothing; the Admitter's Looks had followed its
    first two into a queue that was never committed. Then the CLI, another process, delegates
    (index.json written whole: the Admitter reads it afresh). The calls after both are placed
    as the queue on disk has them (every carried Look is checked against a fresh one here)."""
    pytest.importorskip("mcp", reason="the MCP SDK is in the test extra: pip install -e '.[test]'")
    from kugetsu.frontends.mcp.tools_tasks import Admitter

    kg.config(autostart=False, max_agents=1, max_queue=500, groups={"small": {"max_agents": 1}})
    home = kg.home
    admitter = Admitter(home)

    async def calls() -> list[delegation.Admission]:
        out = [await admitter.admit(_request(f"a{i}")) for i in range(120)]
        bad = [_request("b0"), _request("b1"), admission.Request(cwd="/", command=["true"], group="nosuch")]
        with pytest.raises(delegation.BatchRefused):
            await admitter.admit_all(bad)
        assert kg.ok("delegate", "x0", "--", "true").startswith("queued x0 (#121), position 120 of 120")
        later = admission.Request(cwd="/", command=["true"], source="pm", name="c1",
                                  start_at=datetime.now(timezone.utc) + timedelta(hours=1))
        out += await admitter.admit_all([_request("c0"), later])  # c1 waits for its time: not before d0
        out.append(await admitter.admit(_request("d0")))
        return out

    try:
        out = anyio.run(calls)
    finally:
        admitter.close()
    assert [a.position for a in out] == [None] + list(range(1, 120)) + [121, 122, 122]
    queued = open_store(home).read().queued
    assert [t.name for t in queued[-5:]] == ["a119", "x0", "c0", "c1", "d0"]
    assert not any(t.name.startswith("b") for t in queued)
