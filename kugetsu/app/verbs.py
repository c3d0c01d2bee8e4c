"""The verbs on tasks every front end shares: cancel, pause/resume/signal a running task,
priority and moves, edit, pause the queue, holds and retries, groups, clean and remove.
Each is one transaction around the core's rule, then a wake of the service.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from datetime import datetime
from typing import Any

import msgspec

from kugetsu.app.config_change import set_config
from kugetsu.app.control import wake
from kugetsu.app.delegation import _check_runnable, Admission, delegate
from kugetsu.app.reading import read
from kugetsu.app.transaction import _locked, now, settle
from kugetsu.config.load import cluster_host, load_config
from kugetsu.config.model import Config
from kugetsu.core import admission, commandline, lifecycle, retries, selection
from kugetsu.core.models import Event, Index, Task
from kugetsu.errors import UsageError
from kugetsu.paths import Home
from kugetsu.service import runner
from kugetsu.store.files import open_store


# ---- cancel ------------------------------------------------------------------------------


def cancel(home: Home, refs: list[str], *, everything: bool = False, reason: str = "cancelled") -> list[Task]:
    """Cancel tasks by id or name (or every live one). Queued ones end at once; running ones
    are marked stopping: the service, woken by the commit (started if need be), sends SIGTERM
    to their group (then SIGCONT), and SIGKILL after kill_grace. It is the one sender, on one
    machine as in a cluster (there, the task's own machine's service)."""
    with _locked(home) as (txn, cfg):
        tasks = list(txn.index.live()) if everything else [selection.find(txn.index, ref) for ref in refs]
        for task in tasks:
            txn.emit(lifecycle.cancel(txn.index, task, txn.now, cfg.kill_grace_s, reason))
        settle(txn, cfg)
    wake(home, cfg, txn.index)
    return tasks


# ---- control of one running task ---------------------------------------------------------


def _signal_here(cfg: Config, task: Task) -> None:
    """Signals go from this machine: a task another machine of a cluster runs is refused."""
    if task.host is not None and task.host != cluster_host(cfg):
        raise UsageError(f"task {task.name} (#{task.id}) runs on {task.host}: pause, resume and kill -s act on this"
                         f" machine's tasks; run the command on {task.host}", code=1)


def pause_task(home: Home, ref: str, on: bool, by: str = "cli") -> tuple[Task, bool]:
    """`pause TASK` / `resume TASK`: recorded, then SIGSTOP / SIGCONT to its whole tree (its
    group and every process carrying its token). Returns the task and whether it changed."""
    with _locked(home) as (txn, cfg):
        task = selection.find(txn.index, ref)
        _signal_here(cfg, task)
        events = selection.pause_task(task, txn.now, on, by)
        txn.emit(events)
    runner.signal_tree(task.run.pid, task.run.pid_start, task.token, signal.SIGSTOP if on else signal.SIGCONT)
    wake(home, cfg)
    return task, bool(events)


def signal_task(home: Home, ref: str, sig: signal.Signals, by: str = "cli") -> tuple[Task, int]:
    """`kill -s SIGNAL TASK`: recorded (a `signalled` event), then sent to its whole tree.
    Returns the task and how many were signalled (the group counts as one)."""
    with _locked(home) as (txn, cfg):
        task = selection.find(txn.index, ref)
        _signal_here(cfg, task)
        txn.emit(selection.signal_task(task, txn.now, sig.name, by))
    sent = runner.signal_tree(task.run.pid, task.run.pid_start, task.token, sig, spare_wrapper=True)
    wake(home, cfg)
    return task, sent


# ---- priority ----------------------------------------------------------------------------


def set_priority(home: Home, ref: str, level: str) -> tuple[Task, int | None]:
    """Change a queued task's priority; returns it with its new position."""
    with _locked(home) as (txn, cfg):
        task = selection.find(txn.index, ref)
        txn.emit(admission.set_priority(txn.index, task, level, txn.now))
        settle(txn, cfg)
        position = selection.position(txn.index, cfg, txn.now, task)
    wake(home, cfg, txn.index)
    return task, position


def queued_change(home: Home, ref: str, change: Callable[[Index, Task, datetime], list[Event]]) -> tuple[Task, int | None, bool]:
    """One change of a queued task's place (`next`, `stash`, `unstash`) in one transaction:
    the task, its position after it (None: started, or stashed) and whether it changed."""
    with _locked(home) as (txn, cfg):
        task = selection.find(txn.index, ref)
        events = change(txn.index, task, txn.now)
        txn.emit(events)
        settle(txn, cfg)
        position = selection.position(txn.index, cfg, txn.now, task)
    wake(home, cfg)
    return task, position, bool(events)


def next_task(home: Home, ref: str, by: str = "cli") -> tuple[Task, int | None, bool]:
    """`next TASK` (the CLI, the dashboard's `n`): it starts before every other that may start."""
    return queued_change(home, ref, lambda index, task, now: admission.move_next(index, task, now, by))


def stash_task(home: Home, ref: str, on: bool, by: str = "cli") -> tuple[Task, int | None, bool]:
    """`stash TASK` (on) / `unstash TASK` (the CLI, the dashboard's `z`)."""
    return queued_change(home, ref, lambda index, task, now: admission.stash(task, now, on, by))


# ---- edit --------------------------------------------------------------------------------


def edit(home: Home, ref: str, change: admission.Edit) -> tuple[Task, int | None, bool]:
    """Change a queued task (admission.edit) in one transaction; returns it, its position (None:
    it started as part of the change) and whether anything changed. A new prompt is stored
    with the commit (no agent of a queued task has read it yet)."""
    if change.cwd is not None:
        change.cwd = os.path.abspath(change.cwd)
        if not os.path.isdir(change.cwd):
            raise UsageError(f"--cwd {change.cwd!r} is not a directory")
    if change.command is not None:  # as delegate: refused if it could never start
        cfg, index = read(home)
        task = selection.find(index, ref)
        _check_runnable(cfg, admission.Request(cwd=change.cwd or task.cwd, command=change.command, env=task.env))
    store = open_store(home)
    with _locked(home) as (txn, cfg):
        task = selection.find(txn.index, ref)
        change.prompt_path = str(home.prompt_file(task.id))
        if change.prompt is not None and change.prompt == commandline.prompt_of(task, store.prompts([task.id])):
            change.prompt = None  # the same text: nothing to change
        events = admission.edit(txn.index, cfg, task, txn.now, change)
        if change.prompt is not None and any(e.key and "prompt" in e.key.split(",") for e in events):
            txn.prompts[task.id] = change.prompt
        txn.emit(events)
        settle(txn, cfg)
        position = selection.positions(txn.index, cfg, txn.now).get(task.id)
    wake(home, cfg, txn.index)
    return task, position, bool(events)


# ---- pause -------------------------------------------------------------------------------


def pause(home: Home, group: str | None, on: bool) -> tuple[bool, selection.Capacity]:
    """`kugetsu pause` / `resume` (of one group, or of every start): whether it changed
    anything, and the capacity after it (resuming starts queued tasks at once)."""
    with _locked(home) as (txn, cfg):
        events = selection.pause(txn.index, cfg, txn.now, group, on)
        txn.emit(events)
        settle(txn, cfg)
        cap = selection.capacity(txn.index, cfg)
    wake(home, cfg, txn.index)
    return bool(events), cap


# ---- provider limits and retries ---------------------------------------------------------


def hold(home: Home, agent: str, until: datetime | None) -> list[Event]:
    """`kugetsu hold AGENT [--until T]`: the preset's queued tasks wait; running ones run on."""
    with _locked(home) as (txn, cfg):
        events = retries.hold(txn.index, cfg, agent, until, txn.now)
        txn.emit(events)
        settle(txn, cfg)
    wake(home, cfg, txn.index)
    return events


def release(home: Home, agent: str) -> list[Event]:
    """`kugetsu release AGENT`: its tasks may start at once."""
    with _locked(home) as (txn, cfg):
        events = retries.release(txn.index, cfg, agent, txn.now)
        txn.emit(events)
        settle(txn, cfg)
    wake(home, cfg, txn.index)
    return events


def hold_json(home: Home, agent: str, said: list[str | None]) -> dict[str, Any]:
    """`hold --json`, `release --json`: the preset's hold now (held false: none), and what changed."""
    _, index = read(home)
    view = selection.holds_view(index, now()).get(agent)
    out: dict[str, Any] = {"agent": agent, "held": view is not None, "until": None, "reason": None, "since": None,
                           "queued": sum(1 for t in index.queued if t.agent == agent)}
    if view is not None:
        out.update(msgspec.to_builtins(view))
    out["changed"] = [text for text in said if text]
    return out


def retry(home: Home, cfg: Config, ref: str) -> Admission:
    """`kugetsu retry TASK`: a finished task admitted again as a new task (`retry_of`)."""
    _, index = read(home)
    task = selection.find(index, ref)
    return delegate(home, cfg, retries.retry_request(index, task, commandline.prompt_of(task, open_store(home).prompts([task.id]))))


# ---- groups ------------------------------------------------------------------------------


def group_add(home: Home, name: str, max_agents: int) -> Config:
    """`group add NAME [--max N]`: a new pool in config `groups` (config set groups.NAME)."""
    cfg = load_config(home)
    selection.check_group_name(cfg, name, new=True)
    return set_config(home, f"groups.{name}", {"max_agents": max_agents})


def group_remove(home: Home, name: str) -> Config:
    """`group remove NAME`: refused while a queued or running task is in it (it would be in a
    pool that no longer exists); in the same transaction as the config change."""
    selection.check_group_name(load_config(home), name, new=False)
    return set_config(home, f"groups.{name}", None, remove=True, guard=lambda index: selection.check_group_unused(index, name))


def groups_json(cfg: Config, index: Index) -> list[dict[str, Any]]:
    """`group list --json`: each pool, its slots, its running and queued tasks, whether paused."""
    return [{"name": name, **usage, "paused": name in index.paused_groups}
            for name, usage in sorted(selection.group_usage(index, cfg).items())]


# ---- clean -------------------------------------------------------------------------------


def clean(home: Home, older_than: float | None, states: frozenset[str] | None = None) -> list[Task]:
    """Drop finished tasks from the index, with their log files. Ids are never reused."""
    with open_store(home).transaction() as txn:
        gone = lifecycle.clean(txn.index, txn.now, older_than, states)
    _drop_files(home, gone)
    return gone


def remove(home: Home, refs: list[str]) -> list[Task]:
    """`kugetsu remove TASK...`: these finished tasks leave the index, with their log files."""
    with open_store(home).transaction() as txn:
        gone = lifecycle.remove(txn.index, [selection.find(txn.index, ref) for ref in refs])
    _drop_files(home, gone)
    return gone


def _drop_files(home: Home, gone: list[Task]) -> None:
    for task in gone:
        for path in (home.log(task.id), home.exit_file(task.id), home.prompt_file(task.id)):
            path.unlink(missing_ok=True)
