"""pm's rules for issue 19 (daily use): wait by name, pause, dependencies, edit. Pure, in microseconds."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

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
