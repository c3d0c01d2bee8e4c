"""pm.py: every scheduling rule, with an injected clock, in microseconds."""

from __future__ import annotations

from datetime import timedelta

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import T0

from kugetsu.core import admission, commandline, lifecycle, retries, selection, step
from kugetsu.config.model import Config
from kugetsu.errors import NotFound, Rejected, UsageError
from kugetsu.core.models import Index, Task, TaskState, check_index


def req(name=None, **kw):
    return admission.Request(cwd="/tmp", name=name, command=kw.pop("command", ["true"]), **kw)


def admit_all(index, cfg, names, now=T0):
    return [admission.admit(index, cfg, now, req(n))[0] for n in names]


def test_admit_assigns_increasing_ids_and_default_names():
    index, cfg = Index(), Config()
    a, b = admit_all(index, cfg, [None, "x"])
    assert (a.id, a.name, b.id, b.name) == (1, "task-1", 2, "x")
    assert index.next_id == 3 and check_index(index) is None


def test_fifo_positions_follow_admission_order():
    index, cfg = Index(), Config(max_agents=1)
    tasks = admit_all(index, cfg, ["a", "b", "c", "d"])
    step.settle(index, cfg, T0)
    assert [t.name for t in index.active] == ["a"]
    assert selection.positions(index, cfg, T0) == {tasks[1].id: 1, tasks[2].id: 2, tasks[3].id: 3}


def test_start_takes_lowest_free_slot():
    index, cfg = Index(), Config(max_agents=3)
    a, b, c = admit_all(index, cfg, ["a", "b", "c"])
    step.settle(index, cfg, T0)
    assert (a.run.slot, b.run.slot, c.run.slot) == (1, 2, 3)
    lifecycle.finish(index, b, T0, 0)
    d, = admit_all(index, cfg, ["d"])
    step.settle(index, cfg, T0)
    assert d.run.slot == 2


def test_duplicate_live_name_is_refused_but_finished_name_may_return():
    index, cfg = Index(), Config()
    a, = admit_all(index, cfg, ["a"])
    with pytest.raises(UsageError, match="already queued or running"):
        admission.admit(index, cfg, T0, req("a"))
    step.settle(index, cfg, T0)
    lifecycle.finish(index, a, T0, 0)
    b, _ = admission.admit(index, cfg, T0, req("a"))
    assert b.id == 2
    assert selection.find(index, "a") is b  # the live one wins
    assert selection.find(index, "1") is a


@pytest.mark.parametrize("name", ["", "-x", "a b", "x" * 65, "é", "a/b", ".hidden"])
def test_invalid_names_are_refused(name):
    with pytest.raises(UsageError, match="invalid task name"):
        admission.admit(Index(), Config(), T0, req(name))


def test_queue_full_is_rejected_with_numbers_and_nothing_changes():
    index, cfg = Index(), Config(max_agents=1, max_queue=2)
    admit_all(index, cfg, ["a", "b", "c"])
    step.settle(index, cfg, T0)
    before = (index.next_id, len(index.queued))
    with pytest.raises(Rejected, match=r"queue full: 2/2 waiting, 1/1 running"):
        admission.admit(index, cfg, T0, req("d"))
    assert (index.next_id, len(index.queued)) == before


def test_a_free_slot_admits_even_when_max_queue_is_zero():
    index, cfg = Index(), Config(max_agents=1, max_queue=0)
    admission.admit(index, cfg, T0, req("a"))
    step.settle(index, cfg, T0)
    with pytest.raises(Rejected):
        admission.admit(index, cfg, T0, req("b"))


def test_preset_placeholders_are_substituted_inside_one_argv_element():
    cfg = Config(agents={"echo": {"command": ["echo", "--task={name}#{id}", "{prompt}"]}}, default_agent="echo")
    prompt = "a; rm -rf / $(whoami) '{name}' \"x\""
    task, _ = admission.admit(Index(), cfg, T0, admission.Request(cwd="/", name="n1", prompt=prompt))
    # The index keeps `{prompt}` (the text is the store's); the argv gets the text, verbatim.
    assert task.command == ["echo", "--task=n1#1", "{prompt}"] and task.prompt is None and task.prompted
    assert commandline.argv(task, prompt) == ["echo", "--task=n1#1", prompt]
    assert commandline.argv(task, "{prompt} twice") == ["echo", "--task=n1#1", "{prompt} twice"]
    with pytest.raises(ValueError, match="prompt is missing"):
        commandline.argv(task, None)


def test_a_task_from_an_older_index_runs_with_the_prompt_it_kept():
    old = Task(id=1, name="n", command=["echo", "hi there"], cwd="/", created_at=T0, prompt="hi there")
    assert commandline.argv(old, None) == ["echo", "hi there"] and commandline.prompt_of(old, {}) == "hi there"
    assert commandline.prompt_of(old, {1: "new"}) == "new"
    given = Task(id=2, name="m", command=["echo", "{prompt}"], cwd="/", created_at=T0)  # `-- CMD` as given
    assert commandline.argv(given, "x") == ["echo", "{prompt}"]


def test_preset_needs_a_prompt_and_must_exist():
    with pytest.raises(UsageError, match="needs a prompt"):
        admission.admit(Index(), Config(), T0, admission.Request(cwd="/", name="x"))
    with pytest.raises(UsageError, match="unknown agent preset 'nope'"):
        admission.admit(Index(), Config(), T0, admission.Request(cwd="/", prompt="p", agent="nope"))


def test_finish_states():
    index, cfg = Index(), Config()
    a, b, c = admit_all(index, cfg, ["a", "b", "c"])
    step.settle(index, cfg, T0)
    lifecycle.finish(index, a, T0, 0)
    lifecycle.finish(index, b, T0, 137)
    lifecycle.finish(index, c, T0, None)
    assert (a.state, b.state, c.state) == (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.LOST)
    assert b.reason == "exit code 137 (killed by SIGKILL)"
    assert check_index(index) is None


def test_cancel_queued_is_immediate_and_running_waits_for_the_process():
    index, cfg = Index(), Config(max_agents=1)
    a, b = admit_all(index, cfg, ["a", "b"])
    step.settle(index, cfg, T0)
    events = lifecycle.cancel(index, b, T0, grace=10)
    assert b.state is TaskState.CANCELLED and [e.type for e in events] == ["cancelled"]
    assert lifecycle.cancel(index, a, T0, grace=10) == []
    assert a.state is TaskState.RUNNING and a.run.stop is TaskState.CANCELLED
    assert a.run.kill_at == T0 + timedelta(seconds=10)
    assert lifecycle.kills_due(index, T0 + timedelta(seconds=9)) == []
    assert lifecycle.kills_due(index, T0 + timedelta(seconds=10)) == [a]
    lifecycle.finish(index, a, T0, 143)
    assert a.state is TaskState.CANCELLED and a.exit_code == 143
    with pytest.raises(UsageError, match="already cancelled"):
        lifecycle.cancel(index, a, T0, grace=10)


def test_expiry_is_exact_to_the_deadline():
    index, cfg = Index(), Config(max_agents=1, queue_timeout="1h")
    a, b = admit_all(index, cfg, ["a", "b"])
    step.settle(index, cfg, T0)
    assert lifecycle.expire_due(index, T0 + timedelta(minutes=59, seconds=59)) == []
    events = lifecycle.expire_due(index, T0 + timedelta(hours=1))
    assert [e.type for e in events] == ["expired"] and b.state is TaskState.EXPIRED
    assert b.reason == "expired after 1h in the queue"
    assert a.state is TaskState.RUNNING  # running tasks never expire


def test_run_timeout_marks_failed_stop_once():
    index, cfg = Index(), Config(run_timeout="90s")
    a, = admit_all(index, cfg, ["a"])
    step.settle(index, cfg, T0)
    assert lifecycle.timeouts_due(index, T0 + timedelta(seconds=89), grace=5) == []
    assert lifecycle.timeouts_due(index, T0 + timedelta(seconds=90), grace=5) == [a]
    assert lifecycle.timeouts_due(index, T0 + timedelta(seconds=95), grace=5) == []  # already stopping
    lifecycle.finish(index, a, T0, 143)
    assert a.state is TaskState.FAILED and a.reason == "timed out after 1m30s"


def test_lowering_max_agents_never_stops_running_tasks():
    index = Index()
    admit_all(index, Config(max_agents=3), ["a", "b", "c", "d"])
    step.settle(index, Config(max_agents=3), T0)
    low = Config(max_agents=1)
    step.settle(index, low, T0)
    assert len(index.active) == 3 and selection.free_slots(index, low) == 0


def test_trim_history_keeps_the_newest():
    index, cfg = Index(), Config(max_agents=5)
    tasks = admit_all(index, cfg, list("abcde"))
    step.settle(index, cfg, T0)
    for t in tasks:
        lifecycle.finish(index, t, T0, 0)
    gone = lifecycle.trim_history(index, 2)
    assert [t.name for t in gone] == ["a", "b", "c"] and [t.name for t in index.finished] == ["d", "e"]


def test_find_unknown_task():
    with pytest.raises(NotFound, match="no task 'x'"):
        selection.find(Index(), "x")


# ---- properties ---------------------------------------------------------------------------

ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 0)),
        st.tuples(st.just("finish"), st.integers(0, 9)),
        st.tuples(st.just("cancel"), st.integers(0, 9)),
        st.tuples(st.just("max"), st.integers(1, 5)),
        st.tuples(st.just("tick"), st.integers(1, 3600)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops_strategy, st.integers(1, 5))
def test_invariants_hold_under_any_sequence(steps, max_agents):
    """Capacity is never exceeded by a start, every task is in exactly one place, ids
    increase, positions are 1..n in start order, and tasks start in FIFO order."""
    cfg = Config(max_agents=max_agents, max_queue=1000, queue_timeout="2h")
    index, now, started = Index(), T0, []
    for op, arg in steps:
        if op == "admit":
            admission.admit(index, cfg, now, req())
        elif op == "finish" and index.active:
            lifecycle.finish(index, index.active[arg % len(index.active)], now, arg % 2)
        elif op == "cancel" and index.live():
            task = index.live()[arg % len(index.live())]
            lifecycle.cancel(index, task, now, grace=0)
            if task.state is TaskState.RUNNING:
                lifecycle.finish(index, task, now, 143)
        elif op == "max":
            cfg = Config(max_agents=arg, max_queue=1000, queue_timeout="2h")
        elif op == "tick":
            now += timedelta(seconds=arg)  # settle expires what is due by then
        before = len(index.active)
        started += [e.task for e in step.settle(index, cfg, now).events if e.type == "started"]
        assert len(index.active) <= max(cfg.max_agents, before)
        assert check_index(index) is None
        pos = selection.positions(index, cfg, now)
        assert sorted(pos.values()) == list(range(1, len(index.queued) + 1))
        assert len({t.id for t in index.all_tasks()}) == len(index.all_tasks())
    assert started == sorted(started)  # FIFO: admission order is start order


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20), st.integers(1, 5))
def test_positions_predict_the_real_start_order(n, max_agents):
    cfg = Config(max_agents=max_agents, max_queue=1000)
    index = Index()
    admit_all(index, cfg, [f"t{i}" for i in range(n)])
    step.settle(index, cfg, T0)
    predicted = sorted(selection.positions(index, cfg, T0), key=selection.positions(index, cfg, T0).get)
    actual = []
    while index.active:
        lifecycle.finish(index, index.active[0], T0, 0)
        actual += [e.task for e in step.settle(index, cfg, T0).events if e.type == "started"]
    assert actual == predicted


def test_successor_only_where_one_exit_frees_a_slot_whichever_it_is():
    index, cfg = Index(), Config(max_agents=2)
    admit_all(index, cfg, ["a", "b", "c", "d"])
    step.settle(index, cfg, T0)
    assert selection.successor(index, cfg).task.name == "c"
    assert selection.successor(index, Config(max_agents=1)) is None  # over capacity: an exit frees nothing
    assert selection.successor(index, Config(max_agents=3)) is None  # a free slot: starts happen at once
    assert selection.successor(index, Config(max_agents=2, strategy="fair")) is None
    guarded = msgspec.convert({"max_agents": 2, "resource_guard": {"max_load_per_cpu": 2}}, Config)
    assert selection.successor(index, guarded) is None  # the machine's load decides, not the index


def test_prompt_file_placeholder_gets_the_path_the_caller_gives():
    cfg = Config(agents={"f": {"command": ["agent", "--file={prompt_file}", "{name}"]}}, default_agent="f")
    req = admission.Request(cwd="/", name="n1", prompt="p {prompt_file}", prompt_path="/h/logs/1.prompt")
    assert admission.wants_prompt_file(cfg, req) and not admission.wants_prompt_file(Config(), req)
    task, _ = admission.admit(Index(), cfg, T0, req)
    assert task.command == ["agent", "--file={prompt_file}", "n1"] and task.prompted
    assert commandline.argv(task, "p {prompt_file}", "/h/logs/1.prompt") == ["agent", "--file=/h/logs/1.prompt", "n1"]
    with pytest.raises(UsageError, match="needs a prompt"):
        admission.admit(Index(), cfg, T0, admission.Request(cwd="/", name="x"))


def test_queue_view_is_the_one_view_every_front_end_renders():
    """Order, positions and reasons come from the scheduler's own order; running by slot."""
    from kugetsu.core.models import Index

    cfg = Config(max_agents=2, max_active_per_source=1)
    ix = Index()
    for i, src in enumerate(["a", "a", "b", "a"], 1):
        admission.admit(ix, cfg, T0, admission.Request(cwd="/", name=f"t{i}", command=["x"], source=src))
    step.settle(ix, cfg, T0)
    ix.active.reverse()
    view = selection.queue_view(ix, cfg, T0)
    assert [t.run.slot for t in view.running] == [1, 2]
    assert [t.name for t in view.queued] == [t.name for t in selection.start_order(ix, cfg, T0)]
    assert view.positions == selection.positions(ix, cfg, T0)
    assert view.waiting_for == selection.waiting_for(ix, cfg, T0)
    assert view.capacity == selection.capacity(ix, cfg) and view.capacity.free == 0 and view.capacity.queued == 2


def test_pm_words_its_errors_for_every_front_end_and_names_no_cli_flag():
    """pm's errors are read in the dashboard, the bot and MCP as well: a flag (`--until`) or
    a CLI command in them would be wrong there. Each front end adds its own fix (cli._fix)."""
    import ast
    from pathlib import Path

    for module in ("common", "selection", "commandline", "admission", "lifecycle", "skew", "step", "retries",
                   "policy", "placement"):
        source = (Path(admission.__file__).parent / f"{module}.py").read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and node.exc is not None:
                texts = [n.value for n in ast.walk(node.exc) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                assert not [t for t in texts if "--" in t or "kugetsu " in t], f"{module}.py:{node.lineno}: {texts}"
    cfg = Config()
    with pytest.raises(UsageError, match=r"^invalid retries -1: a task is run again 0 or more times"):
        admission.admit(Index(), cfg, T0, req("a", retries=-1))
    with pytest.raises(UsageError, match=r"^a hold until .* is not in the future; give a later time"):
        retries.hold(Index(), cfg, "claude", T0 - timedelta(minutes=1), T0)
