"""A service's chain of Looks (core/look.py): each Look carries from the one before what the
change between the two states of the queue cannot have made false. Whatever happens to the
queue between two Looks (tasks started from its head, admitted at its end, cancelled from its
middle, a field assigned, many at once), every answer a carried Look gives is the one a fresh
Look gives of the same queue; and a drain through a deep queue asks nothing of the whole queue
but now and then."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import T0

from kugetsu.core import look as looks
from kugetsu.core.look import Chain, Look, by_id
from kugetsu.core.models import Task, TaskState
from kugetsu.store import tracking

FIELDS = {  # what a queued task may carry that a question asks about, and values for it
    "first": [0, 0, 1, 2],
    "after": [[], [], [7]],
    "not_before": [None, None, T0 + timedelta(seconds=5)],
    "stashed_at": [None, None, T0],
    "memory": [None, None, 1 << 30],
    "slots": [1, 1, 2],
    "route": [[], [], ["p1", "p2"]],
    "expires_at": [None, T0 + timedelta(seconds=30), T0 + timedelta(seconds=10), T0 + timedelta(seconds=90)],
}

field_st = st.sampled_from(sorted(FIELDS)).flatmap(lambda f: st.tuples(st.just(f), st.sampled_from(FIELDS[f])))
change_st = st.one_of(
    st.tuples(st.just("start"), st.integers(1, 4)),  # from the head, as a drain does
    st.tuples(st.just("admit"), st.lists(st.lists(field_st, max_size=2), min_size=1, max_size=3)),
    st.tuples(st.just("cancel"), st.integers(0, 40)),  # from anywhere
    st.tuples(st.just("assign"), st.integers(0, 40), field_st),  # to a queued task, in place
    st.tuples(st.just("assign away"), field_st),  # to a task no longer queued
    st.tuples(st.just("nothing"), st.none()),
    st.tuples(st.just("many"), st.integers(20, 70)),  # more than the chain carries one at a time
)


def _task(tid: int, fields: list[tuple[str, object]] = ()) -> Task:
    task = Task(id=tid, name=f"t{tid}", command=["true"], cwd="/", created_at=T0,
                expires_at=T0 + timedelta(seconds=60 + tid))
    for name, value in fields:
        setattr(task, name, value)
    return task


def _answers(look: Look) -> tuple:
    return (look.first, look.after, look.timed, look.stashed, look.memory, look.slots, look.routed,
            [t.id for t in look.smallest(1, by_id)], [t.id for t in look.smallest(3, by_id)],
            look.earliest_expiry())


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.lists(change_st, max_size=25), st.lists(st.booleans(), min_size=25, max_size=25))
def test_each_look_of_a_chain_answers_what_a_fresh_look_answers(depth, changes, ask_between):
    queue = [_task(i) for i in range(1, depth + 1)]
    next_id = depth + 1
    away: list[Task] = []
    chain = Chain(tracking.Assignments())  # verify is off: the answers are compared here
    current = chain.of(queue)
    assert _answers(current) == _answers(Look(list(queue)))
    for change, asked in zip(changes, ask_between):
        what, arg = change[0], change[1]
        if what == "start":
            for _ in range(min(arg, len(queue))):
                task = queue.pop(0)
                task.state = TaskState.RUNNING
                away.append(task)
        elif what == "admit":
            for fields in arg:
                queue.append(_task(next_id, fields))
                next_id += 1
        elif what == "cancel" and queue:
            task = queue.pop(arg % len(queue))
            task.state = TaskState.CANCELLED
            away.append(task)
        elif what == "assign" and queue:
            setattr(queue[arg % len(queue)], *change[2])
        elif what == "assign away" and away:
            setattr(away[-1], *arg)
        elif what == "many":
            queue += [_task(next_id + i) for i in range(arg)]
            next_id += arg
        current = chain.of(queue)
        if asked:  # answers asked in this state are the ones the next state carries
            assert _answers(current) == _answers(Look(list(queue)))
    assert _answers(chain.of(queue)) == _answers(Look(list(queue)))


def count_passes(monkeypatch) -> dict[str, int]:
    """From now on, counts the passes over a list of more than 100 tasks: by the rules'
    questions (look._QUESTIONS) and by the sorts for first tasks (heapq.nsmallest)."""
    passes = {"questions": 0, "sorts": 0}
    questions = {name: (lambda q, ask=ask: (passes.__setitem__("questions", passes["questions"] + (len(q) > 100)),
                                            ask(q))[1])
                 for name, ask in looks._QUESTIONS.items()}
    monkeypatch.setattr(looks, "_QUESTIONS", questions)
    real = looks.heapq.nsmallest

    def nsmallest(n, items, key):
        passes["sorts"] += len(items) > 100
        return real(n, items, key=key)

    monkeypatch.setattr(looks.heapq, "nsmallest", nsmallest)
    return passes


def test_a_drain_through_a_deep_queue_asks_the_whole_queue_only_now_and_then(monkeypatch):
    """10,000 queued, one started from the head per promotion: over 500 promotions the rules'
    questions pass over the whole queue a handful of times (the first tasks in an order are
    counted again once the carried ones run short), where a fresh Look a promotion asked each
    of them 500 times."""
    queue = [_task(i) for i in range(1, 10_001)]
    passes = count_passes(monkeypatch)
    chain = Chain(tracking.Assignments(), verify=False)
    for _ in range(500):
        current = chain.of(queue)
        assert _answers(current)[:8] == (False, False, False, False, False, False, False, [queue[0].id])
        current.smallest(100, by_id)  # the warm wrappers' first ones
        current.earliest_expiry()
        task = queue.pop(0)
        task.state = TaskState.RUNNING
    assert passes["questions"] <= 7 * 2, passes
    # A pass keeps ~sqrt(5 x 10,000) = 223 first tasks, so a pass in id order serves ~120
    # promotions and one in expiry order ~175: 8 passes here (17 when each kept twice what
    # was asked, one every 48 promotions for the expiry).
    assert passes["sorts"] <= 500 // 120 + 500 // 175 + 3, passes


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 30), st.integers(0, 20), st.integers(0, 5), st.sampled_from(["none", "swap", "drop", "copy"]),
       st.integers(0, 40))
def test_follow_moves_the_queue_on_in_place_or_leaves_it_as_it_was(depth, gone, added, other, at):
    """look.follow, which the chain and the file store share: `now` is `before` less its head
    (at most 16 gone) plus tasks at its end exactly when it says so, and then `before` is `now`;
    for any other change (two swapped, one gone from the middle) `before` is left as it was.
    A task replaced by an equal copy counts as the same (the file store writes it as it is)."""
    before = [_task(i) for i in range(1, depth + 1)]
    now = before[min(gone, depth):] + [_task(100 + i) for i in range(added)]
    if other == "swap" and len(now) >= 2:
        i = at % (len(now) - 1)
        now[i], now[i + 1] = now[i + 1], now[i]
    elif other == "drop" and len(now) >= 2:
        del now[1 + at % (len(now) - 1)]
    elif other == "copy" and now:
        i = at % len(now)
        now[i] = Task(**{f: getattr(now[i], f) for f in now[i].__struct_fields__})
    kept = list(before)
    result = looks.follow(before, now)
    if result is not None:  # a true account: its head gone, every other in order, then new ones
        g = len(result)
        assert g <= 16 and result == kept[:g] and now[:len(kept) - g] == kept[g:] and len(now) >= len(kept) - g
        assert before == now
    else:
        assert before == kept and all(a is b for a, b in zip(before, kept))
    if other == "none" and min(gone, depth) <= 16:  # a drain's or an admission's change is always seen
        assert result is not None and [t.id for t in result] == [t.id for t in kept[:min(gone, depth)]]


def test_a_queue_kept_whole_while_short_is_not_carried_whole_as_it_grows(monkeypatch):
    """A queue short enough for its first tasks to be the whole of it, then grown one admission
    at a time (a PM delegating issue by issue into a service or an MCP server): each Look carried
    the whole queue in order, a Python step a task at every Look, for ever. It is cut to its first
    ones (_CARRIED_MOST), so each admission sorts in nothing that comes after them."""
    queue = [_task(i) for i in range(1, 11)]
    sorted_in = [0]
    real = looks.insort

    def insort(items, task, key):
        sorted_in[0] += 1
        real(items, task, key=key)

    monkeypatch.setattr(looks, "insort", insort)
    chain = Chain(tracking.Assignments(), verify=False)
    for tid in range(11, 2001):
        current = chain.of(queue)
        current.smallest(3, by_id)
        current.earliest_expiry()
        queue.append(_task(tid))
    assert _answers(chain.of(queue)) == _answers(Look(list(queue)))
    assert sorted_in[0] <= 2 * looks._CARRIED_MOST, sorted_in  # whole: two for each of the 1,990 admitted
