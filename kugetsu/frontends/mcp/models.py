"""The schemas of the MCP tools' structured results: pydantic models of the JSON the CLI
prints with --json (reading.task_json, reading.capacity_json, reading.queue_json), so that clients get
an output schema. Only validation and schema: the content itself is the CLI's dict, as is.

Here, and not on the CLI path, is where pydantic belongs (the MCP SDK is built on it; the
CLI keeps msgspec, which costs a tenth of its import). Task objects allow extra keys, so a
field added to the task JSON reaches MCP clients before this file learns its description.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

State = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired", "lost"]
Level = Literal["urgent", "high", "normal", "low"]
# Nullable values as pydantic writes them, {"anyOf": [{"type": T}, {"type": "null"}]}, never
# {"type": [T, "null"]}: legal JSON Schema, but clients that map tool schemas onto a single
# `type` (Gemini's OpenAPI subset) reject or loosen it, and the official Inspector's --strict
# warns about every one (tests/test_mcp.py runs it).
OptStr = str | None
OptInt = int | None
OptFloat = float | None


class TaskOut(BaseModel):
    """One task, as `kugetsu status TASK --json` prints it."""

    model_config = ConfigDict(extra="allow")

    id: int = Field(description="never reused; refer to the task by id or by name")
    name: str = Field(description="unique among queued and running tasks")
    state: State = Field(description="queued and running are live; the others are final")
    position: OptInt = Field(
        description="while queued: 1-based place in the order tasks will really start (1 starts next); else null")
    priority: Level
    source: str = Field(description="who delegated it")
    agent: OptStr = Field(description="the agent preset, or null for an explicit command")
    group: OptStr = Field(description="the pool (config `groups`) it runs in, if any")
    command: list[str] = Field(description="the argv it runs (no shell)")
    cwd: str
    created_at: str = Field(description="RFC 3339, UTC")
    started_at: OptStr
    finished_at: OptStr
    expires_at: OptStr = Field(description="a queued task not started by then expires")
    exit_code: OptInt
    pid: OptInt = Field(description="the task's wrapper (its process group is the task's)")
    log: OptStr = Field(description="the file holding its stdout and stderr (the logs tool reads it)")
    reason: OptStr = Field(description="why it ended, in words (exit code, cancelled, timed out, ...)")
    prompt: OptStr
    slot: OptInt = Field(description="while running: its slot, 1..max_agents")
    timeout: OptFloat = Field(description="run timeout in seconds, null: none")
    repo: OptStr = Field(description="worktree tasks: the repository")
    base: OptStr
    branch: OptStr = Field(description="worktree tasks: the branch its work is on")
    worktree: OptStr
    agent_pid: OptInt = Field(description="while running: the agent's own pid")
    paused_at: OptStr = Field(None, description="while its processes are stopped (pause TASK): since when")
    paused_s: float = Field(0.0, description="seconds this run spent paused (not counted toward its timeout)")
    stashed_at: OptStr = Field(None, description="a queued task set aside (stash): it neither starts nor expires"
                                                 " until unstashed")
    env_names: list[str] = Field([], description="the names of the variables set for its agent (delegate env, the"
                                               " preset's); their values are never shown")
    base_commit: OptStr
    worktree_state: Literal["active", "kept", "removed", "pruned"] | None
    host: OptStr = Field(description="cluster mode: the machine it runs (or ran) on")
    pinned_host: OptStr = Field(description="cluster mode: the machine it must run on")
    after: list[int] = Field(description="ids of the tasks that must succeed before it starts (`delegate --after`)")
    attempt: int = Field(1, description="its run: 1, then 2, ... when a retry or its provider's limit ran it again")
    attempts: list[AttemptOut] = Field([], description="the earlier runs, oldest first, and how each ended")
    retries: int = Field(0, description="failed or lost runs run again (delegate --retries)")
    retry_delay: OptFloat = Field(None, description="seconds between a failed run and its retry")
    retry_of: OptInt = Field(None, description="the finished task this one runs again (`kugetsu retry`)")
    not_before: OptStr = Field(None, description="it starts no earlier: a retry's delay, or the time asked"
                               " (delegate at/delay)")
    session: OptStr = Field(None, description="the agent's session id, read from its output (it resumes it)")
    depth: int = Field(0, description="tasks above it: 0 when delegated from outside any task, 1 when a task's agent"
                       " delegated it, ...")
    nesting: int = Field(0, description="levels of tasks its agent may still delegate beneath it (its preset's"
                         " `nesting`, within its delegator's); 0: its agent may not delegate")
    usage: UsageOut | None = Field(None, description="tokens (and cost) of all its runs, as its agent reported them")
    run_usage: UsageOut | None = Field(None, description="while running: what this run used so far, where its agent"
                                       " reports it mid-run")
    route: list[str] = Field([], description="the presets it may run on, in order (failover); empty: `agent` only")
    fallback_from: OptStr = Field(None, description="the preset it would have run on: it runs on a fallback instead")
    fallback_fresh: bool = Field(False, description="a run interrupted with a session may start afresh elsewhere")
    budget_usd: OptFloat = Field(None, description="its budget in US dollars: a run past it is stopped")
    max_tokens: OptInt = Field(None, description="its budget in tokens (in + out): a run past it is stopped")
    memory: OptInt = Field(None, description="bytes it declared it may use (delegate memory); over it, it is stopped")
    max_procs: OptInt = Field(None, description="its processes at most; over it, it is stopped")
    slots: int = Field(1, description="slots of max_agents (and of its group) it takes")
    peak_memory: OptInt = Field(None, description="bytes: the largest total RSS of its processes measured")
    cpu_seconds: OptFloat = Field(None, description="CPU seconds its processes used, as measured")
    rss: OptInt = Field(None, description="while running: bytes, the total RSS of its processes now")
    procs: OptInt = Field(None, description="while running: its processes now")


class UsageOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: OptFloat = Field(None, description="in US dollars, where the agent reports it")


class AttemptOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    ended_at: str
    started_at: OptStr = None
    exit_code: OptInt = None
    reason: OptStr = None
    limit: bool = Field(False, description="it hit its provider's limit (back in the queue, no retry used up)")
    usage: UsageOut | None = Field(None, description="tokens (and cost) of this run, as its agent reported them")


class QueuedTaskOut(TaskOut):
    waiting_for: OptStr = Field(
        description="why it waits when it is not simply behind others (starts at 02:00, a source or group limit, a"
                    " rate limit, ...)")


class CapacityOut(BaseModel):
    """`kugetsu capacity --json`."""

    max_agents: int = Field(description="slots: running agents at once")
    active: int = Field(description="running now")
    queued: int = Field(description="waiting for a slot")
    free: int = Field(description="slots free now (0 while kugetsu is paused): a task delegated now starts at once"
                            " if free > 0")
    max_queue: int = Field(description="queued tasks at most; beyond it delegate is rejected (back off)")
    max_memory: OptInt = Field(None, description="once a task declares memory: the bytes this machine's running"
                               " tasks may declare in all; a task starts only when its memory fits")
    memory_used: OptInt = Field(None, description="bytes the running tasks declared")
    holds: dict[str, HoldOut] | None = Field(
        None, description="agent presets held now (their provider's usage limit, or by hand): their tasks wait")
    budgets: list[BudgetOut] | None = Field(
        None, description="the daily budgets (config budgets) and today's spending: one over starts nothing more today")


class BudgetOut(BaseModel):
    """One daily budget (a source's or a preset's) and what was spent of it today."""

    kind: Literal["source", "agent"] = Field(description="whose budget: a source's (who delegates) or a preset's")
    name: str = Field(description="the source or preset")
    over: bool = Field(description="true: nothing more of this source or preset starts until resets_at")
    resets_at: str = Field(description="local midnight, RFC 3339")
    usd: OptFloat = Field(description="the day's budget in US dollars, if any")
    spent_usd: OptFloat = Field(description="spent today, as the agents reported their cost")
    tokens: OptInt = Field(description="the day's budget in tokens (in + out), if any")
    spent_tokens: int = Field(description="tokens in and out today")


class HoldOut(BaseModel):
    until: OptStr = Field(description="when the hold ends and its tasks start again (null: until released)")
    reason: str
    since: str
    queued: int = Field(description="its tasks waiting for the hold to end")


class GroupUsage(BaseModel):
    max_agents: int
    active: int
    queued: int


class QueueOut(BaseModel):
    """`kugetsu queue --json` (`finished` only when asked for)."""

    max_agents: int
    active: list[TaskOut] = Field(description="running tasks")
    queued: list[QueuedTaskOut] = Field(description="queued tasks, in the order they will start")
    groups: dict[str, GroupUsage] = Field(description="per pool: slots, running, queued")
    more_queued: int = Field(0, description="queued tasks (that match) after the last one listed, left out by"
                             " `limit`")
    finished: list[TaskOut] | None = Field(None, description="the 20 latest finished tasks, latest first")


class AdmittedOut(BaseModel):
    """One task of a delegate call with `tasks`."""

    task: TaskOut
    message: str = Field(description="started NAME (#ID), slot N/M; or queued NAME (#ID), position N of M")
    warning: OptStr = Field(description="what the CLI would warn (a prompt its command does not use)")


class DelegateOut(BaseModel):
    """Admitted (started or queued) or rejected by admission (back-pressure, not an error)."""

    admitted: bool = Field(description="true: the task exists, started or queued; false: nothing was queued")
    task: TaskOut | None = Field(description="the task object (`kugetsu delegate --json`) when admitted")
    rejected: OptStr = Field(
        description="when not admitted: why (queue full, a per-source limit). Back off, then try again")
    retry_after: OptInt = Field(description="when rejected: seconds to wait before trying again")
    # Claude Code shows the model this structured result, not the text: what to do is here too.
    message: str = Field(description="the result in one line: started NAME (#ID), slot N/M; queued ..., position N"
                         " of M; or rejected: why")
    advice: str = Field(description="what to do now (when rejected: back off, do not retry at once)")
    tasks: list[AdmittedOut] | None = Field(None, description="with `tasks`: each one's admission, in the order"
                                            " given (task is null then)")


class CancelOut(BaseModel):
    tasks: list[TaskOut] = Field(description="the cancelled tasks, in their final state (running ones once stopped)")


class WaitOut(BaseModel):
    done: bool = Field(description="every task is final; false: the timeout came first and they go on")
    all_succeeded: bool = Field(description="every task succeeded (what `kugetsu wait` exits 0 for)")
    advice: OptStr = Field(description="what to do now: call wait again (timed out), or read the logs of the tasks"
                           " that did not succeed; null when all succeeded")
    tasks: list[TaskOut]


class LogsOut(BaseModel):
    id: int
    name: str
    state: State
    text: str = Field(description="the end of the task's output (stdout and stderr), as UTF-8 text")
    size: int = Field(description="the whole log's size in bytes")
    truncated: bool = Field(description="true when text is only the end of the log")


class ScheduleOut(BaseModel):
    """One recurring schedule, as `kugetsu schedule list --json` prints it."""

    model_config = ConfigDict(extra="allow")

    name: str
    cron: OptStr = Field(description="a crontab line (5 fields, or 6 with seconds first); null: every (seconds)")
    next_fire: OptStr = Field(description="when it fires next (null while paused)")
    last_outcome: OptStr = Field(description="its last task's state now, and why it ended if it did not succeed")
    last_note: OptStr = Field(description="what its last firing did: delegated, skipped (its task still runs),"
                              " not delegated (queue full, ...)")


class SchedulesOut(BaseModel):
    schedules: list[ScheduleOut]


class StatsOut(BaseModel):
    """`kugetsu stats --json`: the window's outcomes, times, use and spending; each of `total`
    and `rows` has counts, `wait_seconds` and `run_seconds` (percentiles), `usage` (tokens in,
    out, cached, cost_usd), `fallbacks`, `peak_memory`, `cpu_seconds`."""

    model_config = ConfigDict(extra="allow")
    since: str = Field(description="the window's start")
    until: str = Field(description="the window's end: now")
    window_seconds: float
    by: Literal["source", "agent", "group", "host", "day"] | None = Field(description="what each row is")
    total: dict = Field(description="the whole window")
    rows: dict[str, dict] | None = Field(None, description="one per source, agent, group, host or local day (with by)")
