"""Codex CLI's structured output (`codex exec --json`, and `codex exec resume --json`).

One JSON object a line (stderr's warnings may be mixed in): `thread.started` (thread_id: the
session `codex exec resume` continues), `turn.started`, `item.started`/`item.completed`
(agent_message, reasoning, command_execution, file_change, mcp_tool_call, web_search,
todo_list, and `error` items, which are warnings), then `turn.completed` (usage:
input_tokens, cached_input_tokens, cache_write_input_tokens, output_tokens,
reasoning_output_tokens) or `turn.failed` (error.message), with `error` events before it.

A refusal comes as the failed turn's message: `You’ve hit your usage limit. ... try again at
6:12 PM.` (ChatGPT plans, the reset in the machine's zone, to the minute; a date before it
when it is not today: `try again at Nov 27th, 2026 5:26 PM.`), `Quota exceeded. Check your
plan and billing details.` (API key: insufficient_quota), or `exceeded retry limit, last
status: 429 Too Many Requests` (its own retries of a rate limit used up).

A task's log holds all its runs (a resumed one is appended): each run starts with its
`thread.started`, and only the last run is read. Its usage counts the whole thread (`codex exec
resume` goes on counting): a run's own is the difference from the thread's run before it.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from kugetsu.agents.report import Report, Usage, describe, json_object, json_objects

# What Codex says when its provider refused for a limit (typographic apostrophe or not).
_LIMITED = re.compile(
    r"(?i)you[’']ve hit your usage limit|\bquota exceeded\b|\binsufficient_quota\b|usage_limit_reached"
    r"|\b429\b|too many requests|\brate.?limit"
)
# A session id that may be passed to a command line (not an option: no leading "-").
SESSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
# `try again at Nov 27th, 2026 5:26 PM` (a reset not today); the time alone (`at 6:12 PM`) is
# read by limits.reset_time from the report's limit_text.
_DATED = re.compile(
    r"(?i)\bagain at ([a-z]{3})[a-z]*\.? (\d{1,2})(?:st|nd|rd|th)?,? (\d{4}),? (\d{1,2}):(\d{2})\s*([ap])\.?m\.?"
)


def _int(v: object) -> int:
    """A token count, or 0 for anything that is not one (a huge number: the index stores it)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 10**15 else 0


def usage_of(raw: object) -> Usage | None:
    """A turn's usage as a Usage. OpenAI counts cached input within input_tokens (and
    reasoning within output_tokens): input_tokens here is the uncached rest, as Anthropic's."""
    if not isinstance(raw, dict):
        return None
    cached, written = _int(raw.get("cached_input_tokens")), _int(raw.get("cache_write_input_tokens"))
    return Usage(input_tokens=max(0, _int(raw.get("input_tokens")) - cached - written),
                 output_tokens=_int(raw.get("output_tokens")), cache_read_tokens=cached, cache_write_tokens=written)


def dated_reset(text: str, now: datetime) -> datetime | None:
    """The reset Codex prints with its date (`try again at Nov 27th, 2026 5:26 PM`), in the
    machine's zone (Codex's own: it runs here), or None."""
    m = _DATED.search(text)
    if not m or m.group(1).lower() not in _MONTHS:
        return None
    hour = int(m.group(4))
    if not 1 <= hour <= 12:
        return None
    hour = hour % 12 + (12 if m.group(6).lower() == "p" else 0)
    try:
        local = datetime(int(m.group(3)), _MONTHS.index(m.group(1).lower()) + 1, int(m.group(2)), hour, int(m.group(5)))
    except ValueError:
        return None
    at = local.astimezone(timezone.utc)  # a naive time is the machine's own zone
    return at if at > now else None


def _runs(objects: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The log's runs, each from its `thread.started` (what comes before the first: one run)."""
    runs: list[list[dict[str, Any]]] = [[]]
    for obj in objects:
        if obj.get("type") == "thread.started" and runs[-1]:
            runs.append([])
        runs[-1].append(obj)
    return runs


def _thread(run: list[dict[str, Any]]) -> str | None:
    """The run's thread id; only one that looks like one (it becomes an argument of the resume)."""
    first = run[0] if run else {}
    tid = first.get("thread_id") if first.get("type") == "thread.started" else None
    return tid if isinstance(tid, str) and SESSION.fullmatch(tid) else None


def _used(run: list[dict[str, Any]]) -> Usage | None:
    """The thread's usage so far at the end of a run: Codex's turn.completed counts the whole
    thread (a resumed one: its earlier runs too), so the last one says it all."""
    done = [usage_of(o.get("usage")) for o in run if o.get("type") == "turn.completed"]
    return next((u for u in reversed(done) if u is not None), None)


def read(tail: str, now: datetime) -> Report:
    """What the end of a `codex exec --json` log says about its last run. Total: never raises.
    Its usage is what the thread used since the same thread's run before it in the log (a
    refused run reports none: its tokens count with the run that resumes it)."""
    report = Report()
    runs = _runs(json_objects(tail))
    run = runs[-1]
    report.session = _thread(run)
    used = _used(run)
    if used is not None:
        before = next((u for r in reversed(runs[:-1]) if _thread(r) == report.session and (u := _used(r))), None)
        report.usage = used - before if before is not None and report.session else used
    failed = said = None
    for obj in run:
        kind = obj.get("type")
        if kind == "turn.failed":
            error = obj.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                failed = error["message"]
        elif kind == "error" and isinstance(obj.get("message"), str):
            said = obj["message"]
    report.error = (failed or said or "")[:2000] or None
    if report.error and _LIMITED.search(report.error):
        report.limited = True
        report.limit_text = report.error
        report.reset_at = dated_reset(report.error, now)
    return report


def render(line: str) -> str | None:
    """One `--json` line as a person reads it: the agent's messages, the commands it ran and
    the files it changed, the end of its turn (with tokens) or its error; nothing for the
    bookkeeping lines. Not JSON: as it is."""
    obj = json_object(line)
    if obj is None:
        return line
    kind = obj.get("type")
    if kind == "thread.started":
        return f"[codex session {obj.get('thread_id', '?')}]"
    if kind == "turn.completed":
        usage = usage_of(obj.get("usage"))
        return "[done] " + describe(usage) if usage else "[done]"
    if kind == "turn.failed":
        error = obj.get("error") if isinstance(obj.get("error"), dict) else {}
        return f"[error: {error.get('message', '?')}]"
    if kind == "error":
        return f"! {obj.get('message', '?')}"
    if kind != "item.completed" or not isinstance(obj.get("item"), dict):
        return None
    item = obj["item"]
    what = item.get("type")
    if what == "agent_message" and isinstance(item.get("text"), str):
        return item["text"]
    if what == "command_execution":
        code = item.get("exit_code")
        return f"> $ {item.get('command', '')}" + (f"  (exit {code})" if code not in (0, None) else "")
    if what == "file_change":
        changes = item.get("changes") if isinstance(item.get("changes"), list) else []
        names = ", ".join(f"{c.get('kind', 'edit')} {c.get('path', '?')}" for c in changes if isinstance(c, dict))
        return f"> {names or 'file change'}" + ("  (failed)" if item.get("status") == "failed" else "")
    if what == "mcp_tool_call":
        return f"> {item.get('server', '')}.{item.get('tool', 'tool')}"
    if what == "web_search":
        return f"> search: {item.get('query', '')}"
    if what == "error":
        return f"! {item.get('message', '?')}"
    return None
