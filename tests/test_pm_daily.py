"""pm's rules for issue 19 (daily use): wait by name, pause, dependencies, edit. Pure, in microseconds."""

from __future__ import annotations

from datetime import timedelta, timezone

import msgspec
import pytest

from conftest import T0
from kugetsu.core import admission, commandline, lifecycle, selection, step
from kugetsu.config.model import Config
from kugetsu.errors import AmbiguousName
from kugetsu.core.models import Index, TaskState


def req(name=None, **kw):
    return admission.Request(cwd="/tmp", name=name, command=kw.pop("command", ["true"]), **kw)


def admit(index, cfg, name=None, now=T0, **kw):
    return admission.admit(index, cfg, now, req(name, **kw))[0]


def started(index, cfg, now=T0):
    """The names of the tasks a settle starts."""
    return [e.name for e in step.settle(index, cfg, now).events if e.type == "started"]


def run_to_end(index, cfg, task, code=0, now=T0):
    step.settle(index, cfg, now)
    assert task.state is TaskState.RUNNING
    return lifecycle.finish(index, task, now, code)


# ---- wait by name -------------------------------------------------------------------------


def test_wait_by_a_name_only_finished_tasks_bear_is_refused_once_it_was_reused():
    index, cfg = Index(), Config()
    first = admit(index, cfg, "issue-16")
    run_to_end(index, cfg, first)
    assert selection.find_to_wait(index, "issue-16") is first  # one task ever had it: that one
    second = admit(index, cfg, "issue-16")
    assert selection.find_to_wait(index, "issue-16") is second  # a live one: names are unique among them
    run_to_end(index, cfg, second, 1)
    with pytest.raises(AmbiguousName) as err:
        selection.find_to_wait(index, "issue-16")
    assert err.value.ids == [1, 2] and err.value.code == 2
    assert selection.find_to_wait(index, "#1") is first and selection.find_to_wait(index, "2") is second


# ---- pause --------------------------------------------------------------------------------


def test_pause_holds_every_start_but_positions_stay_the_order_after_resume():
    index, cfg = Index(), Config(max_agents=1)
    a, b, c = (admit(index, cfg, n) for n in "abc")
    step.settle(index, cfg, T0)
    assert a.state is TaskState.RUNNING
    assert [e.type for e in selection.pause(index, cfg, T0, None, True)] == ["paused"]
    assert selection.pause(index, cfg, T0, None, True) == []  # already paused: nothing to say
    lifecycle.finish(index, a, T0, 0)
    assert started(index, cfg) == []  # a free slot, and nothing starts
    assert selection.successor(index, cfg) is None
    view = selection.queue_view(index, cfg, T0)
    assert view.positions == {b.id: 1, c.id: 2}
    assert view.waiting_for == {b.id: "paused", c.id: "paused"}
    assert view.capacity.paused and view.capacity.free == 0  # no slot is free to a new task
    selection.pause(index, cfg, T0, None, False)
    assert started(index, cfg) == ["b"]


def test_a_paused_group_lets_the_others_pass_and_comes_last():
    cfg = msgspec.convert({"max_agents": 1, "groups": {"gpu": {"max_agents": 1}}}, Config)
    index = Index()
    with pytest.raises(Exception, match="unknown group 'cpu'"):
        selection.pause(index, cfg, T0, "cpu", True)
    selection.pause(index, cfg, T0, "gpu", True)
    blocker = admit(index, cfg, "blocker")
    train = admit(index, cfg, "train", group="gpu")
    lint = admit(index, cfg, "lint")
    step.settle(index, cfg, T0)
    assert blocker.state is TaskState.RUNNING
    view = selection.queue_view(index, cfg, T0)
    assert [t.name for t in view.queued] == ["lint", "train"]
    assert view.waiting_for == {train.id: "group gpu paused"}
    assert view.capacity.paused_groups == ["gpu"]
    lifecycle.finish(index, blocker, T0, 0)
    assert started(index, cfg) == ["lint"]
    lifecycle.finish(index, lint, T0, 0)
    assert started(index, cfg) == []
    selection.pause(index, cfg, T0, "gpu", False)
    assert started(index, cfg) == ["train"]


def test_every_front_ends_summary_says_paused():
    from kugetsu.frontends import render
    from kugetsu.frontends.telegram import text
    from kugetsu.frontends.tui import view

    index, cfg = Index(paused=True), Config()
    cap = selection.capacity(index, cfg)
    assert render.summary(cap).endswith(" · paused: no queued task starts")
    assert "paused: no queued task starts" in view.summary(cap, 1234)
    assert "paused: no queued task starts" in text.capacity(cap)
    grouped = selection.capacity(Index(paused_groups=["gpu"]), cfg)
    assert render.summary(grouped).endswith(" · paused: group gpu")
    assert render.summary(selection.capacity(Index(), cfg)).endswith("(max 50)")


# ---- dependencies -------------------------------------------------------------------------


def test_a_task_after_others_starts_once_they_succeeded_and_positions_say_when():
    index, cfg = Index(), Config(max_agents=2)
    impl = admit(index, cfg, "impl")
    review = admit(index, cfg, "review", after=["impl"])
    other = admit(index, cfg, "other")
    test = admit(index, cfg, "test", after=["review", f"#{impl.id}"])
    assert review.after == [impl.id] and test.after == [review.id, impl.id]
    step.settle(index, cfg, T0)
    assert [t.name for t in index.active] == ["impl", "other"]  # review may not pass impl's end
    view = selection.queue_view(index, cfg, T0)
    assert view.positions == {review.id: 1, test.id: 2}
    assert view.waiting_for == {review.id: "impl", test.id: "review, impl"}
    assert selection.successor(index, cfg) is None  # which task ends decides
    lifecycle.finish(index, other, T0, 0)
    assert started(index, cfg) == []  # a free slot, and review still waits for impl
    lifecycle.finish(index, impl, T0, 0)
    assert started(index, cfg) == ["review"]
    assert selection.queue_view(index, cfg, T0).waiting_for == {test.id: "review"}
    lifecycle.finish(index, review, T0, 0)
    assert started(index, cfg) == ["test"]


def test_a_failed_dependency_cancels_the_chain_each_with_its_own_event():
    index, cfg = Index(), Config(max_agents=1)
    impl = admit(index, cfg, "issue-16")
    review = admit(index, cfg, "review", after=["issue-16"])
    test = admit(index, cfg, "test", after=["review"])
    step.settle(index, cfg, T0)
    lifecycle.finish(index, impl, T0, 1)
    events = step.settle(index, cfg, T0).events
    assert [(e.type, e.name, e.reason) for e in events] == [
        ("cancelled", "review", "dependency issue-16 failed"), ("cancelled", "test", "dependency review cancelled")]
    assert review.state is test.state is TaskState.CANCELLED


@pytest.mark.parametrize("end", ["cancel", "expire", "lost"])
def test_a_dependency_that_is_cancelled_expires_or_is_lost_cancels_the_task(end):
    index, cfg = Index(), Config(max_agents=1)
    blocker = admit(index, cfg, "blocker")
    dep = admit(index, cfg, "dep", now=T0, **({"expire_after": 5} if end == "expire" else {}))
    task = admit(index, cfg, "task", after=["dep"])
    step.settle(index, cfg, T0)
    later = T0 + timedelta(seconds=10)
    if end == "cancel":
        lifecycle.cancel(index, dep, T0, 0)
    elif end == "lost":
        lifecycle.finish(index, blocker, T0, 0)
        step.settle(index, cfg, T0)
        lifecycle.finish(index, dep, T0, None)
    step.settle(index, cfg, later)
    state = {"cancel": "cancelled", "expire": "expired", "lost": "lost"}[end]
    assert task.state is TaskState.CANCELLED and task.reason == f"dependency dep {state}"


def test_an_unknown_or_failed_dependency_is_refused_at_admission():
    from kugetsu.errors import UsageError

    index, cfg = Index(), Config(max_agents=1)
    with pytest.raises(UsageError, match="unknown dependency 'nope'") as err:
        admit(index, cfg, "x", after=["nope"])
    assert err.value.code == 2 and index.queued == [] and index.next_id == 1
    bad = admit(index, cfg, "bad")
    run_to_end(index, cfg, bad, 1)
    with pytest.raises(UsageError, match="dependency bad \\(#1\\) has already failed"):
        admit(index, cfg, "x", after=["bad"])
    good = admit(index, cfg, "good")
    run_to_end(index, cfg, good, 0)
    x = admit(index, cfg, "x", after=["good"])  # already succeeded: nothing to wait for
    assert started(index, cfg) == ["x"] and x.after == [good.id]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), max_size=2), min_size=1, max_size=15), st.integers(1, 4),
       st.booleans())
def test_positions_with_dependencies_predict_the_real_start_order(deps, max_agents, pause_first):
    """Each task may name earlier ones; the oldest running task ends first, successfully:
    the order the positions gave is the order they really start, paused or not."""
    cfg = Config(max_agents=max_agents, max_queue=1000)
    index = Index()
    for i, picks in enumerate(deps):
        after = sorted({f"#{p % i + 1}" for p in picks}) if i else []
        admit(index, cfg, f"t{i}", after=after)
    if pause_first:
        selection.pause(index, cfg, T0, None, True)
    predicted = [t.id for t in selection.queue_view(index, cfg, T0).queued]
    selection.pause(index, cfg, T0, None, False)
    actual = [t.id for t in selection.plan_starts(index, cfg, T0)]
    for task in selection.plan_starts(index, cfg, T0):
        lifecycle.start(index, task, T0)
    while index.active:
        lifecycle.finish(index, index.active[0], T0, 0)
        for task in selection.plan_starts(index, cfg, T0):
            lifecycle.start(index, task, T0)
            actual.append(task.id)
    assert actual == predicted and not index.queued


def test_the_dashboards_events_pane_says_what_pause_and_edit_did():
    from kugetsu.core.models import Event
    from kugetsu.frontends.tui import view

    index, cfg = Index(), Config()
    task = admit(index, cfg, "a")
    events = selection.pause(index, cfg, T0, None, True) + admission.edit(index, cfg, task, T0, admission.Edit(priority="high", timeout=60))
    events.append(Event(type="resumed", at=T0, value="gpu"))
    rows = view.event_rows(events, T0, timezone.utc)
    assert [r.cells[1:] for r in rows] == [("paused", "-", "every start"), ("edited", "#1 a", "changed priority, timeout"),
                                           ("resumed", "-", "group gpu")]


# ---- edit ---------------------------------------------------------------------------------


def test_edit_changes_only_a_queued_task_and_remakes_a_presets_command():
    from kugetsu.errors import UnknownGroup, UsageError

    cfg = msgspec.convert({"max_agents": 1, "groups": {"gpu": {"max_agents": 1}},
                           "agents": {"echo": {"command": ["echo", "--name={name}", "{prompt}"]}}}, Config)
    index = Index()
    running = admit(index, cfg, "running")
    step.settle(index, cfg, T0)
    task = admission.admit(index, cfg, T0, admission.Request(cwd="/tmp", name="p", agent="echo", prompt="old"))[0]
    cmd = admit(index, cfg, "cmd")
    later = T0 + timedelta(hours=1)
    events = admission.edit(index, cfg, task, later, admission.Edit(prompt="new {name} words", priority="urgent",
                                                      expire_after=60, timeout=0, group="gpu"))
    assert task.command == ["echo", "--name=p", "{prompt}"] and task.prompted  # the store keeps the new text (verbs.edit)
    assert commandline.argv(task, "new {name} words") == ["echo", "--name=p", "new {name} words"]
    assert (task.priority, task.group, task.expires_at) == ("urgent", "gpu", later + timedelta(seconds=60))
    assert [(e.type, e.key) for e in events] == [("edited", "prompt,priority,group,expires_at")]  # timeout was none
    assert "new" not in str(events[0].value)
    assert admission.edit(index, cfg, task, later, admission.Edit(priority="urgent")) == []
    before = msgspec.json.encode(index)
    for target, change, error, text in [
        (running, admission.Edit(priority="high"), UsageError, "is running; only a queued task can be edited"),
        (cmd, admission.Edit(prompt="x"), UsageError, "runs a command given at delegation"),
        (task, admission.Edit(prompt=""), UsageError, "the prompt is empty"),
        (task, admission.Edit(group="cpu", priority="low"), UnknownGroup, "unknown group 'cpu'"),
        (task, admission.Edit(priority="top"), UsageError, "invalid priority 'top'"),
        (task, admission.Edit(prompt="\0", priority="low"), UsageError, "NUL"),
    ]:
        with pytest.raises(error, match=text):
            admission.edit(index, cfg, target, later, change)
    assert msgspec.json.encode(index) == before  # a refused edit changes nothing
    lifecycle.finish(index, running, later, 0)
    with pytest.raises(UsageError, match="has already succeeded") as err:
        admission.edit(index, cfg, running, later, admission.Edit(priority="high"))
    assert err.value.code == 1


def test_a_task_after_one_that_drop_oldest_would_drop_is_rejected_not_cancelled_at_once():
    from kugetsu.errors import QueueFull

    cfg = Config(max_agents=1, max_queue=1, on_queue_full="drop_oldest")
    index = Index()
    admit(index, cfg, "running")
    step.settle(index, cfg, T0)
    admit(index, cfg, "oldest")
    with pytest.raises(QueueFull):
        admit(index, cfg, "x", after=["oldest"])
    assert [t.name for t in index.queued] == ["oldest"]
    assert admit(index, cfg, "y").name == "y" and [t.name for t in index.queued] == ["y"]
