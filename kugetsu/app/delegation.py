"""delegate: a request checked against this machine (agents' PATH, the executable, the
worktree), admitted in one transaction, the service woken; several at once (delegate_many).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import datetime, timedelta

import msgspec

from kugetsu.app.control import wake
from kugetsu.app.reading import hosts_up
from kugetsu.app.transaction import _locked, config_in, measure, now, settle
from kugetsu.config.model import Config
from kugetsu.core import admission, placement, policy, selection
from kugetsu.core.look import Chain
from kugetsu.core.models import Task, TaskState
from kugetsu.errors import KugetsuError, UsageError
from kugetsu.paths import Home
from kugetsu.service import runner
from kugetsu.store import tracking
from kugetsu.store.files import open_store
from kugetsu.store.protocol import StoreProtocol, Txn


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


class Caller(msgspec.Struct, frozen=True):
    """Where a request is admitted, when not in the process that made it (the service admitting
    a CLI's request handed to it, frontends/cli/thin.py): that process's environment (the task it
    runs in, the PATH an error names), the service's own transaction, and its own wake-up."""

    environ: Mapping[str, str]
    locked: Callable[[], AbstractContextManager[tuple[Txn, Config]]]
    woken: Callable[[], object]
    # The token the requesting process chose for its one task: should the service end before it
    # answers, that process finds out by it whether the task was admitted (`admitted`).
    token: str | None = None
    looks: Chain | None = None  # the service's Looks of the queue it keeps (delegate_many's `looks`)


def delegate(home: Home, cfg: Config, req: admission.Request, caller: Caller | None = None) -> Admission:
    out = delegate_many(home, cfg, [req], caller=caller)[0]
    if isinstance(out, KugetsuError):
        raise out
    return out


class _NoneAdmitted(Exception):
    """Aborts a transaction in which every request was refused: a failed command writes nothing."""


class BatchRefused(KugetsuError):
    """delegate_all: the request at `item` was refused (`error`, whose exit code it keeps), so
    none was admitted."""

    def __init__(self, item: int, error: KugetsuError):
        super().__init__(f"tasks[{item}]: {error}", error.code)
        self.item, self.error = item, error


def delegate_all(home: Home, cfg: Config, reqs: list[admission.Request],
                 store: StoreProtocol | None = None, looks: Chain | None = None) -> list[Admission]:
    """Admit every request in one transaction, or none: the first one refused (bad input,
    the queue full before the last) raises BatchRefused naming it, and nothing is written.
    What a caller handing out a list (a PM agent's issues) can act on without sorting out
    which went in."""
    return delegate_many(home, cfg, reqs, atomic=True, store=store, looks=looks)  # type: ignore[return-value]


def new_looks() -> Chain:
    """The Looks of a long-lived writer's queue (the MCP server's, kept with its store), for
    `delegate_many`: each admission then asks the queue only what changed since the last."""
    return Chain(tracking.Assignments(), verify=tracking.VERIFY)


def delegate_many(home: Home, cfg: Config, reqs: list[admission.Request], atomic: bool = False,
                  store: StoreProtocol | None = None, caller: Caller | None = None,
                  looks: Chain | None = None) -> list[Admission | KugetsuError]:
    """Admit requests in one transaction (one read, one fsync'd write), each as `delegate`
    would one after the other, in order: the same checks, slots, positions and events. A
    request that is refused (bad input, queue full: KugetsuError) gets its error and the
    others go on (atomic: BatchRefused, and none goes in); any other failure (disk full)
    fails them all, writing nothing. A long-lived front end (the MCP server) admits
    concurrent calls this way, through a `store` of its own that it keeps warm (the index it
    committed last is not decoded again: transaction._locked), with `looks`, its `new_looks()`."""
    out: list[Admission | KugetsuError | None] = [None] * len(reqs)
    todo = []
    environ = os.environ if caller is None else caller.environ
    runs_on = _agents_path(home, environ)
    for i, req in enumerate(reqs):
        try:
            _check_request(req)
            _check_runnable(cfg, req, runs_on)
            _check_worktree(cfg, req)
        except KugetsuError as err:
            if atomic:
                raise BatchRefused(i, err) from None
            out[i] = err
            continue
        given = caller.token if caller is not None and len(reqs) == 1 else None
        req.token = given or runner.new_token()
        req.parent = req.parent or caller_task(environ)
        todo.append(i)
    if not todo:
        return out  # type: ignore[return-value]
    # A batch's admissions each ask the queue what the one before may have changed (where the
    # next task goes, what expires, who starts): a Chain of Looks carries what an appended task
    # cannot have made false (core/look.py), where a fresh Look an admission asked ~7 passes of
    # the whole queue each (a batch of 100 at 10,000 queued: 7,000,000 tasks looked at).
    if looks is None and caller is not None:
        looks = caller.looks
    chain = looks if looks is not None else new_looks() if len(todo) > 1 else None
    try:
        with (_locked(home, store) if caller is None else caller.locked()) as (txn, cfg):
            settle(txn, cfg, _look(chain, txn))
            admitted: dict[int, Task] = {}
            for i in todo:
                try:
                    admitted[i] = _admit(home, txn, cfg, reqs[i], chain)
                except KugetsuError as err:
                    if atomic:  # out of the transaction: it writes nothing
                        raise BatchRefused(i, err) from None
                    out[i] = err
            # Positions once all are in: a later one of the batch may go ahead of an earlier
            # (priority), and one sort serves them all.
            many = len(admitted) > 1 and any(t.state is TaskState.QUEUED for t in admitted.values())
            positions = selection.positions(txn.index, cfg, txn.now) if many else None
            # Why each waits: past a few, one look at the whole queue costs less than one a
            # task (waiting_for is ~3.5 waiting_for_one's at 10,000 queued).
            waiting = sum(1 for t in admitted.values() if t.state is TaskState.QUEUED)
            whys = selection.waiting_for(txn.index, cfg, txn.now, measure(cfg)) if waiting > _WHYS_PAST else None
            # one for them all: nothing below changes the queue
            look = _look(chain, txn) or policy.Look(txn.index.queued)
            for i, task in admitted.items():
                out[i] = _admission(txn, cfg, task, positions, whys, look)
            if not any(isinstance(a, Admission) for a in out):
                raise _NoneAdmitted
    except _NoneAdmitted:
        return out  # type: ignore[return-value]
    if caller is None:
        wake(home, cfg, txn.index)
    else:
        caller.woken()
    return out  # type: ignore[return-value]


def admitted(home: Home, token: str) -> Admission | None:
    """The task admitted with `token` (Caller.token), as it stands, or None: no such task. Read
    under the index lock and written nowhere: a service that ended while it admitted it has
    left the lock to the kernel, and one still alive has committed by then."""
    store = open_store(home)
    txn = store.begin()
    try:
        task = next((t for t in txn.index.all_tasks() if t.token == token), None)
        return None if task is None else _admission(txn, config_in(home, txn), task, None)
    finally:
        store.abort()


def _admit(home: Home, txn: Txn, cfg: Config, req: admission.Request, chain: Chain | None = None) -> Task:
    """`chain`: the Looks of this transaction's queue, one state after the other (a batch's)."""
    if admission.wants_prompt_file(cfg, req):
        req.prompt_path = str(home.prompt_file(txn.index.next_id))  # the id admit gives it
    task, events = admission.admit(txn.index, cfg, txn.now, req, _look(chain, txn))
    if req.prompt is not None:
        # Kept by the store beside the index, committed with the task (for the file store,
        # the very file a {prompt_file} preset's agent reads).
        txn.prompts[task.id] = req.prompt
    txn.emit(events)
    settle(txn, cfg, _look(chain, txn))
    admission.started_at_once(events, task)  # still in the outbox: written with the commit
    return task


def _look(chain: Chain | None, txn: Txn) -> policy.Look | None:
    """The chain's Look of the transaction's queue as it is now (None without a chain)."""
    return chain.of(txn.index.queued) if chain is not None else None


def admit_in(home: Home, txn: Txn, cfg: Config, req: admission.Request) -> Admission:
    """Admit one checked request inside a transaction the caller holds (a schedule's firing,
    which records itself in the same commit): the task and what its admission came to."""
    return _admission(txn, cfg, _admit(home, txn, cfg, req), None)


_WHYS_PAST = 3  # queued tasks of one transaction past which delegate_many asks waiting_for once


def _admission(txn: Txn, cfg: Config, task: Task, positions: dict[int, int] | None,
               whys: dict[int, str] | None = None, look: policy.Look | None = None) -> Admission:
    """What admitting `task` came to, as the transaction stands: its position (from
    `positions` when given), why it waits (from `whys`, selection.waiting_for's, when given).
    `look`: of the transaction's queue, shared by the admissions of one transaction."""
    look = policy.Look.of(txn.index, look)  # position and why it waits ask the same of the queue
    if positions is None or task.state is not TaskState.QUEUED or task.stashed_at is not None:
        position = selection.position(txn.index, cfg, txn.now, task, look)
    else:
        position = positions.get(task.id)
    if not position:
        why = None
    elif whys is not None:
        why = whys.get(task.id)
    else:
        why = selection.waiting_for_one(txn.index, cfg, txn.now, task, measure(cfg), look)
    if position and task.pinned_host is not None:
        why = placement.placement_note(task, hosts_up(cfg)) or why
    if position == 1 and why is None:
        why = placement.handed_over(cfg, selection.free_slots(txn.index, cfg))
    return Admission(task, position, cfg.max_agents, len(txn.index.queued), why)


def caller_task(environ: Mapping[str, str] = os.environ) -> tuple[int, str] | None:
    """The task the calling process runs in, when an agent of kugetsu's started it (or something the
    agent started): the id and name the runner put in its environment (admission.parent_task checks
    them against the index)."""
    ident, name = environ.get("KUGETSU_TASK_ID", ""), environ.get("KUGETSU_TASK_NAME")
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
    caller_path: str | None = None  # the caller's PATH, where an error says the command is found


def _agents_path(home: Home, environ: Mapping[str, str] = os.environ) -> AgentsPath:
    from kugetsu.app.control import service_pid

    pid = service_pid(home)
    here = environ.get("PATH", os.defpath)
    if pid is None:
        return AgentsPath(environ.get("PATH"), caller_path=here)
    path = runner.environment_variable(pid, "PATH")
    if path is None:  # another user's service (or it just ended): the best guess is ours
        return AgentsPath(environ.get("PATH"), pid, readable=False, caller_path=here)
    return AgentsPath(path, pid, caller_path=here)


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

    here = runner.which(exe, runs_on.caller_path) if os.sep not in exe and "PATH" not in env else None
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


def wants_worktree(cfg: Config, req: admission.Request) -> bool:
    """Whether the task runs in a worktree of its own: --worktree, else the config or its preset."""
    if req.worktree is not None:
        return req.worktree
    preset = cfg.agents.get(req.agent or cfg.default_agent) if req.agent or not req.command else None
    return cfg.worktrees.enabled or bool(preset and preset.worktree)


def _check_worktree(cfg: Config, req: admission.Request) -> None:
    """A worktree task must come from a git repository; record it and the base on the request."""
    if not wants_worktree(cfg, req):
        if req.base is not None:
            raise UsageError("--base needs --worktree (or worktrees.enabled, or a preset with \"worktree\": true)")
        req.repo = None
        return
    from kugetsu.service import worktree

    req.repo, req.base = worktree.admission(req.cwd, req.name, req.base)
