"""Each scheduling rule of pm/policy, on an in-memory Index with an injected clock."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec
import pytest

from conftest import T0

from kugetsu.core import admission, lifecycle, policy, selection, step
from kugetsu.config.model import Config
from kugetsu.config.units import parse_size
from kugetsu.errors import Rejected, UsageError
from kugetsu.core.models import Index, TaskState


def cfg(**kw: object) -> Config:
    return msgspec.convert(kw, Config)


def add(index: Index, c: Config, name: str, source: str = "cli", priority: str = "normal",
        group: str | None = None, now: datetime = T0):
    req = admission.Request(cwd="/", name=name, command=["true"], source=source, priority=priority, group=group)
    task, events = admission.admit(index, c, now, req)
    return task, events


def settle(index: Index, c: Config, now: datetime = T0, res: policy.Resources | None = None) -> list[str]:
    """step.settle; the names of the tasks it started, in order."""
    return [e.name for e in step.settle(index, c, now, res).events if e.type == "started"]


def order(index: Index, c: Config, now: datetime = T0) -> list[str]:
    return [t.name for t in selection.start_order(index, c, now)]


def finish(index: Index, name: str, now: datetime = T0) -> None:
    lifecycle.finish(index, next(t for t in index.active if t.name == name), now, 0)


# ---- defaults: FIFO exactly as before ----------------------------------------------------


def test_default_is_fifo_whatever_the_priority():
    c, ix = cfg(max_agents=1), Index()
    for name, prio in [("a", "low"), ("b", "urgent"), ("c", "normal")]:
        add(ix, c, name, priority=prio)
    assert settle(ix, c) == ["a"]
    assert order(ix, c) == ["b", "c"]
    assert selection.waiting_for(ix, c, T0) == {}


# ---- priority ----------------------------------------------------------------------------


def test_priority_levels_then_admission_order():
    c, ix = cfg(max_agents=1, strategy="priority"), Index()
    add(ix, c, "run")
    settle(ix, c)
    for name, prio in [("l1", "low"), ("n1", "normal"), ("u1", "urgent"), ("h1", "high"), ("u2", "urgent"), ("n2", "normal")]:
        add(ix, c, name, priority=prio)
    assert order(ix, c) == ["u1", "u2", "h1", "n1", "n2", "l1"]
    assert selection.positions(ix, c, T0)[ix.queued[0].id] == 6  # l1


def test_set_priority_moves_a_queued_task_and_refuses_others():
    c, ix = cfg(max_agents=1, strategy="priority"), Index()
    add(ix, c, "run")
    settle(ix, c)
    add(ix, c, "a")
    b, _ = add(ix, c, "b")
    events = admission.set_priority(ix, b, "high", T0)
    assert [e.type for e in events] == ["priority"] and events[0].value == "high"
    assert order(ix, c) == ["b", "a"]
    assert admission.set_priority(ix, b, "high", T0) == []  # no change, no event
    with pytest.raises(UsageError) as err:
        admission.set_priority(ix, ix.active[0], "low", T0)
    assert err.value.code == 1 and "running" in str(err.value)
    with pytest.raises(UsageError):
        admission.set_priority(ix, b, "asap", T0)


# ---- fair --------------------------------------------------------------------------------


def test_fair_round_robin_by_oldest_last_start():
    c, ix = cfg(max_agents=1, strategy="fair"), Index()
    for i, src in enumerate("aaabbc"):
        add(ix, c, f"{src}{i}", source=src)
    started = settle(ix, c)
    assert order(ix, c) == ["b3", "c5", "a1", "b4", "a2"]
    now = T0
    while ix.queued or ix.active:  # drain for real: one slot freeing at a time, the clock moving
        now += timedelta(seconds=1)
        finish(ix, ix.active[0].name, now)
        started += settle(ix, c, now)
    assert [s[0] for s in started] == list("abcaba")


def test_fair_within_a_source_priority_then_fifo():
    c, ix = cfg(max_agents=1, strategy="fair"), Index()
    add(ix, c, "b0", source="b")
    settle(ix, c)
    add(ix, c, "a1", source="a")
    add(ix, c, "a2", source="a", priority="high")
    add(ix, c, "b1", source="b", priority="urgent")
    # a never started: it goes first, its high task first; then b (started before), then a.
    assert order(ix, c) == ["a2", "b1", "a1"]


def test_fair_sources_started_in_one_transaction_still_alternate():
    # Several starts at the same instant must not tie: the start counter orders them.
    c, ix = cfg(max_agents=2, strategy="fair"), Index()
    for name, src in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("a3", "a"), ("b2", "b")]:
        add(ix, c, name, source=src)
    assert settle(ix, c) == ["a1", "b1"]
    assert ix.last_start["a"].at == ix.last_start["b"].at
    assert order(ix, c) == ["a2", "b2", "a3"]


# ---- per-source limits -------------------------------------------------------------------


def test_max_active_per_source_lets_others_pass():
    c, ix = cfg(max_agents=3, max_active_per_source=1), Index()
    add(ix, c, "a1", source="a")
    add(ix, c, "a2", source="a")
    add(ix, c, "b1", source="b")
    assert settle(ix, c) == ["a1", "b1"]
    assert selection.waiting_for(ix, c, T0) == {ix.queued[0].id: "source a has 1 running (limit 1)"}
    finish(ix, "a1")
    assert settle(ix, c) == ["a2"]


def test_max_queued_per_source_rejects_before_writing():
    c, ix = cfg(max_agents=1, max_queued_per_source=2), Index()
    for n in range(3):  # one runs, two wait
        add(ix, c, f"p{n}", source="pm")
        settle(ix, c)
    before = msgspec.json.encode(ix)
    with pytest.raises(Rejected, match=r"^source pm already has 2 queued tasks \(limit 2\)"):
        add(ix, c, "p3", source="pm")
    assert msgspec.json.encode(ix) == before
    add(ix, c, "other", source="cli")  # other sources are not affected


def test_min_start_interval_holds_one_source_only_and_says_until_when():
    c, ix = cfg(max_agents=4, min_start_interval_per_source="10s"), Index()
    add(ix, c, "a1", source="a")
    add(ix, c, "a2", source="a")
    add(ix, c, "b1", source="b")
    assert settle(ix, c) == ["a1", "b1"]
    a2 = ix.queued[0]
    assert selection.waiting_for(ix, c, T0 + timedelta(seconds=3)) == {a2.id: "rate limit: source a may start again in 7s"}
    assert selection.next_release(ix, c, T0) == T0 + timedelta(seconds=10)
    assert settle(ix, c, T0 + timedelta(seconds=9.9)) == []
    assert settle(ix, c, T0 + timedelta(seconds=10)) == ["a2"]
    assert selection.next_release(ix, c, T0 + timedelta(seconds=10)) is None


def test_rate_limit_survives_clean_of_finished_tasks():
    c, ix = cfg(max_agents=2, min_start_interval_per_source="1m"), Index()
    add(ix, c, "a1", source="a")
    settle(ix, c)
    finish(ix, "a1")
    lifecycle.clean(ix, T0)
    add(ix, c, "a2", source="a")
    assert settle(ix, c, T0 + timedelta(seconds=30)) == []


# ---- queue full --------------------------------------------------------------------------


def test_queue_full_rejects_by_default():
    c, ix = cfg(max_agents=1, max_queue=1), Index()
    add(ix, c, "a")
    settle(ix, c)
    add(ix, c, "b")
    with pytest.raises(Rejected, match=r"queue full: 1/1 waiting"):
        add(ix, c, "c")


def test_drop_oldest_cancels_the_longest_waiting_task():
    c, ix = cfg(max_agents=1, max_queue=2, on_queue_full="drop_oldest"), Index()
    for name in "abc":
        add(ix, c, name)
        settle(ix, c)
    task, events = add(ix, c, "d")
    assert [(e.type, e.name, e.reason) for e in events] == [
        ("cancelled", "b", "dropped: queue full"), ("queued", "d", None)
    ]
    assert [t.name for t in ix.queued] == ["c", "d"]
    assert ix.finished[-1].state is TaskState.CANCELLED


def test_drop_oldest_with_an_empty_queue_still_rejects():
    c, ix = cfg(max_agents=1, max_queue=0, on_queue_full="drop_oldest"), Index()
    add(ix, c, "a")
    settle(ix, c)
    with pytest.raises(Rejected):
        add(ix, c, "b")


# ---- groups ------------------------------------------------------------------------------


def test_group_needs_a_slot_in_its_group_and_globally():
    c, ix = cfg(max_agents=2, groups={"gpu": {"max_agents": 1}}), Index()
    add(ix, c, "g1", group="gpu")
    add(ix, c, "g2", group="gpu")
    add(ix, c, "c1")
    add(ix, c, "c2")
    assert settle(ix, c) == ["g1", "c1"]
    assert order(ix, c) == ["g2", "c2"]  # g2 waits for g1, which ends first
    finish(ix, "c1")
    assert selection.waiting_for(ix, c, T0)[ix.queued[0].id] == "group gpu full (1/1 running)"
    assert settle(ix, c) == ["c2"]  # passes the blocked g2
    assert selection.group_usage(ix, c) == {"gpu": {"max_agents": 1, "active": 1, "queued": 1}}


def test_a_deadline_tick_behind_a_full_group_plays_no_lane_of_a_deep_queue(monkeypatch):
    """Issue 31: 10,000 tasks queued in a full one-slot group, free slots beside it (agents
    with run timeouts). The tick that expires a burst and stops a timed-out agent starts
    nothing, and knows it without laying the queue into a Board's lanes (40-60 ms a tick:
    every expiry and timeout fired that late); the tick after it, nothing due, neither."""
    c = cfg(max_agents=4, max_queue=20_000, groups={"q": {"max_agents": 1}})
    ix = Index()
    add(ix, c, "holder", group="q")
    add(ix, c, "timed")
    assert settle(ix, c) == ["holder", "timed"]
    ix.active[1].timeout = 60
    for task in ix.active:  # spawned (a stop of a task without a process ends it at once)
        task.run.pid = 1_000_000 + task.id
    base = ix.queued  # admission at depth is not what is measured: the queue is built directly
    for i in range(10_000):
        base.append(msgspec.structs.replace(ix.active[0], id=ix.next_id + i, name=f"t{i}", state=TaskState.QUEUED,
                                            run=None, started_at=None, token=None,
                                            expires_at=T0 + timedelta(seconds=60 if i < 10 else 3600)))
    ix.next_id += 10_000
    builds = []
    real = policy.Board.__init__
    monkeypatch.setattr(policy.Board, "__init__", lambda self, *a, **kw: builds.append(1) or real(self, *a, **kw))
    now = T0 + timedelta(seconds=60)
    plan = step.tick(ix, c, now, step.Observations())
    assert [e.type for e in plan.events] == ["expired"] * 10 and {t.name for t, _ in plan.signal_groups} == {"timed"}
    assert plan.start == [] and len(ix.queued) == 9_990
    assert step.tick(ix, c, now + timedelta(seconds=1), step.Observations()).events == []
    assert builds == []
    # A slot of the group frees: its next task starts, as the Board picks it.
    finish(ix, "holder", now)
    assert settle(ix, c, now) == ["t10"] and builds == [1]


def test_the_first_tasks_in_start_order_of_a_deep_queue_play_only_those_forward(monkeypatch):
    """The warm wrappers (every slot busy) ask for the first 100 in start order at each tick:
    with a group that order is played forward on a Board, and only as far as those 100 (all
    10,000 were: 30 ms of every tick)."""
    c, ix = cfg(max_agents=1, max_queue=20_000, groups={"q": {"max_agents": 1}}), Index()
    add(ix, c, "holder", group="q")
    assert settle(ix, c) == ["holder"]
    ix.queued += [msgspec.structs.replace(ix.active[0], id=ix.next_id + i, name=f"t{i}", state=TaskState.QUEUED,
                                          run=None, started_at=None, group="q" if i % 2 else None)
                  for i in range(10_000)]
    ix.next_id += 10_000
    picks = []
    real = policy.Board.pick
    monkeypatch.setattr(policy.Board, "pick", lambda self: picks.append(1) or real(self))
    first = selection.start_order(ix, c, T0, 100)
    assert [t.name for t in first] == [f"t{i}" for i in range(100)]
    assert len(picks) <= 2 * 100


def test_the_queue_deadline_is_the_earliest_expiry_of_a_task_not_stashed():
    c, ix = cfg(max_agents=1), Index()
    for name, after in (("a", 30), ("b", 10), ("c", None), ("d", 20)):
        admission.admit(ix, c, T0, admission.Request(cwd="/", name=name, command=["true"], expire_after=after))
    assert lifecycle.queue_deadline(ix) == T0 + timedelta(seconds=10)
    admission.stash(ix.queued[1], T0, True)
    assert lifecycle.queue_deadline(ix) == T0 + timedelta(seconds=20)
    for task in ix.queued:
        task.expires_at = None
    assert lifecycle.queue_deadline(ix) is None


def test_unknown_group_is_refused_at_admission():
    c, ix = cfg(groups={"gpu": {"max_agents": 1}}), Index()
    with pytest.raises(UsageError, match="unknown group 'tpu'"):
        add(ix, c, "x", group="tpu")


def test_a_group_removed_from_config_no_longer_limits():
    c, ix = cfg(max_agents=3, groups={"gpu": {"max_agents": 1}}), Index()
    add(ix, c, "g1", group="gpu")
    add(ix, c, "g2", group="gpu")
    assert settle(ix, c) == ["g1"]
    assert settle(ix, cfg(max_agents=3)) == ["g2"]


# ---- resource guard ------------------------------------------------------------------------


def test_resource_guard_holds_every_start_and_says_why():
    c, ix = cfg(max_agents=3, resource_guard={"min_available_memory": "2GiB", "max_load_per_cpu": 1.5}), Index()
    add(ix, c, "a")
    low_mem = policy.Resources(available_memory=int(1.2 * 1024**3), load_per_cpu=0.1)
    assert settle(ix, c, res=low_mem) == []
    assert selection.waiting_for(ix, c, T0, low_mem) == {ix.queued[0].id: "held: 1.2 GiB available, need 2 GiB"}
    busy = policy.Resources(available_memory=8 * 1024**3, load_per_cpu=2.25)
    assert selection.waiting_for(ix, c, T0, busy) == {ix.queued[0].id: "held: load 2.25 per CPU, max 1.5"}
    assert settle(ix, c, res=busy) == []
    assert selection.positions(ix, c, T0) == {ix.queued[0].id: 1}  # the order does not change
    assert settle(ix, c, res=policy.Resources(available_memory=3 * 1024**3, load_per_cpu=1.0)) == ["a"]


def test_resource_guard_off_by_default_ignores_readings():
    c, ix = cfg(), Index()
    add(ix, c, "a")
    assert settle(ix, c, res=policy.Resources(available_memory=1, load_per_cpu=99.0)) == ["a"]


def test_policy_wakeups_at_a_rate_limits_end_and_a_guard_recheck_that_is_never_pushed_back():
    # The reconcile every 5 s would hide a missing wake-up in the end-to-end tests.
    c, ix = cfg(max_agents=2, min_start_interval_per_source="1m"), Index()
    add(ix, c, "a1", source="a")
    add(ix, c, "a2", source="a")
    assert settle(ix, c) == ["a1"]
    assert lifecycle.policy_wakeups(ix, c, T0, None, {}) == {"rate-limit": T0 + timedelta(minutes=1)}

    c = cfg(max_agents=2, resource_guard={"min_available_memory": "2GiB"})
    low_mem = policy.Resources(available_memory=1024**3, load_per_cpu=0.1)
    jobs = lifecycle.policy_wakeups(ix, c, T0, low_mem, {})
    assert jobs == {"resource-guard": T0 + timedelta(seconds=lifecycle.GUARD_RECHECK)}
    later = T0 + timedelta(seconds=1)
    assert lifecycle.policy_wakeups(ix, c, later, low_mem, jobs) == jobs  # kept, not pushed back by every tick
    due = T0 + timedelta(seconds=lifecycle.GUARD_RECHECK)  # it has come and the guard still holds: the next one
    assert lifecycle.policy_wakeups(ix, c, due, low_mem, jobs) == {"resource-guard": due + timedelta(seconds=lifecycle.GUARD_RECHECK)}
    assert lifecycle.policy_wakeups(ix, c, T0, policy.Resources(available_memory=4 * 1024**3, load_per_cpu=0.1), {}) == {}
    assert lifecycle.policy_wakeups(Index(), c, T0, low_mem, jobs) == {}  # nothing waits: no wake-ups


def test_policy_config_keys_are_checked():
    from kugetsu.config.keys import with_value
    from kugetsu.config.load import validate
    from kugetsu.config.model import KEY_HELP

    raw: dict = {}
    for key, value in [("strategy", "fair"), ("groups.gpu", {"max_agents": 2}), ("groups.gpu.max_agents", 1),
                       ("resource_guard.max_load_per_cpu", 1.5), ("min_start_interval_per_source", "30s"),
                       ("on_queue_full", "drop_oldest"), ("max_active_per_source", 2), ("max_queued_per_source", 5)]:
        raw = with_value(raw, key, value)
    c = validate(raw)
    assert (c.strategy, c.groups["gpu"].max_agents, c.min_start_interval_s) == ("fair", 1, 30.0)
    for key, value in [("strategy", "lottery"), ("min_start_interval_per_source", "soon"),
                       ("on_queue_full", "drop_newest"), ("max_active_per_source", 0), ("groups.gpu.max_agents", 0),
                       ("resource_guard.max_load_per_cpu", -1), ("resource_guard.min_available_memory", "lots")]:
        with pytest.raises(Exception):
            validate(with_value(raw, key, value))
    for key in ("resource_guard.min_free", "groups.gpu.slots", "stratgy"):
        with pytest.raises(UsageError):
            with_value(raw, key, 1)
    assert all(k in KEY_HELP for k in Config.__struct_fields__)


def test_parse_size_units():
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512 MiB") == 512 * 1024**2
    assert parse_size("1G") == 1024**3
    assert parse_size("800MB") == 800 * 1000**2
    assert parse_size(4096) == 4096
    for bad in ("2 GiBs", "-1G", "0", True, "lots"):
        with pytest.raises(ValueError):
            parse_size(bad)


# ---- positions are the selection played forward ------------------------------------------------


def test_positions_follow_a_blocked_head_rather_than_a_sort():
    # a2 is first by admission, but source a is at its limit and a1 ends only after b1 (the
    # oldest running task ends first): b2 takes b1's slot, a2 the next one, then c1.
    c, ix = cfg(max_agents=2, max_active_per_source=1), Index()
    add(ix, c, "b1", source="b")
    add(ix, c, "a1", source="a")
    settle(ix, c)
    add(ix, c, "a2", source="a")
    add(ix, c, "b2", source="b")
    add(ix, c, "c1", source="c")
    assert order(ix, c) == ["b2", "a2", "c1"]
    assert sorted(ix.queued, key=lambda t: t.id)[0].name == "a2"


def test_old_index_without_policy_fields_loads():
    data = b'{"version": 1, "next_id": 2, "queued": [{"id": 1, "name": "x", "state": "queued", "command": ["true"], "cwd": "/", "created_at": "2025-01-01T00:00:00+00:00"}]}'
    ix = msgspec.json.decode(data, type=Index)
    assert ix.starts == 0 and ix.last_start == {} and ix.queued[0].group is None
