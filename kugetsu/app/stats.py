"""How kugetsu has been doing over a time window (`kugetsu stats`, the dashboard's Stats screen).

Two halves:
- `load` reads what the window needs and no more: events.jsonl (then events.jsonl.1) and
  history.jsonl from their ends backwards, stopping at the window's start, so `--since 1h`
  reads the last hour whatever the size of a year of history; plus the index.
- `summarise` and `timeline` are pure functions of those events and tasks, a config and a
  clock: every figure can be computed by hand in a test.

What is counted (the README says the same):
- events say what happened in the window (they outlive `kugetsu clean`); the task records
  of the index and history.jsonl are the truth for times (`started_at` is when the agent
  was really let go) and give agent and group, which events do not carry;
- wait time: created -> started, for tasks started in the window; run time: started ->
  finished, for tasks that ran and finished in the window; percentiles by nearest rank;
- success rate: succeeded / (succeeded + failed + lost), the runs that ended by themselves;
- throughput: tasks that ran and finished in the window, per hour of the window;
- utilisation: busy slot-seconds (each running task's time inside the window) over
  available slot-seconds (max_agents through the window, as `config` events of max_agents
  changed it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from kugetsu.agents.report import Usage
from kugetsu.config.model import Config
from kugetsu.config.load import host_name as config_host
from kugetsu.app.reading import measured
from kugetsu.core.models import Event, Index, Task, TaskState
from kugetsu.core.step import Measured, use_so_far
from kugetsu.paths import Home
from kugetsu.store.files import store_of
from kugetsu.store.history import max_agents_change, max_agents_value

FINAL = ("succeeded", "failed", "cancelled", "expired", "lost")
RAN = ("succeeded", "failed", "lost")  # final states only a task that ran can reach
BY = ("source", "agent", "group", "host", "day")
DEFAULT_WINDOW = 24 * 3600.0
LONGEST_SHOWN = 5


def host_name() -> str:
    """This machine, for `--by host`: where the tasks that carry no host ran (one machine)."""
    return os.uname().nodename


# ---- reading, bounded by the window ---------------------------------------------------


@dataclass
class Window:
    """What `load` read: enough to summarise the window [start, now]."""

    start: datetime
    now: datetime
    cfg: Config
    index: Index
    events: list[Event]
    archived: list[Task]
    max_agents_at_start: int | None = None
    measured: dict[int, Measured] = field(default_factory=dict)  # the running tasks' use (usage.json)

    @property
    def tasks(self) -> list[Task]:
        return self.archived + self.index.all_tasks()


def load(home: Home, cfg: Config, index: Index, seconds: float, now: datetime) -> Window:
    start = now - timedelta(seconds=seconds)
    read = store_of(cfg, home).since(start)  # the files read backwards, or a cluster's rows
    return Window(start, now, cfg, index, read.events, read.archived, read.max_agents_at_start,
                  measured(home, cfg, index))


# ---- the pure part ---------------------------------------------------------------------


@dataclass
class Record:
    """One task as far as the window knows it."""

    id: int
    name: str | None = None
    source: str | None = None
    agent: str | None = None
    group: str | None = None
    created: datetime | None = None
    started: datetime | None = None
    finished: datetime | None = None
    state: str | None = None  # the final state, once final
    ran: bool = False  # it held a slot (known even when its start is not)
    host: str | None = None  # the machine it ran on last (cluster mode)
    usage: Usage | None = None  # what its runs that ended in the window used, as their agents reported
    fallback: bool = False  # it ran on a fallback preset (failover)
    peak_memory: int | None = None  # measured (README, "Resources"): its largest total RSS
    cpu_seconds: float | None = None
    # Its runs (start, end; None: running now), from its task record: a task sent back to
    # the queue (a provider's limit, a retry) is in no slot between two runs, so its time
    # there is no run time. None when only events know it (then started -> finished).
    runs: list[tuple[datetime, datetime | None]] | None = None

    def key(self, by: str, host: str) -> str:
        if by == "host":  # one machine: every task ran here; a cluster: where it ran
            return self.host or host
        if by == "day":  # the local day it ended, else started, else was queued
            at = self.finished or self.started or self.created
            return at.astimezone().date().isoformat() if at else "-"
        value = getattr(self, by)
        return value if value else "-"

    def spans(self, start: datetime) -> list[tuple[datetime, datetime | None]]:
        """Its time in a slot: each run, or started -> finished when the runs are not known
        (a start the window does not know counts from the window's start)."""
        if self.runs is not None:
            return self.runs
        return [(self.started or start, self.finished)] if self.ran else []


def records(events: Iterable[Event], tasks: Iterable[Task], start: datetime,
            measured: Mapping[int, Measured] | None = None) -> dict[int, Record]:
    """What is known of each task that did something in the window (or runs across it);
    `measured`: the running tasks' use now (their records get it when their run ends)."""
    out: dict[int, Record] = {}
    for e in events:
        if e.task is None or e.at < start:
            continue
        r = out.setdefault(e.task, Record(e.task))
        r.name, r.source = e.name or r.name, e.source or r.source
        if e.type == "queued":
            r.created = e.at
        elif e.type == "started":
            r.started, r.ran = e.at, True
        elif e.type in FINAL:
            r.finished, r.state = e.at, e.type
            r.ran = r.ran or e.type in RAN or e.exit_code is not None
    for t in tasks:
        r = out.get(t.id)
        if r is None and not _touches(t, start):
            continue
        if r is None:
            r = out[t.id] = Record(t.id)
        r.name, r.source, r.agent, r.group = t.name, t.source, t.agent, t.group
        r.usage, r.fallback = usage_in(t, start), t.fallback_from is not None
        m = measured.get(t.id) if measured and t.state is TaskState.RUNNING else None
        r.peak_memory, r.cpu_seconds = use_so_far(t, m)
        r.created, r.host = t.created_at, t.host or r.host
        runs = [(a.started_at, a.ended_at) for a in t.attempts if a.started_at is not None]
        if t.started_at is not None:
            r.started, r.ran = t.started_at, True
            runs.append((t.started_at, t.finished_at))
        elif runs:
            r.started, r.ran = r.started or runs[0][0], True
        r.runs = runs or None  # none recorded (a record of an older kugetsu): from its events
        if t.state.final:
            r.finished, r.state = t.finished_at, t.state.value
    return out


def usage_in(t: Task, start: datetime) -> Usage | None:
    """What the task's runs that ended at or after `start` used: each requeued run's own
    (its Attempt), and the last run's (the task's total less its attempts') once it is final."""
    from kugetsu.agents.report import total

    runs = [a.usage for a in t.attempts if a.ended_at >= start]
    if t.usage is not None and t.state.final and t.finished_at is not None and t.finished_at >= start:
        before = total([a.usage for a in t.attempts])
        runs.append(t.usage - before if before is not None else t.usage)
    return total(runs)


def _touches(t: Task, start: datetime) -> bool:
    """Did the task do anything at or after `start` (or is it still queued or running)?"""
    if not t.state.final:
        return True
    return any(x is not None and x >= start for x in (t.created_at, t.started_at, t.finished_at))


def percentiles(values: list[float]) -> dict[str, Any]:
    """count, p50, p95, max; by nearest rank (the smallest value with at least p% of the
    values at or below it), so a test can compute them by hand. None when there are none."""
    v = sorted(values)

    def rank(p: float) -> float | None:
        return v[max(0, math.ceil(p / 100 * len(v)) - 1)] if v else None

    return {"count": len(v), "p50": rank(50), "p95": rank(95), "max": v[-1] if v else None}


@dataclass
class _Row:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("admitted", "started", *FINAL), 0))
    waits: list[float] = field(default_factory=list)
    runs: list[float] = field(default_factory=list)
    busy: float = 0.0
    done: int = 0  # ran and finished in the window
    usage: Usage = field(default_factory=Usage)
    fallbacks: int = 0  # tasks that ran on a fallback preset
    peak_memory: int | None = None  # the largest any of its tasks that ran in the window reached
    cpu: float = 0.0  # CPU seconds of its tasks that ran in the window (their whole runs)

    def add(self, r: Record, start: datetime, now: datetime) -> None:
        c = self.counts
        if r.usage is not None:
            self.usage = self.usage + r.usage
        self.fallbacks += r.fallback
        if r.created is not None and r.created >= start:
            c["admitted"] += 1
        if r.started is not None and r.started >= start:
            c["started"] += 1
            if r.created is not None:
                self.waits.append(max(0.0, (r.started - r.created).total_seconds()))
        in_window = r.finished is not None and r.finished >= start
        if in_window and r.state in c:
            c[r.state] += 1  # type: ignore[index]
            if r.ran:
                self.done += 1
                if r.started is not None:  # the sum of its runs, not the span from first start to end
                    self.runs.append(sum(max(0.0, ((end or r.finished) - began).total_seconds())  # type: ignore[operator]
                                         for began, end in r.spans(start)))
        if r.ran and (r.finished is None or in_window):
            # Its time in a slot inside the window.
            self.busy += sum(max(0.0, ((end or now) - max(began, start)).total_seconds())
                             for began, end in r.spans(start) if end is None or end >= start)
            if r.peak_memory is not None:
                self.peak_memory = max(self.peak_memory or 0, r.peak_memory)
            self.cpu += r.cpu_seconds or 0.0

    def report(self, seconds: float, available: float) -> dict[str, Any]:
        c = self.counts
        ended = c["succeeded"] + c["failed"] + c["lost"]
        return {
            **c,
            "success_rate": c["succeeded"] / ended if ended else None,
            "wait_seconds": percentiles(self.waits),
            "run_seconds": percentiles(self.runs),
            "throughput_per_hour": self.done / (seconds / 3600) if seconds else None,
            "busy_slot_seconds": self.busy,
            "utilisation": self.busy / available if available else None,
            # tokens and cost of the runs that ended in the window, as the agents reported
            "usage": {"input_tokens": self.usage.input_tokens, "output_tokens": self.usage.output_tokens,
                      "cache_read_tokens": self.usage.cache_read_tokens,
                      "cache_write_tokens": self.usage.cache_write_tokens, "cost_usd": self.usage.cost_usd},
            "fallbacks": self.fallbacks,
            "peak_memory": self.peak_memory,
            "cpu_seconds": round(self.cpu, 2),
        }


def available_slot_seconds(events: list[Event], start: datetime, now: datetime, cfg: Config,
                           at_start: int | None = None) -> float:
    """max_agents integrated over [start, now]: the value of each `config` change of
    max_agents from its moment on. Before the window's first change, the value it replaced
    (`at_start`, when the reader found it); unknown, the value that change set."""
    changes = [(e.at, max_agents_value(e)) for e in events if max_agents_change(e) and start <= e.at <= now]
    if not changes:
        return cfg.max_agents * (now - start).total_seconds()
    total, t, level = 0.0, start, at_start if at_start is not None else changes[0][1]
    for at, value in changes:
        total += level * (at - t).total_seconds()
        t, level = at, value
    return total + level * (now - t).total_seconds()




def summarise(window: Window, by: str | None = None, host: str | None = None) -> dict[str, Any]:
    """The report of `kugetsu stats --json`."""
    start, now, cfg = window.start, window.now, window.cfg
    host = host or (config_host(cfg) if cfg.clustered else host_name())
    # Where a task that carries no host ran: here on one machine; in a cluster it never started.
    nowhere = "-" if cfg.clustered else host
    seconds = (now - start).total_seconds()
    available = available_slot_seconds(window.events, start, now, cfg, window.max_agents_at_start)
    recs = records(window.events, window.tasks, start, window.measured)
    total, rows = _Row(), {}
    for r in sorted(recs.values(), key=lambda r: r.id):
        total.add(r, start, now)
        if by is not None:
            rows.setdefault(r.key(by, nowhere), _Row()).add(r, start, now)
    out: dict[str, Any] = {
        "since": start, "until": now, "window_seconds": seconds, "by": by, "host": host,
        "max_agents": cfg.max_agents, "running_now": len(window.index.active), "queued_now": len(window.index.queued),
        "available_slot_seconds": available,
        "total": total.report(seconds, available),
    }
    if by is not None:
        out["rows"] = {}
        for key in sorted(rows):
            row = out["rows"][key] = rows[key].report(seconds, available)
            group = cfg.groups.get(key) if by == "group" else None
            if group is not None:  # a pool's own slots, as configured now
                row["group_utilisation"] = row["busy_slot_seconds"] / (group.max_agents * seconds) if seconds else None
    out["longest_waiting"] = longest_waiting(window.index, cfg, now)
    return out


def longest_waiting(index: Index, cfg: Config, now: datetime, count: int = LONGEST_SHOWN) -> list[dict[str, Any]]:
    """The queued tasks that have waited longest, with their position in the start order."""
    from kugetsu.core import selection

    positions = selection.positions(index, cfg, now) if index.queued else {}
    oldest = sorted(index.queued, key=lambda t: (t.created_at, t.id))[:count]
    return [{"id": t.id, "name": t.name, "source": t.source, "position": positions.get(t.id),
             "waiting_seconds": max(0.0, (now - t.created_at).total_seconds())} for t in oldest]


def timeline(window: Window, buckets: int = 60) -> dict[str, list[float]]:
    """Queue depth (the most waiting at once) and starts in each of `buckets` equal slices of
    the window, oldest first: the dashboard's sparklines. From the same records as the
    report (so its starts add up to the report's), the depth counted back from the queue as
    it is now."""
    start, now = window.start, window.now
    span = (now - start).total_seconds() / buckets
    moves: list[tuple[datetime, int]] = []  # (when, change of the queue's depth)
    starts = [0.0] * buckets
    for r in records(window.events, window.tasks, start).values():
        if r.started is not None and r.started >= start:
            starts[_bucket(r.started, start, span, buckets)] += 1
        if r.started is not None and r.started == r.created:
            continue  # started at its admission: it never waited
        if r.created is not None and r.created >= start:
            moves.append((r.created, 1))
        if r.started is not None and r.started >= start:
            moves.append((r.started, -1))
        elif r.finished is not None and r.finished >= start and not r.ran:
            moves.append((r.finished, -1))  # it left the queue without starting (expired, cancelled)
    # Arrivals before departures at the same instant: the peak shows (order within one
    # instant is not recorded in the task records).
    moves.sort(key=lambda m: (m[0], -m[1]))
    depth = len(window.index.queued) - sum(d for _, d in moves)
    deepest = [0.0] * buckets
    b = 0
    deepest[0] = max(0, depth)
    for at, d in moves:
        nb = _bucket(at, start, span, buckets)
        for i in range(b + 1, nb + 1):  # slices with no move hold the depth they started with
            deepest[i] = max(0, depth)
        b = nb
        depth += d
        deepest[b] = max(deepest[b], depth)
    for i in range(b + 1, buckets):
        deepest[i] = max(0, depth)
    return {"queue_depth": deepest, "starts": starts}


def _bucket(at: datetime, start: datetime, span: float, buckets: int) -> int:
    return min(buckets - 1, max(0, int((at - start).total_seconds() // span))) if span > 0 else buckets - 1


# ---- text ------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    """`kugetsu stats` for a person: outcomes, then times, then who waits longest."""
    from kugetsu.frontends.render import table

    d = seconds
    start, end = report["since"], report["until"]
    rows = [("all", report["total"])] + list(report.get("rows", {}).items())
    by = (report["by"] or "").upper()
    counts = ["admitted", "started", *FINAL]
    outcomes = table(
        [by, *(c.upper() for c in counts), "SUCCESS", "PER HOUR", "UTIL"],
        [[k, *(str(r[c]) for c in counts), percent(r["success_rate"]),
          "-" if r["throughput_per_hour"] is None else f"{r['throughput_per_hour']:.1f}",
          percent(r["utilisation"])
          + (f" ({percent(r['group_utilisation'])} of its slots)" if "group_utilisation" in r else "")]
         for k, r in rows],
        right=set(range(1, len(counts) + 3)),
    )
    times = table(
        [by, "WAIT P50", "P95", "MAX", "STARTS", "RUN P50", "P95", "MAX", "RUNS"],
        [[k, *(d(r["wait_seconds"][p]) for p in ("p50", "p95", "max")), str(r["wait_seconds"]["count"]),
          *(d(r["run_seconds"][p]) for p in ("p50", "p95", "max")), str(r["run_seconds"]["count"])]
         for k, r in rows],
        right=set(range(1, 9)),
    )
    lines = [f"last {d(report['window_seconds'])}: {start:%Y-%m-%d %H:%M:%S} to {end:%Y-%m-%d %H:%M:%S} UTC,"
             f" max_agents {report['max_agents']}", "", outcomes, "", times, ""]
    if any(r["usage"]["input_tokens"] or r["usage"]["output_tokens"] or r["usage"]["cost_usd"] or r["fallbacks"]
           for _, r in rows):
        lines += [table([by, "TOKENS IN", "OUT", "CACHED", "COST", "FALLBACKS"],
                        [[k, f"{u['input_tokens']:,}", f"{u['output_tokens']:,}",
                          f"{u['cache_read_tokens'] + u['cache_write_tokens']:,}",
                          "-" if u["cost_usd"] is None else f"${u['cost_usd']:.2f}", str(r["fallbacks"])]
                         for k, r in rows for u in [r["usage"]]], right=set(range(1, 6))), ""]
    if any(r["peak_memory"] is not None for _, r in rows):  # measured use (README, "Resources")
        from kugetsu.core.policy import short_size

        lines += [table([by, "PEAK MEM", "CPU"], [[k, "-" if r["peak_memory"] is None else short_size(r["peak_memory"]),
                                                  f"{r['cpu_seconds']:.1f}s"] for k, r in rows], right={1, 2}), ""]
    waiting = report["longest_waiting"]
    if waiting:
        lines.append("longest waiting now:")
        lines.append(table(["POS", "ID", "NAME", "SOURCE", "WAITING"],
                           [[str(w["position"] or "-"), str(w["id"]), w["name"], w["source"], d(w["waiting_seconds"])]
                            for w in waiting], right={0, 1}))
    else:
        lines.append("nothing waiting now")
    return "\n".join(lines)


def percent(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 100:.1f}%" if value < 0.1 else f"{value * 100:.0f}%"  # a quiet hour is not 0%


def seconds(value: float | None) -> str:
    """A wait or a run for a person: sub-second ones are the common case on an idle machine."""
    if value is None:
        return "-"
    if value < 10:
        return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"
    from kugetsu.config.units import format_duration

    return format_duration(value)
