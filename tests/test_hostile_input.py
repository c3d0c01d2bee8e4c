"""Hostile input (issue 24, items 1 and 9): what an agent prints, and what a person types, can
never stop the service or give a traceback. Reading the outside world is total: what cannot be
read is "no limit", and one task whose end cannot be handled is set aside, not the machine.

The pure readers (kugetsu.core.limits) are property-tested over arbitrary text; the rest runs the
real CLI, the real service and real agents that print the hostile lines."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import wait_for
from kugetsu.core import limits

NOW = datetime(2026, 11, 23, 14, 0, 0, tzinfo=timezone.utc)
ZONES = [timezone.utc, ZoneInfo("Europe/Berlin"), ZoneInfo("Pacific/Kiritimati"), ZoneInfo("America/Adak"),
         timezone(timedelta(hours=23, minutes=59)), timezone(timedelta(hours=-23, minutes=-59))]

# Lines real agents (and the tools around them) print that once stopped the service: times at
# the ends of what datetime can hold, in zones that push them over, huge numbers.
EDGE_TEXTS = [
    "usage limit reached, resets at 0001-01-01T00:00:00+01:00",
    "0001-01-01 00:00:00 +0000 UTC\nAPI Error: 429 Too Many Requests (rate limit)",  # Go's zero time
    "resets at 0001-01-01T00:00:00", "resets at 0001-01-01 00:00", "limit resets at 9999-12-31T23:59:59-01:00",
    "resets at 9999-12-31T23:59:59Z", "resets at 9999-12-31 23:59", "resets at 0000-00-00T00:00:00Z",
    "retry after " + "9" * 400 + " days", "try again in " + "9" * 5000 + "s", "Retry-After: " + "9" * 400,
    "Retry-After: 1e999", "quota refreshes at 9999999999." + "9" * 400, "|9999999999", "|0000000000",
    "resets 3pm (Etc/GMT+14)", "resets 3pm (../../etc/passwd)", "resets 3pm (" + "A/" * 500 + "B)",
    "try again at 23:59:59 pm", "in 0.0000000000000000001s", "in nan hours", "after inf days",
]

# Text with the shapes the readers look for, mixed with arbitrary characters.
pieces = st.sampled_from([
    "resets at ", "retry after ", "Retry-After: ", "try again in ", "in ", "at ", " (", ")", "Europe/Berlin",
    "Etc/GMT-14", "pm", "am", ":", "-", "T", "Z", "+", " ", "\n", "|", ".", "0001-01-01", "9999-12-31",
    "00:00:00", "23:59:59", "+23:59", "-23:59", "+01:00", "d", "h", "m", "s", "days", "hours", "9" * 30, "1",
    "0", "12", "60", "9999999999", "0000000000", "\x00", "\udcff", "\x1b[31m", "漢字",
])
hostile_text = st.one_of(st.text(max_size=200), st.lists(st.one_of(pieces, st.text(max_size=5)), max_size=40).map("".join))
moments = st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(9998, 1, 1), timezones=st.just(timezone.utc))


@pytest.mark.parametrize("text", EDGE_TEXTS, ids=[f"text{i}" for i in range(len(EDGE_TEXTS))])
@pytest.mark.parametrize("local", ZONES, ids=str)
def test_reset_time_of_edge_texts_is_none_or_a_time_within_a_year(text, local):
    got = limits.reset_time(text, NOW, local)
    assert got is None or NOW < got <= NOW + timedelta(days=366)


@settings(max_examples=400, deadline=None)
@given(text=hostile_text, now=moments, local=st.sampled_from(ZONES))
def test_limit_readers_are_total(text, now, local):
    got = limits.reset_time(text, now, local)
    assert got is None or (got.tzinfo is not None and now < got <= now + timedelta(days=366))
    until = limits.parse_until(text, now, local)
    assert until is None or until.tzinfo is not None
    span = limits.parse_span(text)
    assert span is None or isinstance(span, float)
    assert limits.session_of(r"id: (\S+)", text) is None or "id: " in text
    limits.matches([r"(?i)limit", r"\d+"], text)


def test_parse_until_reads_out_of_range_times_as_times_not_crashes():
    # Year 1 in a zone east of UTC is before anything datetime can hold in UTC: a time long
    # past all the same (retries.hold then says it is not in the future), never an OverflowError.
    for text in ("0001-01-01T00:00:00+01:00", "0001-01-01T00:00:00Z", "0001-01-01 00:00"):
        at = limits.parse_until(text, NOW, ZoneInfo("Europe/Berlin"))
        assert at is not None and at < NOW, text
    for text in ("9999-12-31T23:59:59-01:00", "9999-12-31T23:59:59Z"):
        at = limits.parse_until(text, NOW, ZoneInfo("Pacific/Kiritimati"))
        assert at is not None and at > NOW + timedelta(days=366), text
    assert limits.parse_until("99999999999999d", NOW) is None  # no duration that long
    assert limits.parse_until("soon", NOW) is None


# ---- through the real program --------------------------------------------------------------

HOSTILE_AGENT = r"""
rec="$1"; shift
n=$(cat "$rec.n" 2>/dev/null || echo 0); n=$((n + 1)); echo "$n" > "$rec.n"
echo "start $(date +%s.%N)" >> "$rec"
if [ "$n" -le 1 ]; then
  printf '%s\n' "$SAY"
  exit 1
fi
exit 0
"""


def hostile_preset(kg, name: str, say: str, **extra) -> dict:
    script = kg.rec / "hostile.sh"
    script.write_text(HOSTILE_AGENT)
    return {"command": ["sh", str(script), str(kg.rec / name), "{prompt}"], "env": {"SAY": say}, **extra}


def service_log(kg) -> str:
    try:
        return kg.home.service_log.read_text(errors="replace")
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize("zone, say", [
    # The built-in claude preset's patterns, Go's zero time, a zone east of UTC.
    ("Europe/Berlin", "0001-01-01 00:00:00 +0000 UTC\nAPI Error: 429 Too Many Requests (rate limit)"),
    ("UTC", "Claude AI usage limit reached, resets at 0001-01-01T00:00:00+01:00"),
    ("Pacific/Kiritimati", "Claude AI usage limit reached, resets at 9999-12-31T23:59:59-01:00"),
])
def test_an_agent_printing_an_impossible_reset_time_stops_nothing(kg, zone, say):
    kg.env["TZ"] = zone  # the CLI autostarts the service: it runs in this zone too
    kg.config(max_agents=1, agents={
        "claude": hostile_preset(kg, "claude", say, limit={"backoff": "1s", "max_backoff": "1s"}),
        "other": {"command": kg.agent("other")},
    })
    kg.ok("delegate", "a", "--agent", "claude", "--prompt", "go")
    kg.ok("delegate", "b", "--agent", "other")
    # a's end is read as a limit with no reset time given (the time said is not one): the
    # preset backs off, b starts meanwhile, and a runs again and succeeds.
    kg.wait_state("b", "succeeded", timeout=20)
    a = kg.wait_state("a", "succeeded", timeout=20)
    assert [x["limit"] for x in a["attempts"]] == [True]
    assert kg.service_pid() is not None
    assert "tick failed" not in service_log(kg) and "Traceback" not in service_log(kg)
    for args in (("status", "a"), ("queue",), ("logs", "a"), ("capacity",)):
        r = kg.run(*args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr)


def test_hold_until_a_time_out_of_range_is_a_clear_error(kg):
    kg.config(agents={"claude": {"command": ["true"]}})
    kg.env["TZ"] = "Europe/Berlin"
    before = kg.home.index.read_bytes() if kg.home.index.exists() else None
    for until, says in [("0001-01-01T00:00:00+01:00", "not in the future"),
                        ("9999-12-31T23:59:59-01:00", "more than a year ahead"),
                        ("9999-12-31T23:59:59Z", "more than a year ahead")]:
        r = kg.run("hold", "claude", "--until", until)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert says in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert (kg.home.index.read_bytes() if kg.home.index.exists() else None) == before
    kg.ok("hold", "claude", "--until", "2h")
    assert json.loads(kg.ok("capacity", "--json"))["holds"]["claude"]["until"]


# ---- one task's failure is that task's only -------------------------------------------------


async def test_a_task_whose_end_cannot_be_handled_is_set_aside_and_the_others_go_on(kg, monkeypatch, caplog):
    """Whatever in an agent's end defeats kugetsu (here: its output reader raises, as
    limits.reset_time once did on year 1) fails that task, with the error for its reason, said
    once in the service's log; the tick goes on and every other task runs."""
    import asyncio

    from conftest import service_in_process, wait_for_async
    from kugetsu.core import retries, step

    kg.config(max_agents=1, autostart=False, agents={"fake": {"command": ["sh", "-c", "echo boom; exit 1"],
                                                              "limit": {"patterns": ["boom"]}}})
    await asyncio.to_thread(kg.ok, "delegate", "bad", "--agent", "fake", "--prompt", "x")
    await asyncio.to_thread(kg.ok, "delegate", "good", "--", "true")
    real = retries.read_output

    def read_output(cfg, task, *args):
        if task.name == "bad":
            raise RuntimeError("unreadable output")
        return real(cfg, task, *args)

    monkeypatch.setattr(step, "read_output", read_output)
    async with service_in_process(kg.home):
        await wait_for_async(lambda: len(kg.index()["finished"]) == 2, 20, "both tasks to end")
    finished = {t["name"]: t for t in kg.index()["finished"]}
    assert finished["good"]["state"] == "succeeded"
    bad = finished["bad"]
    assert bad["state"] == "failed" and bad["exit_code"] == 1
    assert "RuntimeError: unreadable output" in bad["reason"] and "set aside" in bad["reason"]
    said = [r for r in caplog.records if "set aside" in r.getMessage()]
    assert len(said) == 1 and "bad (#1)" in said[0].getMessage()
    assert not [r for r in caplog.records if "tick failed" in r.getMessage()]


async def test_a_first_tick_that_fails_leaves_the_service_up_and_retrying(kg, monkeypatch, caplog):
    import asyncio

    from conftest import service_in_process, wait_for_async
    from kugetsu.core import step

    kg.config(max_agents=1, autostart=False)
    await asyncio.to_thread(kg.ok, "delegate", "a", "--", "true")
    real, calls = step.tick, []

    def tick(*args):
        calls.append(1)
        if len(calls) == 1:
            raise OverflowError("date value out of range")
        return real(*args)

    monkeypatch.setattr(step, "tick", tick)
    async with service_in_process(kg.home):
        await wait_for_async(lambda: kg.index()["finished"], 20, "a to run once the tick works again")
    assert kg.index()["finished"][0]["state"] == "succeeded"
    assert [r for r in caplog.records if "tick failed" in r.getMessage()]
