"""Cluster placement (kugetsu/core/placement.py and pm's use of it): pure rules, in microseconds."""

from __future__ import annotations

from datetime import timedelta

from kugetsu.core import admission, lifecycle, selection, step
from kugetsu.config.model import Config
from kugetsu.core.models import Index, TaskState
from kugetsu.core.placement import Here, HostSeen, gone_hosts

from test_pm import T0

URL = "postgresql://db/kugetsu"


def cluster(max_agents: int = 4) -> Config:
    return Config(max_agents=max_agents, store=URL)


def admit(index: Index, cfg: Config, name: str, cwd: str = "/tmp", **kw: object):
    task, _ = admission.admit(index, cfg, T0, admission.Request(cwd=cwd, name=name, command=["true"], **kw))
    return task


def test_a_command_anywhere_in_a_cluster_starts_nothing_each_machine_starts_for_itself():
    index, cfg = Index(), cluster()
    admit(index, cfg, "a")
    assert step.settle(index, cfg, T0).start == [] and [t.name for t in index.queued] == ["a"]
    plan = step.settle(index, cfg, T0, here=Here(name="m1", max_agents=2))
    assert [(t.name, t.host) for t in plan.start] == [("a", "m1")]


def test_a_machine_takes_no_more_than_its_own_slots_and_the_cluster_no_more_than_max_agents():
    index, cfg = Index(), cluster(max_agents=3)
    for n in "abcde":
        admit(index, cfg, n)
    m1, m2 = Here(name="m1", max_agents=2), Here(name="m2", max_agents=2)
    assert [t.name for t in step.settle(index, cfg, T0, here=m1).start] == ["a", "b"]
    step.settle(index, cfg, T0, here=m1)
    assert len(index.active) == 2  # m1 is full
    assert [t.name for t in step.settle(index, cfg, T0, here=m2).start] == ["c"]  # the cluster is full at 3
    assert len(index.active) == 3 and {t.host for t in index.active} == {"m1", "m2"}


def test_each_machine_admits_memory_against_its_own_budget_and_slots_count_in_its_own():
    """Issue 29: max_memory is a machine's own; memory declared on another machine does not
    count here, and a task of 2 slots needs 2 of this machine's."""
    G = 1024**3

    def started(plan: step.Plan) -> list[str]:
        return [e.name for e in plan.events if e.type == "started"]
    index, cfg = Index(), cluster(max_agents=8)
    for name, mem in (("a", 3), ("b", 3), ("c", 3)):
        admit(index, cfg, name, memory=mem * G)
    admit(index, cfg, "wide", slots=2)
    admit(index, cfg, "d", memory=G)
    m1, m2 = Here(name="m1", max_agents=4, max_memory=4 * G), Here(name="m2", max_agents=3, max_memory=6 * G)
    assert started(step.settle(index, cfg, T0, here=m1)) == ["a"]  # b does not fit beside a's 3G
    # m1's 3G is not counted on m2; then wide needs 2 of m2's slots, which has 1 left: it waits
    assert started(step.settle(index, cfg, T0, here=m2)) == ["b", "c"]
    assert started(step.settle(index, cfg, T0, here=m1)) == ["wide", "d"]  # 3G + 1G = m1's 4G
    assert sorted((t.host, t.slots) for t in index.active) == [("m1", 1), ("m1", 1), ("m1", 2), ("m2", 1), ("m2", 1)]


def test_pinned_tasks_start_only_on_their_machine_and_others_pass_them():
    index, cfg = Index(), cluster()
    admit(index, cfg, "pinned", pinned_host="m2")
    admit(index, cfg, "free")
    started = step.settle(index, cfg, T0, here=Here(name="m1", max_agents=4)).start
    assert [t.name for t in started] == ["free"]
    assert [t.name for t in step.settle(index, cfg, T0, here=Here(name="m2", max_agents=4)).start] == ["pinned"]


def test_a_task_whose_directory_is_missing_here_waits_for_a_machine_that_has_it():
    index, cfg = Index(), cluster()
    admit(index, cfg, "a", cwd="/only/on/m2")
    admit(index, cfg, "b")
    m1 = Here(name="m1", max_agents=4, missing=frozenset({"/only/on/m2"}))
    assert [t.name for t in step.settle(index, cfg, T0, here=m1).start] == ["b"]
    assert [t.name for t in index.queued] == ["a"]


def test_a_machine_handles_only_its_own_processes():
    index, cfg = Index(), cluster()
    a, b = admit(index, cfg, "a"), admit(index, cfg, "b")
    step.settle(index, cfg, T0, here=Here(name="m1", max_agents=1))
    step.settle(index, cfg, T0, here=Here(name="m2", max_agents=1))
    a.run.pid = b.run.pid = 100
    # m1 sees pid 100 gone: that is m1's own a, never m2's b
    plan = step.tick(index, cfg, T0, step.Observations(here=Here(name="m1", max_agents=1),
                                                    exits=[step.Exit(a.id, 0), step.Exit(b.id, 1)]))
    assert a.state is TaskState.SUCCEEDED and b.state is TaskState.RUNNING
    assert [e.task for e in plan.events if e.type == "succeeded"] == [a.id]


def test_a_cancel_made_on_another_machine_is_signalled_by_the_owner():
    index, cfg = Index(), cluster()
    a = admit(index, cfg, "a")
    m1 = Here(name="m1", max_agents=1)
    step.settle(index, cfg, T0, here=m1)
    a.run.pid = 100
    lifecycle.cancel(index, a, T0, cfg.kill_grace_s)  # on some other machine: no signal from there
    later = T0 + timedelta(seconds=1)
    other = step.tick(index, cfg, later, step.Observations(here=Here(name="m2", max_agents=1)))
    assert other.signal_groups == []
    owner = step.tick(index, cfg, later, step.Observations(here=m1))
    assert [(t.name, sig) for t, sig in owner.signal_groups] == [("a", 15)]
    after_grace = T0 + timedelta(seconds=cfg.kill_grace_s + 1)
    owner = step.tick(index, cfg, after_grace, step.Observations(here=m1))
    assert [(t.name, sig) for t, sig in owner.signal_groups] == [("a", 9)]


def test_a_machine_silent_past_its_lease_is_gone_and_its_running_tasks_are_lost():
    index, cfg = Index(), cluster()
    a, b = admit(index, cfg, "a"), admit(index, cfg, "b")
    step.settle(index, cfg, T0, here=Here(name="m1", max_agents=1))
    step.settle(index, cfg, T0, here=Here(name="m2", max_agents=1))
    lease = cfg.cluster.lease_s
    now = T0 + timedelta(seconds=lease + 5)
    hosts = [HostSeen(name="m1", heartbeat_at=T0), HostSeen(name="m2", heartbeat_at=now)]
    m2 = Here(name="m2", max_agents=1, since=T0)
    plan = step.tick(index, cfg, now, step.Observations(here=m2, hosts=hosts))
    assert plan.gone == ["m1"] and a.state is TaskState.LOST and "m1" in (a.reason or "")
    assert b.state is TaskState.RUNNING


def test_no_machine_is_declared_gone_by_one_that_has_not_itself_been_up_a_whole_lease():
    """After the database was down, every lease looks old: the first machine back waits."""
    lease = 30.0
    now = T0 + timedelta(minutes=5)
    hosts = [HostSeen(name="m1", heartbeat_at=T0), HostSeen(name="m2", heartbeat_at=now)]
    assert gone_hosts(hosts, Here(name="m2", max_agents=1, since=now - timedelta(seconds=3)), now, lease) == []
    assert gone_hosts(hosts, Here(name="m2", max_agents=1, since=now - timedelta(seconds=31)), now, lease) == ["m1"]
    gone = [HostSeen(name="m1", heartbeat_at=T0, gone=True)]
    assert gone_hosts(gone, Here(name="m2", max_agents=1, since=T0), now, lease) == []


def test_outside_a_cluster_nothing_changes():
    index, cfg = Index(), Config(max_agents=1)
    admit(index, cfg, "a")
    plan = step.settle(index, cfg, T0)
    assert [(t.name, t.host) for t in plan.start] == [("a", None)]


def test_pinning_a_task_needs_a_cluster():
    import pytest

    from kugetsu.errors import NotClustered

    with pytest.raises(NotClustered, match="cluster mode"):
        admit(Index(), Config(), "a", pinned_host="m2")


def test_a_task_pinned_to_a_machine_that_is_not_up_says_so():
    index, cfg = Index(), cluster()
    a = admit(index, cfg, "a", pinned_host="m9")
    b = admit(index, cfg, "b")
    view = selection.with_placement(selection.queue_view(index, cfg, T0), {"m1"})
    assert view.waiting_for == {a.id: "host m9 is not up (the task is pinned to it: `kugetsu hosts`)"}
    assert view.positions == {a.id: 1, b.id: 2}
    assert selection.with_placement(selection.queue_view(index, cfg, T0), {"m9"}).waiting_for == {}


def test_a_hostile_host_name_is_refused_at_admission():
    import pytest

    from kugetsu.errors import UsageError

    for bad in ("a\nb", "-x", "x" * 65, "m1; drop table", ""):
        with pytest.raises(UsageError, match="invalid host"):
            admit(Index(), cluster(), "a", pinned_host=bad)
