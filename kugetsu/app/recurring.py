"""Recurring schedules (kugetsu/core/schedules.py, docs/scheduling.md): add, change, fire (a
firing delegates as `delegate` does), list.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from kugetsu.app.control import wake
from kugetsu.app.delegation import admit_in, _agents_path, _check_request, _check_runnable, _check_worktree, Admission
from kugetsu.app.reading import read
from kugetsu.app.transaction import _locked, now, settle
from kugetsu.config.model import Config
from kugetsu.core import admission
from kugetsu.core.models import Event, Index, Schedule, Task
from kugetsu.errors import KugetsuError
from kugetsu.paths import Home
from kugetsu.service import runner


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
                adm = admit_in(home, txn, cfg, req)  # its prompt is kept with this commit (txn.prompts)
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
