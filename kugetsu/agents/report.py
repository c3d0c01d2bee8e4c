"""What an agent's structured output says about one run: pure data, no I/O.

Each output kind (claude, codex, opencode) has its own reader in this package turning the end
of a log into a Report; pm reads the report first and the preset's text patterns for what it
did not say (README, "Agents").
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec


def json_object(line: str) -> dict[str, Any] | None:
    """One log line as the JSON object it holds, or None (not an object: stderr's lines)."""
    s = line.strip()
    if not s.startswith("{"):
        return None
    import json  # here: models import this module for Usage, and every CLI command paid 1 ms for json

    try:
        obj = json.loads(s)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def json_objects(tail: str) -> list[dict[str, Any]]:
    """The JSON objects among a log's lines, one a line (the first line of a tail may be cut,
    stderr may be mixed in: what is not an object is skipped)."""
    return [obj for obj in map(json_object, tail.splitlines()) if obj is not None]

class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Tokens (and the cost, where the agent reports one) of a run, or of several summed."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cost_usd: float | None = None

    def __add__(self, other: Usage) -> Usage:
        return Usage(input_tokens=self.input_tokens + other.input_tokens,
                     output_tokens=self.output_tokens + other.output_tokens,
                     cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
                     cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
                     cost_usd=_add_cost(self.cost_usd, other.cost_usd))

    def __sub__(self, other: Usage) -> Usage:
        cost = None if self.cost_usd is None else round(self.cost_usd - (other.cost_usd or 0.0), 10)
        return Usage(input_tokens=self.input_tokens - other.input_tokens,
                     output_tokens=self.output_tokens - other.output_tokens,
                     cache_read_tokens=self.cache_read_tokens - other.cache_read_tokens,
                     cache_write_tokens=self.cache_write_tokens - other.cache_write_tokens, cost_usd=cost)

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens + self.cache_read_tokens + self.cache_write_tokens


def _add_cost(a: float | None, b: float | None) -> float | None:
    if a is None and b is None:
        return None  # no agent said: unknown, not free
    return round((a or 0.0) + (b or 0.0), 10)


def total(usages: list[Usage | None]) -> Usage | None:
    """The sum of the usages that are known (None when none is)."""
    known = [u for u in usages if u is not None]
    if not known:
        return None
    out = known[0]
    for u in known[1:]:
        out = out + u
    return out


def describe(usage: Usage) -> str:
    """`12,345 tokens in, 678 out, 9,000 cached, $0.0123`: for status and the dashboard."""
    parts = [f"{usage.input_tokens:,} tokens in", f"{usage.output_tokens:,} out"]
    cached = usage.cache_read_tokens + usage.cache_write_tokens
    if cached:
        parts.append(f"{cached:,} cached")
    if usage.cost_usd is not None:
        parts.append(f"${usage.cost_usd:.4f}")
    return ", ".join(parts)


class Report(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one run's structured output said. Fields it did not say stay at their defaults."""

    session: str | None = None  # the agent's session/thread id, for resume
    limited: bool = False  # the provider refused for a usage or rate limit
    reset_at: datetime | None = None  # when that limit resets, when the stream says
    limit_text: str | None = None  # the agent's words about it (a reason; a reset time in prose)
    usage: Usage | None = None  # tokens (and cost) of this run, summed
    denied: list[str] = []  # permission denials the agent reported ("Write: /path")
    error: str | None = None  # the agent's own error/result text when it failed
