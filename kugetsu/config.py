"""config.json: the model, defaults, load/validate/save, dotted keys and durations."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect

from kugetsu.errors import FileError, UsageError, redact_url
from kugetsu.core.models import valid_host
from kugetsu.paths import DISK_FULL, Home, atomic_write, disk_full, read_file

# ---- durations ------------------------------------------------------------------------

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


MAX_DURATION = 3650 * 86400  # ten years: deadlines past year 9999 cannot be represented


def parse_duration(value: object, what: str = "duration") -> float:
    """`90s`, `15m`, `2h`, `1d` or plain seconds -> seconds (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a duration like 90s, 15m, 2h, 1d or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(str(value))
        if not m:
            raise ValueError(f"{what}: {value!r} is not a duration; use 90s, 15m, 2h, 1d or plain seconds")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not seconds > 0:
        raise ValueError(f"{what}: must be more than 0, got {value!r}")
    if not seconds <= MAX_DURATION:  # also NaN and inf: a deadline must be a real date
        raise ValueError(f"{what}: {value!r} is too long; at most {MAX_DURATION // 86400}d")
    return seconds


def format_duration(seconds: float) -> str:
    """Short human form: 45s, 1m30s, 12m, 24h, 3h05m, 2d, 2d04h."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s < 600 and s % 60 else f"{s // 60}m"
    if s < 2 * 86400:  # "24h" and "36h" read better than "1d00h"
        h, m = divmod(s // 60, 60)
        return f"{h}h{m:02d}m" if m else f"{h}h"
    d, h = divmod(s // 3600, 24)
    return f"{d}d{h:02d}h" if h else f"{d}d"


Duration = str | int | float

# ---- sizes -----------------------------------------------------------------------------

# KiB/MiB/GiB and bare K/M/G are powers of 1024 (what free(1) and psutil report); KB/MB/GB
# are powers of 1000, as their SI names say.
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
               "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


# The smallest log_max_size: a capped log keeps a quarter of it from its beginning and a
# quarter from its end (kugetsu/store/logtail.py).
LOG_MIN = 4 * 1024 * 1024


def parse_size(value: object, what: str = "size") -> int:
    """`2GiB`, `512MiB`, `1.5G`, `800MB` or plain bytes -> bytes (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size like 2GiB or 512MiB, got {value!r}")
    if isinstance(value, (int, float)):
        size = float(value)
    else:
        m = _SIZE_RE.match(str(value))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ValueError(f"{what}: {value!r} is not a size; use e.g. 2GiB, 512MiB, 800MB or plain bytes")
        size = float(m.group(1)) * _SIZE_UNITS[unit]
    if not size > 0:
        raise ValueError(f"{what}: must be more than 0, got {value!r}")
    return int(size)


def format_size(size: float) -> str:
    """Short binary form: 1.2 GiB, 512 MiB."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale:
            value = size / scale
            return f"{value:.1f} {unit}".replace(".0 ", " ")
    return f"{int(size)} B"

# ---- the model -------------------------------------------------------------------------

# The built-in presets' limit patterns are best-effort: what these agents printed when their
# provider refused them, as far as known (README, "Provider limits"); users tune them.
_HTTP_LIMIT = r"(?i)\b429\b.{0,40}(too many requests|rate.?limit)|rate_limit_(error|exceeded)"
# `codex exec resume` has no --sandbox: the sandbox is set as config (-c), the same for both.
_CODEX_FLAGS = ["--json", "--skip-git-repo-check", "-c", 'sandbox_mode="workspace-write"',
                "-c", "sandbox_workspace_write.exclude_slash_tmp=true",
                "-c", "sandbox_workspace_write.exclude_tmpdir_env_var=true"]
_OPENCODE_PLUGIN = (Path(__file__).parent / "agents" / "opencode_plugin.js").as_uri()
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
            raise ValueError("resources.interval must be at least 50ms")
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

# ---- loading ---------------------------------------------------------------------------


def line_col(data: bytes, offset: int) -> tuple[int, int]:
    before = data[:offset]
    return before.count(b"\n") + 1, offset - (before.rfind(b"\n") + 1) + 1


def describe_decode_error(path: object, data: bytes, err: Exception) -> str:
    """Turn a msgspec error into 'file: line L col C: what' or 'file: key k: what'."""
    if isinstance(err, UnicodeDecodeError):
        at = err.start  # relative to the string msgspec was decoding: find the byte in the file
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as whole:
            at = whole.start
        line, col = line_col(data, at)
        return f"{path}: not UTF-8 text at line {line}, column {col} (byte {at})"
    text = str(err)
    if "truncated" in text:
        line, col = line_col(data, len(data))
        return f"{path}: not valid JSON: it ends early, at line {line}, column {col} (truncated?)"
    m = re.search(r"\(byte (\d+)\)", text)
    if m:
        line, col = line_col(data, int(m.group(1)))
        return f"{path}: not valid JSON at line {line}, column {col}: {text[: m.start()].strip()}"
    m = re.match(r"Object contains unknown field `([^`]*)`(?: - at `\$(.*)`)?", text)
    if m:
        parent = _dotted(m.group(2) or "")
        key = f"{parent}.{m.group(1)}" if parent else m.group(1)
        return f"{path}: unknown key {key!r}{_did_you_mean(key)}"
    m = re.match(r"(.*) - at `\$(.*)`$", text)
    if m:
        return f"{path}: key {_dotted(m.group(2))!r}: {m.group(1)}"
    return f"{path}: {text}"


def _dotted(msgspec_path: str) -> str:
    return re.sub(r"\[(\d+)\]", r".\1", msgspec_path).lstrip(".")


def _did_you_mean(key: str) -> str:
    known = list(Config.__struct_fields__) + [
        f"{top}.{f}" for top, struct in _NESTED.items() for f in struct.__struct_fields__
    ]
    import difflib

    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(Config.__struct_fields__)}"


_FIX = "\nNothing was changed. Fix the file (`kugetsu config check` re-checks it) or move it away to use the defaults."


def read_raw(home: Home) -> dict[str, Any]:
    """The file's own content ({} when there is none): what `config set` edits."""
    try:
        data = read_file(home.config)
    except FileNotFoundError:
        return {}
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW: kugetsu never follows a link in its home
            raise FileError(f"{home.config} is a symbolic link; kugetsu never follows a link inside its home"
                            " (another user may have planted it): put the file itself there"
                            " (or remove it to use the defaults)") from None
        raise
    try:
        raw = msgspec.json.decode(data)
    # RecursionError: absurdly deep nesting; UnicodeDecodeError: bytes that are not UTF-8 in a
    # string or a key (msgspec raises it, not DecodeError, there).
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as err:
        raise FileError(describe_decode_error(home.config, data, err) + _FIX) from None
    if not isinstance(raw, dict):
        raise FileError(f"{home.config}: must hold a JSON object {{...}}{_FIX}")
    return raw


def with_builtin_presets(raw: dict[str, Any]) -> dict[str, Any]:
    """A built-in preset named in config.json keeps the built-in keys it does not set (so
    `config set agents.claude.max_agents 2` is all it takes), inside `limit` and `env` too
    (an API key added to its env keeps the variables the built-in one needs)."""
    agents = raw.get("agents")
    if not isinstance(agents, dict) or not any(n in DEFAULT_AGENTS and isinstance(p, dict) for n, p in agents.items()):
        return raw
    merged = dict(agents)
    for name, preset in agents.items():
        base = DEFAULT_AGENTS.get(name)
        if base is None or not isinstance(preset, dict):
            continue
        merged[name] = {**base, **preset}
        for key in ("limit", "env"):
            value = preset.get(key, {})
            if isinstance(value, dict):
                merged[name][key] = {**base.get(key, {}), **value}
    return {**raw, "agents": merged}


def validate(raw: dict[str, Any], where: object = "config.json", hint: str = _FIX, setting: str | None = None) -> Config:
    """The config `raw` holds, or an InvalidConfig naming the key (its real path, not msgspec's
    `agents[...]`), what it takes and how to write it. `setting`: the key `config set` is
    changing; an error at that key needs no file name (the file is not what was wrong)."""
    try:
        return msgspec.convert(with_builtin_presets(raw), Config)
    except msgspec.ValidationError as err:
        key, problem, suggestion = _explain_invalid(raw, str(err))
        if key and setting and (key == setting or key.startswith(setting + ".")):
            where = f"cannot set {setting}"
        elif setting:
            where = f"cannot set {setting}: {where}"
        at = f"key {key!r}: " if key and key != setting and not problem.startswith("unknown key") else ""
        raise InvalidConfig(f"{where}: {at}{problem}{hint}", key, suggestion, setting) from None


class InvalidConfig(FileError):
    """A value of config.json (or one `config set` would write) that does not validate.
    `suggestion`: the JSON to write instead, when one is plain (`"30"` for a number where a
    string belongs); the CLI turns it into the command to type."""

    def __init__(self, message: str, key: str | None, suggestion: str | None, setting: str | None):
        super().__init__(message)
        self.key, self.suggestion, self.setting = key, suggestion, setting


# msgspec's words for JSON types -> ours
_TYPE_WORDS = {"str": "a string", "int": "a whole number", "float": "a number", "bool": "true or false",
               "null": "null", "array": "a list [...]", "object": "an object {...}"}
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _explain_invalid(raw: dict[str, Any], text: str) -> tuple[str | None, str, str | None]:
    """msgspec's validation message -> (the dotted key, what is wrong in plain words, a
    suggested JSON value or None)."""
    import json  # only when a config does not validate

    m = re.match(r"(.*) - at `\$(.*)`$", text, re.DOTALL)
    message, masked = (m.group(1), m.group(2)) if m else (text, "")
    parts = _real_path(raw, masked, text)
    key = ".".join(parts) or None
    value = _lookup(raw, parts)
    info = _type_at(parts)
    unknown = re.match(r"Object contains unknown field `([^`]*)`", message)
    if unknown:
        full = ".".join([*parts, unknown.group(1)])
        fields = list(info.cls.__struct_fields__) if isinstance(info, msgspec.inspect.StructType) else []
        close = __import__("difflib").get_close_matches(unknown.group(1), fields, n=1)
        problem = f"unknown key {full!r}" + (f" (did you mean {'.'.join([*parts, close[0]])!r}?)" if close else "")
        if parts:
            return full, f"{problem}; {key} has: {', '.join(fields)}", None
        return full, f"unknown key {full!r}{_did_you_mean(full)}", None
    if message.startswith("Invalid enum value") and isinstance(info, msgspec.inspect.LiteralType):
        return key, f"{value!r} is not one of: {', '.join(map(str, _choices(parts, info)))}", None
    typed = re.match(r"Expected `([^`]*)`(.*?)(?:, got `([^`]*)`)?$", message)
    if typed:
        kinds = set(typed.group(1).split(" | "))
        expected = " or ".join(_TYPE_WORDS.get(t, t) for t in typed.group(1).split(" | "))
        if kinds - {"null"} == {"int", "float", "str"}:  # Duration
            expected = 'a duration ("90s", "15m", "2h", "1d") or seconds' + (", or null" if "null" in kinds else "")
        elif kinds - {"null"} == {"int", "str"}:  # a size
            expected = 'a size ("2GiB", "512MiB") or bytes' + (", or null" if "null" in kinds else "")
        bound = typed.group(2).strip()
        bound = re.sub(r"^<= (\S+)$", r"at most \1", re.sub(r"^>= (\S+)$", r"at least \1", bound))
        bound = re.sub(r"^of length >= (\d+)$", r"of at least \1 item(s)", bound)
        shown = json.dumps(value, ensure_ascii=False) if value is not None or parts else "nothing"
        problem = f"expected {expected}{' ' + bound if bound else ''}, got {shown}"
        if typed.group(1).split(" | ")[0] == "str" and isinstance(value, (int, float, bool)):
            suggestion = json.dumps(json.dumps(value))
            return key, f"{problem}; write it as a JSON string, in quotes: {suggestion}", suggestion
        if isinstance(value, str) and typed.group(1) in ("int", "float", "bool"):
            try:
                plain = json.loads(value)
            except ValueError:
                plain = None
            if isinstance(plain, (int, float, bool)):
                return key, f"{problem}; write it without quotes: {value}", value
        return key, problem, None
    return key, message[:1].lower() + message[1:] if message[:2] != message[:2].upper() else message, None


def _real_path(raw: dict[str, Any], masked: str, text: str) -> list[str]:
    """msgspec's path with each `[...]` (a dict key it does not name) replaced by the key:
    the first key whose entry alone makes the config fail the same way is the one it met."""
    import json  # only when a config does not validate

    parts: list[str] = []
    for name, index in _PATH_PART.findall(masked):
        if index != "...":
            parts.append(name or index)
            continue
        node = _lookup(raw, parts)
        for candidate in node if isinstance(node, dict) else ():
            trial = json.loads(json.dumps(raw))
            holder = _lookup(trial, parts)
            for other in [k for k in holder if k != candidate]:
                del holder[other]
            try:
                msgspec.convert(trial, Config)
            except msgspec.ValidationError as err:
                if str(err) == text:
                    parts.append(candidate)
                    break
        else:
            return parts  # not found: the path up to here is still the truth
    return parts


def _choices(parts: list[str], info: msgspec.inspect.LiteralType) -> tuple[object, ...]:
    """A Literal's values in the order they are declared (fifo first), not sorted."""
    import typing

    parent = _type_at(parts[:-1])
    if isinstance(parent, msgspec.inspect.StructType) and parts:
        hint = typing.get_type_hints(parent.cls).get(parts[-1])
        if typing.get_origin(hint) is typing.Literal:
            return typing.get_args(hint)
    return info.values


def _lookup(raw: object, parts: list[str]) -> Any:
    node = raw
    for part in parts:
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _type_at(parts: list[str]) -> msgspec.inspect.Type | None:
    """The declared type at a real path of the config (a preset, a group, a Literal)."""
    import msgspec.inspect as inspect

    node: inspect.Type = inspect.type_info(Config)
    for part in parts:
        if isinstance(node, inspect.UnionType):  # `X | None`: the X
            node = next((t for t in node.types if not isinstance(t, inspect.NoneType)), node)
        if isinstance(node, inspect.StructType):
            node = next((f.type for f in node.fields if f.name == part), None)
        elif isinstance(node, inspect.DictType):
            node = node.value_type
        elif isinstance(node, inspect.ListType):
            node = node.item_type
        else:
            return None
        if node is None:
            return None
    return node


def load_config(home: Home) -> Config:
    raw = read_raw(home)
    url = _store_in(raw)
    if url is None:
        key = (str(home.config), msgspec.json.encode(raw))
        global _last_loaded
        if _last_loaded is not None and _last_loaded[0] == key:
            return _last_loaded[1]  # the same file again (delegate reads it twice: before and under the lock)
        cfg = validate(raw, home.config)
        _last_loaded = (key, cfg)
        return cfg
    from kugetsu.store.postgres import store_for  # cluster mode only: psycopg is not light

    return cluster_config(home, raw, store_for(url).read_config())


# The last file config validated, by its path and content: a Config is never changed in place.
_last_loaded: tuple[tuple[str, bytes], Config] | None = None


def _store_in(local: dict[str, Any]) -> str | None:
    """The cluster's database URL: env KUGETSU_STORE wins over this machine's config `store`."""
    url = os.environ.get(STORE_ENV) or local.get("store")
    return str(url) if url else None


def host_name(cfg: Config) -> str:
    """This machine's name in a cluster: config `host`, else its hostname."""
    import socket

    return cfg.host or socket.gethostname()


def cluster_host(cfg: Config) -> str | None:
    """This machine's name when it is in a cluster (tasks there carry the machine they run
    on: placement.ours), None on a machine of its own."""
    return host_name(cfg) if cfg.store else None


def store_url(home: Home) -> str | None:
    """The cluster's database, when this machine is in one (env KUGETSU_STORE, config `store`).
    A config.json that does not parse names no store here: every command that goes on to read
    the config stops on it (with its message), and `doctor` reports it and checks the rest."""
    try:
        return _store_in(read_raw(home))
    except FileError:
        return _store_in({})


def cluster_config(home: Home, local: dict[str, Any], shared: dict[str, Any], setting: str | None = None) -> Config:
    """The effective config of a machine in a cluster: the database's, and its own keys."""
    misplaced = [k for k in local if k not in LOCAL_KEYS]
    if misplaced:
        raise FileError(
            f"{home.config}: holds {', '.join(misplaced)}, which in cluster mode live in the database"
            f" (only {', '.join(LOCAL_KEYS)} stay in this file). Move them with `kugetsu store migrate URL`"
            " or `kugetsu config set KEY VALUE` (it applies to every machine), then remove them here.")
    raw = {**{k: v for k, v in shared.items() if k not in LOCAL_KEYS}, **local, "store": _store_in(local)}
    return validate(raw, f"{home.config} and the cluster's config", hint="\nNothing was changed.", setting=setting)


def save_raw(home: Home, raw: dict[str, Any]) -> None:
    home.ensure()
    try:
        import json  # only `config set`: not on every command's path

        atomic_write(home.config, json.dumps(raw, indent=2, ensure_ascii=False).encode() + b"\n")
    except OSError as err:
        if err.errno in DISK_FULL:  # atomic_write removed its temp file: config.json is as it was
            raise disk_full(home, f"writing {home.config}") from None
        raise


# ---- dotted keys -----------------------------------------------------------------------


def parse_value(text: str) -> object:
    """A command-line value: JSON when it parses (5, true, null, [1,2]), else the plain string."""
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def _check_key(key: str) -> list[str]:
    parts = key.split(".")
    if not all(parts):
        raise UsageError(f"bad key {key!r}: use names separated by dots, e.g. telegram.allowed_chat_ids")
    top = parts[0]
    if top not in Config.__struct_fields__:
        raise UsageError(f"unknown config key {key!r}{_did_you_mean(key)}")
    nested = _NESTED.get(top)
    if nested is not None and len(parts) > 1 and parts[1] not in nested.__struct_fields__:
        raise UsageError(f"unknown config key {key!r}{_did_you_mean(key)}")
    if top == "groups" and len(parts) > 2 and parts[2] not in GroupConfig.__struct_fields__:
        raise UsageError(f"unknown config key {key!r}; a group has: {', '.join(GroupConfig.__struct_fields__)}")
    return parts


def get_value(cfg: Config, key: str) -> object:
    node: object = msgspec.to_builtins(cfg)
    parts = _check_key(key)
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            import difflib

            close = difflib.get_close_matches(part, list(node), n=1) if isinstance(node, dict) else []
            meant = ".".join(parts[:i] + close[:1])
            raise UsageError(f"config key {key!r} is not set" + (f" (did you mean {meant!r}?)" if close else ""))
        node = node[part]
    return node


# What the service reads once, when it starts (the listeners it opens): a change applies at its
# next start; every other key applies at once.
AT_START = ("metrics", "telegram.token", "telegram.api_base_url")


def applies_at_start(key: str) -> bool:
    return key == "telegram" or any(key == k or key.startswith(k + ".") for k in AT_START)


def has_value(cfg: Config, key: str) -> bool:
    """Does the effective config hold `key` (set, or a default)? `config unset agents.x`
    leaves none."""
    try:
        get_value(cfg, key)
    except UsageError:
        return False
    return True


def with_value(raw: dict[str, Any], key: str, value: object, *, remove: bool = False) -> dict[str, Any]:
    """A copy of the raw config with `key` set to `value` (or removed, back to its default)."""
    import json

    parts = _check_key(key)
    new = json.loads(json.dumps(raw))
    node = new
    for part in parts[:-1]:
        child = node.get(part)
        if child is None and not remove:
            child = node[part] = {}
        if not isinstance(child, dict):
            if remove:
                return new
            raise UsageError(f"cannot set {key!r}: {part!r} is not an object")
        node = child
    if remove:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value
    return new


# A key holding a secret: the bot token, and what people name their secrets in a preset's
# `env` (GITHUB_TOKEN, OPENAI_API_KEY, ...), which the config shows and events record too.
_SECRET_KEY = re.compile(r"(token|secret|password|passwd|api_?key)$", re.IGNORECASE)
MASK = "***"


def mask_secrets(value: Any, key: str = "") -> Any:
    """`value` (the value of config key `key`, dotted or not) as it may be shown or written to
    events: every secret in it, at any depth, replaced by "***": the values of secret keys,
    and the password of a URL under any key (the store's, a preset's DATABASE_URL)."""
    if _SECRET_KEY.search(key) and value not in (None, "", [], {}):
        return MASK
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: mask_secrets(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    return value


def masked(cfg: Config) -> dict[str, Any]:
    """The effective config for display: no secret shown."""
    return mask_secrets(msgspec.to_builtins(cfg))
