"""Reading the queue: the one listing every front end renders (CLI, MCP, dashboard, bot), with
its placement and resource notes; tasks as public JSON; capacity and status.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from itertools import repeat
from typing import Any

import msgspec

from kugetsu.app.transaction import measure, now
from kugetsu.config.load import cluster_host, load_config
from kugetsu.config.model import Config
from kugetsu.core import selection, step
from kugetsu.core.models import TASK_DEFAULTS, Index, QueueCounts, Task, TaskState
from kugetsu.paths import Home
from kugetsu.service import runner
from kugetsu.store.files import open_store, store_of


# ---- reading -----------------------------------------------------------------------------


def read(home: Home) -> tuple[Config, Index]:
    return load_config(home), open_store(home).read()


def read_head(home: Home) -> tuple[Config, Index, QueueCounts]:
    """`read` without the queued and finished tasks (the index's lists are empty), with the
    queued tasks' counts: what `capacity` needs, cheap at any queue length."""
    index, counts = open_store(home).read_head()
    return load_config(home), index, counts


def capacity_json(cfg: Config, index: Index, counts: QueueCounts | None = None) -> dict[str, Any]:
    """`kugetsu capacity --json`: what a PM agent checks before delegating (`counts`: as
    selection.capacity takes them)."""
    out: dict[str, Any] = msgspec.to_builtins(selection.capacity(index, cfg, now(), counts))  # `holds` always there, {} when none
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
            keep: selection.TaskFilter | None = None, at: datetime | None = None,
            limit: int | None = None) -> Listing:
    """The queue view every front end shows (the CLI's `queue`, MCP, the dashboard), with the
    resource guard's and placement's notes and (with `home`) the running tasks' measured use;
    `keep`: only the tasks it matches, at their true positions, and (when it asks for a final
    state) the latest 20 finished that match. `at`: the time to show it at (the dashboard's
    clock), default now. `limit`: the first that many queued tasks (that match), the rest
    counted (QueueView.more)."""
    t = at or now()
    latest = None
    if finished or (keep is not None and keep.wants_finished):
        done = index.finished if keep is None else [x for x in index.finished if keep.matches(x)]
        latest = list(reversed(done[-20:]))
    here = cluster_host(cfg)
    view = selection.queue_view(index, cfg, t, measure(cfg), first=limit if keep is None else None)
    if cfg.clustered and any(x.pinned_host for x in view.queued):
        view = selection.with_placement(view, hosts_up(cfg))
    if keep is not None:
        view = selection.filter_view(view, keep)
        if limit is not None:
            view = selection.limit_view(view, limit)
    return Listing(view, index, t, latest, here, measured(home, cfg, index))


def measured(home: Home | None, cfg: Config, index: Index) -> dict[int, step.Measured]:
    """The running tasks' use as the service last measured it (usage.json), when it is
    recent: a service that is gone measures nothing."""
    if home is None or not index.active:
        return {}
    return last_measured(home, cfg)


def last_measured(home: Home, cfg: Config) -> dict[int, step.Measured]:
    """measured's look, for a caller that holds no index (a verb that acted on a running task)."""
    from kugetsu.service import usage

    last = usage.read(home)
    if last is None or (now() - last.at).total_seconds() > max(10.0, 5 * cfg.resources.interval_s):
        return {}
    return last.tasks


def hosts_up(cfg: Config) -> set[str]:
    """Cluster mode: the machines whose lease holds now."""
    standing = store_of(cfg).machines(cfg.cluster.lease_s)
    return set() if standing is None else {row.name for row, state in standing[1] if state == "up"}


def queue_json(listed: Listing, home: Home | None = None, known: Mapping[int, str] | None = None) -> dict[str, Any]:
    """`kugetsu queue --json`: msgspec encodes it as it is (its tasks are PublicTask structs,
    the cheap way for a long queue); msgspec.to_builtins makes plain JSON values of it.
    With `home`, each task's stored prompt is in its object (one read for those shown);
    `known`: those prompts as the caller has read them already (the MCP server's look)."""
    view = listed.view
    active = listed.index.active  # in start order, as ever; a filtered view's only
    if len(view.running) != len(active):
        shown_ids = {t.id for t in view.running}
        active = [t for t in active if t.id in shown_ids]
    shown = [*active, *view.queued, *(listed.finished or [])]
    texts = known if known is not None else prompts(home, shown) if home is not None else None
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
    if view.more:
        out["more_queued"] = view.more
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
        run = raw.pop("run", None)
        if run is not None:  # the run's record is shown flat, as the task held it before index version 2
            raw.update(run)
        if prompts is not None and task.id in prompts:
            raw["prompt"] = prompts[task.id]
        # `pid` is the wrapper's (its process group is the task's); `agent_pid` the agent's own,
        # looked up only where it runs.
        if task.state is running and (task.host is None or task.host == here):
            raw["agent_pid"] = runner.agent_pid(task.run.pid, task.run.pid_start)
        if waiting_for is not None:
            raw["waiting_for"] = waiting_for.get(task.id)
        m = measured.get(task.id) if measured and task.state is running else None
        if m is not None:  # its use now (its record gets its peak and CPU time when the run ends)
            raw["rss"], raw["procs"] = m.memory, m.procs
            raw["peak_memory"], raw["cpu_seconds"] = step.use_so_far(task, m)
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
