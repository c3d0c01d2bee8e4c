"""config.json's model: every key with its type and default, the built-in agent presets, the
rules a value must meet (checked when it is decoded), and each key's help text.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect

from kugetsu.config.units import Duration, format_size, LOG_MIN, parse_duration, parse_size
from kugetsu.core.models import valid_host
from kugetsu.errors import redact_url


# ---- the model -------------------------------------------------------------------------

# The built-in presets' limit patterns are best-effort: what these agents printed when their
# provider refused them, as far as known (README, "Provider limits"); users tune them.
_HTTP_LIMIT = r"(?i)\b429\b.{0,40}(too many requests|rate.?limit)|rate_limit_(error|exceeded)"
# `codex exec resume` has no --sandbox: the sandbox is set as config (-c), the same for both.
_CODEX_FLAGS = ["--json", "--skip-git-repo-check", "-c", 'sandbox_mode="workspace-write"',
                "-c", "sandbox_workspace_write.exclude_slash_tmp=true",
                "-c", "sandbox_workspace_write.exclude_tmpdir_env_var=true"]
_OPENCODE_PLUGIN = (Path(__file__).parent.parent / "agents" / "opencode_plugin.js").as_uri()
_CLAUDE_FLAGS = ["--output-format", "stream-json", "--verbose", "--permission-mode", "acceptEdits"]
DEFAULT_AGENTS: dict[str, dict[str, Any]] = {
    # opencode: its JSON events (session, usage, the error that ended a run: kugetsu/agents/
    # opencode.py), and kugetsu's plugin, which ends a run whose retry of a refused request
    # would wait longer than 30 s instead of sitting silent in its slot (README, "Agents").
    "opencode": {"command": ["opencode", "run", "--format", "json", "{prompt}"],
                 "env": {"OPENCODE_CONFIG_CONTENT": '{"plugin": ["%s"]}' % _OPENCODE_PLUGIN},
                 "output": "opencode",
                 "limit": {"patterns": [_HTTP_LIMIT, r"(?i)(usage|quota|rate) limit (reached|exceeded)",
                                        r"(?i)insufficient_quota", r'"statusCode"\s*:\s*429\b']},
                 "session_pattern": r'"sessionID"\s*:\s*"(ses_[A-Za-z0-9]+)"',
                 "resume": ["opencode", "run", "--format", "json", "--session", "{session}", "Continue where you left off."]},
    # Claude Code headless: its stream-json output (session, limits, errors, usage, denials;
    # kugetsu/agents/claude.py) with edits allowed in its working directory, and no retries of
    # its own (kugetsu holds the preset and resumes the session instead: README, "Agents").
    "claude": {"command": ["claude", "-p", "{prompt}", *_CLAUDE_FLAGS], "env": {"CLAUDE_CODE_MAX_RETRIES": "0"},
               "output": "claude",
               "limit": {"patterns": [_HTTP_LIMIT, r"(?i)usage limit reached", r"(?i)\b(5-hour|weekly|session|opus) limit reached",
                                      r"(?i)you've (hit|reached) your [\w -]{0,30}\blimit\b",
                                      r"(?i)\bAPI Error:.{0,40}\b(429|529)\b|\boverloaded_error\b"]},
               "session_pattern": r'"session_id"\s*:\s*"([0-9a-fA-F-]{36})"',
               "resume": ["claude", "-p", "--resume", "{session}", "Continue where you left off.", *_CLAUDE_FLAGS]},
    # Codex: its JSONL events (thread id, usage, the failed turn's message: kugetsu/agents/
    # codex.py), outside a git repository too, in its workspace-write sandbox: it may write its
    # working directory (a worktree) and nothing else, not /tmp, not the network (README, "Agents").
    "codex": {"command": ["codex", "exec", *_CODEX_FLAGS, "{prompt}"], "env": {},
              "output": "codex",
              "limit": {"patterns": [_HTTP_LIMIT, r"(?i)you've hit your usage limit", r"(?i)usage_limit_reached",
                                     r"(?i)rate limit (reached|exceeded)", r"(?i)\bquota exceeded\b",
                                     r"(?i)exceeded retry limit, last status: 429"]},
              "session_pattern": r'(?i)(?:session id:\s*|"thread_id"\s*:\s*")([0-9a-fA-F-]{36})',
              "resume": ["codex", "exec", "resume", *_CODEX_FLAGS, "{session}", "Continue where you left off."]},
}
DEFAULT_TELEGRAM_EVENTS = ["started", "succeeded", "failed", "cancelled", "expired", "lost", "held"]
EVENT_TYPES = ("queued", "started", "succeeded", "failed", "cancelled", "expired", "lost", "config", "worktree",
               "requeued", "held", "released", "schedule")


def _builtin_patterns() -> frozenset[str]:
    out = set()
    for preset in DEFAULT_AGENTS.values():
        out.update(preset.get("limit", {}).get("patterns", []))
        if preset.get("session_pattern"):
            out.add(preset["session_pattern"])
    return frozenset(out)


# Known good (tests/test_config_store.py compiles them): not compiled again on every CLI call,
# where the built-in presets are validated with the user's config.
_BUILTIN_PATTERNS = _builtin_patterns()


def _check_pattern(pattern: str, what: str) -> None:
    if pattern in _BUILTIN_PATTERNS:
        return
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{what}: {pattern!r} is not a regular expression ({err})") from None


class LimitConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How a preset's provider limit shows at the end of its output (docs: README, "Provider
    limits"): an exit that is not 0 with one of `exit_codes`, or one of `patterns` in the log's
    tail. The preset is then held until the reset time the output gives, else for `backoff`,
    doubling with each hit in a row up to `max_backoff`."""

    patterns: list[str] = []
    exit_codes: list[int] = []
    backoff: Duration = "1m"
    max_backoff: Duration = "1h"
    # Before the wall: the provider's window quota, as far as it is known (e.g. "5h" and a
    # number of starts or of tokens in and out): kugetsu starts no more of this preset in a
    # window once it is used up, and lets one task probe the next window first.
    window: Duration | None = None
    window_starts: Annotated[int, msgspec.Meta(ge=1)] | None = None
    window_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        for p in self.patterns:
            _check_pattern(p, "limit.patterns")
        parse_duration(self.backoff, "limit.backoff")
        parse_duration(self.max_backoff, "limit.max_backoff")
        if self.window is not None:
            if parse_duration(self.window, "limit.window") <= 0:
                raise ValueError("limit.window must be a duration longer than 0, e.g. \"5h\"")
            if self.window_starts is None and self.window_tokens is None:
                raise ValueError("limit.window needs limit.window_starts (starts in a window) or limit.window_tokens"
                                 " (tokens in and out in a window)")
        elif self.window_starts is not None or self.window_tokens is not None:
            raise ValueError("limit.window_starts and limit.window_tokens need limit.window, e.g. \"5h\"")

    @property
    def window_s(self) -> float | None:
        return None if self.window is None else parse_duration(self.window)

    @property
    def enabled(self) -> bool:
        return bool(self.patterns or self.exit_codes)


class AgentPreset(msgspec.Struct, forbid_unknown_fields=True):
    command: Annotated[list[str], msgspec.Meta(min_length=1)]
    env: dict[str, str] = {}
    worktree: bool = False  # run this agent in its own git worktree (docs/worktrees.md)
    max_agents: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None  # its own running agents at most
    limit: LimitConfig = msgspec.field(default_factory=LimitConfig)
    session_pattern: str | None = None  # its session id in its output (group 1)
    resume: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None  # argv continuing {session}
    # How many levels of tasks its agents may delegate beneath them (0: none; their `kugetsu
    # mcp` serves only the tools that read). A task delegated from inside a task gets the
    # smaller of its own preset's and what is left of its delegator's: recursion ends.
    nesting: Annotated[int, msgspec.Meta(ge=0, le=8)] = 0
    # What its output is (kugetsu/agents): "text", or the agent's structured stream, read first
    # for the session, a limit, an error, usage and denials (the patterns are the fallback).
    output: Literal["text", "claude", "codex", "opencode"] = "text"
    # Failover (README, "Provider limits"): while this preset is held (or full, or over its
    # budget), its queued tasks start on the first of these with room. `fallback_fresh`: a task
    # whose run was interrupted with a session may start afresh there too (else it waits to resume).
    fallback: list[str] = []
    fallback_fresh: bool = False
    # Resources its tasks declare unless `delegate` says otherwise (README, "Resources"): the
    # memory each may use (admission counts it against max_memory; over it, the task is
    # stopped), its processes at most (a fork storm), the slots it takes.
    memory: str | int | None = None
    max_procs: Annotated[int, msgspec.Meta(ge=1)] | None = None
    slots: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1

    def __post_init__(self) -> None:
        if self.memory is not None:
            parse_size(self.memory, "memory")
        if self.session_pattern is not None:
            _check_pattern(self.session_pattern, "session_pattern")
        if self.resume is not None and not any("{session}" in a for a in self.resume):
            raise ValueError("resume: the command must contain {session}, e.g. [\"claude\", \"--resume\", \"{session}\"]")


class WorktreesConfig(msgspec.Struct, forbid_unknown_fields=True):
    enabled: bool = False
    keep: Literal["changed", "always", "never"] = "changed"
    max_disk: str | int | None = None

    def __post_init__(self) -> None:
        if self.max_disk is not None:
            parse_size(self.max_disk, "worktrees.max_disk")

    @property
    def max_disk_bytes(self) -> int | None:
        return None if self.max_disk is None else parse_size(self.max_disk)


class TelegramConfig(msgspec.Struct, forbid_unknown_fields=True):
    token: str | None = None
    allowed_chat_ids: list[int] = []
    allowed_user_ids: list[int] = []
    notify_chat_ids: list[int] = []
    api_base_url: str = "https://api.telegram.org/bot"
    events: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_TELEGRAM_EVENTS))
    allow_delegate: bool = False
    # Where /delegate runs the agent (the service itself runs in /); None: the user's home.
    delegate_cwd: str | None = None

    def __post_init__(self) -> None:
        unknown = [e for e in self.events if e not in EVENT_TYPES]
        if unknown:
            raise ValueError(f"unknown event type {unknown[0]!r}; choose from {', '.join(EVENT_TYPES)}")


def parse_address(text: str, what: str, example: str = "127.0.0.1:9464") -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:9464` for IPv6) -> (host, port); port 0 takes any free one."""
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"{what}: {text!r} is not HOST:PORT, e.g. {example}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Only this machine can reach an address of the loopback range (or `localhost`)."""
    if host == "localhost":
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The service's OpenMetrics endpoint: off unless `listen` is set. Only on the loopback
    addresses unless `allow_remote`: the figures (task names are not among them, sources
    are) are for this machine's eyes unless someone decides otherwise."""

    listen: str | None = None
    allow_remote: bool = False

    def __post_init__(self) -> None:
        if self.listen is None:
            return
        host, _ = parse_address(self.listen, "metrics.listen")
        if not self.allow_remote and not is_loopback(host):
            raise ValueError(
                f"metrics.listen {self.listen!r} is not a loopback address: anyone who can reach it would see"
                " the figures. Use 127.0.0.1:PORT, or set metrics.allow_remote to true first"
            )

    @property
    def address(self) -> tuple[str, int] | None:
        return None if self.listen is None else parse_address(self.listen, "metrics.listen")


class McpConfig(msgspec.Struct, forbid_unknown_fields=True):
    # The bearer token `kugetsu mcp --http` requires (env KUGETSU_MCP_TOKEN wins); stdio needs none.
    token: str | None = None


class Budget(msgspec.Struct, forbid_unknown_fields=True):
    """What may be spent in a local day (a source's, a preset's): US dollars, tokens, or both."""

    usd: Annotated[float, msgspec.Meta(gt=0)] | None = None
    tokens: Annotated[int, msgspec.Meta(gt=0)] | None = None


class BudgetsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Daily budgets (README, "Provider limits"): a source or preset whose usage today has
    reached its budget starts nothing more until local midnight."""

    sources: dict[str, Budget] = {}
    agents: dict[str, Budget] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.sources or self.agents)


class GroupConfig(msgspec.Struct, forbid_unknown_fields=True):
    max_agents: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1


class ResourceGuard(msgspec.Struct, forbid_unknown_fields=True):
    """No new agent starts while the machine is below either bound. Both off by default."""

    min_available_memory: str | int | None = None
    max_load_per_cpu: Annotated[float, msgspec.Meta(gt=0)] | None = None

    def __post_init__(self) -> None:
        if self.min_available_memory is not None:
            parse_size(self.min_available_memory, "min_available_memory")

    @property
    def min_available_memory_bytes(self) -> int | None:
        return None if self.min_available_memory is None else parse_size(self.min_available_memory)

    @property
    def enabled(self) -> bool:
        return self.min_available_memory is not None or self.max_load_per_cpu is not None


class ResourcesConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Per-task resources (README, "Resources"): how use is measured and limits enforced, and
    what a task that declares nothing counts. The machine's budget is `max_memory` (local)."""

    # auto: cgroups where this service may make them (cgroup v1 memory+pids as root, or a
    # delegated v2 subtree), else sampling; sampling: /proc every `interval`, whatever is there.
    mode: Literal["auto", "cgroup", "sampling"] = "auto"
    interval: Duration = "2s"  # between two measurements of the running tasks
    default_memory: str | int | None = None  # a task that declares none counts this (null: 0, no limit)
    max_procs: Annotated[int, msgspec.Meta(ge=1)] | None = None  # a task's processes at most (null: no limit)

    def __post_init__(self) -> None:
        if parse_duration(self.interval, "resources.interval") < 0.05:
            raise ValueError("resources.interval must be at least 0.05s")  # in a unit parse_duration reads
        if self.default_memory is not None:
            parse_size(self.default_memory, "resources.default_memory")

    @property
    def interval_s(self) -> float:
        return parse_duration(self.interval)

    @property
    def default_memory_bytes(self) -> int | None:
        return None if self.default_memory is None else parse_size(self.default_memory)


def total_memory() -> int:
    """This machine's RAM (a sysconf: no file read)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


Strategy = Literal["fifo", "priority", "fair"]
STRATEGIES: tuple[str, ...] = ("fifo", "priority", "fair")


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Cluster mode's shared settings (docs/architecture.md §10)."""

    lease: Duration = "30s"  # a machine silent this long has its running tasks marked lost
    log_max_size: str | int = "1MiB"  # of each task's output shipped to the database

    def __post_init__(self) -> None:
        if parse_duration(self.lease, "cluster.lease") < 3:
            raise ValueError("cluster.lease must be at least 3s (heartbeats come every third of it)")
        parse_size(self.log_max_size, "cluster.log_max_size")

    @property
    def lease_s(self) -> float:
        return parse_duration(self.lease)

    @property
    def log_max_bytes(self) -> int:
        return parse_size(self.log_max_size)


# A machine's own keys: in cluster mode they stay in its config.json, everything else lives
# in the database and applies to every machine.
LOCAL_KEYS = ("store", "host", "host_max_agents", "max_memory", "memory_reserve")
STORE_ENV = "KUGETSU_STORE"


class Config(msgspec.Struct, forbid_unknown_fields=True):
    max_agents: Annotated[int, msgspec.Meta(ge=1, le=64)] = 3
    max_queue: Annotated[int, msgspec.Meta(ge=0)] = 50
    queue_timeout: Duration | None = "24h"
    run_timeout: Duration | None = None
    kill_grace: Duration = "10s"
    default_agent: str = "opencode"
    agents: dict[str, AgentPreset] = {}
    history_limit: Annotated[int, msgspec.Meta(ge=0)] = 500
    events_max_size: str | int = "16MiB"
    # Each task's log on disk: beyond it the service keeps its beginning and its end and drops
    # the middle (kugetsu/store/logtail.py); null: no cap.
    log_max_size: str | int | None = "64MiB"
    # A task's prompt at most: it lives in the index. 128 KiB is also the most Linux passes as
    # one argv element (MAX_ARG_STRLEN), so any prompt taken fits a {prompt} preset.
    prompt_max_size: str | int = "128KiB"
    autostart: bool = True
    telegram: TelegramConfig = msgspec.field(default_factory=TelegramConfig)
    worktrees: WorktreesConfig = msgspec.field(default_factory=WorktreesConfig)
    # Scheduling policies (docs/policies.md); the defaults are plain FIFO.
    strategy: Strategy = "fifo"
    max_active_per_source: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_queued_per_source: Annotated[int, msgspec.Meta(ge=1)] | None = None
    min_start_interval_per_source: Duration | None = None
    on_queue_full: Literal["reject", "drop_oldest"] = "reject"
    # Recurring schedules (docs/scheduling.md): firings missed while the service was down
    # run once when it is back (one) or not at all (skip).
    schedule_missed: Literal["one", "skip"] = "one"
    groups: dict[str, GroupConfig] = {}
    resource_guard: ResourceGuard = msgspec.field(default_factory=ResourceGuard)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    mcp: McpConfig = msgspec.field(default_factory=McpConfig)
    # Cluster mode (docs/architecture.md §10): the database's URL, this machine's name and slots.
    store: str | None = None
    host: str | None = None
    host_max_agents: Annotated[int, msgspec.Meta(ge=0, le=64)] | None = None
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    budgets: BudgetsConfig = msgspec.field(default_factory=BudgetsConfig)
    # The memory the running tasks of this machine may declare in all (null: its RAM less
    # memory_reserve); local to each machine in a cluster.
    max_memory: str | int | None = None
    memory_reserve: str | int = "1GiB"
    resources: ResourcesConfig = msgspec.field(default_factory=ResourcesConfig)

    @property
    def clustered(self) -> bool:
        """Whether this machine is one of a cluster (config `store` names its database): the
        one predicate the pure rules ask (placement, admission, selection); what else differs
        between one machine and a cluster the store answers (store/protocol.py)."""
        return self.store is not None

    def __post_init__(self) -> None:
        if self.store is not None and not re.match(r"^postgres(ql)?://", self.store):
            raise ValueError(f"store must be a PostgreSQL URL (postgresql://user@host/db), not {redact_url(self.store)!r}")
        if self.host is not None and not valid_host(self.host):
            raise ValueError(f"host {self.host!r}: use letters, digits, '.', '_' and '-' (at most 64)")
        for key in ("queue_timeout", "run_timeout", "kill_grace", "min_start_interval_per_source"):
            value = getattr(self, key)
            if value is not None:
                parse_duration(value, key)
        parse_size(self.events_max_size, "events_max_size")
        if self.max_memory is not None:
            parse_size(self.max_memory, "max_memory")
        parse_size(self.memory_reserve, "memory_reserve")
        parse_size(self.prompt_max_size, "prompt_max_size")
        if self.log_max_size is not None and parse_size(self.log_max_size, "log_max_size") < LOG_MIN:
            raise ValueError(f"log_max_size must be at least {format_size(LOG_MIN)} (room for the log's beginning"
                             f" and its end), got {self.log_max_size!r}; null: no cap")
        # User presets extend (and may override) the built-in ones.
        self.agents = msgspec.convert({**DEFAULT_AGENTS, **msgspec.to_builtins(self.agents)}, dict[str, AgentPreset])
        for name, preset in self.agents.items():
            for other in preset.fallback:
                if other not in self.agents or other == name:
                    raise ValueError(f"agents.{name}.fallback: {other!r} is not another preset; known:"
                                     f" {', '.join(sorted(self.agents))}")
        for name in self.budgets.agents:
            if name not in self.agents:
                raise ValueError(f"budgets.agents: {name!r} is not a preset; known: {', '.join(sorted(self.agents))}")
        if self.default_agent not in self.agents:
            raise ValueError(
                f"default_agent {self.default_agent!r} is not a preset; known: {', '.join(sorted(self.agents))}"
            )

    # Durations in seconds, for the code that needs numbers.
    @property
    def queue_timeout_s(self) -> float | None:
        return None if self.queue_timeout is None else parse_duration(self.queue_timeout)

    @property
    def run_timeout_s(self) -> float | None:
        return None if self.run_timeout is None else parse_duration(self.run_timeout)

    @property
    def kill_grace_s(self) -> float:
        return parse_duration(self.kill_grace)

    @property
    def events_max_bytes(self) -> int:
        return parse_size(self.events_max_size)

    @property
    def prompt_max_bytes(self) -> int:
        return parse_size(self.prompt_max_size)

    @property
    def log_max_bytes(self) -> int | None:
        return None if self.log_max_size is None else parse_size(self.log_max_size)

    @property
    def memory_budget(self) -> int:
        """The memory this machine's running tasks may declare in all (admission's budget)."""
        if self.max_memory is not None:
            return parse_size(self.max_memory)
        return max(0, total_memory() - parse_size(self.memory_reserve))

    @property
    def min_start_interval_s(self) -> float | None:
        v = self.min_start_interval_per_source
        return None if v is None else parse_duration(v)


KEY_HELP: dict[str, str] = {
    "max_agents": "running agents at once (1..64)",
    "max_queue": "queued tasks at most; beyond: rejected, exit 3",
    "queue_timeout": "a queued task not started by then expires (null: never)",
    "run_timeout": "a running task is cancelled after this (per task: --timeout; null: never)",
    "kill_grace": "SIGTERM -> SIGKILL delay",
    "default_agent": "preset used when no command is given",
    "agents": "presets {name: {command: [argv with {prompt} {prompt_file} {name} {id}], env: {}, max_agents,"
    " limit: {patterns, exit_codes, backoff, max_backoff, window, window_starts, window_tokens}, session_pattern, resume: [argv with {session}],"
    " output: text|claude|codex|opencode, fallback: [presets], fallback_fresh, memory, max_procs, slots}}; extend the built-ins",
    "history_limit": "finished tasks kept in index.json; older ones move to history.jsonl",
    "events_max_size": "events.jsonl beyond this becomes events.jsonl.1 (the older one is dropped)",
    "prompt_max_size": "a task's prompt at most (it is kept in index.json); longer: refused, exit 2",
    "log_max_size": "each task's log on disk: beyond it its beginning and end are kept, the middle dropped with"
    " a marker line (at least 4MiB; null: no cap)",
    "autostart": "the CLI starts the service when needed",
    "telegram": "the Telegram bot: token, allowed_chat_ids, allowed_user_ids, notify_chat_ids, api_base_url, events,"
    " allow_delegate, delegate_cwd (docs/telegram.md)",
    "worktrees": "git worktree per agent: enabled, keep (changed|always|never), max_disk (e.g. 20G)",
    "strategy": "who starts next: fifo | priority (urgent>high>normal>low) | fair (round-robin across sources)",
    "max_active_per_source": "running tasks one source may hold at once (null: no limit)",
    "max_queued_per_source": "queued tasks one source may have; beyond: rejected, exit 3 (null: no limit)",
    "min_start_interval_per_source": "rate limit: two starts of one source at least this far apart (null: none)",
    "on_queue_full": "when max_queue is reached: reject (exit 3) | drop_oldest (cancel the oldest queued task)",
    "schedule_missed": "recurring schedules: firings missed while the service was down run once (one) or not"
    " at all (skip)",
    "groups": 'named pools {name: {"max_agents": N}}; delegate --group NAME needs a slot there and globally',
    "resource_guard": "hold new starts while min_available_memory (e.g. 2GiB) or max_load_per_cpu is not met",
    "metrics": "the service's OpenMetrics endpoint: listen (e.g. 127.0.0.1:9464; null: off), allow_remote"
    " (needed for a non-loopback address)",
    "store": "cluster mode: the PostgreSQL URL of the shared queue (env KUGETSU_STORE wins); local to this machine",
    "host": "cluster mode: this machine's name (default: its hostname); local to this machine",
    "host_max_agents": "cluster mode: agents this machine runs at most (default: max_agents); local",
    "cluster": "cluster mode: lease (a silent machine's tasks are lost after it, default 30s),"
    " log_max_size (output of a task shipped to the database, default 1MiB)",
    "budgets": "daily budgets (local day): sources {NAME: {usd, tokens}}, agents {PRESET: {usd, tokens}}; over it:"
    " nothing more of it starts until 00:00",
    "max_memory": "the memory this machine's running tasks may declare in all (delegate --memory, a preset's memory);"
    " null: its RAM less memory_reserve; local",
    "memory_reserve": "what max_memory leaves to the rest of the machine when not set (default 1GiB); local",
    "resources": "per-task resources: mode (auto|cgroup|sampling), interval (between measurements, default 2s),"
    " default_memory (a task declaring none counts this), max_procs (a task's processes at most)",
    "mcp": "the MCP server: token, the bearer token `kugetsu mcp --http` requires (set it with `config set mcp.token -`)",
}
# Sub-objects whose keys are fixed (dotted `config set` checks them); `groups` has free names.
_NESTED: dict[str, type[msgspec.Struct]] = {
    "telegram": TelegramConfig, "worktrees": WorktreesConfig, "resource_guard": ResourceGuard,
    "metrics": MetricsConfig, "mcp": McpConfig, "cluster": ClusterConfig,
    "budgets": BudgetsConfig,
    "resources": ResourcesConfig,
}
