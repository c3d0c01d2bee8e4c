"""Budgets (README, "Provider limits"): what a task, a source or a preset may spend. Pure, like pm.

A task's own budget (`delegate --budget-usd`, `--max-tokens`) counts all its runs; a source's
and a preset's (`budgets.sources`, `budgets.agents`) count a local day, kept in the index
(`Index.spend`: history trimming must not make a day's spending go down). Tokens are the
tokens in and out (cached input is not counted: Claude Code reads its whole context from the
cache at every turn, which would make a token budget mean nothing). A cost is what the agent
reports; an agent that reports none spends nothing in US dollars.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from kugetsu.agents.report import Usage
from kugetsu.config.model import Budget, Config
from kugetsu.core.models import DaySpend, Index, QuotaWindow, Task
from kugetsu.core.times import clock


def day_of(now: datetime) -> str:
    """The local day `now` falls on (budgets reset at local midnight)."""
    return now.astimezone().date().isoformat()


def midnight_after(now: datetime) -> datetime:
    """The next local midnight: when a daily budget starts over."""
    local = now.astimezone()
    return (local + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)


def counted_tokens(usage: Usage) -> int:
    return usage.input_tokens + usage.output_tokens


def today(index: Index, now: datetime) -> DaySpend | None:
    """What was spent today (None: nothing yet)."""
    spend = index.spend
    return spend if spend is not None and spend.day == day_of(now) else None


def book(index: Index, task: Task, delta: Usage, now: datetime) -> None:
    """Add what a run used (a part of it, as its agent reports it) to today's spending of its
    source and its preset."""
    day = day_of(now)
    if index.spend is None or index.spend.day != day:
        index.spend = DaySpend(day=day)
    for ledger, key in ((index.spend.sources, task.source), (index.spend.agents, task.agent)):
        if key is not None:
            ledger[key] = ledger[key] + delta if key in ledger else delta
    window = index.windows.get(task.agent) if task.agent is not None else None
    if window is not None:  # a window that has turned since starts over at the next start
        window.tokens += counted_tokens(delta)
        if window.probe == task.id:
            window.probe = None  # its provider answered the probe


def daily_over(what: str, budget: Budget | None, used: Usage | None, now: datetime) -> str | None:
    """`budget pm 20.00/20.00 USD, resets 00:00` when `used` has reached the budget, else None."""
    if budget is None or used is None:
        return None
    if budget.usd is not None and used.cost_usd is not None and used.cost_usd >= budget.usd:
        figure = f"{used.cost_usd:.2f}/{budget.usd:.2f} USD"
    elif budget.tokens is not None and counted_tokens(used) >= budget.tokens:
        figure = f"{counted_tokens(used):,}/{budget.tokens:,} tokens"
    else:
        return None
    # The coming midnight (local): always the next day's 00:00, which needs no date to be read right.
    return f"budget {what} {figure}, resets 00:00"


def task_used(task: Task) -> Usage | None:
    """All a task's runs have used, the running one's so far included."""
    run = task.run.usage if task.run is not None else None
    if run is None:
        return task.usage
    return run if task.usage is None else task.usage + run


def task_over(task: Task) -> str | None:
    """`budget 2.00 USD exceeded: 2.13 USD` once a task has used more than its budget, else None."""
    if task.budget_usd is None and task.max_tokens is None:
        return None
    used = task_used(task)
    if used is None:
        return None
    if task.budget_usd is not None and used.cost_usd is not None and used.cost_usd > task.budget_usd:
        return f"budget {task.budget_usd:.2f} USD exceeded: {used.cost_usd:.2f} USD"
    if task.max_tokens is not None and counted_tokens(used) > task.max_tokens:
        return f"budget {task.max_tokens:,} tokens exceeded: {counted_tokens(used):,} tokens"
    return None


# ---- window quotas (a preset's `limit.window`) -------------------------------------------


def window_end(cfg: Config, agent: str, window: QuotaWindow) -> datetime | None:
    """When the preset's window that began at window.since turns (None: no window quota)."""
    preset = cfg.agents.get(agent)
    seconds = preset.limit.window_s if preset is not None else None
    return window.since + timedelta(seconds=seconds) if seconds is not None else None


def window_used_up(cfg: Config, agent: str, window: QuotaWindow) -> str | None:
    """`12/12 starts` or `1,000,000/1,000,000 tokens` when the window's quota is used up."""
    limit = cfg.agents[agent].limit
    if limit.window_starts is not None and window.starts >= limit.window_starts:
        return f"{window.starts}/{limit.window_starts} starts"
    if limit.window_tokens is not None and window.tokens >= limit.window_tokens:
        return f"{window.tokens:,}/{limit.window_tokens:,} tokens"
    return None


def window_why(cfg: Config, agent: str, window: QuotaWindow | None, now: datetime,
               running: frozenset[int] | set[int] = frozenset()) -> str | None:
    """Why the preset's window quota lets none of its tasks start now, or None: its window is
    used up (until it turns), or the task probing a new window is still waiting for its
    provider's first answer (`running`: the ids of running tasks)."""
    if window is None:
        return None
    end = window_end(cfg, agent, window)
    if end is None or end <= now:
        return None  # no quota, or the window has turned: the next start opens a new one
    if window.probe is not None and window.probe in running:
        return f"{agent} window quota: task #{window.probe} probes the new window first"
    used = window_used_up(cfg, agent, window)
    if used is None:
        return None
    return f"{agent} window quota {used}, resets {clock(end, now)}"


def window_start(cfg: Config, windows: dict[str, QuotaWindow], agent: str | None, task_id: int, now: datetime) -> None:
    """A task of `agent` starts now: it counts in the preset's window, which it opens when
    none is open (the first after one used up is the probe)."""
    if agent is None:
        return
    preset = cfg.agents.get(agent)
    if preset is None or preset.limit.window is None:
        windows.pop(agent, None)  # a quota removed from the config
        return
    window = windows.get(agent)
    end = window_end(cfg, agent, window) if window is not None else None
    if window is None or end is None or end <= now:
        used_up = window is not None and window_used_up(cfg, agent, window) is not None
        window = windows[agent] = QuotaWindow(since=now, probe=task_id if used_up else None)
    window.starts += 1


def window_ended(windows: dict[str, QuotaWindow], agent: str | None, task_id: int) -> None:
    """A run has ended: a probe is over, whatever its end (a refusal holds the preset)."""
    window = windows.get(agent) if agent is not None else None
    if window is not None and window.probe == task_id:
        window.probe = None
