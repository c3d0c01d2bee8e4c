"""Provider limits, read from an agent's output: pure functions of text and a clock.

An agent that hits its provider's usage limit or rate limit says so at the end of its output
and exits non-zero. Whether it did (the preset's `limit.patterns` and `limit.exit_codes`),
when the limit resets (`reset_time`), and the session it ran (`session_pattern`) are read
here; pm decides what follows (the task back in its place, the preset held).

Every reader here is total (issue 24): any text, however hostile (times UTC cannot hold, a
thousand digits, NaN), gives a value or None, never an exception; tests/test_hostile_input.py
property-tests it.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone, tzinfo

from kugetsu.errors import warn


# How much of the end of the log is read at an agent's exit: a limit message is among the
# last lines an agent prints.
TAIL_BYTES = 16 * 1024
# The furthest ahead a reset time can be: no provider's limit lasts longer. A time said beyond
# it (9999-12-31) is no reset time at all.
MAX_AHEAD = timedelta(days=366)

_UNIT_SECONDS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hr": 3600,
                 "hour": 3600, "d": 86400, "day": 86400}
_UNIT = r"(?:d|days?|h|hrs?|hours?|m|mins?|minutes?|s|secs?|seconds?)"
# Pattern texts, compiled at first use (re's own cache): pm imports this module on every CLI
# call, and compiling them all there cost 1.5 ms.
# `in 5 minutes`, `after 120s`, `in 2 days 3 hours 5 minutes`, `in 1h30m`, `Retry-After: 120`
_SPAN = (
    rf"(?i)\b(?:in|after|retry-after:?|wait)\s+((?:\d+(?:\.\d+)?\s*{_UNIT}(?![a-z])[\s,]*(?:and\s+)?)+)"
    r"|\b(?:retry[- ]after:?)\s*(\d+(?:\.\d+)?)(?![\d:.])"
)
_SPAN_PART = rf"(?i)(\d+(?:\.\d+)?)\s*({_UNIT})(?![a-z])"
# 2026-11-23T15:00:00Z, 2026-11-23 15:00:00+01:00
_ISO = r"\b(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)(?![\d:])"
# A Unix time in seconds: ten digits (2001 to 2286), e.g. `usage limit reached|1763910000`
_UNIX = r"(?<![\d.])(\d{10})(?:\.(\d+))?(?![\d])"
# `resets at 3pm`, `reset at 3:30 PM`, `resets 15:00 (Europe/Berlin)`, `try again at 4:05 pm`;
# with a date before it (Claude Code, a reset more than a day away): `resets Nov 27, 3pm (UTC)`
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_CLOCK = (
    r"(?i)\b(?:resets?|again|until|after|at)\s+(?:at\s+)?"
    r"(?:(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?\s+(\d{1,2})(?:st|nd|rd|th)?,?\s+(?:at\s+)?)?"
    r"(\d{1,2})(?::(\d{2}))?(?::(\d{2}))?\s*(am|pm|a\.m\.|p\.m\.)?"
    r"(?:\s*\(([A-Za-z_]+(?:/[A-Za-z_+-]+)*)\))?(?![\d:])"
)
# Providers print a reset time truncated to the minute (`resets 2:39pm` for 14:39:05), so an
# agent resumed at it may be refused once more and print the same minute: a clock time this
# recent is "try again shortly" (the preset's backoff), not tomorrow's.
JUST_PAST = timedelta(minutes=15)


def _unit_seconds(unit: str) -> int:
    u = unit.lower()
    if u in _UNIT_SECONDS:
        return _UNIT_SECONDS[u]
    return _UNIT_SECONDS[u.rstrip("s")]


def parse_span(text: str) -> float | None:
    """`5 minutes`, `2 days 3 hours`, `1h30m`, `120s`, `120` -> seconds."""
    parts = re.findall(_SPAN_PART, text)
    try:
        seconds = sum(float(n) * _unit_seconds(u) for n, u in parts) if parts else float(text.strip())
    except (ValueError, KeyError):
        return None
    return seconds if seconds == seconds and seconds not in (float("inf"), float("-inf")) else None  # no NaN, no inf


def _zone(name: str | None, default: tzinfo) -> tzinfo:
    if not name:
        return default
    try:
        from zoneinfo import ZoneInfo

        return ZoneInfo(name)
    except Exception:  # an unknown or malformed zone name: the machine's own zone
        return default


def _clock_time(m: re.Match[str], now: datetime, local: tzinfo, just_past: timedelta = timedelta(0)) -> datetime | None:
    """The moment a _CLOCK match names: the next one to come, or one within `just_past`
    before now (then as it is: the caller reads that as "now")."""
    month, day = m.group(1), m.group(2)
    hour, minute, second = int(m.group(3)), int(m.group(4) or 0), int(m.group(5) or 0)
    meridiem = (m.group(6) or "").lower().replace(".", "")
    if not meridiem and m.group(4) is None:
        return None  # a bare number (`at 3`) is not a time
    if meridiem:
        if not 1 <= hour <= 12:
            return None
        hour = hour % 12 + (12 if meridiem == "pm" else 0)
    if hour > 23 or minute > 59 or second > 59:
        return None
    zone = _zone(m.group(7), local)
    try:
        here = now.astimezone(zone)
        if month:  # a date without its year: this year's, or next year's once it is past
            at = here.replace(month=_MONTHS.index(month.lower()[:3]) + 1, day=int(day), hour=hour, minute=minute,
                              second=second, microsecond=0)
            if at < here - just_past:
                at = at.replace(year=at.year + 1)
        else:  # a clock time already past today is tomorrow's
            at = here.replace(hour=hour, minute=minute, second=second, microsecond=0)
            if at < here - just_past or (not just_past and at <= here):
                at += timedelta(days=1)
        return at.astimezone(timezone.utc)
    except (OverflowError, ValueError):  # Feb 30, Feb 29 of a year without it, the ends of datetime
        return None


def _utc(at: datetime, local: tzinfo) -> datetime | None:
    """A time said (in its own zone, else `local`) in UTC; None when UTC cannot hold it (year 1
    east of Greenwich, 9999-12-31 west of it): such a time is no reset time anyone meant."""
    try:
        return (at if at.tzinfo else at.replace(tzinfo=local)).astimezone(timezone.utc)
    except (OverflowError, ValueError):
        return None


def reset_time(text: str, now: datetime, local: tzinfo | None = None) -> datetime | None:
    """When a limit resets, as the agent's output says, or None when it does not say.

    Understands a span (`retry after 120s`, `try again in 5 minutes`, `in 2 days 3 hours`,
    `Retry-After: 120`), an ISO 8601 time, a Unix time (ten digits, as Claude Code's
    `usage limit reached|1763910000`), and a clock time (`resets at 3pm`, `resets 3:30 PM
    (Europe/Berlin)`, `try again at 15:00`) in the named zone or else `local` (the machine's
    zone when None), with a date before it (`resets Nov 27, 3pm (UTC)`); a clock time already
    past is tomorrow's, except one just past (JUST_PAST: printed to the minute) which, like
    any time just past, means "shortly": None, the preset backs off. The last mention in the
    text wins (the latest message). Times further in the past are ignored. `now` must be aware.
    Total: whatever the text, a time or None (a reading that fails is said once in the log)."""
    try:
        return _reset_time(text, now, local)
    except Exception as err:  # a reading this module did not foresee: no reset time, said once
        _unreadable(err)
        return None


def _reset_time(text: str, now: datetime, local: tzinfo | None) -> datetime | None:
    text = _straight(text)
    local = local or now.astimezone().tzinfo or timezone.utc
    latest = now + MAX_AHEAD
    found: list[tuple[int, datetime | None]] = []
    for m in re.finditer(_SPAN, text):
        seconds = parse_span(m.group(1) or m.group(2))
        if seconds is not None and 0 < seconds <= MAX_AHEAD.total_seconds():
            found.append((m.start(), now + timedelta(seconds=seconds)))
    for m in re.finditer(_ISO, text):
        try:
            at = datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
        except ValueError:
            continue
        found.append((m.start(), _utc(at, local)))
    iso_spans = [m.span() for m in re.finditer(_ISO, text)]
    for m in re.finditer(_UNIX, text):
        seconds = float(m.group(1) + "." + (m.group(2) or "0"))
        if seconds <= latest.timestamp():  # ten digits reach 2286: only a year ahead is a reset
            found.append((m.start(), datetime.fromtimestamp(seconds, timezone.utc)))
    for m in re.finditer(_CLOCK, text):
        if any(a <= m.start(3) < b for a, b in iso_spans):
            continue  # the hour of an ISO time
        found.append((m.start(), _clock_time(m, now, local, JUST_PAST)))
    recent = [(pos, at) for pos, at in found if at is not None and now - JUST_PAST <= at <= latest]
    if not recent:
        return None
    at = max(recent, key=lambda pa: pa[0])[1]
    return at if at > now else None


# Agents print typographic apostrophes and quotes (Codex: `You’ve hit your usage limit`):
# patterns are written with plain ones, so the text is read with plain ones.
_TYPOGRAPHIC = str.maketrans({"\u2018": "'", "\u2019": "'", "\u02bc": "'", "\u201c": '"', "\u201d": '"'})


def _straight(text: str) -> str:
    return text.translate(_TYPOGRAPHIC)


_SAID: set[str] = set()


def _unreadable(err: Exception) -> None:
    """Log a reading that failed, once per kind of failure (not once per agent's exit)."""
    what = f"{type(err).__name__}: {err}"
    if what not in _SAID:
        _SAID.add(what)
        warn("kugetsu.limits", "an agent's output could not be read for a limit (%s): read as no reset time", what)


def matches(patterns: list[str], text: str) -> bool:
    """Does any of the patterns (regular expressions) occur in the text? (Its typographic
    apostrophes and quotes read as plain ones.)"""
    text = _straight(text)
    return any(re.search(p, text, re.MULTILINE) for p in patterns)


def session_of(pattern: str | None, text: str) -> str | None:
    """The agent's session id: the first group of the last match of `pattern` (the whole
    match when it has no group)."""
    if not pattern:
        return None
    last = None
    for last in re.finditer(pattern, text, re.MULTILINE):
        pass
    if last is None:
        return None
    return last.group(1) if last.re.groups else last.group(0)


def backoff(first: float, most: float, strikes: int) -> float:
    """Seconds a preset is held when its agent did not say when its limit resets: `first`,
    doubling with each limit hit in a row, at most `most`."""
    return min(most, first * 2 ** min(strikes, 40))


def parse_until(text: str, now: datetime, local: tzinfo | None = None) -> datetime | None:
    """`kugetsu hold --until T`: a duration from now (`30m`, `2h`, `90`), an ISO 8601 time or
    a clock time (`15:00`, `3pm`, the next one to come); None when it is none of these."""
    from kugetsu.config.units import parse_duration

    try:
        return now + timedelta(seconds=parse_duration(text))
    except (ValueError, OverflowError):
        pass
    text = text.strip()
    local = local or now.astimezone().tzinfo or timezone.utc
    m = re.fullmatch(_ISO, text)
    if m:
        try:
            at = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            return None
        utc = _utc(at, local)
        if utc is None:  # beyond what UTC holds: as far as it goes, so that the caller says why
            utc = (datetime.min if at.year < 2 else datetime.max).replace(tzinfo=timezone.utc)
        return utc
    m = re.fullmatch(_CLOCK, f"at {text}")
    return _clock_time(m, now, local) if m else None
