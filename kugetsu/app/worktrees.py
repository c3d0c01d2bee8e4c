"""Worktree pruning: finished tasks' worktrees removed by age and by the disk they take (max_disk).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import msgspec

from kugetsu.app.transaction import now
from kugetsu.config.model import Config
from kugetsu.config.units import format_size
from kugetsu.core.models import Event
from kugetsu.paths import Home
from kugetsu.store.files import open_store

if TYPE_CHECKING:  # git's module is imported by the worktree commands only
    from kugetsu.service.worktree import Entry


# ---- worktrees ---------------------------------------------------------------------------


class Pruned(msgspec.Struct):
    entry: Any  # worktree.Entry
    note: str  # what was done, or why it was left alone
    removed: bool


def prune_worktrees(home: Home, older_than: float | None = None, force: bool = False) -> list[Pruned]:
    """Remove the worktrees of final tasks (and orphans). Never one of a queued or running
    task; without `force`, never uncommitted changes or a branch whose commits are on no other
    branch. Branches with nothing of their own go with their worktree."""
    from kugetsu.service import worktree

    t = now()
    out = []
    for entry in worktree.entries(home, open_store(home).read().all_tasks()):
        if entry.live:
            continue
        task = entry.task
        since = task.finished_at if task and task.finished_at else datetime.fromtimestamp(entry.path.stat().st_mtime, timezone.utc)
        if older_than is not None and (t - since).total_seconds() < older_than:
            continue
        out.append(_prune_one(home, entry, force))
    events = [_worktree_event(p.entry, p.note, t) for p in out if p.removed]
    if events:
        with open_store(home).transaction() as txn:
            gone = {str(p.entry.path) for p in out if p.removed}
            for task in txn.index.all_tasks():
                if task.worktree in gone and task.state.final and task.worktree_state in ("kept", "active"):
                    task.worktree_state = "pruned"
            txn.emit(events)
    return out


def _prune_one(home: Home, entry: Entry, force: bool, keep_branch: bool = False) -> Pruned:
    from kugetsu.service import worktree

    try:
        has_git = entry.repo is not None and (entry.path / ".git").is_file()
        if has_git and not force:
            if worktree.dirty(entry.path):
                return Pruned(entry, "has uncommitted changes (--force discards them)", False)
            if not keep_branch and not worktree.merged(entry.repo, entry.branch):
                return Pruned(entry, f"branch {entry.branch} has commits on no other branch (--force deletes them)", False)
        with worktree.group_lock(entry.path.parent):
            live = [x for x in open_store(home).read().live() if x.worktree == str(entry.path)]
            if live:  # it started again under the same name since we looked
                return Pruned(entry, f"now used by running task {live[0].name}", False)
            branch = None if keep_branch or not has_git else entry.branch
            worktree.remove(entry.repo if has_git else None, entry.path, branch)
    except worktree.WorktreeError as err:
        return Pruned(entry, f"could not remove: {err}", False)
    kept = f", branch {entry.branch} kept" if keep_branch and entry.branch else ""
    return Pruned(entry, f"removed {entry.path}{kept}", True)


def _worktree_event(entry: Entry, note: str, at: datetime) -> Event:
    task = entry.task
    return Event(
        type="worktree", at=at, task=task.id if task else None, name=task.name if task else entry.path.name,
        source=task.source if task else None, reason=note, branch=entry.branch, worktree=str(entry.path),
    )


def enforce_max_disk(home: Home, cfg: Config) -> list[Pruned]:
    """worktrees.max_disk: over the cap, remove the worktrees of final tasks, oldest first,
    until under it. Their branches stay (commits cost little disk, and are work); a worktree
    with uncommitted changes is never removed for this, and the user is told."""
    from kugetsu.service import worktree

    cap = cfg.worktrees.max_disk_bytes
    if cap is None:
        return []
    entries = worktree.entries(home, open_store(home).read().all_tasks())
    sizes = {e.path: worktree.disk_usage(e.path) for e in entries}
    total = sum(sizes.values())
    if total <= cap:
        return []
    final = [e for e in entries if not e.live]
    final.sort(key=lambda e: e.task.finished_at if e.task and e.task.finished_at else datetime.min.replace(tzinfo=timezone.utc))
    out = []
    for entry in final:
        if total <= cap:
            break
        done = _prune_one(home, entry, force=False, keep_branch=True)
        if done.removed:
            total -= sizes[entry.path]
            done.note += f" (worktrees over max_disk {cfg.worktrees.max_disk})"
        out.append(done)
    t = now()
    events = [_worktree_event(p.entry, p.note, t) for p in out if p.removed]
    if total > cap:
        events.append(Event(type="worktree", at=t, reason=(
            f"worktrees use {format_size(total)}, over max_disk {cfg.worktrees.max_disk}; the rest belong to running"
            " tasks or hold uncommitted changes (`kugetsu worktrees` lists them)")))
    if events:
        with open_store(home).transaction() as txn:
            gone = {str(p.entry.path) for p in out if p.removed}
            for task in txn.index.all_tasks():
                if task.worktree in gone and task.state.final:
                    task.worktree_state = "pruned"
            txn.emit(events)
    return out
