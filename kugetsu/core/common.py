"""What every rule module says of a task: its events, how it stands in words, its end (closing
it into the finished list), a stop requested, paused time booked, whether its end may requeue it.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from kugetsu.config.model import Config
from kugetsu.core.models import Event, Index, Task, TaskState


def unpause(task: Task, now: datetime) -> None:
    """The paused time so far joins `paused_s` (its timeout moves by as much)."""
    run = task.run
    if run is not None and run.paused_at is not None:
        run.paused_s += max(0.0, (now - run.paused_at).total_seconds())
        run.paused_at = None
def _request_stop(task: Task, state: TaskState, reason: str, now: datetime, grace: float) -> None:
    assert task.run is not None, "only a running task is stopped this way"
    if task.run.stop is None:
        task.run.stop, task.reason = state, reason
        task.run.kill_at = now + timedelta(seconds=grace)
def _close(index: Index, task: Task, state: TaskState, now: datetime, exit_code: int | None = None) -> Event:
    unpause(task, now)
    task.stashed_at = None
    task.state = state
    task.finished_at = now
    task.exit_code = exit_code
    if task.run is not None:
        task.run.kill_at = None
    index.finished.append(task)
    # A worktree task's final event names its worktree: the service closes it just after.
    worktree = task.worktree if task.worktree_state == "active" else None
    return _event(state.value, task, now, exit_code=exit_code, reason=task.reason, worktree=worktree)
def _event(kind: str, task: Task, now: datetime, **detail: object) -> Event:
    detail.setdefault("branch", task.branch)  # worktree tasks: notifications name the branch
    return Event(type=kind, at=now, task=task.id, name=task.name, source=task.source, state=task.state.value, **detail)
def _stands(task: Task) -> str:
    """How a task stands, in words: 'is running', 'is already cancelled', 'has already
    succeeded' (not 'is succeeded')."""
    if task.state in (TaskState.SUCCEEDED, TaskState.FAILED):
        return f"has already {task.state.value}"
    return f"is already {task.state.value}" if task.state.final else f"is {task.state.value}"
def may_requeue(cfg: Config, task: Task) -> bool:
    """Could this running task's end send it back to the queue (a retry, its provider's limit)?"""
    if task.retries > 0:
        return True
    preset = cfg.agents.get(task.agent) if task.agent else None
    return preset is not None and (preset.limit.enabled or preset.output != "text")  # its stream may report a limit
