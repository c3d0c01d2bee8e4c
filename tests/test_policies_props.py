"""Property tests of the scheduling policies: random tasks, sources, priorities, limits and
strategies, drained for real (selection.next_to_start + lifecycle.start + lifecycle.finish, an injected clock)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import T0

from kugetsu.core import admission, budgets, lifecycle, policy, retries, selection, step
from kugetsu.agents.report import Usage
from kugetsu.errors import UsageError
from kugetsu.config.model import Config
from kugetsu.core.models import PRIORITIES, DaySpend, Index
from kugetsu.core.policy import Board, simple_order, task_key

task_st = st.tuples(st.sampled_from("abcd"), st.sampled_from(PRIORITIES), st.sampled_from([None, None, "g1", "g2"]),
                    st.sampled_from([None, "p1", "p2", "p2", "p2,p1", "p1,p2"]))
# Agent presets with their own max_agents (issue 18); a hold on p2 (a provider's limit) is
# drawn per example. "p2,p1": a failover order (issue 30): while p2 is held, on p1.
preset_st = st.fixed_dictionaries({"command": st.just(["true"]), "max_agents": st.none() | st.integers(1, 2),
                                   # a window quota (issue 30): 2 starts in 10 s, then a probe
                                   "limit": st.sampled_from([{}, {"window": "10s", "window_starts": 2}])})
config_st = st.fixed_dictionaries({
    "max_agents": st.integers(1, 4),
    "strategy": st.sampled_from(["fifo", "priority", "fair"]),
    "max_active_per_source": st.none() | st.integers(1, 3),
    "min_start_interval_per_source": st.none() | st.integers(1, 5),
    "groups": st.fixed_dictionaries({"g1": st.fixed_dictionaries({"max_agents": st.integers(1, 2)}),
                                     "g2": st.fixed_dictionaries({"max_agents": st.integers(1, 3)})}),
    "max_queue": st.just(100),
    "agents": st.fixed_dictionaries({"p1": preset_st, "p2": preset_st}),
    # Daily budgets (issue 30): source a's in US dollars, preset p1's in tokens; what was
    # spent today is drawn per example (build's `spent`).
    "budgets": st.sampled_from([{}, {"sources": {"a": {"usd": 1.0}}, "agents": {"p1": {"tokens": 10}}}]),
})
spent_st = st.sets(st.sampled_from(["a", "p1"]))


def build(raw: dict, first: list, later: list, gap: int, hold: int | None = None,
          spent: set[str] = frozenset()) -> tuple[Config, Index, datetime]:
    """Admit `first` and let them start at T0, then admit `later` at T0 + gap: a queue with
    some tasks running and the clock moved on, as the scheduler leaves it. `hold`: preset p2
    is held from T0 until that many seconds after T0 + gap (0: until released by hand).
    `spent`: source a and preset p1 have spent their daily budgets today."""
    cfg = msgspec.convert(raw, Config)
    index = Index()
    if spent:
        index.spend = DaySpend(day=budgets.day_of(T0), sources={"a": Usage(cost_usd=1.0)} if "a" in spent else {},
                               agents={"p1": Usage(input_tokens=10)} if "p1" in spent else {})
    if hold is not None:
        until = T0 + timedelta(seconds=gap + hold) if hold else None
        retries.hold(index, cfg, "p2", until, T0 - timedelta(seconds=1))
    now = T0
    for batch in (first, later):
        for source, priority, group, agent in batch:
            routed = agent is not None and "," in agent  # a failover order runs presets, with a prompt
            admission.admit(index, cfg, now, admission.Request(cwd="/", command=None if routed else ["true"], source=source,
                                                 priority=priority, group=group, agent=agent,
                                                 prompt="x" if routed else None))
        step.settle(index, cfg, now)
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


def windows_closed(cfg: Config, index: Index, now: datetime) -> set[str]:
    """Presets whose window quota lets nothing start now: used up until the window turns, or
    a probe of a new window still running."""
    out = set()
    running = {t.id for t in index.active}
    for agent, w in index.windows.items():
        limit = cfg.agents[agent].limit
        if w.since + timedelta(seconds=limit.window_s) > now and (  # type: ignore[operator]
                w.starts >= limit.window_starts or w.probe in running):  # type: ignore[operator]
            out.add(agent)
    return out


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
        task = selection.next_to_start(index, cfg, now)
        if task is not None:
            assert selection.plan_starts(index, cfg, now)[0] is task
            first, agent = selection.starts_now(index, cfg, now)[0]
            assert first is task
            if task.route:  # failover: the first preset of its order that is not held
                held = {a for a, h in index.holds.items() if h.until is None or h.until > now}
                if index.spend is not None and index.spend.day == budgets.day_of(now):  # over its budget: passed over
                    held |= set(index.spend.agents) & set(cfg.budgets.agents)
                held |= windows_closed(cfg, index, now)
                assert agent == next(a for a in task.route if a not in held)
            else:
                assert agent == task.agent
            hold = index.holds.get(agent)  # type: ignore[arg-type]
            assert hold is None or (hold.until is not None and hold.until <= now), "a held preset started"
            if index.spend is not None and index.spend.day == budgets.day_of(now):  # nothing over its budget starts
                assert not (task.source in index.spend.sources and "a" in cfg.budgets.sources), "a source over budget"
                assert not (agent in index.spend.agents and "p1" in cfg.budgets.agents), "a preset over budget"
            assert agent not in windows_closed(cfg, index, now), "a preset started past its window quota or probe"
            if on_pick:
                on_pick(index, now, task)
            lifecycle.start(index, task, now, None, cfg, agent)
            assert task.agent == agent and task.fallback_from == (task.route[0] if task.route and agent != task.route[0] else None)
            window = index.windows.get(agent)  # type: ignore[arg-type]
            if window is not None:  # never more starts in a window than its quota
                assert window.starts <= cfg.agents[agent].limit.window_starts  # type: ignore[operator]
            starts.setdefault(task.source, []).append(now)
            order.append(task.id)
            check_limits(cfg, index, starts)
            continue
        release = selection.next_release(index, cfg, now)
        if selection.free_slots(index, cfg) > 0 and release is not None:
            assert release > now
            now = release
        else:
            if not index.active and index.holds:  # only a hold by hand holds them: release it
                retries.release(index, cfg, next(iter(index.holds)), now)
                continue
            assert index.active, "queued tasks that nothing can ever start"
            lifecycle.finish(index, index.active[0], now, 0)
    return order


@settings(max_examples=150, deadline=None)
@given(config_st, st.lists(task_st, max_size=8), st.lists(task_st, max_size=16), st.integers(0, 6),
       st.none() | st.integers(0, 8), spent_st)
def test_limits_hold_and_positions_are_the_real_start_order(raw, first, later, gap, hold, spent):
    cfg, index, now = build(raw, first, later, gap, hold, spent)
    check_limits(cfg, index, {})
    predicted = [t.id for t in selection.start_order(index, cfg, now)]
    positions = selection.positions(index, cfg, now)
    assert sorted(positions.values()) == list(range(1, len(index.queued) + 1))
    assert [i for i, _ in sorted(positions.items(), key=lambda kv: kv[1])] == predicted
    for ahead in range(len(predicted) + 2):  # the warm wrappers' first ones: the drain stops there
        assert [t.id for t in selection.start_order(index, cfg, now, ahead)] == predicted[:ahead]
        assert [t.id for t in Board(index, cfg, now).drain(ahead)][:ahead] == predicted[:ahead]
    assert drain(cfg, index, now) == predicted  # (drains the index itself)


@settings(max_examples=60, deadline=None)
@given(config_st, st.lists(task_st, max_size=8), st.lists(task_st, max_size=16), st.integers(0, 6),
       st.integers(1, 18))
def test_a_limited_queue_view_is_the_whole_views_head(raw, first, later, gap, limit):
    """`queue --limit N`: the first N of the whole view, at the same positions, the rest counted."""
    cfg, index, now = build(raw, first, later, gap)
    whole = selection.queue_view(index, cfg, now)
    head = selection.queue_view(index, cfg, now, first=limit)
    assert head.queued == whole.queued[:limit] and head.more == max(0, len(whole.queued) - limit)
    assert head.positions == {t.id: whole.positions[t.id] for t in head.queued if t.id in whole.positions}
    assert selection.limit_view(whole, limit).queued == head.queued


@settings(max_examples=60, deadline=None)
@given(config_st, st.lists(task_st, max_size=8), st.lists(task_st, max_size=16), st.integers(0, 6))
def test_sort_fast_path_is_the_simulation(raw, first, later, gap):
    raw = {**raw, "strategy": raw["strategy"] if raw["strategy"] != "fair" else "priority"}
    raw |= {"max_active_per_source": None, "min_start_interval_per_source": None, "agents": {}, "budgets": {}}
    first, later = ([(s, p, g, None if a and "," in a else a) for s, p, g, a in batch] for batch in (first, later))
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
        held = selection.waiting_for(index, cfg, now)
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
    """selection.successor is a promise the service acts on before its transaction: whichever
    running task ends, at any moment before `until`, the transaction that records the end
    starts that task first. Queue deadlines are random, so expiry is part of the bargain; so
    are start times (`delegate --at`, a retry's delay) of tasks that sort before it."""
    if simple:
        raw |= {"strategy": data.draw(st.sampled_from(["fifo", "priority"])), "max_active_per_source": None,
                "min_start_interval_per_source": None, "agents": {}, "budgets": {}}
        first, later = ([(s, p, None, None) for s, p, _, _ in batch] for batch in (first, later))
    cfg, index, now = build(raw, first, later, gap)
    waiting = data.draw(st.booleans())  # some tasks wait for their time (`delegate --at`, a retry's delay)
    for task in index.queued:
        task.expires_at = data.draw(st.none() | st.integers(1, 30).map(lambda s: now + timedelta(seconds=s)))
        if waiting:
            task.not_before = data.draw(st.none() | st.integers(1, 30).map(lambda s: now + timedelta(seconds=s)))
    succ = selection.successor(index, cfg)
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
            lifecycle.finish(after, after.active[ending], at, 0)
            lifecycle.expire_due(after, at)
            assert [t.id for t in selection.plan_starts(after, cfg, at)][:1] == [succ.task.id]


@settings(max_examples=150, deadline=None)
@given(config_st, st.lists(task_st, max_size=8), st.lists(task_st, max_size=16), st.integers(0, 6),
       st.booleans(), st.booleans(), st.sampled_from([None, policy.Resources(available_memory=1, load_per_cpu=99.0)]))
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
    assert selection.waiting_for(index, cfg, now, res) == {i: why for i, why in lanes.items() if why is not None}
    full = selection.positions(index, cfg, now)
    for task in index.queued + index.active:
        assert selection.position(index, cfg, now, task) == full.get(task.id)
    for task in index.queued:
        assert selection.waiting_for_one(index, cfg, now, task, res) == lanes[task.id]
    picked = []
    while (task := board.pick()) is not None:
        board.take(task)
        picked.append(task)
    assert selection.plan_starts(index, cfg, now, res) == picked


grouped_st = st.tuples(st.sampled_from("abcd"), st.sampled_from(PRIORITIES), st.sampled_from(["g1", "g2", "g2"]),
                      st.sampled_from([None, "p1", "p2", "p2,p1"]))


@settings(max_examples=150, deadline=None)
@given(config_st, st.lists(grouped_st, max_size=8), st.lists(grouped_st | task_st, max_size=16), st.integers(0, 6),
       st.sets(st.sampled_from(["g1", "g2"])), st.sampled_from(["both", "g1", "none"]))
def test_a_queue_behind_full_groups_starts_what_the_board_starts(raw, first, later, gap, paused, kept):
    """policy.groups_full, which spares a deep queue's tick the Board (issue 31), says "no
    start" only where the Board's pick says so too: each queued task's group full or paused,
    none outside a group (or in one removed from the config since)."""
    cfg, index, now = build(raw, first, later, gap)
    index.paused_groups = sorted(paused)
    if kept != "both":
        cfg = msgspec.convert({**raw, "groups": {g: v for g, v in raw["groups"].items() if g == kept}}, Config)
    board = Board(index, cfg, now)
    picked = []
    while (task := board.pick()) is not None:
        board.take(task)
        picked.append(task)
    if policy.groups_full(index, cfg):
        assert picked == []
    assert selection.plan_starts(index, cfg, now) == picked


# ---- capacity: slots and memory (issue 29) -----------------------------------------------

G = 1024**3
# A task: source, priority, group, preset, then its declared memory (GiB; None: none) and slots.
heavy_st = st.tuples(st.sampled_from("abc"), st.sampled_from(PRIORITIES), st.sampled_from([None, None, "g1", "g2"]),
                     st.sampled_from([None, "p1"]), st.sampled_from([None, 1, 2, 3]), st.sampled_from([1, 1, 2]))


def build_heavy(raw: dict, first: list, later: list, gap: int) -> tuple[Config, Index, datetime]:
    """As build, with each task's memory and slots; what admission refuses (more than the
    machine or its group could ever hold) is left out, as a delegator would be told."""
    cfg = msgspec.convert(raw, Config)
    index = Index()
    now = T0
    for batch in (first, later):
        for source, priority, group, agent, mem, slots in batch:
            try:
                routed = agent is not None and "," in agent  # a failover order runs presets, with a prompt
                admission.admit(index, cfg, now, admission.Request(cwd="/", command=None if routed else ["true"], source=source,
                                                     priority=priority, group=group, agent=agent,
                                                     prompt="x" if routed else None, memory=mem and mem * G,
                                                     slots=slots))
            except UsageError:
                assert slots > cfg.max_agents or (group and slots > cfg.groups[group].max_agents) \
                    or (mem or 0) * G > cfg.memory_budget
        step.settle(index, cfg, now)
        now = T0 + timedelta(seconds=gap)
    return cfg, index, now


def check_capacity(cfg: Config, index: Index) -> None:
    assert sum(t.slots for t in index.active) <= cfg.max_agents
    assert sum(policy.memory_of(cfg, t) for t in index.active) <= cfg.memory_budget
    for group in cfg.groups:
        assert sum(t.slots for t in index.active if t.group == group) <= cfg.groups[group].max_agents


heavy_config_st = config_st.map(lambda raw: raw | {"max_agents": raw["max_agents"] + 1}).flatmap(
    lambda raw: st.fixed_dictionaries({"max_memory": st.sampled_from(["3G", "4G", "6G"]),
                                       "resources": st.sampled_from([{}, {"default_memory": "1G"}])}).map(raw.__or__))


@settings(max_examples=150, deadline=None)
@given(heavy_config_st, st.lists(heavy_st, max_size=8), st.lists(heavy_st, max_size=16), st.integers(0, 6))
def test_slots_and_memory_hold_and_positions_are_the_real_start_order(raw, first, later, gap):
    """Memory and slots are counted with every other limit: never more declared than the
    budget nor more slots than max_agents (and a group's) at once, and the positions are the
    order the tasks really start in, one being held for memory included."""
    cfg, index, now = build_heavy(raw, first, later, gap)
    check_capacity(cfg, index)
    predicted = [t.id for t in selection.start_order(index, cfg, now)]
    assert [i for i, _ in sorted(selection.positions(index, cfg, now).items(), key=lambda kv: kv[1])] == predicted
    assert drain(cfg, index, now, lambda index, now, task: check_capacity(cfg, index)) == predicted
    check_capacity(cfg, index)


@settings(max_examples=100, deadline=None)
@given(heavy_config_st, st.lists(heavy_st, max_size=8), st.lists(heavy_st, min_size=1, max_size=16), st.integers(0, 6))
def test_a_task_that_does_not_fit_says_why_and_nothing_passes_it(raw, first, later, gap):
    """The task next in line that does not fit (memory, slots) waits with the numbers, and no
    task behind it starts meanwhile; the quick answer for one task is the full one."""
    cfg, index, now = build_heavy(raw, first, later, gap)
    why = selection.waiting_for(index, cfg, now)
    for task in index.queued:
        assert selection.waiting_for_one(index, cfg, now, task) == why.get(task.id)
    board = Board(index, cfg, now)
    if board.pick() is None and board.blocked is not None:
        task, reason = board.blocked
        assert why[task.id] == reason
        assert reason.startswith(("memory (", "slots ("))
        assert selection.plan_starts(index, cfg, now) == []
        if reason.startswith("memory"):
            used = sum(policy.memory_of(cfg, t) for t in index.active)
            assert f"{used / G:.1f}G of {cfg.memory_budget / G:.1f}G in use" in reason


def test_memory_waits_with_the_numbers_and_capacity_counts_it():
    cfg = msgspec.convert({"max_agents": 4, "max_memory": "8G"}, Config)
    index = Index()
    for mem in (4, 2, 4, 1):
        admission.admit(index, cfg, T0, admission.Request(cwd="/", command=["true"], memory=mem * G))
    step.settle(index, cfg, T0)
    assert [t.id for t in index.active] == [1, 2]
    assert selection.waiting_for(index, cfg, T0) == {3: "memory (6.0G of 8.0G in use, it needs 4.0G)"}
    assert selection.positions(index, cfg, T0) == {3: 1, 4: 2}  # the small one does not pass it
    cap = selection.capacity(index, cfg, T0)
    assert (cap.max_memory, cap.memory_used, cap.free) == (8 * G, 6 * G, 2)
    with pytest.raises(UsageError, match="could never start: max_memory is 8.0G"):
        admission.admit(index, cfg, T0, admission.Request(cwd="/", command=["true"], memory=9 * G))
    with pytest.raises(UsageError, match="5 slots could never start: max_agents is 4"):
        admission.admit(index, cfg, T0, admission.Request(cwd="/", command=["true"], slots=5))
    lifecycle.finish(index, index.active[0], T0, 0)
    step.settle(index, cfg, T0)
    assert [t.id for t in index.active] == [2, 3, 4]


def test_a_wide_task_cannot_be_moved_into_a_group_too_small_for_it():
    cfg = msgspec.convert({"max_agents": 4, "groups": {"small": {"max_agents": 1}}}, Config)
    index = Index()
    task, _ = admission.admit(index, cfg, T0, admission.Request(cwd="/", command=["true"], slots=2))
    with pytest.raises(UsageError, match="takes 2 slots: it could never start in group small, which has 1"):
        admission.edit(index, cfg, task, T0, admission.Edit(group="small"))
    assert task.group is None


@settings(max_examples=150, deadline=None)
@given(config_st, st.booleans(), st.lists(task_st, max_size=8), st.lists(task_st, max_size=16), st.integers(0, 6),
       st.data())
def test_one_look_shared_by_the_rules_gives_what_each_asks_alone(raw, simple, first, later, gap, data):
    """policy.Look: the service asks the warm wrappers' order, the next expiry and the
    successor of one queue with one Look, admission its position and why it waits, settle
    its dependencies and its starts: each answer is the one the rule gives with a Look of
    its own, whatever the queue holds (tasks put first, waiting for their time, stashed,
    waiting for others, declaring memory or slots)."""
    if simple:
        raw |= {"strategy": data.draw(st.sampled_from(["fifo", "priority"])), "max_active_per_source": None,
                "min_start_interval_per_source": None, "agents": {}, "budgets": {}}
        first, later = ([(s, p, None, None) for s, p, _, _ in batch] for batch in (first, later))
    cfg, index, now = build(raw, first, later, gap)
    later_s = st.none() | st.integers(1, 30).map(lambda s: now + timedelta(seconds=s))
    for task in index.queued:
        if data.draw(st.integers(0, 4)) == 0:  # now and then, each thing a task may carry
            task.first = data.draw(st.integers(0, 2))
            task.not_before = data.draw(later_s)
            task.stashed_at = data.draw(st.sampled_from([None, now]))
            task.memory = data.draw(st.sampled_from([None, G]))
            task.slots = data.draw(st.sampled_from([1, 1, 2]))
            task.after = data.draw(st.sampled_from([[], [t.id for t in index.active[:1]]]))
        task.expires_at = data.draw(later_s)
    ahead = data.draw(st.integers(1, 5))
    look = policy.Look(index.queued)
    q = index.queued  # each question, as the rules asked it of the whole queue before the Look
    assert (look.first, look.after, look.timed, look.stashed, look.memory, look.slots, look.routed) == (
        any(t.first for t in q), any(t.after for t in q), any(t.not_before is not None for t in q),
        any(t.stashed_at is not None for t in q), any(t.memory for t in q), any(t.slots != 1 for t in q),
        any(t.route for t in q))
    # in the service's order: the warm wrappers' first tasks, then the successor
    assert policy.simple_order(index, cfg, look=look) == policy.simple_order(index, cfg)
    assert selection.start_order(index, cfg, now, ahead, look) == selection.start_order(index, cfg, now, ahead)
    assert policy.may_release(index, cfg, look) == policy.may_release(index, cfg)
    assert lifecycle.queue_deadline(index, look) == lifecycle.queue_deadline(index)
    assert selection.successor(index, cfg, look) == selection.successor(index, cfg)
    assert policy.accounts(index, cfg, look) == policy.accounts(index, cfg)
    full = selection.positions(index, cfg, now)  # played forward: the newest task's short cut too
    for task in index.queued:
        assert selection.position(index, cfg, now, task, look) == full.get(task.id)
        assert (selection.waiting_for_one(index, cfg, now, task, None, look)
                == selection.waiting_for_one(index, cfg, now, task))
    key, sizes = policy.order_key(index, cfg), (1, ahead + 2, ahead)  # a longer one after a shorter, then a prefix
    fresh = policy.Look(index.queued)
    assert [fresh.smallest(n, key) for n in sizes] == [sorted(index.queued, key=key)[:n] for n in sizes]
    other = msgspec.json.decode(msgspec.json.encode(index), type=Index)
    assert [t.id for t, _ in selection.starts_now(index, cfg, now, None, None, look)] == \
        [t.id for t, _ in selection.starts_now(other, cfg, now)]
