"""The tools that change the queue: delegate (one task, or a list in one transaction),
cancel, priority. Concurrent delegate calls share transactions (Admitter: group commit)."""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
from typing import Annotated, Any

import anyio
import anyio.to_thread
from mcp.server import MCPServer
from mcp.types import CallToolResult, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from kugetsu.app import delegation, reading, verbs, waiting
from kugetsu.config.load import load_config, store_url
from kugetsu.config.model import Config
from kugetsu.core.look import Chain
from kugetsu.core import admission
from kugetsu.errors import Rejected, UsageError
from kugetsu.frontends import render
from kugetsu.frontends.mcp.models import CancelOut, DelegateOut, Level, TaskOut
from kugetsu.frontends.mcp.tooling import Duration, TaskRef, answers, duration, in_thread, reply, size
from kugetsu.paths import Home
from kugetsu.service import runner
from kugetsu.store.files import store_at
from kugetsu.store.protocol import StoreProtocol

BACK_OFF_S = 60  # what a rejected delegate suggests: "try again in a minute"
BATCH_MAX = 1000  # tasks in one delegate call: one transaction, one answer an agent still reads
FORGET_AFTER = 120.0  # seconds without an admission after which the Admitter lets go of its store

# delegate's arguments, each once: the tool's own and a `tasks` item's.
Prompt = Annotated[str | None, Field(description="the instructions for the agent preset (the worker agent)")]
Name = Annotated[str | None, Field(description="the task's name, e.g. your issue id (issue-16): 1-64 letters,"
                                   " digits, '.', '_', '-'; unique among queued and running tasks")]
Source = Annotated[str, Field(description="who delegates (e.g. pm): shown everywhere, used by fair"
                              " scheduling and per-source limits")]
Command = Annotated[list[str] | None, Field(min_length=1, description="run this argv instead of an agent"
                                            " preset (no shell: one list element per argument)")]
Agent = Annotated[str | None, Field(description="agent preset (config `agents`: opencode, claude, codex,"
                                    " ...); default: the config's default_agent")]
Cwd = Annotated[str | None, Field(description="working directory (absolute); default: where the MCP"
                                  " server runs")]
Priority = Annotated[Level, Field(description="matters under the priority and fair strategies")]
Group = Annotated[str | None, Field(description="a pool (config `groups`) it must also have a slot in")]
Timeout = Annotated[str | float | None, Field(description="stop the agent after it ran this long (90s, 15m,"
                                              " 2h, 1d or seconds); null: the config's run_timeout")]
Worktree = Annotated[bool | None, Field(description="run in its own git worktree on branch kugetsu/NAME;"
                                        " null: as the preset and config say")]
Base = Annotated[str | None, Field(description="with worktree: the git ref it starts from")]
Retries = Annotated[int, Field(ge=0, le=100, description="run it again, as the same task, up to this many"
                               " times when it fails or is lost (not when cancelled)")]
RetryDelay = Annotated[str | float | None, Field(description="wait this long before each retry (90s,"
                                                 " 15m or seconds)")]
Fallback = Annotated[list[str] | None, Field(description="presets to start it on, in order, while `agent`"
                                             " is held (its usage limit, its budget); null: the preset's"
                                             " `fallback`")]
FallbackFresh = Annotated[bool | None, Field(description="a run interrupted with a session may start"
                                             " afresh on a fallback (default: it waits to resume)")]
BudgetUsd = Annotated[float | None, Field(gt=0, description="stop it once its runs cost more (US dollars)")]
MaxTokens = Annotated[int | None, Field(gt=0, description="stop it once its runs used more tokens (in + out)")]
Memory = Annotated[str | int | None, Field(description="memory it may use (4G, 512M or bytes): it starts"
                                           " when that fits the machine's max_memory; over it, it is"
                                           " stopped. null: the preset's, else none")]
MaxProcs = Annotated[int | None, Field(ge=1, description="its processes at most (a fork storm is"
                                       " stopped); null: the preset's or the config's")]
Slots = Annotated[int | None, Field(ge=1, le=64, description="slots of max_agents (and of its group) it"
                                    " takes; null: the preset's (1)")]
At = Annotated[str | None, Field(description="start no earlier than this time (02:00, 3pm, ISO 8601: the"
                                 " next one to come); it waits in the queue until then")]
Delay = Annotated[str | float | None, Field(description="start no earlier than this long from now (30m, 2h"
                                            " or seconds)")]
Env = Annotated[dict[str, str] | None, Field(description="extra environment variables for the agent"
                                             " (NAME: value; not KUGETSU_*). Only their names are ever shown"
                                             " (env_names)")]


class TaskItem(BaseModel):
    """One task of delegate's `tasks`: the keys of delegate's own arguments; a key left out
    takes the value given beside `tasks` (or its default)."""

    model_config = ConfigDict(extra="forbid")

    prompt: Prompt = None
    name: Name = None
    source: Source | None = None
    command: Command = None
    agent: Agent = None
    cwd: Cwd = None
    priority: Priority | None = None
    group: Group = None
    expire_after: Duration = None
    timeout: Timeout = None
    worktree: Worktree = None
    base: Base = None
    retries: Retries | None = None
    retry_delay: RetryDelay = None
    fallback: Fallback = None
    fallback_fresh: FallbackFresh = None
    budget_usd: BudgetUsd = None
    max_tokens: MaxTokens = None
    memory: Memory = None
    max_procs: MaxProcs = None
    slots: Slots = None
    at: At = None
    delay: Delay = None
    env: Env = None


Tasks = Annotated[list[TaskItem] | None, Field(min_length=1, max_length=BATCH_MAX, description=(
    "instead of one task, a list of them, admitted together in one transaction: all of them or, when one"
    " is refused, none (the error names it: tasks[3]). Each item takes delegate's arguments; the"
    " arguments given beside `tasks` are every item's defaults (e.g. source, cwd, agent)"))]


def register(server: MCPServer, home: Home) -> None:
    answered = answers(home)
    admitter = Admitter(home)
    atexit.register(admitter.close)  # the client closed stdio, the HTTP server stopped: fold

    @server.tool(annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=False, open_world_hint=True))
    @answered
    async def delegate(
        prompt: Prompt = None,
        name: Name = None,
        source: Source = "mcp",
        command: Command = None,
        agent: Agent = None,
        cwd: Cwd = None,
        priority: Priority = "normal",
        group: Group = None,
        expire_after: Duration = None,
        timeout: Timeout = None,
        worktree: Worktree = None,
        base: Base = None,
        retries: Retries = 0,
        retry_delay: RetryDelay = None,
        fallback: Fallback = None,
        fallback_fresh: FallbackFresh = None,
        budget_usd: BudgetUsd = None,
        max_tokens: MaxTokens = None,
        memory: Memory = None,
        max_procs: MaxProcs = None,
        slots: Slots = None,
        at: At = None,
        delay: Delay = None,
        env: Env = None,
        tasks: Tasks = None,
    ) -> Annotated[CallToolResult, DelegateOut]:
        """Hand one piece of work (one issue) to a worker agent. kugetsu starts it at once in a
        free slot or queues it, and says which: "started NAME (#ID), slot 2/3" or "queued NAME
        (#ID), position 4 of 4". Give `prompt` (the agent preset runs with it) or `command`.
        Name it after your issue and set `source` so you can refer to it later (status, wait,
        logs take the name).
        Several issues at once: give `tasks`, a list of such tasks (up to 1000); all go in
        together, each with its true position (the result's `tasks`, in your order), or none.
        When the queue is full (or your source hit its limit) the result is "rejected" with
        admitted=false: nothing was queued. That is back-pressure, not an error: do not retry
        at once; wait about a minute (or `wait` for one of your running tasks) and delegate again.
        A tool error means a bad argument (name taken or invalid, unknown preset, bad duration,
        cwd missing; in `tasks`, which item): fix it and call again."""
        given = {k: v for k, v in locals().items() if k in TaskItem.model_fields}  # the arguments, but tasks
        if tasks is not None:
            return await _delegate_all(home, admitter, [_request(**{**given, **t.model_dump(exclude_unset=True)})
                                              for t in tasks])
        req = _request(**given)
        try:
            adm = await admitter.admit(req)
        except Rejected as err:
            return _rejected(str(err))
        line, warning = _admitted(load_config(home), adm, req)
        task = reading.task_json(adm.task, adm.position, prompts=_prompts([adm], [req]))
        advice = (f"It runs on its own; call wait with {adm.task.name!r} (or {adm.task.id}) when you need its"
                  " result, then logs if it did not succeed.")
        text = line
        if warning:
            text, advice = f"{line}\n{warning}", f"{warning}. {advice}"
        return reply(text, {"admitted": True, "task": task, "rejected": None, "retry_after": None,
                            "message": line, "advice": advice})

    @server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=False, open_world_hint=False))
    @answered
    async def cancel(
        tasks: Annotated[list[str], Field(description="task ids or names")] = [],  # noqa: B006 (pydantic copies it)
        all: Annotated[bool, Field(description="every queued and running task (of every source)")] = False,
    ) -> Annotated[CallToolResult, CancelOut]:
        """Cancel tasks you no longer want. A queued task is removed from the queue at once; a
        running one gets SIGTERM to its whole process group (SIGKILL after kill_grace), and this
        returns once it is final, its slot handed to the next task. To stop waiting for a task,
        do not cancel it: cancel the `wait` call instead."""
        if not tasks and not all:
            raise UsageError("name the tasks to cancel (ids or names), or set all: true")
        stop = waiting.Stop()
        try:
            out = await in_thread(functools.partial(
                waiting.cancel, home, tasks, everything=all, reason="cancelled by mcp", stop=stop))
        finally:
            stop.set()
        return reply(render.cancelled(out), {"tasks": reading.tasks_json(out, prompts=reading.prompts(home, out))})

    @server.tool(annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=True, open_world_hint=False))
    @answered
    def priority(
        task: TaskRef,
        level: Annotated[Level, Field(description="urgent > high > normal > low")],
    ) -> Annotated[CallToolResult, TaskOut]:
        """Change a queued task's priority. It moves ahead under the priority and fair
        strategies (not under fifo); the result gives its new position."""
        changed, position = verbs.set_priority(home, task, level)
        return reply(render.priority_changed(changed, position), reading.task_json(changed, position, prompts=reading.prompts(home, [changed])))


def _request(*, prompt: str | None, name: str | None, source: str, command: list[str] | None, agent: str | None,
             cwd: str | None, priority: str, group: str | None, expire_after: str | float | None,
             timeout: str | float | None, worktree: bool | None, base: str | None, retries: int,
             retry_delay: str | float | None, fallback: list[str] | None, fallback_fresh: bool | None,
             budget_usd: float | None, max_tokens: int | None, memory: str | int | None, max_procs: int | None,
             slots: int | None, at: str | None, delay: str | float | None,
             env: dict[str, str] | None) -> admission.Request:
    return admission.Request(
        cwd=os.path.abspath(cwd or os.getcwd()), name=name, command=command, prompt=prompt, agent=agent,
        source=source, priority=priority, group=group, expire_after=duration(expire_after, "expire_after"),
        timeout=duration(timeout, "timeout"), worktree=worktree, base=base, retries=retries,
        retry_delay=duration(retry_delay, "retry_delay"), fallback=fallback, fallback_fresh=fallback_fresh,
        budget_usd=budget_usd, max_tokens=max_tokens, memory=size(memory), max_procs=max_procs, slots=slots,
        start_at=delegation.start_time(at, duration(delay, "delay"), "at"), env=dict(env or {}),
    )


def _prompts(adms: list[delegation.Admission], reqs: list[admission.Request]) -> dict[int, str]:
    """The admitted tasks' prompts, as just stored (the store keeps each request's prompt as
    it came): not read back from their files."""
    return {adm.task.id: req.prompt for adm, req in zip(adms, reqs) if req.prompt is not None}


def _rejected(why: str, what: str = "Nothing was queued") -> CallToolResult:
    """Admission's refusal (queue full, a per-source limit): a normal result that says to
    back off, as the CLI's exit 3."""
    line = f"rejected: {why}"
    advice = (f"{what}. Back off: try again in about {BACK_OFF_S}s (or after one of your tasks ends); do not retry"
              " at once.")
    return reply(f"{line}. {advice}", {"admitted": False, "task": None, "rejected": why,
                                       "retry_after": BACK_OFF_S, "message": line, "advice": advice})


def _admitted(cfg: Config, adm: delegation.Admission, req: admission.Request) -> tuple[str, str | None]:
    """The CLI's line for an admission, and its warning (as the CLI warns) or None."""
    line = render.admitted(adm.task, adm.position, adm.queued, adm.max_agents, adm.waiting_for)
    unused = admission.unused_prompt_text(cfg, req, "`command`")
    return line, f"warning: {unused}" if unused else None


async def _delegate_all(home: Home, admitter: Admitter, reqs: list[admission.Request]) -> CallToolResult:
    """delegate with `tasks`: one transaction, all or none (delegation.delegate_all)."""
    try:
        adms = await admitter.admit_all(reqs)
    except delegation.BatchRefused as err:
        if isinstance(err.error, Rejected):
            return _rejected(str(err), f"Nothing was queued (none of the {len(reqs)} tasks)")
        raise UsageError(f"{err}; nothing was delegated (none of the {len(reqs)} tasks): fix it and call"
                         " again") from None
    cfg, prompts = load_config(home), _prompts(adms, reqs)
    items, lines = [], []
    for adm, req in zip(adms, reqs):
        line, warning = _admitted(cfg, adm, req)
        lines.append(line if warning is None else f"{line}\n{warning}")
        items.append({"task": reading.task_json(adm.task, adm.position, prompts=prompts), "message": line,
                      "warning": warning})
    started = sum(1 for a in adms if a.position is None)
    summary = f"delegated {len(adms)} tasks: {started} started, {len(adms) - started} queued"
    advice = ("They run on their own; call wait with their names (or group, if you gave them one) when you need"
              " their results, then logs of any that did not succeed.")
    return reply("\n".join([summary, *lines]), {"admitted": True, "task": None, "rejected": None,
                                                "retry_after": None, "message": summary, "advice": advice,
                                                "tasks": items})


class Admitter:
    """Every delegate of this server goes through here, one transaction at a time, on one
    long-lived store (`store`): what it committed last is not decoded again at the next
    admission (a fresh Store per worker thread decoded index.json at every call, and that
    grows with the queue). Concurrent calls share transactions: while one batch is being
    admitted (a locked, fsync'd write), the calls that arrive, from any session, wait, then
    go in together as the next batch (delegation.delegate_many: each as if alone, in order
    of arrival). A lone call is a batch of one, with no delay; calls in flight pay one write
    per batch instead of one per task, which only a long-lived process can offer. A `tasks`
    list (all or none) is a transaction of its own, in its turn among the others."""

    def __init__(self, home: Home, forget_after: float = FORGET_AFTER):
        self.home = home
        self.pending: list[_Entry] = []
        self.lock = anyio.Lock()
        self._store: tuple[str | None, StoreProtocol] | None = None  # the store's URL (None: files), the store
        self._looks: Chain | None = None  # the Looks of that store's queue, one admission after the other
        self._used = 0.0  # time.monotonic() of the last admission
        self._forget_after = forget_after
        self._forgetter: threading.Thread | None = None
        # A batch's admission, or the store let go: one at a time (a Store is one thread's).
        self._using = threading.Lock()

    async def admit(self, req: admission.Request) -> delegation.Admission:
        """One request, alone or sharing a transaction with those in flight beside it."""
        return await self._turn(_Entry([req], atomic=False))  # type: ignore[no-any-return]

    async def admit_all(self, reqs: list[admission.Request]) -> list[delegation.Admission]:
        """A list, all or none (delegation.delegate_all: BatchRefused names the item)."""
        return await self._turn(_Entry(reqs, atomic=True))  # type: ignore[no-any-return]

    async def _turn(self, entry: _Entry) -> Any:
        self.pending.append(entry)
        try:
            async with self.lock:
                if not entry.done:  # not taken by the batch before: lead the next one
                    batch, self.pending = self.pending, []
                    with anyio.CancelScope(shield=True):  # a batch, once begun, hands out every result
                        await anyio.to_thread.run_sync(self._admit, batch)
        except anyio.get_cancelled_exc_class():
            if entry in self.pending:  # cancelled before its batch began: it is not admitted
                self.pending.remove(entry)
            raise
        if isinstance(entry.result, Exception):
            raise entry.result
        return entry.result

    def _admit(self, batch: list[_Entry]) -> None:
        """The batch in order of arrival: each run of single calls one transaction, each list
        one of its own. A failure of a whole transaction (disk full) is each of its calls'."""
        with self._using:
            self._admit_now(batch)

    def _admit_now(self, batch: list[_Entry]) -> None:
        try:
            store, cfg = self._store_now(), load_config(self.home)
        except Exception as err:
            for e in batch:
                e.result, e.done = err, True
            return
        at = 0
        while at < len(batch):
            if batch[at].atomic:
                run, reqs = batch[at:at + 1], batch[at].reqs
            else:
                end = next((k for k in range(at, len(batch)) if batch[k].atomic), len(batch))
                run, reqs = batch[at:end], [e.reqs[0] for e in batch[at:end]]
            try:
                if run[0].atomic:
                    results: list[Any] = [delegation.delegate_all(self.home, cfg, reqs, store, self._looks)]
                else:
                    results = delegation.delegate_many(self.home, cfg, reqs, store=store,  # type: ignore[assignment]
                                                       looks=self._looks)
            except Exception as err:
                results = [err] * len(run)
            for e, result in zip(run, results):
                e.result, e.done = result, True
            at += len(run)

    def _store_now(self) -> StoreProtocol:
        """The store admissions write through, kept from one to the next (open again when the
        config names another one: `config set store`). Its commits are records appended to
        index.journal, as the service's are (a whole index.json a call cost 1.3 of an
        admission's 1.5 ms at a few hundred queued, and grows with the queue); they are folded
        into index.json when it is let go: idle, or as the server ends (`close`)."""
        url = store_url(self.home)
        self._used = time.monotonic()
        kept = self._store
        if kept is None or kept[0] != url:
            self._let_go()
            store = store_at(self.home, url)
            store.append_commits()
            store.read_ahead()  # kept as read: the first admission appends too (as the service's first tick)
            kept = self._store = (url, store)
            self._looks = delegation.new_looks()
        if self._forgetter is None:
            self._forgetter = threading.Thread(target=self._forget_when_idle, name="kugetsu-mcp-forget", daemon=True)
            self._forgetter.start()
        return kept[1]

    def _let_go(self) -> None:
        """Forget the store, its journal records folded into index.json first: with no
        long-lived writer left, index.json alone is the state (a server killed before it could
        fold leaves the journal, which every reader replays and the next writer folds)."""
        kept = self._store
        try:
            if kept is not None:
                kept[1].fold()
        finally:
            self._store = None  # after the fold: one that sees it gone sees index.json whole
            self._looks = None

    def close(self) -> None:
        """The server ends: what it appended goes into index.json."""
        with self._using:
            self._let_go()

    def _forget_when_idle(self) -> None:
        """Let go of the store (and the index it keeps: ~1.5 KB a queued task) once no admission
        came for `forget_after`, and give the heap's free pages back: an agent's own `kugetsu mcp`
        that delegated once would keep a copy of the index for as long as it lives. The next
        admission opens the store again (one decode)."""
        while True:
            time.sleep(self._forget_after / 4)
            with self._using:
                if self._store is None or time.monotonic() - self._used < self._forget_after:
                    continue
                self._let_go()
            runner.trim_heap()


class _Entry:
    def __init__(self, reqs: list[admission.Request], atomic: bool):
        self.reqs = reqs
        self.atomic = atomic  # a `tasks` list: all or none, a transaction of its own
        self.done = False
        self.result: Any = None
