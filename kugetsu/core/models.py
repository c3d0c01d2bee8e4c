"""Task, TaskState, Event and Index: what kugetsu keeps in index.json and events.jsonl.

msgspec Structs rather than pydantic models: the CLI decodes and validates the whole index
on every call, and msgspec does that at a fraction of pydantic's import and decode cost
(README, "Design decisions").
"""

from __future__ import annotations

import enum
import re
from datetime import datetime, timezone
from operator import attrgetter
from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec

from kugetsu.agents.report import Usage

# 2: what belongs to one run is in the task's `run` record (version 1 had it in the task
# itself: upgrade() reads it).
INDEX_VERSION = 2

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)

Time = Annotated[datetime, msgspec.Meta(tz=True)]
Priority = Literal["urgent", "high", "normal", "low"]
PRIORITIES: tuple[str, ...] = ("urgent", "high", "normal", "low")


class TaskState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    LOST = "lost"

    @property
    def final(self) -> bool:
        return self not in (TaskState.QUEUED, TaskState.RUNNING)


FINAL_STATES = tuple(state for state in TaskState if state.final)


def valid_host(name: str) -> bool:
    """A machine's name in a cluster (config `host`, `delegate --host`): NAME_PATTERN, digits
    alone allowed (no task id to confuse it with)."""
    return bool(_NAME_RE.match(name))


def valid_name(name: str) -> bool:
    """A task name: NAME_PATTERN, and not digits only (that reads as an id: `cancel 18`)."""
    return bool(_NAME_RE.match(name)) and not name.isdigit()


class Task(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One delegated unit of work: one agent session.

    The first fields are the public task object of docs/architecture.md §5, in its order.
    Encoded without the fields at their defaults (index.json, history.jsonl): a queued task is
    a third of the bytes, which every CLI call reads and decodes and every change rewrites.
    The public object (reading.public_tasks) still has every field.

    gc=False: the cyclic collector does not track tasks (16 bytes less each, and a full
    collection walks 50,000 fewer objects at 50,000 queued). A task is never part of a
    reference cycle: its fields hold strings, numbers, lists and dicts of them and its own
    records (Run, Attempt, Usage), none of which refers back to it.
    """

    id: int
    name: str
    state: TaskState = TaskState.QUEUED
    priority: Priority = "normal"
    source: str = "cli"
    agent: str | None = None
    group: str | None = None  # a named pool (config `groups`): it needs a slot there too
    command: list[str]
    cwd: str
    created_at: Time
    started_at: Time | None = None
    finished_at: Time | None = None
    expires_at: Time | None = None
    exit_code: int | None = None
    # What belongs to the current (or last) run only: None while queued, set when it starts;
    # a requeue drops it whole. The public object shows its fields flat (reading.public_tasks).
    run: Run | None = None
    log: str | None = None
    reason: str | None = None
    # Beyond the public core:
    # The prompt's text is kept by the store, beside the index (StoreProtocol.prompts), so the
    # index does not grow with prompts. `prompt` is only read from an index an older kugetsu
    # wrote (the prompt was kept here then); `prompted`: `command` holds `{prompt}` where the
    # stored prompt goes when the agent starts (commandline.argv).
    prompt: str | None = None
    prompted: bool = False
    timeout: float | None = None  # run timeout in seconds, None = no limit
    # Only the preset's variables, never the caller's whole environment.
    env: dict[str, str] = {}
    # In the agent's environment and everything it starts: how kugetsu finds the processes
    # the task owns, also those that left its process group (runner.new_token).
    token: str | None = None
    # Worktree isolation (docs/worktrees.md). `repo` set = the task runs in its own worktree.
    # `base` is what it branches from: a commit pinned at admission, or the --base REF as given
    # (resolved when it starts); `base_commit` is the commit the worktree was really created at.
    repo: str | None = None
    base: str | None = None
    branch: str | None = None
    worktree: str | None = None
    base_commit: str | None = None
    worktree_state: Literal["active", "kept", "removed", "pruned"] | None = None
    # `delegate --after`: ids of the tasks that must succeed before this one starts; if one
    # ends otherwise, this one is cancelled (admission.dependencies_failed).
    after: list[int] = []
    # Cluster mode (docs/architecture.md §10): the machine it runs (or ran) on, and the one it must
    # run on (`delegate --host`).
    host: str | None = None
    pinned_host: str | None = None
    # Retries and provider limits (README, "Provider limits and retries"). `attempts`: every
    # run that ended and sent the task back to the queue, oldest first; `retries`: how many
    # failed (or lost) runs are run again; `not_before`: a retry waits for its delay.
    attempt: int = 1
    attempts: list[Attempt] = []
    retries: int = 0
    retry_delay: float | None = None  # seconds
    retry_of: int | None = None  # `kugetsu retry`: the finished task this one runs again
    not_before: Time | None = None
    session: str | None = None  # the agent's session id, read from its output
    first_command: list[str] | None = None  # the command before a resume replaced it
    # Delegated by another task's agent (admission.admit): how many tasks are above it (0: delegated
    # from outside any task), and how many levels its own agent may still delegate beneath it.
    depth: int = 0
    nesting: int = 0
    # Tokens (and cost) of all its runs, as its agent's structured output reported them
    # (each requeued run's own in its Attempt): README, "Agents".
    usage: Usage | None = None
    # Failover (README, "Provider limits"): the presets it may run on, in order (`delegate
    # --agent claude,codex`, or its preset's `fallback`); empty: its `agent` only. `agent` is
    # the one it runs (or last ran) on; `fallback_from` the first of the order when that is
    # another. `fallback_fresh`: a run interrupted with a session may start afresh elsewhere
    # (else it stays with its preset, to resume).
    route: list[str] = []
    fallback_from: str | None = None
    fallback_fresh: bool = False
    # Budgets (README, "Provider limits"): a run that passes one is stopped; a task over it
    # does not start again (what the running run has used so far: `run.usage`).
    budget_usd: float | None = None
    max_tokens: int | None = None
    # Resources (README, "Resources"): what it declared (bytes it may use, counted against the
    # machine's max_memory; its processes at most; the slots it takes of max_agents and its
    # group's), and what was measured of its whole process tree (the largest total RSS seen,
    # CPU seconds).
    memory: int | None = None
    max_procs: int | None = None
    slots: int = 1
    peak_memory: int | None = None
    cpu_seconds: float | None = None
    # `kugetsu stash TASK`: a queued task set aside since then: never started, no position,
    # no expiry, until `unstash`.
    stashed_at: Time | None = None
    # `kugetsu next TASK`: it starts before every other task that may start (the latest
    # `next` first); 0: its place is its priority and id.
    first: int = 0


class Run(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What belongs to one run of a task only (pueue's `Running { start }`): set when it
    starts, kept with the finished task (its public object shows them), dropped whole when it
    goes back to the queue. What tells the task's history (started_at, exit_code, reason,
    attempts, usage, host...) stays in the Task. Each field has the JSON name it had in a
    version-1 task, where it stood in the task itself (upgrade, decode_task read that)."""

    slot: int | None = None
    pid: int | None = None  # the wrapper's; its process group is the task's
    # Identity of `pid`: its start time (clock ticks since boot), so a reused pid is never trusted.
    pid_start: int | None = None
    # Set while a running task is being stopped: the final state it will get, and when
    # SIGKILL follows the SIGTERM it was sent.
    stop: TaskState | None = None
    kill_at: Time | None = None
    # Set when the agent has ended (the task's exit_code then holds its status) while processes
    # it started still run: the task keeps its slot until they are gone (SIGTERM, SIGKILL at
    # kill_at). `leftovers` counts the processes found and ended.
    ended_at: Time | None = None
    leftovers: int = 0
    # The agent's exit hit its provider's limit: back to the queue once its leftovers are gone.
    limit: LimitHit | None = None
    # What this run has used so far, where its agent's stream says it mid-run (Claude Code's
    # per-turn usage); budgets count it with the task's `usage`.
    usage: Usage | None = msgspec.field(default=None, name="run_usage")
    # `kugetsu pause TASK`: its processes are stopped (SIGSTOP) since then; `paused_s`: the
    # seconds of its earlier pauses this run. Paused time does not count toward its timeout.
    paused_at: Time | None = None
    paused_s: float = 0.0


class Attempt(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One run of a task that did not end it: how it ended and why it runs again."""

    started_at: Time | None = None
    ended_at: Time
    exit_code: int | None = None
    reason: str | None = None
    limit: bool = False  # it hit its provider's limit (a retry is not used up)
    usage: Usage | None = None  # what this run used, as its agent reported


class LimitHit(msgspec.Struct, kw_only=True):
    until: Time | None = None  # the reset time its output gave, if it gave one


class Hold(msgspec.Struct, kw_only=True):
    """A preset held: none of its tasks starts until `until` (None: until released by hand)."""

    until: Time | None = None
    reason: str  # e.g. "claude usage limit", "held by hand"
    since: Time


class Event(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One line of events.jsonl."""

    seq: int = 0
    type: str
    at: Time
    task: int | None = None
    name: str | None = None
    source: str | None = None
    state: str | None = None
    reason: str | None = None
    exit_code: int | None = None
    slot: int | None = None
    position: int | None = None
    key: str | None = None
    value: object = None
    branch: str | None = None
    worktree: str | None = None
    worktree_state: str | None = None  # `worktree` events of a task's end: kept or removed
    host: str | None = None  # cluster mode: the machine a task started on


class SourceMark(msgspec.Struct, kw_only=True):
    """When a source last started a task. `n` is the index's start counter at that start: it
    orders sources that started in the same transaction (same `at`), which `fair` needs."""

    at: Time
    n: int


class ClockMark(msgspec.Struct, kw_only=True):
    """Who wrote the index last (a transaction with events), and the time its clock said: what
    names the command when a time it wrote turns out to be from a wrong clock."""

    at: Time
    by: str  # e.g. "kugetsu delegate (pid 4242)"


class ClockError(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A time written by a clock that was wrong, as the service found and corrected it
    (skew.correct_clock): `off` seconds ahead (> 0) or behind (< 0) of the service's clock."""

    found_at: Time  # the service's clock when it found it
    at: Time  # the time that was written
    off: float
    what: str  # what held it: "task build (#5) created_at", "the last start of source cli"
    by: str | None = None  # the command that wrote it, when known (ClockMark)


class DaySpend(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What was used on one local day, per source and per preset: what the daily budgets
    (`budgets.*`) are checked against. Kept in the index, as history trimming must not make
    a day's spending go down."""

    day: str  # YYYY-MM-DD, local time
    sources: dict[str, Usage] = {}
    agents: dict[str, Usage] = {}


class QuotaWindow(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A preset's window quota (its `limit.window`), as used so far: the window began at its
    first start; `probe`: when the window before was used up, the one task let through in
    this one until its provider has answered it (its first turn) or it has ended."""

    since: Time
    starts: int = 0
    tokens: int = 0
    probe: int | None = None
class Schedule(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A recurring schedule (`kugetsu schedule add`, docs/scheduling.md): each firing
    delegates `request` (a admission.Request as JSON values, without its name) as a task named after
    the schedule and the time. In the index, so the file store and the cluster's database
    keep it alike, and every change of it is one transaction."""

    name: str
    cron: str | None = None  # a crontab line: 5 fields, or 6 with seconds first
    every: float | None = None  # seconds between firings (from created_at)
    tz: str | None = None  # cron's IANA zone (given, or the adding machine's; None: the service's)
    request: dict[str, object] = {}
    created_at: Time
    paused: bool = False
    overlap: bool = False  # fire even while its last task is still queued or running
    # The last firing: its scheduled time (a firing at or before it is never run again: a
    # restart, or a second machine, cannot double it), the task it delegated, what happened.
    last_fire: Time | None = None
    last_task: int | None = None
    last_note: str | None = None
    last_at: Time | None = None  # when that happened (a firing, a skip, a refusal, `schedule run`)
    fired: int = 0  # tasks delegated
    skipped: int = 0  # firings that delegated nothing (overlap, a full queue, a bad request)


class Index(msgspec.Struct, kw_only=True):
    """The whole state. `active`, `queued` and `finished` hold each task exactly once."""

    version: int = INDEX_VERSION
    next_id: int = 1
    next_seq: int = 1
    active: list[Task] = []
    queued: list[Task] = []
    finished: list[Task] = []
    # Scheduling memory that must outlive `clean` and history trimming (rate limits, fair).
    starts: int = 0
    last_start: dict[str, SourceMark] = {}
    # `kugetsu pause`: no queued task starts (running ones go on); `pause --group G`: none of
    # group G. Here, not in the config: a pause outlives restarts and is undone by `resume`.
    paused: bool = False
    paused_groups: list[str] = []
    # Provider limits: presets held now, and each preset's limit hits in a row (the backoff).
    holds: dict[str, Hold] = {}
    strikes: dict[str, int] = {}
    # Usage today (budgets), and each window-quota preset's starts and tokens in its window.
    spend: DaySpend | None = None
    windows: dict[str, QuotaWindow] = {}
    # The events of the last transaction, committed with it: if the process dies between
    # the index rename and the events.jsonl append, the next transaction appends them.
    outbox: list[Event] = []
    # The last writer and its clock; the last clock error the service found (doctor says it).
    clock: ClockMark | None = None
    clock_error: ClockError | None = None
    # Recurring schedules by name (kugetsu/core/schedules.py).
    schedules: dict[str, Schedule] = {}

    def live(self) -> list[Task]:
        return self.active + self.queued

    def all_tasks(self) -> list[Task]:
        return self.active + self.queued + self.finished


# Where a version-1 task had the fields that are its Run's now (each after the Task field
# named): the flat shape the public task object keeps.
_RUN_AFTER: dict[str, tuple[str, ...]] = {
    "exit_code": ("pid",), "prompted": ("slot",), "timeout": ("pid_start",), "env": ("stop", "kill_at"),
    "token": ("ended_at", "leftovers"), "first_command": ("limit",), "max_tokens": ("run_usage",),
    "cpu_seconds": ("paused_at", "paused_s")}


def _task_defaults() -> dict[str, object]:
    runs = {f.encode_name: f for f in msgspec.structs.fields(Run)}
    out: dict[str, object] = {}
    for f in msgspec.structs.fields(Task):
        if f.name == "run":
            continue
        default = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
        out[f.name] = None if default is msgspec.NODEFAULT else msgspec.to_builtins(default)
        for name in _RUN_AFTER.get(f.name, ()):
            out[name] = msgspec.to_builtins(runs.pop(name).default)
    assert not runs, f"Run fields without a place in the flat task: {sorted(runs)}"
    return out


# Every field of a Task at its default, as JSON values, flat (its Run's fields where a version-1
# task had them, in that order; None for the required ones): what the index leaves out, and the
# public task object's shape. Shared, so never changed in place.
TASK_DEFAULTS: dict[str, object] = _task_defaults()


def task_record(raw: dict[str, object]) -> dict[str, object]:
    """A task as stored (JSON, defaults left out, of either version) with every field, flat:
    for readers of index.json or history.jsonl as plain JSON."""
    run = raw.get("run")
    if isinstance(run, dict):
        raw = {k: v for k, v in raw.items() if k != "run"} | run
    return {**TASK_DEFAULTS, **raw}


# ---- version 1: the run's fields in the task itself -------------------------------------------
# Read wherever a task's JSON may be older than INDEX_VERSION 2: an index.json or a cluster's
# state row of version 1 (upgrade), history.jsonl lines and history rows, and task rows under a
# state row of version 1 (decode_task). Written back in version 2 by the next write.

class _Runs(msgspec.Struct):
    """A version-1 index's task lists, each task read as the Run its flat fields make."""

    active: list[Run] = []
    queued: list[Run] = []
    finished: list[Run] = []


_EMPTY_RUN = Run()
_run_decoder = msgspec.json.Decoder(Run)
_task_decoder = msgspec.json.Decoder(Task)


def upgrade(index: Index, data: bytes) -> Index:
    """`index`, decoded from `data`, as version 2: a version-1 document's tasks get the run
    records their flat fields make (decoding as Task skipped those fields). One more C decode,
    for an old document only; the next write writes version 2."""
    if index.version != 1:  # this version, or one no kugetsu wrote (refused by the store)
        return index
    if index.active or index.queued or index.finished:
        runs = msgspec.json.decode(data, type=_Runs)
        for tasks, flat in ((index.active, runs.active), (index.queued, runs.queued), (index.finished, runs.finished)):
            for task, run in zip(tasks, flat):
                if task.run is None and (run != _EMPTY_RUN or tasks is index.active):  # a running task has one
                    task.run = run
    index.version = INDEX_VERSION
    return index


def decode_task(data: bytes, old: bool = True) -> Task:
    """One task's JSON (a history line, a task row) of either version; `old=False` when it is
    known to be version 2 (a task row under a version-2 state row): one decode, as before."""
    task = _task_decoder.decode(data)
    return with_flat_run(task, data) if old else task


def with_flat_run(task: Task, data: bytes) -> Task:
    """`task`, decoded from `data`, with the run record a version-1 task's flat fields make."""
    if task.run is None:
        run = _run_decoder.decode(data)
        if run != _EMPTY_RUN:
            task.run = run
    return task


# The times kugetsu writes lie well inside what datetime holds: one at its ends (year 1, 9999:
# an index edited by hand, a clock set absurdly) would overflow the first deadline computed
# from it, in every command and in the service. Such an index is refused like a damaged one.
TIME_MIN = datetime(100, 1, 1, tzinfo=timezone.utc)
TIME_MAX = datetime(9000, 1, 1, tzinfo=timezone.utc)

_ID, _STATE, _RUN, _CREATED = map(attrgetter, ("id", "state", "run", "created_at"))
_LIVE_TIMES = tuple(map(attrgetter, ("expires_at", "started_at", "not_before")))
_RUN_TIMES = tuple(map(attrgetter, ("kill_at", "ended_at")))


def _bad_time(index: Index) -> str | None:
    """The first time a deadline is computed from that lies outside TIME_MIN..TIME_MAX, named,
    or None. Live tasks only (finished ones' times are only compared and shown), in passes of
    C over them (every CLI call and the service's start run it: a Python step a task was ~20 ms
    of the service's start at 50,000 queued)."""
    lo, hi = TIME_MIN, TIME_MAX
    live = index.active + index.queued
    runs = list(filter(None, map(_RUN, live)))
    # A datetime is always true: filter(None, ...) leaves out the fields not set.
    times = [list(map(_CREATED, live)), *(list(filter(None, map(get, live))) for get in _LIVE_TIMES),
             *(list(filter(None, map(get, runs))) for get in _RUN_TIMES)]
    if any(ts and (min(ts) < lo or max(ts) > hi) for ts in times):
        # Named by the same getters as the passes above: a field added there is looked at here too.
        task, at = next((t, a) for t in live
                        for a in (_CREATED(t), *(get(t) for get in _LIVE_TIMES),
                                  *((get(t.run) for get in _RUN_TIMES) if t.run else ()))
                        if a is not None and not lo <= a <= hi)
        return f"task #{task.id} has the time {at.isoformat()}"
    for source, mark in index.last_start.items():
        if not lo <= mark.at <= hi:
            return f"last_start of {source!r} is {mark.at.isoformat()}"
    for agent, hold in index.holds.items():
        for at in (hold.since, hold.until):
            if at is not None and not lo <= at <= hi:
                return f"the hold on {agent!r} has the time {at.isoformat()}"
    for agent, window in index.windows.items():
        if not lo <= window.since <= hi:
            return f"the quota window of {agent!r} has the time {window.since.isoformat()}"
    return None


def _all_in(tasks: list[Task], states: tuple[TaskState, ...]) -> bool:
    """Whether every one of `tasks` has one of `states`: counted in C (enum members are
    singletons: list.count compares by identity first)."""
    found = list(map(_STATE, tasks))
    return sum(map(found.count, states)) == len(found)


def check_index(index: Index) -> str | None:
    """What is inconsistent in a decoded index, or None. Decoding checks types; this checks meaning."""
    bad = _bad_time(index)
    if bad is not None:
        return f"{bad}, which is no time kugetsu writes (outside {TIME_MIN.year}-{TIME_MAX.year})"
    # Every CLI call checks the whole index: the common case (all well) in a few passes over
    # lists, the slow loop below only to name what is wrong.
    ids = [*map(_ID, index.active), *map(_ID, index.queued), *map(_ID, index.finished)]
    if (
        len(set(ids)) == len(ids)
        and (not ids or max(ids) < index.next_id)
        and _all_in(index.active, (TaskState.RUNNING,))
        and _all_in(index.queued, (TaskState.QUEUED,))
        and _all_in(index.finished, FINAL_STATES)
    ):
        return None
    seen: set[int] = set()
    for where, tasks, ok in (
        ("active", index.active, lambda s: s is TaskState.RUNNING),
        ("queued", index.queued, lambda s: s is TaskState.QUEUED),
        ("finished", index.finished, lambda s: s.final),
    ):
        for i, task in enumerate(tasks):
            if not ok(task.state):
                return f"{where}[{i}] (task #{task.id}) has state {task.state.value!r}"
            if task.id in seen:
                return f"task id {task.id} appears twice"
            if task.id >= index.next_id:
                return f"task id {task.id} is not below next_id {index.next_id}"
            seen.add(task.id)
    return None


class QueueCounts(msgspec.Struct, frozen=True, kw_only=True):
    """What `capacity` needs of the queued tasks, for a reader that did not decode them (the
    file store's read_head): how many, how many of each held agent's (its hold's count), and
    whether one takes more than one slot or declares memory (policy.accounts)."""

    queued: int
    held_agents: dict[str, int] = {}
    accounting: bool = False

    @classmethod
    def of(cls, tasks: list[Task] | list[QueuedBrief], held: Iterable[str], accounting: bool | None = None) -> QueueCounts:
        """The counts of decoded queued tasks (or their briefs); `held`: the agents with a hold;
        `accounting`: whether one declares memory or slots, when the caller knows (a Look's
        passes in C; a Python step a task was 18 ms of `queue --limit 20` at 50,000 queued)."""
        by_agent = dict.fromkeys(held, 0)
        if by_agent:
            for t in tasks:
                if t.agent in by_agent:
                    by_agent[t.agent] += 1
        if accounting is None:  # in C (map): a whole write of index.json counts its queue for index.head
            accounting = any(map(_MEMORY, tasks)) or any(map((1).__ne__, map(_SLOTS, tasks)))
        return cls(queued=len(tasks), held_agents=by_agent, accounting=accounting)


_MEMORY, _SLOTS = attrgetter("memory"), attrgetter("slots")


class QueuedBrief(msgspec.Struct):
    """Of a queued task as stored, the fields QueueCounts reads (the rest is skipped unread)."""

    agent: str | None = None
    memory: int | None = None
    slots: int = 1
