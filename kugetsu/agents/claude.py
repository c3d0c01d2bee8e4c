"""Claude Code's structured output (`claude -p --output-format stream-json --verbose`).

One JSON object a line: `system` (init: session_id, model, tools, permissionMode),
`assistant` and `user` messages (text, tool calls, tool results), `rate_limit_event`
(the provider's limit status, its reset as a Unix time), and a last `result` (session_id,
is_error, result text, usage, total_cost_usd, permission_denials). An API error (a limit
among them) comes as an assistant message with `error` set ("rate_limit", ...) and its text
("You've hit your session limit · resets 5:33pm (UTC)", "API Error: Request rejected (429) · ...").
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from typing import Any

from kugetsu.agents.report import Report, Usage, json_object, json_objects as _objects


# A session id as Claude Code makes them (a UUID); anything else is not passed to --resume.
_SESSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")


def _int(v: object) -> int:
    """A token count: a whole number a 64-bit store can hold, else 0."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53 else 0


def _list(v: object) -> list[Any]:
    return v if isinstance(v, list) else []


def _dict(v: object) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _cost(v: object) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1e12
    return float(v) if ok else None  # type: ignore[arg-type]


def usage_of(raw: object, cost: object = None) -> Usage | None:
    """An Anthropic usage block ({input_tokens, output_tokens, cache_read_input_tokens,
    cache_creation_input_tokens}) as a Usage."""
    if not isinstance(raw, dict):
        return None
    return Usage(input_tokens=_int(raw.get("input_tokens")), output_tokens=_int(raw.get("output_tokens")),
                 cache_read_tokens=_int(raw.get("cache_read_input_tokens")),
                 cache_write_tokens=_int(raw.get("cache_creation_input_tokens")),
                 cost_usd=_cost(cost))


def _text(message: object) -> str:
    """The text blocks of a message, joined."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))


def _when(v: object) -> datetime | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v < 10**11:
        return datetime.fromtimestamp(v, timezone.utc)
    return None


def _denial(d: object) -> str | None:
    if not isinstance(d, dict):
        return None
    tool = d.get("tool_name") if isinstance(d.get("tool_name"), str) else "tool"
    inp = d.get("tool_input") if isinstance(d.get("tool_input"), dict) else {}
    what = next((inp[k] for k in ("file_path", "path", "command", "url", "pattern") if isinstance(inp.get(k), str)), None)
    return (f"{tool}: {what}" if what else str(tool))[:200]


def read(tail: str, now: datetime) -> Report:
    """What the end of a stream-json log says. Total: never raises."""
    report = Report()
    result: dict[str, Any] | None = None
    for obj in _objects(tail):
        kind = obj.get("type")
        if isinstance(obj.get("session_id"), str) and _SESSION.fullmatch(obj["session_id"]):
            report.session = obj["session_id"]
        if kind == "rate_limit_event":
            info = obj.get("rate_limit_info")
            if isinstance(info, dict) and info.get("status") == "rejected":
                report.limited = True
                report.reset_at = _when(info.get("resetsAt")) or report.reset_at
        elif kind == "assistant" and obj.get("error") is not None:
            text = _text(obj.get("message"))
            if obj.get("error") == "rate_limit":
                report.limited = True
                report.limit_text = text or report.limit_text
            report.error = (text or str(obj.get("error")))[:2000]
        elif kind == "result":
            result = obj
    if result is not None:
        report.usage = usage_of(result.get("usage"), result.get("total_cost_usd"))
        report.denied = [d for d in map(_denial, _list(result.get("permission_denials"))) if d]
        if result.get("is_error"):
            text = result.get("result")
            errors = result.get("errors")
            if isinstance(text, str) and text:
                report.error = text[:2000]
            elif isinstance(errors, list) and errors:  # e.g. error_max_turns
                report.error = "; ".join(str(e) for e in errors)[:2000]
            else:
                report.error = report.error or str(result.get("subtype") or "error")
    if report.limited and report.limit_text is None:
        report.limit_text = report.error
    return report


def progress(tail: str) -> Usage | None:
    """The usage of the run still going at the end of the log, turn by turn: each assistant
    message of the run (after its `system` init line) carries its model call's usage, the same
    block repeated for each of its content blocks (counted once, by message id). No cost: Claude
    Code says that only in its `result`, at the end. None: no turn yet."""
    turns: dict[str, Usage] = {}
    for obj in _objects(tail):
        kind = obj.get("type")
        if kind == "system" and obj.get("subtype") == "init":
            turns = {}  # a new run (a resume appends to the same log)
        elif kind == "result":
            turns = {}  # that run has ended: its usage is read at its exit
        elif kind == "assistant" and obj.get("error") is None:
            message = _dict(obj.get("message"))
            usage = usage_of(message.get("usage"))
            if usage is not None:
                turns[str(message.get("id") or len(turns))] = usage
    if not turns:
        return None
    out = Usage()
    for usage in turns.values():
        out = out + usage
    return out


def render(line: str) -> str | None:
    """One stream-json line as a person reads it: the assistant's text, its tool calls, the
    end (with tokens and cost); nothing for the bookkeeping lines. Not JSON: as it is."""
    obj = json_object(line)
    if obj is None:
        return line
    kind = obj.get("type")
    if kind == "system" and obj.get("subtype") == "init":
        return f"[claude {obj.get('model', '')}, session {obj.get('session_id', '?')}]"
    if kind == "assistant":
        out = []
        for block in _list(_dict(obj.get("message")).get("content")):
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text" and isinstance(block.get("text"), str):
                out.append(block["text"])
            elif block.get("type") == "tool_use":
                inp = block.get("input") if isinstance(block.get("input"), dict) else {}
                arg = next((inp[k] for k in ("file_path", "command", "path", "pattern", "url") if isinstance(inp.get(k), str)), "")
                out.append(f"> {block.get('name', 'tool')}({arg})")
        return "\n".join(out) or None
    if kind == "user":
        for block in _list(_dict(obj.get("message")).get("content")):
            if isinstance(block, dict) and block.get("type") == "tool_result" and block.get("is_error"):
                content = block.get("content")
                return f"  ! {content if isinstance(content, str) else _text(block)}"
        return None
    if kind == "rate_limit_event":
        info = _dict(obj.get("rate_limit_info"))
        if info.get("status") == "rejected":
            at = _when(info.get("resetsAt"))
            return "[rate limit reached" + (f", resets {at.isoformat()}]" if at else "]")
        return None
    if kind == "result":
        from kugetsu.agents.report import describe

        usage = usage_of(obj.get("usage"), obj.get("total_cost_usd"))
        head = "[error: " + str(obj.get("result") or obj.get("subtype")) + "]" if obj.get("is_error") else "[done]"
        denied = [d for d in map(_denial, _list(obj.get("permission_denials"))) if d]
        parts = [head] + ([describe(usage)] if usage else []) + ([f"denied: {', '.join(denied)}"] if denied else [])
        return " ".join(parts)
    return None
