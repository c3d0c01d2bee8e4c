"""The operations every front end shares (CLI, dashboard, Telegram bot, service).

Each one is a store transaction around pm calls, then a wake of the service. When the
dashboard and the CLI both cancel, they call `cancel` here: one code path.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec

from kugetsu import pm, runner
from kugetsu.control import check_wakeable, wake
from kugetsu.config import Config, format_size, load_config, mask_secrets, read_raw, save_raw, validate, with_value
from kugetsu.errors import KugetsuError, UsageError
from kugetsu.models import Event, Index, Task, TaskState
from kugetsu.paths import Home, write_new
from kugetsu.store import Store, Txn


def now() -> datetime:
    return datetime.now(timezone.utc)


@contextmanager
def _locked(home: Home) -> Iterator[tuple[Txn, Config]]:
    """A transaction, with the config as it is under the index lock: `config set` writes it
    under that lock, so a config read before taking it may already be stale (a lowered
    max_agents overshot by one start)."""
    check_wakeable(home)  # every transaction here ends with a wake
    with Store(home).transaction() as txn:
        yield txn, load_config(home)


def settle(txn: Txn, cfg: Config) -> None:
    """pm.settle in a transaction: every transaction runs it (expiry, starts, history)."""
    plan = pm.settle(txn.index, cfg, txn.now, measure(cfg))
    txn.emit(plan.events)
    txn.archive.extend(plan.archive)


def measure(cfg: Config) -> pm.Resources | None:
    """The machine's readings for the resource guard; None (and no psutil import) when it is off."""
    if not cfg.resource_guard.enabled:
        return None
    import psutil

    return pm.Resources(
        available_memory=psutil.virtual_memory().available,
        load_per_cpu=os.getloadavg()[0] / (os.cpu_count() or 1),
    )


# ---- delegate ----------------------------------------------------------------------------


class Admission(msgspec.Struct):
    task: Task
    position: int | None  # None when it started at once
    max_agents: int
    queued: int
    waiting_for: str | None = None  # why it waits when not simply behind others (pm.waiting_for)


def delegate(home: Home, cfg: Config, req: pm.Request) -> Admission:
    out = delegate_many(home, cfg, [req])[0]
    if isinstance(out, KugetsuError):
        raise out
    return out


class _NoneAdmitted(Exception):
    """Aborts a transaction in which every request was refused: a failed command writes nothing."""


def delegate_many(home: Home, cfg: Config, reqs: list[pm.Request]) -> list[Admission | KugetsuError]:
    """Admit requests in one transaction (one read, one fsync'd write), each as `delegate`
    would one after the other, in order: the same checks, slots, positions and events. A
    request that is refused (bad input, queue full: KugetsuError) gets its error and the
    others go on; any other failure (disk full) fails them all, writing nothing. A
    long-lived front end (the MCP server) admits concurrent calls this way."""
    out: list[Admission | KugetsuError | None] = [None] * len(reqs)
    todo = []
    for i, req in enumerate(reqs):
        try:
            _check_request(req)
            _check_runnable(cfg, req)
            _check_worktree(cfg, req)
        except KugetsuError as err:
            out[i] = err
            continue
        req.token = runner.new_token()
        todo.append(i)
    if not todo:
        return out  # type: ignore[return-value]
    written: list[Path] = []
    try:
        with _locked(home) as (txn, cfg):
            settle(txn, cfg)
            for i in todo:
                try:
                    out[i] = _admit(home, txn, cfg, reqs[i], written)
                except KugetsuError as err:
                    out[i] = err
            if not any(isinstance(a, Admission) for a in out):
                raise _NoneAdmitted
    except _NoneAdmitted:
        return out  # type: ignore[return-value]
    except BaseException:
        for path in written:  # no task owns them: a failed command leaves nothing behind
            path.unlink(missing_ok=True)
        raise
    wake(home, cfg)
    return out  # type: ignore[return-value]


def _admit(home: Home, txn: Txn, cfg: Config, req: pm.Request, written: list[Path]) -> Admission:
    if pm.wants_prompt_file(cfg, req):
        req.prompt_path = str(home.prompt_file(txn.index.next_id))  # the id admit gives it
    task, events = pm.admit(txn.index, cfg, txn.now, req)
    if req.prompt_path is not None:
        # Before the commit that makes the task startable; removed if it fails.
        written.append(Path(req.prompt_path))
        _write_prompt(written[-1], req.prompt or "")
    txn.emit(events)
    settle(txn, cfg)
    position = pm.positions(txn.index, cfg, txn.now).get(task.id)
    why = pm.waiting_for(txn.index, cfg, txn.now, measure(cfg)).get(task.id) if position else None
    return Admission(task, position, cfg.max_agents, len(txn.index.queued), why)


def _write_prompt(path: Path, prompt: str) -> None:
    """The prompt as a private file (0600, never through a link): not on the agent's command
    line, where any local user can read it. fsync'd: the committed task must find it after a
    crash. A file already there is a crash's leftover or planted (ids are never reused)."""
    write_new(path, prompt.encode())


def _check_request(req: pm.Request) -> None:
    if not req.command and req.prompt is None and req.agent is None and req.name is None:
        raise UsageError("nothing to run: give --prompt TEXT (for the agent preset) or a command after --")
    if req.source.strip() == "" or len(req.source) > 64 or not req.source.isprintable():
        raise UsageError("--source must be 1-64 printable characters, e.g. pm or telegram:123")


def _check_runnable(cfg: Config, req: pm.Request) -> None:
    """Refuse at admission what could never start: a missing cwd or command."""
    if not os.path.isdir(req.cwd):
        raise UsageError(f"--cwd {req.cwd!r} is not a directory")
    _, argv, env = pm.resolve_agent(cfg, req)
    path = env.get("PATH", os.environ.get("PATH"))
    exe = argv[0]
    import shutil

    found = shutil.which(exe, path=path) if os.sep not in exe else shutil.which(os.path.join(req.cwd, exe))
    if found is None:
        hint = f" (agent preset {req.agent or cfg.default_agent!r})" if not req.command else ""
        raise UsageError(
            f"command not found: {exe!r}{hint}; install it, pick another preset with --agent,"
            " or give the command after --"
        )


def _check_worktree(cfg: Config, req: pm.Request) -> None:
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
    from kugetsu import worktree

    req.repo, req.base = worktree.admission(req.cwd, req.name, req.base)


# ---- cancel ------------------------------------------------------------------------------


def cancel(home: Home, refs: list[str], *, everything: bool = False, reason: str = "cancelled") -> list[Task]:
    """Cancel tasks by id or name (or every live one). Queued ones end at once; running ones
    get SIGTERM to their group now, SIGKILL after kill_grace (the service sees to it)."""
    with _locked(home) as (txn, cfg):
        tasks = list(txn.index.live()) if everything else [pm.find(txn.index, ref) for ref in refs]
        for task in tasks:
            txn.emit(pm.cancel(txn.index, task, txn.now, cfg.kill_grace_s, reason))
        settle(txn, cfg)
    for task in tasks:
        if task.state is TaskState.RUNNING:
            runner.kill_group(task.pid, task.pid_start, signal.SIGTERM)
    wake(home, cfg)
    return tasks


# ---- priority ----------------------------------------------------------------------------


def set_priority(home: Home, ref: str, level: str) -> tuple[Task, int | None]:
    """Change a queued task's priority; returns it with its new position."""
    with _locked(home) as (txn, cfg):
        task = pm.find(txn.index, ref)
        txn.emit(pm.set_priority(txn.index, task, level, txn.now))
        settle(txn, cfg)
        position = pm.positions(txn.index, cfg, txn.now).get(task.id)
    wake(home, cfg)
    return task, position


# ---- provider limits and retries ---------------------------------------------------------


def hold(home: Home, agent: str, until: datetime | None) -> list[Event]:
    """`kugetsu hold AGENT [--until T]`: the preset's queued tasks wait; running ones run on."""
    with _locked(home) as (txn, cfg):
        events = pm.hold(txn.index, cfg, agent, until, txn.now)
        txn.emit(events)
        settle(txn, cfg)
    wake(home, cfg)
    return events


def release(home: Home, agent: str) -> list[Event]:
    """`kugetsu release AGENT`: its tasks may start at once."""
    with _locked(home) as (txn, cfg):
        events = pm.release(txn.index, cfg, agent, txn.now)
        txn.emit(events)
        settle(txn, cfg)
    wake(home, cfg)
    return events


def retry(home: Home, cfg: Config, ref: str) -> Admission:
    """`kugetsu retry TASK`: a finished task admitted again as a new task (`retry_of`)."""
    _, index = read(home)
    return delegate(home, cfg, pm.retry_request(pm.find(index, ref)))


# ---- config ------------------------------------------------------------------------------


def set_config(home: Home, key: str, value: Any, *, remove: bool = False) -> Config:
    """Validate, write atomically and apply at once (raising max_agents starts queued tasks)."""
    check_wakeable(home)
    store = Store(home)
    with store.transaction() as txn:  # the index lock also orders config writes
        raw = with_value(read_raw(home), key, value, remove=remove)
        cfg = validate(raw, f"cannot set {key}: {home.config}", hint="\nNothing was changed.")
        save_raw(home, raw)
        txn.emit([Event(type="config", at=txn.now, key=key, value=None if remove else mask_secrets(value, key))])
        settle(txn, cfg)
    wake(home, cfg)
    return cfg


# ---- clean -------------------------------------------------------------------------------


def clean(home: Home, older_than: float | None) -> list[Task]:
    """Drop finished tasks from the index, with their log files. Ids are never reused."""
    with Store(home).transaction() as txn:
        gone = pm.clean(txn.index, txn.now, older_than)
    for task in gone:
        for path in (home.log(task.id), home.exit_file(task.id), home.prompt_file(task.id)):
            path.unlink(missing_ok=True)
    return gone


# ---- worktrees ---------------------------------------------------------------------------


class Pruned(msgspec.Struct):
    entry: Any  # worktree.Entry
    note: str  # what was done, or why it was left alone
    removed: bool


def prune_worktrees(home: Home, older_than: float | None = None, force: bool = False) -> list[Pruned]:
    """Remove the worktrees of final tasks (and orphans). Never one of a queued or running
    task; without `force`, never uncommitted changes or a branch whose commits are on no other
    branch. Branches with nothing of their own go with their worktree."""
    from kugetsu import worktree

    t = now()
    out = []
    for entry in worktree.entries(home, Store(home).read().all_tasks()):
        if entry.live:
            continue
        task = entry.task
        since = task.finished_at if task and task.finished_at else datetime.fromtimestamp(entry.path.stat().st_mtime, timezone.utc)
        if older_than is not None and (t - since).total_seconds() < older_than:
            continue
        out.append(_prune_one(home, entry, force))
    events = [_worktree_event(p.entry, p.note, t) for p in out if p.removed]
    if events:
        with Store(home).transaction() as txn:
            gone = {str(p.entry.path) for p in out if p.removed}
            for task in txn.index.all_tasks():
                if task.worktree in gone and task.state.final and task.worktree_state in ("kept", "active"):
                    task.worktree_state = "pruned"
            txn.emit(events)
    return out


def _prune_one(home: Home, entry: Any, force: bool, keep_branch: bool = False) -> Pruned:
    from kugetsu import worktree

    try:
        has_git = entry.repo is not None and (entry.path / ".git").is_file()
        if has_git and not force:
            if worktree.dirty(entry.path):
                return Pruned(entry, "has uncommitted changes (--force discards them)", False)
            if not keep_branch and not worktree.merged(entry.repo, entry.branch):
                return Pruned(entry, f"branch {entry.branch} has commits on no other branch (--force deletes them)", False)
        with worktree.group_lock(entry.path.parent):
            live = [x for x in Store(home).read().live() if x.worktree == str(entry.path)]
            if live:  # it started again under the same name since we looked
                return Pruned(entry, f"now used by running task {live[0].name}", False)
            branch = None if keep_branch or not has_git else entry.branch
            worktree.remove(entry.repo if has_git else None, entry.path, branch)
    except worktree.WorktreeError as err:
        return Pruned(entry, f"could not remove: {err}", False)
    kept = f", branch {entry.branch} kept" if keep_branch and entry.branch else ""
    return Pruned(entry, f"removed {entry.path}{kept}", True)


def _worktree_event(entry: Any, note: str, at: datetime) -> Event:
    task = entry.task
    return Event(
        type="worktree", at=at, task=task.id if task else None, name=task.name if task else entry.path.name,
        source=task.source if task else None, reason=note, branch=entry.branch, worktree=str(entry.path),
    )


def enforce_max_disk(home: Home, cfg: Config) -> list[Pruned]:
    """worktrees.max_disk: over the cap, remove the worktrees of final tasks, oldest first,
    until under it. Their branches stay (commits cost little disk, and are work); a worktree
    with uncommitted changes is never removed for this, and the user is told."""
    from kugetsu import worktree

    cap = cfg.worktrees.max_disk_bytes
    if cap is None:
        return []
    entries = worktree.entries(home, Store(home).read().all_tasks())
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
        with Store(home).transaction() as txn:
            gone = {str(p.entry.path) for p in out if p.removed}
            for task in txn.index.all_tasks():
                if task.worktree in gone and task.state.final:
                    task.worktree_state = "pruned"
            txn.emit(events)
    return out



# ---- reading -----------------------------------------------------------------------------


def read(home: Home) -> tuple[Config, Index]:
    return load_config(home), Store(home).read()


def capacity_json(cfg: Config, index: Index) -> dict[str, Any]:
    """`kugetsu capacity --json`: what a PM agent checks before delegating."""
    return msgspec.to_builtins(pm.capacity(index, cfg, now()))  # type: ignore[no-any-return]


class Listing(msgspec.Struct):
    """What `kugetsu queue` shows (pm.queue_view, with the finished tasks asked for),
    computed once for its text and its JSON."""

    view: pm.QueueView
    index: Index
    now: datetime
    finished: list[Task] | None  # latest first; None unless asked for

    @property
    def positions(self) -> dict[int, int]:
        return self.view.positions


def listing(cfg: Config, index: Index, finished: bool = False) -> Listing:
    t = now()
    latest = list(reversed(index.finished[-20:])) if finished else None
    return Listing(pm.queue_view(index, cfg, t, measure(cfg)), index, t, latest)


def queue_json(listed: Listing) -> dict[str, Any]:
    """`kugetsu queue --json`."""
    view = listed.view
    out: dict[str, Any] = {
        "max_agents": view.capacity.max_agents,
        "active": [task_json(t, None) for t in listed.index.active],
        "queued": [task_json(t, view.positions[t.id]) | {"waiting_for": view.waiting_for.get(t.id)} for t in view.queued],
        "groups": view.groups,
    }
    if view.capacity.holds:
        out["holds"] = msgspec.to_builtins(view.capacity.holds)
    if listed.finished is not None:
        out["finished"] = [task_json(t, None) for t in listed.finished]
    return out


_PRIVATE_FIELDS = frozenset(("id", "name", "state", "env", "pid_start", "stop", "kill_at", "token", "ended_at", "leftovers",
                             "limit", "first_command"))


def task_json(task: Task, position: int | None) -> dict[str, Any]:
    """The public task object of DESIGN section 5."""
    import msgspec

    out = msgspec.to_builtins(task)
    out = {k: out[k] for k in ("id", "name", "state")} | {"position": position} | {
        k: v for k, v in out.items() if k not in _PRIVATE_FIELDS
    }
    # `pid` is the wrapper's (its process group is the task's); `agent_pid` the agent's own.
    out["agent_pid"] = runner.agent_pid(task.pid, task.pid_start) if task.state is TaskState.RUNNING else None
    return out
