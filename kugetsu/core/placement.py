"""Where a task runs, in cluster mode (docs/architecture.md §10). Pure, like pm.

One queue and one capacity (`max_agents`) span the machines; each machine's service starts
tasks for itself alone, within its own slots (`host_max_agents`), and only tasks that can
run there: pinned to it (`delegate --host`), or not pinned and their directory exists there.
A machine that stops heartbeating is gone: its running tasks are lost and their slots free.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec

from kugetsu.config.model import Config
from kugetsu.core.models import Index, Task


class Here(msgspec.Struct, frozen=True, kw_only=True):
    """The machine a cluster service decides for: its name, its slots, and the directories
    queued tasks need that it lacks (the service looks; pm decides)."""

    name: str
    max_agents: int
    missing: frozenset[str] = frozenset()
    since: datetime | None = None  # since when its heartbeats have reached the database without a gap
    max_memory: int | None = None  # the memory its running tasks may declare in all (None: config's)


def needs_dir(task: Task) -> str:
    """The directory a task needs on the machine that runs it: its repository for a worktree
    task (the worktree is made there), else its cwd."""
    return task.repo or task.cwd


def runs_here(task: Task, here: Here) -> bool:
    if task.pinned_host is not None:
        return task.pinned_host == here.name
    return needs_dir(task) not in here.missing


def room(index: Index, here: Here) -> int:
    """Slots free on this machine (its own limit; the cluster's is the Board's)."""
    return here.max_agents - sum(t.slots for t in index.active if t.host == here.name)


def candidates(index: Index, here: Here) -> Index:
    """The index as this machine's selection sees it: every running task (they all count
    against the cluster's limits), and the queued tasks that can run here."""
    return msgspec.structs.replace(index, queued=[t for t in index.queued if runs_here(t, here)])


def starts_anywhere(cfg: Config, here: Here | None) -> bool:
    """Whether this transaction may start tasks: always on one machine; in a cluster only a
    machine's service, for itself (a CLI anywhere cannot know where a task can run)."""
    return not cfg.clustered or here is not None


def ours(task: Task, host: str | None) -> bool:
    """Is the task's process on this machine, `host` in a cluster (None: one machine, always)?"""
    return host is None or task.host == host


def placement_note(task: Task, alive: set[str] | None) -> str | None:
    """Why a pinned task cannot start anywhere now, or None."""
    if task.pinned_host is None or alive is None:
        return None
    if task.pinned_host not in alive:
        return f"host {task.pinned_host} is not up (the task is pinned to it: `kugetsu hosts`)"
    return None


def handed_over(cfg: Config, free: int) -> str | None:
    """Why a task admitted in a cluster with a slot free is queued: a CLI starts nothing
    there (starts_anywhere), a machine's service starts it a moment later. None on one
    machine, or when no slot is free (then it waits like any other)."""
    if not cfg.clustered or free <= 0:
        return None
    return "a machine to start it (a slot is free: within a moment)"


class HostSeen(msgspec.Struct, frozen=True, kw_only=True):
    """A machine's lease as the database holds it."""

    name: str
    heartbeat_at: datetime
    gone: bool = False
    epoch: int = 0  # its incarnation: a machine finds itself fenced when the epoch moved on


def gone_hosts(hosts: list[HostSeen], here: Here, now: datetime, lease: float) -> list[str]:
    """Machines whose lease ran out: silent for longer than `lease`. Only a machine that has
    itself been heartbeating for a whole lease judges others: after the database was down
    for a while every lease looks old, and the first machine back must not declare the
    others gone before they had a chance to reconnect."""
    if here.since is None or (now - here.since).total_seconds() < lease:
        return []
    limit = timedelta(seconds=lease)
    return [h.name for h in hosts if not h.gone and h.name != here.name and now - h.heartbeat_at > limit]


def host_state(heartbeat_at: datetime, gone: bool, now: datetime, lease: float) -> str:
    """How a machine stands: up (its lease holds), silent (past it: about to be declared
    gone), gone (its tasks were ended as lost; it rejoins when its service is back)."""
    if gone:
        return "gone"
    return "up" if (now - heartbeat_at).total_seconds() <= lease else "silent"
