"""Property tests of the scheduling policies: random tasks, sources, priorities, limits and
strategies, drained for real (pm.next_to_start + pm.start + pm.finish, an injected clock)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import T0

from kugetsu import pm
from kugetsu.config import Config
from kugetsu.models import PRIORITIES, Index
from kugetsu.policy import Board, simple_order, task_key

task_st = st.tuples(st.sampled_from("abcd"), st.sampled_from(PRIORITIES), st.sampled_from([None, None, "g1", "g2"]),
                    st.sampled_from([None, "p1", "p2", "p2"]))
# Agent presets with their own max_agents (issue 18); a hold on p2 (a provider's limit) is
# drawn per example.
preset_st = st.fixed_dictionaries({"command": st.just(["true"]), "max_agents": st.none() | st.integers(1, 2)})
config_st = st.fixed_dictionaries({
    "max_agents": st.integers(1, 4),
    "strategy": st.sampled_from(["fifo", "priority", "fair"]),
    "max_active_per_source": st.none() | st.integers(1, 3),
    "min_start_interval_per_source": st.none() | st.integers(1, 5),
    "groups": st.fixed_dictionaries({"g1": st.fixed_dictionaries({"max_agents": st.integers(1, 2)}),
                                     "g2": st.fixed_dictionaries({"max_agents": st.integers(1, 3)})}),
    "max_queue": st.just(100),
    "agents": st.fixed_dictionaries({"p1": preset_st, "p2": preset_st}),
})


def build(raw: dict, first: list, later: list, gap: int, hold: int | None = None) -> tuple[Config, Index, datetime]:
    """Admit `first` and let them start at T0, then admit `later` at T0 + gap: a queue with
    some tasks running and the clock moved on, as the scheduler leaves it. `hold`: preset p2
    is held from T0 until that many seconds after T0 + gap (0: until released by hand)."""
    cfg = msgspec.convert(raw, Config)
    index = Index()
    if hold is not None:
        until = T0 + timedelta(seconds=gap + hold) if hold else None
        pm.hold(index, cfg, "p2", until, T0 - timedelta(seconds=1))
    now = T0
    for batch in (first, later):
        for source, priority, group, agent in batch:
            pm.admit(index, cfg, now, pm.Request(cwd="/", command=["true"], source=source, priority=priority,
                                                 group=group, agent=agent))
        pm.settle(index, cfg, now)
        now = T0 + timedelta(seconds=gap)
    return cfg, index, now


def check_limits(cfg: Config, index: Index, starts: dict[str, list[datetime]]) -> None:
    assert len(index.active) <= cfg.max_agents
    per_source = Counter(t.source for t in index.active)
    if cfg.max_active_per_source is not None:
        assert max(per_source.values(), default=0) <= cfg.max_active_per_source
    per_group = Counter(t.group for t in index.active if t.group)
    for group, n in per_group.items():
        assert n <= cfg.groups[group].max_agents
    for agent, n in Counter(t.agent for t in index.active if t.agent).items():
        cap = cfg.agents[agent].max_agents
        assert cap is None or n <= cap
    if cfg.min_start_interval_s is not None:
        gap = timedelta(seconds=cfg.min_start_interval_s)
        for times in starts.values():
            assert all(b - a >= gap for a, b in zip(times, times[1:]))


def drain(cfg: Config, index: Index, now: datetime, on_pick=None) -> list[int]:
    """Start tasks as the scheduler would, one at a time; when nothing may start, let time
    run to the next rate-limit release if a slot is free, else end the oldest running task."""
    starts: dict[str, list[datetime]] = {}
    for t in index.active:
        starts.setdefault(t.source, []).append(t.started_at)
    order = []
    steps = 0
    while index.queued:
        steps += 1
        assert steps < 1000, "drain does not progress"
        board = Board(index, cfg, now)
        for lane in board.lanes:  # the quick rule and the worded one agree
            assert board.free(*lane) == (board.why(*lane) is None)
        task = pm.next_to_start(index, cfg, now)
        if task is not None:
            assert pm.plan_starts(index, cfg, now)[0] is task
            hold = index.holds.get(task.agent)  # type: ignore[arg-type]
            assert hold is None or (hold.until is not None and hold.until <= now), "a held preset started"
            if on_pick:
                on_pick(index, now, task)
            pm.start(index, task, now)
            starts.setdefault(task.source, []).append(now)
            order.append(task.id)
            check_limits(cfg, index, starts)
            continue
        release = pm.next_release(index, cfg, now)
        if pm.free_slots(index, cfg) > 0 and release is not None:
            assert release > now
            now = release
        else:
            if not index.active and index.holds:  # only a hold by hand holds them: release it
                pm.release(index, cfg, next(iter(index.holds)), now)
                continue
            assert index.active, "queued tasks that nothing can ever start"
            pm.finish(index, index.active[0], now, 0)
    return order


@settings(max_examples=150, deadline=None)
@given(config_st, st.lists(task_st, max_size=8), st.lists(task_st, max_size=16), st.integers(0, 6),
       st.none() | st.integers(0, 8))
def test_limits_hold_and_positions_are_the_real_start_order(raw, first, later, gap, hold):
    cfg, index, now = build(raw, first, later, gap, hold)
    check_limits(cfg, index, {})
    predicted = [t.id for t in pm.start_order(index, cfg, now)]
    positions = pm.positions(index, cfg, now)
    assert sorted(positions.values()) == list(range(1, len(index.queued) + 1))
    assert [i for i, _ in sorted(positions.items(), key=lambda kv: kv[1])] == predicted
    assert drain(cfg, index, now) == predicted


@settings(max_examples=60, deadline=None)
@given(config_st, st.lists(task_st, max_size=8), st.lists(task_st, max_size=16), st.integers(0, 6))
def test_sort_fast_path_is_the_simulation(raw, first, later, gap):
    raw = {**raw, "strategy": raw["strategy"] if raw["strategy"] != "fair" else "priority"}
    raw |= {"max_active_per_source": None, "min_start_interval_per_source": None, "agents": {}}
    cfg, index, now = build(raw, first, later, gap)
    if not simple_order(index, cfg):  # tasks in a group: the fast path must stand aside
        assert any(t.group for t in index.queued)
        raw["groups"] = {}
        cfg = msgspec.convert(raw, Config)
    assert simple_order(index, cfg)
    assert Board(index, cfg, now).drain() == sorted(index.queued, key=lambda t: task_key(cfg, t))


@settings(max_examples=100, deadline=None)
@given(config_st, st.lists(task_st, max_size=8), st.lists(task_st, min_size=1, max_size=16), st.integers(0, 6))
def test_fair_never_starves_a_source(raw, first, later, gap):
    cfg, index, now = build({**raw, "strategy": "fair"}, first, later, gap)
    n_sources = len({t.source for t in index.all_tasks()})
    waited: dict[str, int] = {}  # source -> starts of others since it became eligible

    def on_pick(index: Index, now: datetime, task) -> None:
        held = pm.waiting_for(index, cfg, now)
        eligible = {t.source for t in index.queued if t.id not in held}
        for source in list(waited):
            if source not in eligible:
                del waited[source]  # no longer eligible: a new streak starts when it is again
        for source in eligible:
            if source == task.source:
                waited.pop(source, None)
            else:
                waited[source] = waited.get(source, 0) + 1
                assert waited[source] <= n_sources - 1, f"{source} passed over {waited[source]} times"

    drain(cfg, index, now, on_pick)


@settings(max_examples=150, deadline=None)
@given(config_st, st.booleans(), st.lists(task_st, max_size=8), st.lists(task_st, max_size=16), st.integers(0, 6), st.data())
def test_successor_is_what_the_next_free_slot_starts(raw, simple, first, later, gap, data):
    """pm.successor is a promise the service acts on before its transaction: whichever
    running task ends, at any moment before `until`, the transaction that records the end
    starts that task first. Queue deadlines are random, so expiry is part of the bargain; so
    are start times (`delegate --at`, a retry's delay) of tasks that sort before it."""
    if simple:
        raw |= {"strategy": data.draw(st.sampled_from(["fifo", "priority"])), "max_active_per_source": None,
                "min_start_interval_per_source": None, "agents": {}}
        first, later = ([(s, p, None, None) for s, p, _, _ in batch] for batch in (first, later))
    cfg, index, now = build(raw, first, later, gap)
    waiting = data.draw(st.booleans())  # some tasks wait for their time (`delegate --at`, a retry's delay)
    for task in index.queued:
        task.expires_at = data.draw(st.none() | st.integers(1, 30).map(lambda s: now + timedelta(seconds=s)))
        if waiting:
            task.not_before = data.draw(st.none() | st.integers(1, 30).map(lambda s: now + timedelta(seconds=s)))
    succ = pm.successor(index, cfg)
    if simple and not waiting and index.queued and len(index.active) == cfg.max_agents:
        assert succ is not None  # the common case of a busy queue does get its fast start
    if succ is None:
        return
    assert succ.task.not_before is None
    ahead = [t.not_before for t in index.queued if t.not_before and task_key(cfg, t) < task_key(cfg, succ.task)]
    assert succ.until == min(filter(None, [succ.task.expires_at, *ahead]), default=None)
    last = (succ.until - now) - timedelta(microseconds=1) if succ.until else timedelta(hours=1)
    for ending in range(len(index.active)):
        for at in (now, now + last):
            after = msgspec.json.decode(msgspec.json.encode(index), type=Index)
            pm.finish(after, after.active[ending], at, 0)
            pm.expire_due(after, at)
            assert [t.id for t in pm.plan_starts(after, cfg, at)][:1] == [succ.task.id]


@settings(max_examples=150, deadline=None)
@given(config_st, st.lists(task_st, max_size=8), st.lists(task_st, max_size=16), st.integers(0, 6),
       st.booleans(), st.booleans(), st.sampled_from([None, pm.Resources(available_memory=1, load_per_cpu=99.0)]))
def test_the_quick_answers_for_one_task_are_the_full_ones(raw, first, later, gap, groups, guard, res):
    """The CLI's hot path asks for one task's position and reason, and settles without a
    free slot: the short cuts give what the full computations give (the Board's lanes)."""
    if guard:
        raw = {**raw, "resource_guard": {"max_load_per_cpu": 1.0}}
    cfg, index, now = build(raw, first, later, gap)
    if not groups:  # removed from the config since: they limit nothing any more
        cfg = msgspec.convert({**raw, "groups": {}}, Config)
    board = Board(index, cfg, now, res)
    lanes = {t.id: board.pause or board.hold or board.why(*lane_id) for lane_id, lane in board.lanes.items() for _, t in lane}
    assert pm.waiting_for(index, cfg, now, res) == {i: why for i, why in lanes.items() if why is not None}
    full = pm.positions(index, cfg, now)
    for task in index.queued + index.active:
        assert pm.position(index, cfg, now, task) == full.get(task.id)
    for task in index.queued:
        assert pm.waiting_for_one(index, cfg, now, task, res) == lanes[task.id]
    picked = []
    while (task := board.pick()) is not None:
        board.take(task)
        picked.append(task)
    assert pm.plan_starts(index, cfg, now, res) == picked
