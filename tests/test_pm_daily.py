"""pm's rules for issue 19 (daily use): wait by name, pause, dependencies, edit. Pure, in microseconds."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import msgspec
import pytest

from kugetsu import pm
from kugetsu.config import Config
from kugetsu.errors import AmbiguousName
from kugetsu.models import Index, TaskState

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def req(name=None, **kw):
    return pm.Request(cwd="/tmp", name=name, command=kw.pop("command", ["true"]), **kw)


def admit(index, cfg, name=None, now=T0, **kw):
    return pm.admit(index, cfg, now, req(name, **kw))[0]


def run_to_end(index, cfg, task, code=0, now=T0):
    pm.settle(index, cfg, now)
    assert task.state is TaskState.RUNNING
    return pm.finish(index, task, now, code)


# ---- wait by name -------------------------------------------------------------------------


def test_wait_by_a_name_only_finished_tasks_bear_is_refused_once_it_was_reused():
    index, cfg = Index(), Config()
    first = admit(index, cfg, "issue-16")
    run_to_end(index, cfg, first)
    assert pm.find_to_wait(index, "issue-16") is first  # one task ever had it: that one
    second = admit(index, cfg, "issue-16")
    assert pm.find_to_wait(index, "issue-16") is second  # a live one: names are unique among them
    run_to_end(index, cfg, second, 1)
    with pytest.raises(AmbiguousName) as err:
        pm.find_to_wait(index, "issue-16")
    assert err.value.ids == [1, 2] and err.value.code == 2
    assert pm.find_to_wait(index, "#1") is first and pm.find_to_wait(index, "2") is second


# ---- pause --------------------------------------------------------------------------------


def test_pause_holds_every_start_but_positions_stay_the_order_after_resume():
    index, cfg = Index(), Config(max_agents=1)
    a, b, c = (admit(index, cfg, n) for n in "abc")
    pm.settle(index, cfg, T0)
    assert a.state is TaskState.RUNNING
    assert [e.type for e in pm.pause(index, cfg, T0, None, True)] == ["paused"]
    assert pm.pause(index, cfg, T0, None, True) == []  # already paused: nothing to say
    pm.finish(index, a, T0, 0)
    assert pm.settle(index, cfg, T0).start == []  # a free slot, and nothing starts
    assert pm.successor(index, cfg) is None
    view = pm.queue_view(index, cfg, T0)
    assert view.positions == {b.id: 1, c.id: 2}
    assert view.waiting_for == {b.id: "paused", c.id: "paused"}
    assert view.capacity.paused and view.capacity.free == 1
    pm.pause(index, cfg, T0, None, False)
    assert [t.name for t in pm.settle(index, cfg, T0).start] == ["b"]


def test_a_paused_group_lets_the_others_pass_and_comes_last():
    cfg = msgspec.convert({"max_agents": 1, "groups": {"gpu": {"max_agents": 1}}}, Config)
    index = Index()
    with pytest.raises(Exception, match="unknown group 'cpu'"):
        pm.pause(index, cfg, T0, "cpu", True)
    pm.pause(index, cfg, T0, "gpu", True)
    blocker = admit(index, cfg, "blocker")
    train = admit(index, cfg, "train", group="gpu")
    lint = admit(index, cfg, "lint")
    pm.settle(index, cfg, T0)
    assert blocker.state is TaskState.RUNNING
    view = pm.queue_view(index, cfg, T0)
    assert [t.name for t in view.queued] == ["lint", "train"]
    assert view.waiting_for == {train.id: "group gpu paused"}
    assert view.capacity.paused_groups == ["gpu"]
    pm.finish(index, blocker, T0, 0)
    assert [t.name for t in pm.settle(index, cfg, T0).start] == ["lint"]
    pm.finish(index, lint, T0, 0)
    assert pm.settle(index, cfg, T0).start == []
    pm.pause(index, cfg, T0, "gpu", False)
    assert [t.name for t in pm.settle(index, cfg, T0).start] == ["train"]


def test_every_front_ends_summary_says_paused():
    from kugetsu import render
    from kugetsu.telegram import text
    from kugetsu.tui import view

    index, cfg = Index(paused=True), Config()
    cap = pm.capacity(index, cfg)
    assert render.summary(cap).endswith(" · paused: no queued task starts")
    assert "paused: no queued task starts" in view.summary(cap, 1234)
    assert "paused: no queued task starts" in text.capacity(cap)
    grouped = pm.capacity(Index(paused_groups=["gpu"]), cfg)
    assert render.summary(grouped).endswith(" · paused: group gpu")
    assert render.summary(pm.capacity(Index(), cfg)).endswith("(max 50)")
