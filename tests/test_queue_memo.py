"""fastpath.QueueMemo keeps what the service derives from a deep queue while the queue is the
one committed before (issue 31): here, the warm wrappers' first tasks in start order when
that order is played on a Board (a group) with every slot busy."""

from __future__ import annotations

from datetime import timedelta

import msgspec

from conftest import T0

from kugetsu.config.model import Config
from kugetsu.core import admission, policy, selection, step
from kugetsu.core.models import Index, TaskState
from kugetsu.service.fastpath import FastPath, QueueMemo


class Warm:
    """The one call FastPath.warm makes of Processes: what it was handed."""

    def __init__(self) -> None:
        self.first: list = []

    def sync_warm(self, index, cfg, first=None) -> None:
        self.first.append(first)


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
