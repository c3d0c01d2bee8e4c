"""The operations every front end shares (CLI, dashboard, Telegram bot, service).

Each one is a store transaction around pm calls, then a wake of the service. When the
dashboard and the CLI both cancel, they call `cancel` here: one code path.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kugetsu.core import admission, commandline, lifecycle, placement, policy, retries, selection, step

from kugetsu.service import runner
from kugetsu.app.control import check_wakeable, wake
from kugetsu.config.keys import has_value, mask_secrets, with_value
from kugetsu.config.load import cluster_config, cluster_host, host_name, load_config, read_raw, save_raw, validate
from kugetsu.config.model import Config, LOCAL_KEYS
from kugetsu.config.units import format_size
from kugetsu.errors import KugetsuError, NotClustered, UsageError
from kugetsu.core.models import TASK_DEFAULTS, Event, Index, Schedule, Task, TaskState
from kugetsu.paths import Home
from kugetsu.store.files import open_store
from kugetsu.store.protocol import Txn

if TYPE_CHECKING:  # git's module is imported by the worktree commands only
    from kugetsu.service.worktree import Entry


def now() -> datetime:
    return datetime.now(timezone.utc)


@contextmanager
def _locked(home: Home) -> Iterator[tuple[Txn, Config]]:
    """A transaction, with the config as it is under the index lock: `config set` writes it
    under that lock, so a config read before taking it may already be stale (a lowered
    max_agents overshot by one start)."""
    check_wakeable(home)  # every transaction here ends with a wake
    with open_store(home).transaction() as txn:
        yield txn, config_in(home, txn)


def config_in(home: Home, txn: Txn) -> Config:
    """The config as the transaction sees it: in a cluster, the shared part came with the
    queue row (under its lock), so both are of one moment."""
    if not txn.shared_config:
        return load_config(home)
    return cluster_config(home, read_raw(home), msgspec.json.decode(txn.shared_config))


def settle(txn: Txn, cfg: Config) -> None:
    """step.settle in a transaction: every transaction runs it (expiry, starts, history)."""
    plan = step.settle(txn.index, cfg, txn.now, measure(cfg))
    txn.emit(plan.events)
    txn.archive.extend(plan.archive)


def measure(cfg: Config) -> policy.Resources | None:
    """The machine's readings for the resource guard; None (and no psutil import) when it is off."""
    if not cfg.resource_guard.enabled:
        return None
    import psutil

    return policy.Resources(
        available_memory=psutil.virtual_memory().available,
        load_per_cpu=os.getloadavg()[0] / (os.cpu_count() or 1),
    )


# ---- delegate ----------------------------------------------------------------------------


class Admission(msgspec.Struct):
    task: Task
    position: int | None  # None when it started at once
    max_agents: int
    queued: int
    waiting_for: str | None = None  # why it waits when not simply behind others (selection.waiting_for)


def start_time(at: str | None, delay: float | None, flag: str = "--at") -> datetime | None:
    """`--at TIME` or `--delay DUR` (delegate, edit, a schedule's task; MCP's at/delay) as the
    moment it may start; None: neither given. TIME is read as `hold --until` reads it."""
    if at is not None and delay is not None:
        raise UsageError(f"give {flag} or {flag.replace('at', 'delay')}, not both")
    if delay is not None:
        return now() + timedelta(seconds=delay)
    if at is None:
        return None
    from kugetsu.core import limits

    when = limits.parse_until(at, now())
    if when is None:
        raise UsageError(f"{flag} {at!r} is neither a time (02:00, 3pm, 2026-11-23T15:00Z) nor a duration (30m, 2h)")
    return when


def delegate(home: Home, cfg: Config, req: admission.Request) -> Admission:
    out = delegate_many(home, cfg, [req])[0]
    if isinstance(out, KugetsuError):
        raise out
    return out


class _NoneAdmitted(Exception):
    """Aborts a transaction in which every request was refused: a failed command writes nothing."""


def delegate_many(home: Home, cfg: Config, reqs: list[admission.Request]) -> list[Admission | KugetsuError]:
    """Admit requests in one transaction (one read, one fsync'd write), each as `delegate`
    would one after the other, in order: the same checks, slots, positions and events. A
    request that is refused (bad input, queue full: KugetsuError) gets its error and the
    others go on; any other failure (disk full) fails them all, writing nothing. A
    long-lived front end (the MCP server) admits concurrent calls this way."""
    out: list[Admission | KugetsuError | None] = [None] * len(reqs)
    todo = []
    runs_on = _agents_path(home)
    for i, req in enumerate(reqs):
        try:
            _check_request(req)
            _check_runnable(cfg, req, runs_on)
            _check_worktree(cfg, req)
        except KugetsuError as err:
            out[i] = err
            continue
        req.token = runner.new_token()
        req.parent = req.parent or caller_task()
        todo.append(i)
    if not todo:
        return out  # type: ignore[return-value]
    try:
        with _locked(home) as (txn, cfg):
            settle(txn, cfg)
            for i in todo:
                try:
                    out[i] = _admit(home, txn, cfg, reqs[i])
                except KugetsuError as err:
                    out[i] = err
            if not any(isinstance(a, Admission) for a in out):
                raise _NoneAdmitted
    except _NoneAdmitted:
        return out  # type: ignore[return-value]
    wake(home, cfg, txn.index)
    return out  # type: ignore[return-value]


def _admit(home: Home, txn: Txn, cfg: Config, req: admission.Request) -> Admission:
    if admission.wants_prompt_file(cfg, req):
        req.prompt_path = str(home.prompt_file(txn.index.next_id))  # the id admit gives it
    task, events = admission.admit(txn.index, cfg, txn.now, req)
    if req.prompt is not None:
        # Kept by the store beside the index, committed with the task (for the file store,
        # the very file a {prompt_file} preset's agent reads).
        txn.prompts[task.id] = req.prompt
    txn.emit(events)
    settle(txn, cfg)
    admission.started_at_once(events, task)  # still in the outbox: written with the commit
    position = selection.position(txn.index, cfg, txn.now, task)
    why = selection.waiting_for_one(txn.index, cfg, txn.now, task, measure(cfg)) if position else None
    if position and task.pinned_host is not None:
        why = placement.placement_note(task, hosts_up(cfg)) or why
    if position == 1 and why is None:
        why = placement.handed_over(cfg, selection.free_slots(txn.index, cfg))
    return Admission(task, position, cfg.max_agents, len(txn.index.queued), why)


def caller_task() -> tuple[int, str] | None:
    """The task this process runs in, when an agent of kugetsu's started it (or something the
    agent started): the id and name the runner put in its environment (admission.parent_task checks
    them against the index)."""
    ident, name = os.environ.get("KUGETSU_TASK_ID", ""), os.environ.get("KUGETSU_TASK_NAME")
    return (int(ident), name) if ident.isascii() and ident.isdigit() and name else None


def _check_request(req: admission.Request) -> None:
    if not req.command and req.prompt is None and req.agent is None and req.name is None:
        raise UsageError("nothing to run: give --prompt TEXT (for the agent preset) or a command after --")
    if req.source.strip() == "" or len(req.source) > 64 or not req.source.isprintable():
        raise UsageError("--source must be 1-64 printable characters, e.g. pm or telegram:123")


class AgentsPath(msgspec.Struct, frozen=True):
    """The PATH agents will be looked up on: the running service's own (agents get its
    environment), else this process's (the service it would start inherits it)."""

    path: str | None
    service_pid: int | None = None
    readable: bool = True  # False: a service runs, but its environment is not ours to read


def _agents_path(home: Home) -> AgentsPath:
    from kugetsu.app.control import service_pid

    pid = service_pid(home)
    if pid is None:
        return AgentsPath(os.environ.get("PATH"))
    path = runner.environment_variable(pid, "PATH")
    if path is None:  # another user's service (or it just ended): the best guess is ours
        return AgentsPath(os.environ.get("PATH"), pid, readable=False)
    return AgentsPath(path, pid)


def _check_runnable(cfg: Config, req: admission.Request, runs_on: AgentsPath | None = None) -> None:
    """Refuse at admission what could never start: a missing cwd or command. The command is
    looked up where it will run: on the PATH of the service that starts it, not the caller's."""
    if not os.path.isdir(req.cwd):
        raise UsageError(f"--cwd {req.cwd!r} is not a directory")
    agent, argv, env = admission.resolve_agent(cfg, req)
    runs_on = runs_on or AgentsPath(os.environ.get("PATH"))
    _check_exe(req, argv[0], env, None if req.command else agent, runs_on)
    for other in admission.route_request(cfg, req, agent)[1:]:  # a fallback that could not start is no fallback
        preset = cfg.agents[other]
        _check_exe(req, preset.command[0], preset.env, other, runs_on)


def _check_exe(req: admission.Request, exe: str, env: dict[str, str], preset: str | None, runs_on: AgentsPath) -> None:
    path = env.get("PATH", runs_on.path)
    found = runner.which(exe, path) if os.sep not in exe else runner.which(os.path.join(req.cwd, exe))
    if found is not None:
        return
    from kugetsu.errors import CommandNotFound

    here = runner.which(exe) if os.sep not in exe and "PATH" not in env else None
    if "PATH" in env:
        looked = "the PATH of the preset's env"
    elif runs_on.service_pid is None:
        looked = "the PATH here, which a service started from here inherits"
    elif runs_on.readable:
        looked = (f"the PATH of the kugetsu service (pid {runs_on.service_pid}), which starts agents with its own"
                  f" environment: {path}")
    else:
        here = None
        looked = (f"this PATH: the kugetsu service (pid {runs_on.service_pid}) starts agents with its own,"
                  " which is not ours to read")
    raise CommandNotFound(exe, preset, looked, here if runs_on.service_pid is not None else None)


def _check_worktree(cfg: Config, req: admission.Request) -> None:
    """A worktree task must come from a git repository; record it and the base on the request."""
    want = req.worktree
    if want is None:
        preset = cfg.agents.get(req.agent or cfg.default_agent) if req.agent or not req.command else None
        want = cfg.worktrees.enabled or bool(preset and preset.worktree)
    if not want:
        if req.base is not None:
            raise UsageError("--base needs --worktree (or worktrees.enabled, or a preset with \"worktree\": true)")
        req.repo = None
        return
    from kugetsu.service import worktree

    req.repo, req.base = worktree.admission(req.cwd, req.name, req.base)


# ---- cancel ------------------------------------------------------------------------------


def cancel(home: Home, refs: list[str], *, everything: bool = False, reason: str = "cancelled") -> list[Task]:
    """Cancel tasks by id or name (or every live one). Queued ones end at once; running ones
    get SIGTERM to their group now, SIGKILL after kill_grace (the service sees to it)."""
    with _locked(home) as (txn, cfg):
        tasks = list(txn.index.live()) if everything else [selection.find(txn.index, ref) for ref in refs]
        paused = [t for t in tasks if t.paused_at is not None]
        for task in tasks:
            txn.emit(lifecycle.cancel(txn.index, task, txn.now, cfg.kill_grace_s, reason))
        settle(txn, cfg)
    # In a cluster the task's own machine signals it (step.tick: its service is woken by the
    # commit); on one machine the signal goes now, as a service may not be running.
    for task in tasks if cfg.store is None else []:
        if task.state is TaskState.RUNNING:
            runner.kill_group(task.pid, task.pid_start, signal.SIGTERM)
    for task in paused if cfg.store is None else []:  # a stopped process acts on its SIGTERM once it runs
        runner.signal_tree(task.pid, task.pid_start, task.token, signal.SIGCONT)
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
    runner.signal_tree(task.pid, task.pid_start, task.token, signal.SIGSTOP if on else signal.SIGCONT)
    wake(home, cfg)
    return task, bool(events)


def signal_task(home: Home, ref: str, sig: signal.Signals, by: str = "cli") -> tuple[Task, int]:
    """`kill -s SIGNAL TASK`: recorded (a `signalled` event), then sent to its whole tree.
    Returns the task and how many were signalled (the group counts as one)."""
    with _locked(home) as (txn, cfg):
        task = selection.find(txn.index, ref)
        _signal_here(cfg, task)
        txn.emit(selection.signal_task(task, txn.now, sig.name, by))
    sent = runner.signal_tree(task.pid, task.pid_start, task.token, sig, spare_wrapper=True)
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


# ---- config ------------------------------------------------------------------------------


def set_config(home: Home, key: str, value: Any, *, remove: bool = False,
               guard: Callable[[Index], None] | None = None) -> Config:
    """Validate, write atomically and apply at once (raising max_agents starts queued tasks).
    `guard`: a check of the index in the same transaction (`group remove`: no live task in it)."""
    check_wakeable(home)
    local = read_raw(home)
    if key == "store" and local.get("store"):
        # Leaving a cluster, or moving to another database: never through the database being
        # left, which may be the very reason (unreachable, a role without privileges). Its
        # queue does not record this machine's change of mind; config.json is the record.
        raw = with_value(local, key, value, remove=remove)
        cfg = validate(raw, home.config, hint="\nNothing was changed.", setting=key)
        save_raw(home, raw)
        return cfg
    store = open_store(home)
    with store.transaction() as txn:  # the index lock also orders config writes
        if guard is not None:
            guard(txn.index)
        local = read_raw(home)
        if key == "store" and not remove and not txn.shared_config:
            _check_joinable(home, local, txn.index)
        if txn.shared_config and key.split(".")[0] not in LOCAL_KEYS:
            # A cluster: the shared config is in the queue row, written in this transaction.
            before = msgspec.json.decode(txn.shared_config)
            shared = with_value(before, key, value, remove=remove)
            cfg = cluster_config(home, local, shared, setting=key)
            _check_unset(cfg, key, remove and shared == before)
            txn.new_config = msgspec.json.encode(shared)
        else:
            raw = with_value(local, key, value, remove=remove)
            if txn.shared_config:
                cfg = cluster_config(home, raw, msgspec.json.decode(txn.shared_config), setting=key)
            else:
                cfg = validate(raw, home.config, hint="\nNothing was changed.", setting=key)
            _check_unset(cfg, key, remove and raw == local)
            save_raw(home, raw)
        txn.emit([Event(type="config", at=txn.now, key=key, value=None if remove else mask_secrets(value, key))])
        settle(txn, cfg)
    wake(home, cfg, txn.index)
    return cfg


def _check_unset(cfg: Config, key: str, removed_nothing: bool) -> None:
    """`config unset` of a key that was not there and has no default (`agents.typo`) is an
    error before anything is written; one that removed an entry (`agents.x`) succeeds."""
    if removed_nothing and not has_value(cfg, key):
        raise UsageError(f"config key {key!r} is not set; nothing was changed")


def _check_joinable(home: Home, local: dict[str, Any], index: Index) -> None:
    """`config set store URL` joins this machine to a cluster as it is: a home with its own
    queue or config would silently lose them from view; `store migrate` moves them."""
    own = [k for k in local if k not in LOCAL_KEYS]
    if index.live() or own:
        what = f"{len(index.live())} queued or running task(s)" if index.live() else f"config keys {', '.join(own)}"
        raise UsageError(f"this home has {what}, which a cluster would not see: `kugetsu store migrate URL`"
                         f" moves them into an empty database; to join an existing cluster, remove them from"
                         f" {home.config} (or let the tasks finish) first")


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



# ---- reading -----------------------------------------------------------------------------


def read(home: Home) -> tuple[Config, Index]:
    return load_config(home), open_store(home).read()


def capacity_json(cfg: Config, index: Index) -> dict[str, Any]:
    """`kugetsu capacity --json`: what a PM agent checks before delegating."""
    out: dict[str, Any] = msgspec.to_builtins(selection.capacity(index, cfg, now()))  # `holds` always there, {} when none
    if not out["budgets"]:
        del out["budgets"]  # there only when daily budgets are set
    return out


class Listing(msgspec.Struct):
    """What `kugetsu queue` shows (selection.queue_view, with the finished tasks asked for),
    computed once for its text and its JSON."""

    view: selection.QueueView
    index: Index
    now: datetime
    finished: list[Task] | None  # latest first; None unless asked for
    here: str | None = None  # this machine's name, in a cluster
    measured: dict[int, step.Measured] = {}  # the running tasks' use, as the service last measured it

    @property
    def positions(self) -> dict[int, int]:
        return self.view.positions


def listing(cfg: Config, index: Index, finished: bool = False, home: Home | None = None,
            keep: selection.TaskFilter | None = None, at: datetime | None = None) -> Listing:
    """The queue view every front end shows (the CLI's `queue`, MCP, the dashboard), with the
    resource guard's and placement's notes and (with `home`) the running tasks' measured use;
    `keep`: only the tasks it matches, at their true positions, and (when it asks for a final
    state) the latest 20 finished that match. `at`: the time to show it at (the dashboard's
    clock), default now."""
    t = at or now()
    latest = None
    if finished or (keep is not None and keep.wants_finished):
        done = index.finished if keep is None else [x for x in index.finished if keep.matches(x)]
        latest = list(reversed(done[-20:]))
    here = cluster_host(cfg)
    view = selection.queue_view(index, cfg, t, measure(cfg))
    if cfg.store is not None and any(x.pinned_host for x in view.queued):
        view = selection.with_placement(view, hosts_up(cfg))
    if keep is not None:
        view = selection.filter_view(view, keep)
    return Listing(view, index, t, latest, here, measured(home, cfg, index))


def measured(home: Home | None, cfg: Config, index: Index) -> dict[int, step.Measured]:
    """The running tasks' use as the service last measured it (usage.json), when it is
    recent: a service that is gone measures nothing."""
    if home is None or not index.active:
        return {}
    from kugetsu.service import usage

    last = usage.read(home)
    if last is None or (now() - last.at).total_seconds() > max(10.0, 5 * cfg.resources.interval_s):
        return {}
    return last.tasks


def hosts_up(cfg: Config) -> set[str]:
    """Cluster mode: the machines whose lease holds now."""
    assert cfg.store is not None
    from kugetsu.cluster import hosts as H
    from kugetsu.store.postgres import store_for

    with store_for(cfg.store).guarded() as conn:
        return {row.name for row, state in H.standing(conn, cfg.cluster.lease_s)[1] if state == "up"}


def queue_json(listed: Listing, home: Home | None = None) -> dict[str, Any]:
    """`kugetsu queue --json`: msgspec encodes it as it is (its tasks are PublicTask structs,
    the cheap way for a long queue); msgspec.to_builtins makes plain JSON values of it.
    With `home`, each task's stored prompt is in its object (one read for those shown)."""
    view = listed.view
    active = listed.index.active  # in start order, as ever; a filtered view's only
    if len(view.running) != len(active):
        shown_ids = {t.id for t in view.running}
        active = [t for t in active if t.id in shown_ids]
    shown = [*active, *view.queued, *(listed.finished or [])]
    texts = prompts(home, shown) if home is not None else None
    out: dict[str, Any] = {
        "max_agents": view.capacity.max_agents,
        "active": public_tasks(active, here=listed.here, measured=listed.measured, prompts=texts),
        "queued": public_tasks(view.queued, [view.positions.get(t.id) for t in view.queued],
                               waiting_for=view.waiting_for, prompts=texts),
        "groups": view.groups,
        "paused": view.capacity.paused,
        "paused_groups": view.capacity.paused_groups,
        "holds": msgspec.to_builtins(view.capacity.holds),  # always there: {} when no preset is held
    }
    if listed.finished is not None:
        out["finished"] = public_tasks(listed.finished, prompts=texts)
    return out


# Kept in the index, never shown: the environment, process identity, stop bookkeeping.
_HIDDEN_FIELDS = frozenset(("env", "pid_start", "stop", "kill_at", "token", "ended_at", "leftovers", "limit", "first_command",
                            "prompted", "first"))  # `first`: `next`'s ordering mark: the position says it


def _public_task_type() -> type[msgspec.Struct]:
    """PublicTask: the public task object of docs/architecture.md §5, derived from Task so the two
    never drift. Its fields, in order: id, name, state, position, the Task's other shown
    fields with the Task's defaults (the index leaves defaults out; the public object has
    every field), then agent_pid, and waiting_for (queued tasks of `queue --json` only).
    Values were checked when the index was decoded: `Any` here is a view, not a gap."""
    fields: list[tuple[str, Any, Any]] = []
    for name, default in TASK_DEFAULTS.items():
        if name not in _HIDDEN_FIELDS:
            fields.append((name, Any, msgspec.field(default_factory=list) if default == [] else default))
        if name == "state":
            fields.append(("position", Any, None))
    fields += [("agent_pid", Any, None), ("env_names", Any, msgspec.field(default_factory=list)),
               ("waiting_for", Any, msgspec.UNSET)]  # UNSET: not in the object
    # A running task's use now, as the service last measured it (README, "Resources").
    fields += [("rss", Any, None), ("procs", Any, None)]
    return msgspec.defstruct("PublicTask", fields, kw_only=True, module=__name__)


PublicTask = _public_task_type()


def prompts(home: Home, tasks: Iterable[Task]) -> dict[int, str]:
    """The stored prompts of these tasks, for their public objects (public_tasks)."""
    return open_store(home).prompts([t.id for t in tasks])


def public_tasks(tasks: list[Task], positions: list[int | None] | None = None, here: str | None = None,
                 waiting_for: dict[int, str] | None = None, measured: dict[int, step.Measured] | None = None,
                 prompts: Mapping[int, str] | None = None) -> list[msgspec.Struct]:
    """The public objects of `tasks` (with their queue positions; in a cluster, `here` is
    this machine's name: a process on another machine cannot be looked at from this one;
    `prompts`: their stored prompts, from `prompts()`; without them `prompt` is null).
    Two conversions in C for the lot, and no Python loop over fields (`queue --json` of a
    long queue spends its time here)."""
    raws = msgspec.to_builtins(tasks)  # a task's own values; hidden ones are dropped below
    running = TaskState.RUNNING
    for task, raw, position in zip(tasks, raws, positions or repeat(None)):
        raw["position"] = position
        if prompts is not None and task.id in prompts:
            raw["prompt"] = prompts[task.id]
        # `pid` is the wrapper's (its process group is the task's); `agent_pid` the agent's own,
        # looked up only where it runs.
        if task.state is running and (task.host is None or task.host == here):
            raw["agent_pid"] = runner.agent_pid(task.pid, task.pid_start)
        if waiting_for is not None:
            raw["waiting_for"] = waiting_for.get(task.id)
        m = measured.get(task.id) if measured and task.state is running else None
        if m is not None:  # its use now (the record's peak and CPU are as of the last transaction)
            raw["rss"], raw["procs"] = m.memory, m.procs
            raw["peak_memory"] = max(task.peak_memory or 0, m.peak) or None
            raw["cpu_seconds"] = max(task.cpu_seconds or 0.0, m.cpu) or None
        if task.env:  # the names only: a value may be a secret (`delegate --env`, a preset's API key)
            raw["env_names"] = sorted(task.env)
    return msgspec.convert(raws, list[PublicTask])  # fills the defaults, drops what it does not name


def task_json(task: Task, position: int | None, here: str | None = None, waiting_for: str | None = None,
              measured: dict[int, step.Measured] | None = None, prompts: Mapping[int, str] | None = None
              ) -> dict[str, Any]:
    """The public task object of docs/architecture.md §5, as plain JSON values."""
    why = {task.id: waiting_for} if waiting_for is not None else None
    return msgspec.to_builtins(public_tasks([task], [position], here, why, measured, prompts))[0]  # type: ignore[no-any-return]


def status_json(home: Home, index: Index, cfg: Config, task: Task) -> dict[str, Any]:
    """`status` (CLI, MCP): the task object with its prompt, a running task's measured use,
    and for a queued task that waits for more than the tasks ahead of it, why (`waiting_for`:
    `starts at 02:00`, `memory (...)`), as `queue --json` says it."""
    now_ = now()
    why = selection.waiting_for_one(index, cfg, now_, task, measure(cfg)) if task.state is TaskState.QUEUED else None
    return task_json(task, selection.position(index, cfg, now_, task), cluster_host(cfg), why,
                     measured(home, cfg, index) if task.state is TaskState.RUNNING else None,
                     prompts=prompts(home, [task]))


def tasks_json(tasks: list[Task], positions: list[int | None] | None = None, here: str | None = None,
               prompts: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
    """task_json of each task."""
    return msgspec.to_builtins(public_tasks(tasks, positions, here, prompts=prompts))  # type: ignore[no-any-return]


# ---- cluster -----------------------------------------------------------------------------


def hosts(home: Home) -> list[dict[str, Any]]:
    """`kugetsu hosts`: every machine of the cluster, its slots, running tasks, last heartbeat."""
    cfg = load_config(home)
    if cfg.store is None:
        raise NotClustered("`kugetsu hosts`")
    from kugetsu.cluster import hosts as H
    from kugetsu.store.postgres import store_for

    store = store_for(cfg.store)
    index = store.read()
    with store.guarded() as conn:
        t, machines = H.standing(conn, cfg.cluster.lease_s)
    out = []
    for row, state in machines:
        running = [x for x in index.active if x.host == row.name]
        out.append({
            "name": row.name,
            "state": state,
            "max_agents": row.max_agents,
            "running": len(running),
            "tasks": [x.name for x in running],
            "heartbeat_at": row.heartbeat_at.isoformat(),
            "heartbeat_age": round((t - row.heartbeat_at).total_seconds(), 1),
            "joined_at": row.joined_at.isoformat(),
            "epoch": row.epoch,
            "pid": row.pid,
            "this": row.name == host_name(cfg),
        })
    return out


def output_kind(cfg: Config, task: Task) -> str:
    """What a task's log is (its preset's `output`): how the front ends show it as text."""
    preset = cfg.agents.get(task.agent) if task.agent else None
    return preset.output if preset is not None else "text"


def log_json(home: Home, cfg: Config, task: Task, lines: int | None, max_bytes: int, raw: bool = False) -> dict[str, Any]:
    """The end of a task's output as JSON (`logs --json`, MCP's logs): the last `lines` lines
    within the last `max_bytes` bytes, as UTF-8 text (a structured output as its text unless
    `raw`), the log's whole size and whether the text is only its end."""
    from kugetsu.store import logtail

    path = log_path(home, cfg, task)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        size = 0
    end = logtail.tail(path, lines, max_bytes) if size else logtail.Tail(b"", 0, 0)
    text = end.data.decode("utf-8", errors="replace")
    kind = "text" if raw else output_kind(cfg, task)
    if kind != "text":  # e.g. Claude Code's stream-json: its messages, tool calls and end, as text
        from kugetsu.agents import render_tail

        text = render_tail(kind, text, cut=end.start > 0 and lines is None)
    return {"id": task.id, "name": task.name, "state": task.state.value, "text": text, "size": size,
            "truncated": len(end.data) != end.size}


def log_path(home: Home, cfg: Config, task: Task) -> Path:
    """Where this machine reads a task's output: its log, or in a cluster, for a task that ran
    on another machine, the local mirror of what that machine shipped (brought up to date
    by this call: a follower calls it again for more)."""
    if cfg.store is None or task.host is None or task.host == host_name(cfg):
        return home.log(task.id)
    from kugetsu.cluster import logs
    from kugetsu.store.postgres import store_for

    path = home.mirror_log(task.id)
    with store_for(cfg.store).guarded() as conn:
        logs.mirror(conn, task.id, path)
    return path


# ---- recurring schedules (kugetsu/core/schedules.py, docs/scheduling.md) --------------------------


def _checked(home: Home, cfg: Config, req: admission.Request) -> None:
    """The checks delegate makes outside the lock (a schedule's request, at `add` and again
    at each firing: the command or repository may have gone since)."""
    _check_request(req)
    _check_runnable(cfg, req, _agents_path(home))
    _check_worktree(cfg, req)


def schedule_add(home: Home, cfg: Config, name: str, *, cron: str | None, every: float | None, tz: str | None,
                 req: admission.Request, overlap: bool = False) -> Schedule:
    from kugetsu.core import schedules

    schedules.check_name(name)
    # Checked on a copy, as the firings' tasks will be named: the checks fill in what holds
    # for one task (a worktree's base pinned to the commit of now), which each firing must
    # find afresh.
    probe = msgspec.structs.replace(req, name=schedules.task_name(Schedule(name=name, created_at=now()), now()))
    _checked(home, cfg, probe)
    if cron is not None and tz is None:
        # This machine's zone, kept with it: a cron line means the same hours wherever the
        # service that fires it runs (another machine of a cluster, a server in UTC).
        tz = schedules.local_zone_name()
    with _locked(home) as (txn, cfg):
        sched, events = schedules.add(txn.index, txn.now, name, cron=cron, every=every, tz=tz, request=req,
                                      overlap=overlap)
        txn.emit(events)
    wake(home, cfg)
    return sched


def schedule_change(home: Home, name: str, what: str) -> list[Event]:
    """`schedule pause|resume|remove NAME`."""
    from kugetsu.core import schedules

    with _locked(home) as (txn, cfg):
        if what == "remove":
            events = schedules.remove(txn.index, txn.now, name)
        else:
            events = schedules.set_paused(txn.index, txn.now, name, what == "pause")
        txn.emit(events)
    if events:
        wake(home, cfg)
    return events


class Firing(msgspec.Struct):
    note: str  # what happened: "delegated NAME (#ID) ...", "skipped: ...", "not delegated: queue full ..."
    task: Task | None = None
    admission: Admission | None = None


def fire_schedule(home: Home, name: str, at: datetime | None = None) -> Firing | None:
    """One firing of a schedule, at its scheduled time `at` (the service's job), or now by
    hand (`schedule run`, at None). Delegated through the same admission as `delegate`, in
    one transaction that also records the outcome on the schedule; a refusal (a full queue,
    a command gone) is recorded there too. None: nothing to record (it already fired at
    that time, or it is paused or gone)."""
    from kugetsu.core import schedules

    by_hand = at is None
    cfg, index = read(home)
    sched = schedules.find(index, name)
    fire_at = at or now()
    req = schedules.request(sched, fire_at)
    problem: KugetsuError | None = None
    try:
        _checked(home, cfg, req)
    except KugetsuError as err:
        problem = err
    req.token = runner.new_token()
    with _locked(home) as (txn, cfg):
        settle(txn, cfg)
        sched = txn.index.schedules.get(name)
        if sched is None:
            if by_hand:
                raise schedules.NoSuchSchedule(name)
            return None
        why = schedules.should_fire(txn.index, sched, fire_at, by_hand)
        if why in ("already fired", "paused"):
            return None
        out = Firing(note=why or "")
        if why is None and problem is not None:
            out.note = schedules.refused(problem)
        elif why is None:
            req.name = schedules.free_name(txn.index, req.name or "")
            try:
                adm = _admit(home, txn, cfg, req)  # its prompt is kept with this commit (txn.prompts)
            except KugetsuError as err:
                out.note = schedules.refused(err)
            else:
                out = Firing(note=f"delegated {adm.task.name} (#{adm.task.id})", task=adm.task, admission=adm)
        txn.emit(schedules.record(txn.index, sched, fire_at, txn.now, by_hand,
                                  out.task.id if out.task else None, out.note))
    wake(home, cfg, txn.index)
    return out


def schedules_json(cfg: Config, index: Index) -> list[dict[str, Any]]:
    """`schedule list --json`: each schedule, its next firing, its last task and how it ended."""
    from kugetsu.core import schedules

    t = now()
    out = []
    for sched in sorted(index.schedules.values(), key=lambda s: s.name):
        raw = msgspec.to_builtins(sched)
        nxt = schedules.next_fire(sched, t)
        last = next((x for x in index.all_tasks() if x.id == sched.last_task), None) if sched.last_task else None
        out.append({"name": sched.name, "cron": sched.cron, "every": sched.every, "tz": sched.tz,
                    "paused": sched.paused, "overlap": sched.overlap,
                    "next_fire": msgspec.to_builtins(nxt),
                    "last_fire": raw.get("last_fire"), "last_at": raw.get("last_at"),
                    "last_task": sched.last_task, "last_task_name": last.name if last else None,
                    "last_outcome": schedules.outcome(index, sched), "last_note": sched.last_note,
                    "fired": sched.fired, "skipped": sched.skipped, "request": sched.request,
                    "created_at": raw["created_at"]})
    return out
