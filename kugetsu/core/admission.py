"""Admission: a request checked (name, prompt, env, nesting, dependencies, limits) and queued or
started at once; the commands a preset renders; priority, move, stash and edit of queued tasks.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

import msgspec

from kugetsu.config.model import Config
from kugetsu.config.units import format_size, MAX_DURATION, parse_size
from kugetsu.core.commandline import _KEPT, _NEEDS_PROMPT, render_command, render_template
from kugetsu.core.common import _close, _event, _stands
from kugetsu.core.lifecycle import cancel
from kugetsu.core.models import PRIORITIES, Event, Index, Task, TaskState, valid_host, valid_name
from kugetsu.core.policy import Look, short_size
from kugetsu.core.selection import find, free_slots, position
from kugetsu.errors import EmptyPrompt, InvalidHost, NeedsPrompt, Nested, NoSuchTask, NotClustered, QueueFull, Rejected, UnknownDependency, UnknownGroup, UsageError


# ---- admission -------------------------------------------------------------------------


class Request(msgspec.Struct, kw_only=True):
    """What a delegator asks for. `command` is an explicit argv; without it the agent preset runs."""

    cwd: str
    name: str | None = None
    command: list[str] | None = None
    prompt: str | None = None
    agent: str | None = None
    source: str = "cli"
    priority: str = "normal"
    group: str | None = None
    expire_after: float | None = None  # seconds; None: config queue_timeout
    timeout: float | None = None  # seconds; None: config run_timeout
    retries: int = 0  # failed or lost runs run again, as the same task
    retry_delay: float | None = None  # seconds between a failed run and the next
    retry_of: int | None = None  # `kugetsu retry`: the finished task this one runs again
    # `delegate --at/--delay`: it waits in the queue until then (Task.not_before), then
    # competes like any other; its queue expiry counts from then. Past or None: at once.
    start_at: datetime | None = None
    env: dict[str, str] = {}
    # Worktree isolation: None lets the agent preset and config decide (ops does); ops then
    # fills `repo` (the repository's top level) and `base`, which pm records on the task.
    worktree: bool | None = None
    base: str | None = None
    repo: str | None = None
    pinned_host: str | None = None  # cluster mode: the machine it must run on
    token: str | None = None  # the task's process token (runner.new_token); ops makes it
    # Where {prompt_file} points (the caller writes the prompt there: pm does no I/O); only
    # for a preset that uses it (wants_prompt_file).
    prompt_path: str | None = None
    # `command` is a kept task's (`kugetsu retry`): its `{prompt}` takes `prompt` at the start.
    prompted: bool = False
    after: list[str] = []  # tasks (ids or names) that must succeed before this one starts
    # Failover: presets to fall back on, in order, after `agent` (`--agent claude,codex` is
    # read into agent + fallback here, for every front end); None: the preset's `fallback`.
    fallback: list[str] | None = None
    fallback_fresh: bool | None = None  # None: the preset's `fallback_fresh`
    budget_usd: float | None = None
    max_tokens: int | None = None
    # Resources (README, "Resources"); None: the preset's, else the config's defaults.
    memory: int | None = None  # bytes
    max_procs: int | None = None
    slots: int | None = None
    # The task whose agent delegates (id, name), from that agent's environment (ops fills it
    # in: KUGETSU_TASK_ID, KUGETSU_TASK_NAME): None from outside any task.
    parent: tuple[int, str] | None = None

    def __post_init__(self) -> None:
        if self.agent is not None and "," in self.agent:
            names = [a.strip() for a in self.agent.split(",")]
            self.agent, rest = names[0], names[1:]
            self.fallback = rest + [a for a in self.fallback or [] if a not in rest]


def route_request(cfg: Config, req: Request, agent: str | None) -> list[str]:
    """The failover order of a request: its agent then its fallbacks (given, or its preset's);
    [] when it has none. A bare command has no order (nothing to start elsewhere)."""
    if agent is None:
        return []
    preset = cfg.agents.get(agent)
    rest = req.fallback if req.fallback is not None else (preset.fallback if preset and not req.command else [])
    if not rest:
        return []
    if req.command:
        raise UsageError("a fallback runs another preset with the prompt: give a prompt, not an explicit command")
    order = [agent]
    for name in rest:
        if name not in cfg.agents:
            raise UsageError(f"unknown agent preset {name!r} in the fallback order; known: {', '.join(sorted(cfg.agents))}")
        if name not in order:
            order.append(name)
    if any(any(_NEEDS_PROMPT.search(a) for a in cfg.agents[n].command) for n in order) and req.prompt is None:
        raise NeedsPrompt(next(n for n in order if any(_NEEDS_PROMPT.search(a) for a in cfg.agents[n].command)))
    return order if len(order) > 1 else []




def wants_prompt_file(cfg: Config, req: Request) -> bool:
    """Does the request run a preset that takes its prompt as a file ({prompt_file})?"""
    if req.command:
        return False
    agent = resolve_agent(cfg, req)[0]
    return any("{prompt_file}" in a for name in route_request(cfg, req, agent) or [agent]
               for a in cfg.agents[name].command)


def unused_prompt(cfg: Config, req: Request) -> str | None:
    """Why a prompt given is put nowhere, or None: "command", beside an explicit command and
    no preset (the command runs as given); "preset", its preset's command has neither
    {prompt} nor {prompt_file}. Each front end says so in its own terms."""
    if req.prompt is None:
        return None
    if req.command:
        return "command" if req.agent is None else None
    preset = cfg.agents.get(req.agent or cfg.default_agent)
    if preset is not None and not any(_NEEDS_PROMPT.search(a) for a in preset.command):
        return "preset"
    return None


def unused_prompt_text(cfg: Config, req: Request, command: str) -> str | None:
    """The warning of unused_prompt, `command` naming the explicit command as the front end
    takes it (`the command after --`, `command`)."""
    why = unused_prompt(cfg, req)
    if why == "command":
        return (f"the prompt is not used: {command} runs as given (put the prompt in its arguments, or leave out"
                " the command to run the agent preset)")
    if why == "preset":
        agent = req.agent or cfg.default_agent
        return (f"the prompt is not used: preset {agent!r} has no {{prompt}} or {{prompt_file}} in its command"
                f" (add one to config agents.{agent}.command)")
    return None


def parent_task(index: Index, ref: tuple[int, str] | None) -> Task | None:
    """The task a delegating agent runs in: None from outside any task, or when the id and
    name its environment carries are not a task of this home (another home's agent)."""
    if ref is None:
        return None
    return next((t for t in index.all_tasks() if t.id == ref[0] and t.name == ref[1]), None)


def check_nesting(parent: Task | None) -> None:
    """May the agent of `parent` delegate? (Admission asks, and the MCP server, which serves
    such an agent only the tools that read.)"""
    if parent is None or parent.nesting > 0:
        return
    where = f"this agent runs inside kugetsu task {parent.name} (#{parent.id})"
    if parent.depth > 0:
        raise Nested(f"{where} at depth {parent.depth + 1}, the deepest the preset that began the chain allows"
                     " (its `nesting`): a task's agent delegates no deeper")
    what = f"its preset {parent.agent!r}" if parent.agent else "it runs an explicit command, which"
    raise Nested(f"{where}, and {what} allows no nesting: its agents may not delegate (set the preset's"
                 " `nesting` to 1 or more to let them)")


def nesting_of(index: Index, cfg: Config, req: Request, agent: str | None) -> tuple[int, int]:
    """(depth, nesting) of a task admitted for `req` (see Task); raises Nested when its
    delegator may not delegate."""
    preset = cfg.agents.get(agent) if agent else None
    own = preset.nesting if preset else 0
    parent = parent_task(index, req.parent)
    check_nesting(parent)
    if parent is None:
        return 0, own
    return parent.depth + 1, min(parent.nesting - 1, own)


def resolve_agent(cfg: Config, req: Request) -> tuple[str | None, list[str], dict[str, str]]:
    """(agent name, argv template, env) for a request."""
    if req.command:
        return req.agent, list(req.command), dict(req.env)
    agent = req.agent or cfg.default_agent
    preset = cfg.agents.get(agent)
    if preset is None:
        raise UsageError(f"unknown agent preset {agent!r}; known: {', '.join(sorted(cfg.agents))}")
    if req.prompt is None and any(_NEEDS_PROMPT.search(a) for a in preset.command):
        raise NeedsPrompt(agent)
    return agent, list(preset.command), {**preset.env, **req.env}


def empty_prompt(prompt: str) -> bool:
    """The one definition of an empty prompt: nothing but white space. check_prompt refuses one
    at admission and edit; the CLI asks it of a --prompt-file to name the file in its message."""
    return not prompt.strip()


def check_prompt(cfg: Config, prompt: str | None) -> None:
    """A prompt given must say something (an agent started with nothing to do is a slot spent
    for nothing), and one over prompt_max_size is refused (a 64 MB prompt made every command
    cost a second and 200 MB). Admission and edit: every front end gets these checks."""
    if prompt is None:
        return
    if empty_prompt(prompt):
        raise EmptyPrompt
    size, cap = len(prompt.encode("utf-8", "surrogateescape")), cfg.prompt_max_bytes
    if size > cap:
        raise UsageError(
            f"the prompt is {format_size(size)}, over prompt_max_size ({format_size(cap)}; each prompt is kept"
            " in index.json): raise it (config prompt_max_size, e.g. 1MiB) and use a preset with {prompt_file},"
            " which hands the agent the prompt as a file (an argument takes at most 128 KiB); or give a short prompt"
            " that names a file in the task's directory for the agent to read")


def _check_text(req: Request) -> None:
    """Everything a task keeps is UTF-8 text. An argument with a byte that is not (a shell's
    $'\\x9b' arrives as a lone surrogate) cannot be stored: refused here, by name, not a
    traceback from the index's encoder after the checks."""
    fields = [("the working directory", req.cwd), ("the prompt", req.prompt), ("the source", req.source),
              ("the agent preset", req.agent), ("the group", req.group)]
    fields += [(f"argument {i} of the command", a) for i, a in enumerate(req.command or [])]
    for what, text in fields:
        try:
            (text or "").encode()
        except UnicodeEncodeError:
            raise UsageError(f"{what} is not UTF-8 text ({text!r}), and a task is kept as text: give it in"
                             " UTF-8 (or, in a command, let the shell make the byte: printf '\\233')") from None


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env(env: dict[str, str]) -> None:
    """`delegate --env K=V`: a name a shell could export, none of kugetsu's own (KUGETSU_*:
    the task's identity, token and home are set for each agent and must not be forged), a
    value the kernel can pass (no NUL) kept as text. Errors name the variable, never its
    value: a value may be a secret (an API key), and an error is printed and logged."""
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise UsageError(f"invalid environment variable name {name!r}: letters, digits and '_', not starting"
                             " with a digit (e.g. API_BASE)")
        if name.upper().startswith("KUGETSU_"):
            raise UsageError(f"environment variable {name} is kugetsu's own (KUGETSU_* variables are set for each"
                             " agent: its task id, name, token and home), and cannot be set for a task")
        if not isinstance(value, str) or "\0" in value:
            raise UsageError(f"the value of environment variable {name} has a NUL byte, which no environment"
                             " variable can hold")
        try:
            value.encode()
        except UnicodeEncodeError:
            raise UsageError(f"the value of environment variable {name} is not UTF-8 text, and a task is kept as"
                             " text") from None


def _check_name(index: Index, name: str) -> None:
    """A new task's name (delegate, edit): valid, not digits only, unique among live tasks."""
    if name.isascii() and name.isdigit():
        raise UsageError(
            f"invalid task name {name!r}: a name of digits only would be read as task #{name};"
            f" add a letter, e.g. issue-{name}"
        )
    if not valid_name(name):
        raise UsageError(
            f"invalid task name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    if any(t.name == name for t in index.live()):
        raise UsageError(f"a task named {name!r} is already queued or running; pick another name")


def admit(index: Index, cfg: Config, now: datetime, req: Request,
          look: Look | None = None) -> tuple[Task, list[Event]]:
    """Add a task to the queue, or refuse. Raises before changing anything. `look`: of the
    queue as it is before (a Chain's, core/look.py: the new task's position then asks only
    what its arrival can have changed, not the whole queue again)."""
    check_prompt(cfg, req.prompt)
    check_env(req.env)
    if req.name is not None:
        _check_name(index, req.name)
    if req.priority not in PRIORITIES:
        raise UsageError(f"invalid priority {req.priority!r}; choose one of {', '.join(PRIORITIES)}")
    if req.group is not None and req.group not in cfg.groups:
        raise UnknownGroup(req.group, sorted(cfg.groups))
    if req.pinned_host is not None and not cfg.clustered:
        raise NotClustered("a task pinned to a host")
    if req.pinned_host is not None and not valid_host(req.pinned_host):
        raise InvalidHost(req.pinned_host)
    if req.retries < 0:
        raise UsageError(f"invalid retries {req.retries}: a task is run again 0 or more times after a failure")
    _check_text(req)
    agent, template, env = resolve_agent(cfg, req)
    route = route_request(cfg, req, agent)
    for what, value in (("a budget in USD", req.budget_usd), ("a token budget", req.max_tokens)):
        if value is not None and not value > 0:
            raise UsageError(f"{what} must be more than 0, got {value}")
    memory, max_procs, slots = declared(cfg, req, agent)
    depth, nesting = nesting_of(index, cfg, req, agent)
    after = dependencies(index, req.after)
    limit = cfg.max_queued_per_source
    if limit is not None:
        mine = sum(1 for t in index.queued if t.source == req.source)
        if mine >= limit:
            raise Rejected(
                f"source {req.source} already has {mine} queued task{'' if mine == 1 else 's'} (limit {limit});"
                " try again when one of them starts"
            )
    waiting_after = len(index.queued) + 1 - free_slots(index, cfg)
    excess = waiting_after - cfg.max_queue
    if excess > 0 and (cfg.on_queue_full != "drop_oldest" or excess > len(index.queued)):
        raise QueueFull(len(index.queued), cfg.max_queue, len(index.active), cfg.max_agents)
    victims = sorted(index.queued, key=lambda t: t.id)[:excess] if excess > 0 else []
    if any(v.id in after for v in victims):  # it would be cancelled at once, its dependency dropped
        raise QueueFull(len(index.queued), cfg.max_queue, len(index.active), cfg.max_agents)
    # Nothing was refused: from here on the index changes.
    events = []
    for victim in victims:  # drop_oldest: the longest-waiting tasks make room, their delegators are told
        events += cancel(index, victim, now, 0.0, "dropped: queue full")
    task_id = index.next_id
    name = req.name or f"task-{task_id}"
    expire_after = req.expire_after if req.expire_after is not None else cfg.queue_timeout_s
    start_at = _start_time(req.start_at, now)
    timeout = req.timeout if req.timeout is not None else cfg.run_timeout_s
    if not req.command and req.prompt_path is None and wants_prompt_file(cfg, req):
        raise ValueError("a {prompt_file} preset needs Request.prompt_path (delegation.delegate sets it)")
    values = {"prompt": req.prompt or "", "prompt_file": req.prompt_path or "", "name": name, "id": str(task_id)}
    _check_argv(template if req.command else render_command(template, values), req.cwd)
    prompted = req.prompted if req.command else any(_NEEDS_PROMPT.search(a) for a in template)
    if prompted and req.command:  # `kugetsu retry` of a preset's task: its kept command, with the prompt
        _check_argv([_KEPT.sub(lambda m: values[m.group(1)], a) for a in template], req.cwd)
    command = template if req.command else render_template(template, values)
    task = Task(
        id=task_id,
        name=name,
        priority=req.priority,  # type: ignore[arg-type]
        source=req.source,
        group=req.group,
        agent=agent,
        command=command,
        cwd=req.cwd,
        created_at=now,
        expires_at=(start_at or now) + timedelta(seconds=expire_after) if expire_after else None,
        not_before=start_at,
        prompted=prompted,
        timeout=timeout,
        env=env,
        token=req.token,
        repo=req.repo,
        base=req.base if req.repo else None,
        branch=f"kugetsu/{name}" if req.repo else None,
        pinned_host=req.pinned_host,
        after=after,
        retries=req.retries,
        retry_delay=req.retry_delay,
        retry_of=req.retry_of,
        depth=depth,
        nesting=nesting,
        route=route,
        fallback_fresh=bool(route) and (req.fallback_fresh if req.fallback_fresh is not None
                                        else bool(cfg.agents[agent].fallback_fresh)),  # type: ignore[index]
        budget_usd=req.budget_usd,
        max_tokens=req.max_tokens,
        memory=memory,
        max_procs=max_procs,
        slots=slots,
    )
    index.next_id += 1
    index.queued.append(task)
    now_look = look.following(index.queued) if look is not None else None  # of the queue with the task in it
    return task, events + [_event("queued", task, now, position=position(index, cfg, now, task, now_look))]


def declared(cfg: Config, req: Request, agent: str | None) -> tuple[int | None, int | None, int]:
    """(memory, max_procs, slots) a task admitted for `req` declares: the request's, else its
    preset's (memory, max_procs fall back on resources' defaults when it runs). A task that
    could never fit this machine (or the cluster's max_agents, or its group) is refused here
    rather than wait for ever."""
    preset = cfg.agents.get(agent) if agent else None
    memory = req.memory
    if memory is None and preset is not None and preset.memory is not None:
        memory = parse_size(preset.memory)
    max_procs = req.max_procs if req.max_procs is not None else (preset.max_procs if preset else None)
    slots = req.slots if req.slots is not None else (preset.slots if preset else 1)
    if memory is not None and memory <= 0:
        raise UsageError(f"invalid memory {memory}: give a size like 4G or 512M")
    if slots < 1 or (max_procs is not None and max_procs < 1):
        raise UsageError("slots and max-procs are 1 or more")
    if slots > cfg.max_agents:
        raise UsageError(f"a task of {slots} slots could never start: max_agents is {cfg.max_agents}; declare"
                         f" {cfg.max_agents} slots or fewer, or raise max_agents")
    if req.group in cfg.groups and slots > cfg.groups[req.group].max_agents:
        cap = cfg.groups[req.group].max_agents
        raise UsageError(f"a task of {slots} slots could never start in group {req.group}, which has {cap}")
    need = memory if memory is not None else cfg.resources.default_memory_bytes
    if need and not cfg.clustered and need > (budget := cfg.memory_budget):
        raise UsageError(f"a task of {short_size(need)} could never start: max_memory is {short_size(budget)};"
                         " declare less memory, or raise max_memory")
    return memory, max_procs, slots


STARTED_AT_ONCE = "started at once"


def started_at_once(events: list[Event], task: Task) -> None:
    """The `queued` event of a task that started in its admission's own transaction: no
    position (it never waited at one), and says so, so that a feed reads `queued · started
    at once`, `started · slot 1`, not a position 1 it never held. The event stays: it is
    the admission (stats count admissions by it)."""
    if task.state is TaskState.RUNNING:
        for e in events:
            if e.type == "queued" and e.task == task.id:
                e.position, e.reason = None, STARTED_AT_ONCE


def dependencies(index: Index, refs: list[str]) -> list[int]:
    """The ids of the tasks named to run after (duplicates dropped). One kugetsu does not
    know, or one that has already ended otherwise than succeeded, is refused: this task
    could never start."""
    ids: list[int] = []
    for ref in refs:
        try:
            dep = find(index, ref)
        except NoSuchTask:
            raise UnknownDependency(ref) from None
        if dep.state.final and dep.state is not TaskState.SUCCEEDED:
            raise UsageError(f"dependency {dep.name} (#{dep.id}) {_stands(dep)}: a task after it could never start")
        if dep.id not in ids:
            ids.append(dep.id)
    return ids


def dependencies_failed(index: Index, now: datetime, look: Look | None = None) -> list[Event]:
    """Queued tasks one of whose dependencies ended otherwise than succeeded are cancelled,
    each with its own event (`dependency issue-16 failed`). In id order: a dependency is
    always older than its dependent, so a whole chain ends in one pass. `look`: of this queue,
    when the caller asks more of it (policy.Look)."""
    if not Look.of(index, look).after:  # C's steps: every transaction asks it of the whole queue
        return []
    waiting = [t for t in index.queued if t.after]
    ended = {t.id: t for t in index.finished}
    events = []
    for task in sorted(waiting, key=lambda t: t.id):
        bad = next((ended[d] for d in task.after if d in ended and ended[d].state is not TaskState.SUCCEEDED), None)
        if bad is not None:
            index.queued.remove(task)
            task.reason = f"dependency {bad.name} {bad.state.value}"
            events.append(_close(index, task, TaskState.CANCELLED, now))
            ended[task.id] = task
    return events


def set_priority(index: Index, task: Task, level: str, now: datetime) -> list[Event]:
    """Change a queued task's priority (it moves in the order under `priority` and `fair`)."""
    if level not in PRIORITIES:
        raise UsageError(f"invalid priority {level!r}; choose one of {', '.join(PRIORITIES)}")
    if task.state is not TaskState.QUEUED:
        raise UsageError(
            f"task {task.name} (#{task.id}) {_stands(task)}; only a queued task's priority can change", code=1
        )
    if task.priority == level:
        return []
    task.priority = level  # type: ignore[assignment]
    return [_event("priority", task, now, value=level)]


def _queued_only(task: Task, what: str) -> None:
    if task.state is not TaskState.QUEUED:
        raise UsageError(f"task {task.name} (#{task.id}) {_stands(task)}; only a queued task can be {what}", code=1)


def move_next(index: Index, task: Task, now: datetime, by: str = "cli") -> list[Event]:
    """`next TASK`: it starts before every other queued task that may start (the latest `next`
    first), whatever the strategy; limits still apply (its group's slots, a hold, its
    dependencies), and it never starts beyond max_agents. No event when it is first already."""
    _queued_only(task, "moved")
    if task.stashed_at is not None:
        raise UsageError(f"task {task.name} (#{task.id}) is stashed: unstash it first", code=1)
    top = max((t.first for t in index.queued), default=0)
    if task.first and task.first == top:
        return []
    task.first = top + 1
    return [_event("moved", task, now, reason=f"to the front by {by}")]


def stash(task: Task, now: datetime, on: bool, by: str = "cli") -> list[Event]:
    """`stash TASK` (on) / `unstash TASK`: a queued task set aside: it keeps its place in the
    index but has no position, never starts, holds no one up and does not expire; unstashed,
    it takes its place again and its queue deadline moves by the time it was stashed."""
    _queued_only(task, "stashed" if on else "unstashed")
    if (task.stashed_at is not None) == on:
        return []
    if on:
        task.stashed_at = now
    else:
        if task.expires_at is not None and task.stashed_at is not None:
            task.expires_at += max(timedelta(0), now - task.stashed_at)
        task.stashed_at = None
    return [_event("stashed" if on else "unstashed", task, now, reason=f"{'stashed' if on else 'unstashed'} by {by}")]


class Edit(msgspec.Struct, kw_only=True):
    """What `kugetsu edit` changes of a queued task; None leaves a field as it is."""

    prompt: str | None = None
    priority: str | None = None
    expire_after: float | None = None  # seconds from now; 0: never expires
    timeout: float | None = None  # run timeout in seconds; 0: no limit
    group: str | None = None
    name: str | None = None
    cwd: str | None = None  # absolute; ops checks that it is a directory
    agent: str | None = None  # another preset: its command is made with the task's prompt
    command: list[str] | None = None  # an explicit argv instead (the task's agent stays its label)
    prompt_path: str | None = None  # where a {prompt_file} preset's prompt is (ops knows; pm does no I/O)
    start_at: datetime | None = None  # `edit --at/--delay`: when it may start (now or past: at once)

    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in self.__struct_fields__ if f != "prompt_path")


def edit(index: Index, cfg: Config, task: Task, now: datetime, change: Edit) -> list[Event]:
    """Change a queued task: checks everything first, then changes it, one `edited` event
    naming the fields (the prompt's text stays out of the event log)."""
    if task.state is not TaskState.QUEUED:
        raise UsageError(f"task {task.name} (#{task.id}) {_stands(task)}; only a queued task can be edited", code=1)
    if change.priority is not None and change.priority not in PRIORITIES:
        raise UsageError(f"invalid priority {change.priority!r}; choose one of {', '.join(PRIORITIES)}")
    if change.group is not None and change.group not in cfg.groups:
        raise UnknownGroup(change.group, sorted(cfg.groups))
    if change.group is not None and task.slots > (cap := cfg.groups[change.group].max_agents):
        raise UsageError(f"task {task.name} (#{task.id}) takes {task.slots} slots: it could never start in group"
                         f" {change.group}, which has {cap}")
    for what, value in (("expiry", change.expire_after), ("timeout", change.timeout)):
        if value is not None and value < 0:
            raise UsageError(f"a negative {what} ({value:g}s) makes no sense; 0 means none")
    check_prompt(cfg, change.prompt)
    name = task.name if change.name is None else change.name
    if name != task.name:
        _check_name(index, name)
        if task.repo:
            raise UsageError(f"task {task.name} (#{task.id}) works in a worktree on branch {task.branch}, named"
                             " after it: its name cannot change; cancel it and delegate again", code=1)
    if change.cwd is not None and change.cwd != task.cwd and task.repo:
        raise UsageError(f"task {task.name} (#{task.id}) works in a worktree of {task.repo}: its directory cannot"
                         " change; cancel it and delegate again", code=1)
    agent = task.agent if change.agent is None else change.agent
    new_preset = cfg.agents.get(agent) if agent else None
    if change.agent is not None and new_preset is None:
        raise UsageError(f"unknown agent preset {agent!r}; known: {', '.join(sorted(cfg.agents))}")
    old_preset = cfg.agents.get(task.agent) if task.agent else None
    values = {"prompt": task.prompt or "", "prompt_file": change.prompt_path or "", "name": task.name,
              "id": str(task.id)}
    # Only a command made from its preset's template can be made again (a new prompt, name or
    # preset): one given at delegation (`-- CMD`), or from a preset changed since, cannot. A
    # task keeps `{prompt}` in its command (the text is the store's); one from an older index
    # has its prompt inside its command, so it is rendered whole to compare.
    kept = render_template if task.prompted else render_command
    from_preset = old_preset is not None and kept(old_preset.command, values) == task.command
    # Does the task have a prompt? Its text is the store's (ops passes a new one in `change`).
    has_prompt = change.prompt is not None or task.prompted or task.prompt is not None
    command = change.command
    if command is None and (change.prompt is not None or change.agent is not None) and not from_preset:
        what = "prompt" if change.prompt is not None else "agent preset"
        raise UsageError(f"task {task.name} (#{task.id}) runs a command given at delegation, not its agent preset's"
                         f" with the prompt, so its {what} cannot change; give the new command (or cancel it and"
                         " delegate again)")
    prompted = task.prompted if change.command is None else False
    if command is None and from_preset and new_preset is not None:
        if not has_prompt and any(_NEEDS_PROMPT.search(a) for a in new_preset.command):
            raise NeedsPrompt(agent or "")
        if task.prompt is not None and not task.prompted and change.prompt is None:
            # An older index's task keeps its prompt where it was (inside its command).
            command = render_command(new_preset.command, {**values, "prompt": task.prompt, "name": name})
        else:
            command = render_template(new_preset.command, {**values, "name": name})
            prompted = any(_NEEDS_PROMPT.search(a) for a in new_preset.command)
            _check_argv(render_command(new_preset.command, {**values, "prompt": change.prompt or "", "name": name}),
                        change.cwd or task.cwd)
    env = task.env
    if agent != task.agent and new_preset is not None:  # the task's own variables stay, the preset's change
        own = {k: v for k, v in task.env.items() if old_preset is None or old_preset.env.get(k) != v}
        env = {**new_preset.env, **own}
    if command is not None:
        _check_argv(command, change.cwd or task.cwd)
    changed: dict[str, object] = {}
    if change.prompt is not None:
        # The caller stores the new text (verbs.edit: txn.prompts, only when the text differs);
        # the index keeps the template.
        task.prompt = None
        changed["prompt"] = f"{len(change.prompt or '')} characters"
    if name != task.name:
        task.name = changed["name"] = name
    if agent != task.agent:
        task.agent = changed["agent"] = agent
        task.env = env
    if change.cwd is not None and change.cwd != task.cwd:
        task.cwd = changed["cwd"] = change.cwd
    if command is not None and command != task.command:
        task.command = command
        if change.command is not None:  # an argv given: its words are the caller's, not a prompt
            changed["command"] = f"{len(command)} arguments"
    task.prompted = prompted
    if change.priority is not None and change.priority != task.priority:
        task.priority = change.priority  # type: ignore[assignment]
        changed["priority"] = change.priority
    if change.group is not None and change.group != task.group:
        task.group = changed["group"] = change.group
    if change.expire_after is not None:
        task.expires_at = now + timedelta(seconds=change.expire_after) if change.expire_after else None
        changed["expires_at"] = task.expires_at.isoformat() if task.expires_at else None
    if change.timeout is not None and (change.timeout or None) != task.timeout:
        task.timeout = change.timeout or None
        changed["timeout"] = task.timeout
    if change.start_at is not None:
        start = _start_time(change.start_at, now)
        if start != task.not_before:
            # Its queue expiry moves with its start (it counts from then, as at admission),
            # unless an expiry was given in this same edit.
            if task.expires_at is not None and change.expire_after is None:
                task.expires_at += (start or now) - max(task.not_before or now, now)
                changed["expires_at"] = task.expires_at.isoformat()
            task.not_before = start
            changed["not_before"] = start.isoformat() if start else None
    if not changed:
        return []
    return [_event("edited", task, now, key=",".join(changed), value=changed)]


def _start_time(at: datetime | None, now: datetime) -> datetime | None:
    """A start time asked for (`--at`, `--delay`): None when it has come already; at most
    MAX_DURATION ahead, as every duration (a deadline computed from it must stay a date)."""
    if at is None or at <= now:
        return None
    if at - now > timedelta(seconds=MAX_DURATION):
        raise UsageError(f"a start time {at.isoformat()} is too far ahead: at most {MAX_DURATION // 86400}d from now")
    return at


# Linux refuses a single argv element of 32 pages (MAX_ARG_STRLEN) or more at exec.
MAX_ARG_BYTES = 128 * 1024 - 1


def _check_argv(command: list[str], cwd: str) -> None:
    """Refuse at admission an argv that exec could never take, rather than admit a task that
    cannot start (a NUL byte in a prompt file made the service's spawn raise)."""
    if "\0" in cwd:
        raise UsageError("the working directory contains a NUL character")
    for i, arg in enumerate(command):
        if "\0" in arg:
            raise UsageError(
                f"argument {i} of the command (the prompt, if the preset puts it there) contains a NUL"
                " character, which no program can receive in its arguments"
            )
        size = len(arg.encode("utf-8", "surrogateescape"))
        if size > MAX_ARG_BYTES:
            raise UsageError(
                f"argument {i} of the command is {size} bytes; the system allows at most {MAX_ARG_BYTES} in one"
                " argument: if it is the prompt, put {prompt_file} in place of {prompt} in the preset's command"
                " (the agent gets the prompt as a file), or give a short prompt that names a file for the agent to read"
            )
