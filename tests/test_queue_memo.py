"""fastpath.QueueMemo keeps what the service derives from a deep queue while the queue is the
one committed before (issue 31): here, the warm wrappers' first tasks in start order when
that order is played on a Board (a group) with every slot busy."""

from __future__ import annotations

from datetime import timedelta

import msgspec

from conftest import T0

from kugetsu.config.model import Config
from kugetsu.core import admission, policy, selection, step
from kugetsu.core.models import Index, Task, TaskState
from kugetsu.service.fastpath import FastPath, QueueMemo


class Warm:
    """The one call FastPath.warm makes of Processes: what it was handed."""

    def __init__(self) -> None:
        self.first: list = []
        self.ahead: list[int] = []

    def sync_warm(self, index, cfg, ahead, first=None) -> None:
        self.first.append(first)
        self.ahead.append(ahead)


def test_the_played_start_order_of_a_deep_queue_is_kept_while_the_queue_and_the_running_are_the_same(monkeypatch):
    cfg = msgspec.convert({"max_agents": 1, "max_queue": 20_000, "groups": {"q": {"max_agents": 1}}}, Config)
    ix = Index()
    admission.admit(ix, cfg, T0, admission.Request(cwd="/", name="holder", command=["true"], group="q"))
    step.settle(ix, cfg, T0)
    ix.queued += [msgspec.structs.replace(ix.active[0], id=ix.next_id + i, name=f"t{i}", state=TaskState.QUEUED,
                                          run=None, started_at=None) for i in range(10_000)]
    ix.next_id += 10_000
    builds = []
    real = policy.Board.__init__
    monkeypatch.setattr(policy.Board, "__init__", lambda self, *a, **kw: builds.append(1) or real(self, *a, **kw))
    memo, warm = QueueMemo(), Warm()
    fast = FastPath(None, warm, None, memo)  # type: ignore[arg-type]  (warm reads neither home nor exits)
    memo.at(1)  # the store says: this queue, committed
    fast.warm(ix, cfg)
    fast.warm(ix, cfg)  # a run timeout's tick: the queue is the same
    assert len(builds) == 1
    assert warm.ahead == [100, 100]  # no run to go by (selection.warm_ahead)
    assert [t.name for t in warm.first[1]] == [f"t{i}" for i in range(100)] and warm.first[0] is warm.first[1]
    ix.active[0].slots = 1  # assigned, not changed: still the same
    fast.warm(ix, cfg)
    assert len(builds) == 1
    memo.at(2)  # the queue changed (an expiry)
    fast.warm(ix, cfg)
    assert len(builds) == 2
    assert warm.first[-1] == selection.start_order(ix, cfg, T0, 100)
    # A task waiting for its time: the order depends on the clock, left to sync_warm, which
    # plays it at each tick.
    ix.queued[5].not_before = T0 + timedelta(hours=1)
    memo.at(3)
    fast.warm(ix, cfg)
    assert warm.first[-1] is None


def _finished_task() -> Task:
    ix = Index()
    admission.admit(ix, Config(), T0, admission.Request(cwd="/", name="t", command=["true"]))
    return msgspec.structs.replace(ix.active[0] if ix.active else ix.queued[0], state=TaskState.SUCCEEDED, run=None)


def _ran(ix: Index, seconds: list[float]) -> None:
    """Finished tasks that ran that long each."""
    done = _finished_task()
    ix.finished += [msgspec.structs.replace(done, id=1000 + i, started_at=T0, finished_at=T0 + timedelta(seconds=s))
                    for i, s in enumerate(seconds)]


def test_the_warm_wrappers_follow_the_pace_of_the_last_runs():
    cfg = msgspec.convert({"max_agents": 2}, Config)
    ix = Index()
    assert selection.warm_ahead(ix, cfg, 100, 30.0) == 100  # no run to go by: as many as may be
    _ran(ix, [600.0] * (selection.PACE_LEAST - 1))  # too few runs to tell a pace (a drain's blocker)
    assert selection.warm_ahead(ix, cfg, 100, 30.0) == 100
    _ran(ix, [600.0])  # agents of 10 minutes: the next promotion of each slot
    assert selection.warm_ahead(ix, cfg, 100, 30.0) == 2
    _ran(ix, [3.0] * 20)  # the last 20 ran 3 s: 2 slots x 30 s / 3 s
    assert selection.warm_ahead(ix, cfg, 100, 30.0) == 20
    _ran(ix, [0.002] * 20)  # a drain of trivial tasks: the most
    assert selection.warm_ahead(ix, cfg, 100, 30.0) == 100
    ix.finished.append(msgspec.structs.replace(_finished_task(), id=5000, started_at=None, finished_at=T0))  # never ran: no pace
    assert selection.warm_ahead(ix, cfg, 100, 30.0) == 100
