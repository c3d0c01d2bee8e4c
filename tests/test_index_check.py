"""An index.json no kugetsu writer writes (a hand edit, another tool): a time a deadline would
overflow on, a task in the wrong list, an id twice. Every reader refuses it, naming the task and
what is wrong, and changes nothing. The check runs at every CLI call and at the service's start,
so it is made of passes in C over the tasks (issue 31); these tests pin what it must still find."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from kugetsu.core.models import Index, Run, Task, TaskState, check_index
from kugetsu.store.protocol import encode_index

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
FAR = datetime(9999, 12, 31, tzinfo=timezone.utc)
EARLY = datetime(1, 1, 1, tzinfo=timezone.utc)


def _index(queued: int = 300) -> Index:
    """A well-formed index: one running task, `queued` queued, two finished."""
    index = Index(next_id=queued + 10)
    index.active.append(Task(id=1, name="run", command=["true"], cwd="/", created_at=NOW, state=TaskState.RUNNING,
                             started_at=NOW, run=Run(pid=1, pid_start=1, kill_at=NOW + timedelta(hours=1))))
    for i in range(2, queued + 2):
        index.queued.append(Task(id=i, name=f"q{i}", command=["true"], cwd="/", created_at=NOW,
                                 expires_at=NOW + timedelta(hours=1)))
    for i in (queued + 2, queued + 3):
        index.finished.append(Task(id=i, name=f"f{i}", command=["true"], cwd="/", created_at=NOW,
                                   state=TaskState.SUCCEEDED, started_at=NOW, finished_at=NOW, exit_code=0))
    return index


def test_a_well_formed_index_passes():
    assert check_index(_index()) is None
    assert check_index(Index()) is None


# (where, what is set, the time): each a time a deadline is computed from, on a live task.
BAD_TIMES = [
    ("queued", "created_at", FAR), ("queued", "expires_at", FAR), ("queued", "not_before", EARLY),
    ("queued", "started_at", FAR), ("active", "created_at", EARLY), ("active", "run.kill_at", FAR),
    ("active", "run.ended_at", FAR), ("queued", "run.ended_at", EARLY),
]


@pytest.mark.parametrize("where,field,at", BAD_TIMES)
def test_a_live_tasks_time_out_of_range_is_named(where, field, at):
    index = _index()
    task = index.queued[-7] if where == "queued" else index.active[0]
    if field.startswith("run."):
        if task.run is None:
            task.run = Run()
        setattr(task.run, field[4:], at)
    else:
        setattr(task, field, at)
    problem = check_index(index)
    assert problem is not None and f"task #{task.id} " in problem and str(at.year) in problem


def test_a_finished_tasks_time_is_only_shown_never_refused():
    index = _index()
    index.finished[0].finished_at = FAR
    assert check_index(index) is None


@pytest.mark.parametrize("case", ["queued running", "active queued", "finished queued", "id twice", "id ahead"])
def test_a_task_in_the_wrong_list_or_an_id_twice_is_named(case):
    index = _index()
    if case == "queued running":
        index.queued[5].state, named = TaskState.RUNNING, f"queued[5] (task #{index.queued[5].id})"
    elif case == "active queued":
        index.active[0].state, named = TaskState.QUEUED, "active[0] (task #1)"
    elif case == "finished queued":
        index.finished[1].state, named = TaskState.QUEUED, f"finished[1] (task #{index.finished[1].id})"
    elif case == "id twice":
        index.queued[9].id, named = index.queued[3].id, f"task id {index.queued[3].id} appears twice"
    else:
        index.queued[-1].id, named = index.next_id, f"task id {index.next_id} is not below next_id"
    problem = check_index(index)
    assert problem is not None and named in problem


@pytest.mark.parametrize("field", ["not_before", "expires_at"])
def test_every_command_refuses_such_an_index_and_writes_nothing(kg, field):
    index = _index(queued=2000)
    setattr(index.queued[1234], field, FAR)
    kg.home.root.mkdir(mode=0o700)
    kg.config(max_agents=1, autostart=False)
    data = encode_index(index)
    kg.home.index.write_bytes(data)
    # (`capacity` reads the queue's counts only, never a task's times: it answers.)
    for args in (["queue"], ["delegate", "x", "--", "true"], ["cancel", "q5"], ["serve", "--detach"]):
        r = kg.run(*args)
        # 2: the file is wrong; 1: `serve --detach` says its service stopped at once, and why
        assert r.returncode == (1 if args[0] == "serve" else 2), (args, r.stdout, r.stderr)
        assert f"task #{index.queued[1234].id} has the time 9999-12-31" in r.stderr
        assert "Traceback" not in r.stderr
        assert kg.home.index.read_bytes() == data
