"""opencode's structured output (`opencode run --format json`).

One JSON object a line, each with `type`, `timestamp` (ms) and `sessionID` (the session
`opencode run --session` continues): `step_start`, `text` (part.text), `reasoning`,
`tool_use` (part.tool, part.state: status completed|error, input, output, error), `step_finish`
(part.tokens: input, output, reasoning, cache.read, cache.write; part.cost in USD) and, when
the run fails, `error` (error.name, error.data: message, statusCode, responseHeaders,
responseBody). A permission it asks for in `run` is rejected (`--auto` aside); the tool part
then ends in error "The user rejected permission ..." and the run stops.

opencode retries a provider's 429 itself, printing nothing meanwhile: 1.18 gives up after 5
retries (2 s doubling to 30 s apart, or the provider's `retry-after` apart, however long) and
prints the `error` event with the last response's status, headers and body. kugetsu's plugin
(opencode_plugin.js, which the built-in preset loads) makes it give up at once when a retry
would wait long, printing `{"type": "error", "error": {"name": "KugetsuGaveUp", "data":
{"message", "next"}}}` (`next`: when opencode would have tried again, ms).

A task's log holds all its runs (a resumed one is appended after the `error` that ended the
one before): only the last run is read.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime
from typing import Any

from kugetsu.agents.codex import SESSION
from kugetsu.agents.report import Report, Usage, describe, json_object, json_objects, total

_LIMITED = re.compile(
    r"(?i)\b429\b|too many requests|\brate.?limit|insufficient_quota|exceeded your current quota|\bquota exceeded\b"
    r"|usage.?limit|resource.?exhausted"
)
_REJECTED = "rejected permission"
# OpenAI's `x-ratelimit-reset-requests: 1m30s`, `6m0s`, `20ms`, `1.5s`
_GO_SPAN = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_GO_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


def _num(v: object) -> float:
    """A count or a cost, or 0 for anything that is not one (not finite, huge: the index stores it)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e15 else 0.0


def _dict(v: object) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def usage_of(part: object) -> Usage | None:
    """A step_finish part's tokens and cost as a Usage (reasoning counts as output)."""
    tokens = _dict(_dict(part).get("tokens"))
    if not tokens:
        return None
    cache = _dict(tokens.get("cache"))
    cost = _dict(part).get("cost")
    return Usage(input_tokens=int(_num(tokens.get("input"))),
                 output_tokens=int(_num(tokens.get("output")) + _num(tokens.get("reasoning"))),
                 cache_read_tokens=int(_num(cache.get("read"))), cache_write_tokens=int(_num(cache.get("write"))),
                 cost_usd=_num(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) and _num(cost) == cost
                 else None)


def _span(text: str) -> float | None:
    parts = _GO_SPAN.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        return None
    return sum(float(n) * _GO_UNIT[u] for n, u in parts)


def reset_from(data: dict[str, Any], at: datetime) -> datetime | None:
    """When a refused request may be sent again, from the error's response: its body's
    `resets_at` / `resets_in_seconds` (a usage limit), else its headers (`retry-after-ms`,
    `retry-after` in seconds or as an HTTP date, OpenAI's `x-ratelimit-reset-*`: the latest),
    counted from `at` (when the response came). None: it does not say."""
    try:
        body = json.loads(data["responseBody"]) if isinstance(data.get("responseBody"), str) else {}
    except ValueError:
        body = {}
    error = _dict(_dict(body).get("error"))
    resets = error.get("resets_at")
    if isinstance(resets, (int, float)) and not isinstance(resets, bool) and 10**9 < resets < 10**10:
        return datetime.fromtimestamp(resets, timezone.utc)
    if isinstance(error.get("resets_in_seconds"), (int, float)) and not isinstance(error["resets_in_seconds"], bool):
        return at + timedelta(seconds=max(0.0, float(error["resets_in_seconds"])))
    headers = {str(k).lower(): str(v) for k, v in _dict(data.get("responseHeaders")).items()}
    found: list[datetime] = []
    try:
        if "retry-after-ms" in headers:
            found.append(at + timedelta(milliseconds=float(headers["retry-after-ms"])))
        elif "retry-after" in headers:
            value = headers["retry-after"].strip()
            if re.fullmatch(r"\d+(?:\.\d+)?", value):
                found.append(at + timedelta(seconds=float(value)))
            else:
                when = parsedate_to_datetime(value)
                if when is not None and when.tzinfo is not None:
                    found.append(when.astimezone(timezone.utc))
    except (ValueError, TypeError, OverflowError):
        pass
    for name in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
        seconds = _span(headers.get(name, ""))
        if seconds is not None:
            found.append(at + timedelta(seconds=seconds))
    future = [t for t in found if t <= at + timedelta(days=366)]
    return max(future) if future else None


def _last_run(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the log's last run: after the last `error` that is not the last event."""
    ends = [i for i, o in enumerate(objects) if o.get("type") == "error" and i < len(objects) - 1]
    return objects[ends[-1] + 1:] if ends else objects


def _when(obj: dict[str, Any], now: datetime) -> datetime:
    ms = obj.get("timestamp")
    if isinstance(ms, (int, float)) and not isinstance(ms, bool) and 10**12 < ms < 10**13:
        return datetime.fromtimestamp(ms / 1000, timezone.utc)
    return now


def _target(state: dict[str, Any]) -> str:
    inp = _dict(state.get("input"))
    return next((str(inp[k]) for k in ("filePath", "path", "command", "url", "pattern") if isinstance(inp.get(k), str)), "")


def read(tail: str, now: datetime) -> Report:
    """What the end of a `run --format json` log says about its last run. Total: never raises."""
    report = Report()
    usages: list[Usage] = []
    for obj in _last_run(json_objects(tail)):
        kind = obj.get("type")
        if isinstance(obj.get("sessionID"), str) and SESSION.fullmatch(obj["sessionID"]):
            report.session = obj["sessionID"]
        part = _dict(obj.get("part"))
        if kind == "step_finish":
            usage = usage_of(part)
            if usage is not None:
                usages.append(usage)
        elif kind == "tool_use":
            state = _dict(part.get("state"))
            if state.get("status") == "error" and _REJECTED in str(state.get("error")):
                target = _target(state)
                report.denied.append(f"{part.get('tool', 'tool')}: {target}" if target else str(part.get("tool", "tool")))
        elif kind == "error":
            error = _dict(obj.get("error"))
            data = _dict(error.get("data"))
            message = data.get("message") if isinstance(data.get("message"), str) else str(error.get("name") or "error")
            report.error = message = message[:2000]
            status = data.get("statusCode")
            gave_up = error.get("name") == "KugetsuGaveUp"
            if status == 429 or gave_up or _LIMITED.search(message) or _LIMITED.search(str(data.get("responseBody", ""))):
                report.limited = True
                report.limit_text = message
                nxt = data.get("next")
                if gave_up and isinstance(nxt, (int, float)) and not isinstance(nxt, bool) and 10**12 < nxt < 10**13:
                    report.reset_at = datetime.fromtimestamp(nxt / 1000, timezone.utc)
                else:
                    try:
                        report.reset_at = reset_from(data, _when(obj, now))
                    except (ValueError, TypeError, OverflowError):  # a number no clock holds
                        report.reset_at = None
                if report.reset_at is not None and report.reset_at <= now:
                    report.reset_at = None  # already past: try again shortly (the preset's backoff)
            else:
                report.limited, report.limit_text, report.reset_at = False, None, None
    report.usage = total(list(usages))
    return report


def render(line: str) -> str | None:
    """One `--format json` line as a person reads it: the agent's text, its tool calls (and
    their errors), the end of its run (with tokens) or its error; nothing for the bookkeeping
    lines. Not JSON: as it is."""
    obj = json_object(line)
    if obj is None:
        return line
    kind = obj.get("type")
    part = _dict(obj.get("part"))
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "tool_use":
        state = _dict(part.get("state"))
        head = f"> {part.get('tool', 'tool')}({_target(state)})"
        return head + (f"\n  ! {state.get('error')}" if state.get("status") == "error" else "")
    if kind == "step_finish" and part.get("reason") == "stop":
        usage = usage_of(part)
        return "[done] " + describe(usage) if usage else "[done]"
    if kind == "error":
        error = _dict(obj.get("error"))
        data = _dict(error.get("data"))
        status = f" ({data['statusCode']})" if isinstance(data.get("statusCode"), int) else ""
        return f"[error{status}: {data.get('message') or error.get('name') or '?'}]"
    return None
