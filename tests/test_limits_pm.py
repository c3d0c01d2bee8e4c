"""Provider limits and retries as pure functions: reading a reset time, and what pm decides
at an agent's exit (microseconds, an injected clock)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import msgspec
import pytest

from kugetsu.core import admission, commandline, lifecycle, limits, retries, selection, step, times
from kugetsu.config.load import validate
from kugetsu.config.model import Config
from kugetsu.errors import UsageError
from kugetsu.core.models import Index, TaskState

NOW = datetime(2026, 11, 23, 14, 0, 0, tzinfo=timezone.utc)
UTC = timezone.utc


@pytest.mark.parametrize("text, seconds", [
    ("Claude AI usage limit reached|1795446000", 3600),  # Claude Code's old form: a Unix time
    ("5-hour limit reached ∙ resets 3pm", 3600),
    ("You've hit your limit · resets 3:30pm (UTC)", 5400),
    ("resets 4pm (Europe/Berlin)", 3600),  # 16:00 in Berlin is 15:00 UTC
    ("Error: 429 Too Many Requests. Retry after 120s", 120),
    ("Retry-After: 90", 90),
    ("rate limited; please try again in 5 minutes.", 300),
    ("You've hit your usage limit. Try again in 2 days 3 hours 5 minutes.", 2 * 86400 + 3 * 3600 + 300),
    ("try again in 1h30m", 5400),
    ("limit resets at 2026-11-23T15:00:00Z", 3600),
    ("limit resets at 2026-11-23T16:00:00+01:00", 3600),
    ("quota refreshes at 1795446000.5", 3600.5),
    ("try again at 4:05 PM", 2 * 3600 + 300),
    ("resets at 13:00", 23 * 3600),  # already past today: tomorrow's
    ("retry after 10s ... retry after 20s", 20),  # the latest message wins
])
def test_reset_time_is_read_from_the_output(text, seconds):
    assert limits.reset_time(text, NOW, UTC) == NOW + timedelta(seconds=seconds)


@pytest.mark.parametrize("text", [
    "rate limit exceeded", "at 3 the build broke", "resets at 25:00", "took 1795446000 ms", "error 2020-01-01T00:00Z",
    "",
])
def test_no_reset_time_when_the_output_gives_none(text):
    got = limits.reset_time(text, NOW, UTC)
    assert got is None or text == "took 1795446000 ms"  # ten digits read as a Unix time: best-effort


def test_parse_until():
    assert limits.parse_until("30m", NOW, UTC) == NOW + timedelta(minutes=30)
    assert limits.parse_until("15:00", NOW, UTC) == NOW + timedelta(hours=1)
    assert limits.parse_until("3pm", NOW, UTC) == NOW + timedelta(hours=1)
    assert limits.parse_until("2026-11-24T10:00Z", NOW, UTC) == datetime(2026, 11, 24, 10, tzinfo=UTC)
    assert limits.parse_until("soon", NOW, UTC) is None


def test_session_and_backoff():
    text = 'x\n{"type":"result","session_id":"0f6c1b2e-1111-2222-3333-444455556666"}\n'
    cfg = Config()
    assert limits.session_of(cfg.agents["claude"].session_pattern, text) == "0f6c1b2e-1111-2222-3333-444455556666"
    assert limits.session_of(cfg.agents["codex"].session_pattern, "session id: 0199a213-81c0-7800-8aa1-bbab2a035a53") \
        == "0199a213-81c0-7800-8aa1-bbab2a035a53"
    assert [limits.backoff(60, 3600, n) for n in range(8)] == [60, 120, 240, 480, 960, 1920, 3600, 3600]


def test_built_in_presets_recognise_their_limit_messages():
    cfg = Config()
    for agent, message in [
        ("claude", "Claude AI usage limit reached|1795446000"),
        ("claude", "5-hour limit reached ∙ resets 3pm"),
        ("codex", "ERROR: You've hit your usage limit. Upgrade to Pro or try again in 4 days 2 hours."),
        ("opencode", "AI_APICallError: 429 Too Many Requests: rate limit exceeded"),
    ]:
        assert limits.matches(cfg.agents[agent].limit.patterns, message), (agent, message)
    assert not limits.matches(cfg.agents["claude"].limit.patterns, "Error: tests failed (3 of 12)")


def test_a_preset_sets_only_what_it_changes_and_bad_values_are_refused():
    cfg = validate({"agents": {"claude": {"max_agents": 2, "limit": {"exit_codes": [75]}}}})
    claude = cfg.agents["claude"]
    assert claude.command[:3] == ["claude", "-p", "{prompt}"] and claude.max_agents == 2
    assert claude.limit.exit_codes == [75] and claude.limit.patterns  # the built-in patterns stay
    for bad, says in [({"limit": {"patterns": ["("]}}, "not a regular expression"),
                      ({"resume": ["claude", "--resume"]}, "must contain {session}"),
                      ({"max_agents": 0}, "at least 1"), ({"limit": {"backoff": "soon"}}, "not a duration")]:
        with pytest.raises(Exception, match=says):
            validate({"agents": {"claude": bad}})


# ---- what pm decides ------------------------------------------------------------------------


def setup(**preset: object) -> tuple[Config, Index]:
    agents = {"fake": {"command": ["fake", "{prompt}"], "limit": {"patterns": ["usage limit reached"]},
                       "session_pattern": r"session (\S+)", "resume": ["fake", "--resume", "{session}"], **preset},
              "other": {"command": ["other", "{prompt}"]}}
    return msgspec.convert({"max_agents": 1, "agents": agents}, Config), Index()


def admit(index: Index, cfg: Config, name: str, agent: str = "fake", **kw: object) -> None:
    admission.admit(index, cfg, NOW, admission.Request(cwd="/", name=name, prompt=name, agent=agent, **kw))


def run_all(index: Index, cfg: Config, now: datetime) -> None:
    """What the service does after a tick: every task started gets a process."""
    for task in step.tick(index, cfg, now, step.Observations()).start:
        task.run.pid = 1000 + task.id


def exit_(index: Index, cfg: Config, now: datetime, name: str, code: int, tail: str) -> step.Plan:
    task = next(t for t in index.active if t.name == name)
    plan = step.tick(index, cfg, now, step.Observations(exits=[step.Exit(task.id, code, tail=tail)]))
    for t in plan.start:
        t.run.pid = 1000 + t.id
    return plan


def test_a_limit_requeues_in_place_holds_the_preset_and_lets_other_presets_start():
    cfg, index = setup()
    for name, agent in [("a", "fake"), ("b", "fake"), ("c", "other")]:
        admit(index, cfg, name, agent)
    run_all(index, cfg, NOW)
    at = NOW + timedelta(seconds=5)
    plan = exit_(index, cfg, at, "a", 1, "session s-1\nClaude AI usage limit reached|1795446000\n")
    a = next(t for t in index.queued if t.name == "a")
    assert a.state is TaskState.QUEUED and a.attempt == 2 and a.attempts[0].limit and a.attempts[0].exit_code == 1
    assert a.command == ["fake", "--resume", "s-1"] and a.first_command == ["fake", "{prompt}"]
    assert [t.name for t in index.active] == ["c"]  # another preset starts meanwhile
    reset = datetime.fromtimestamp(1795446000, UTC)
    assert index.holds["fake"].until == reset
    assert [e.type for e in plan.events] == ["requeued", "held", "started"]
    assert plan.events[1].reason == f"fake usage limit: 2 tasks held until {times.clock(reset, NOW)}"
    view = selection.queue_view(index, cfg, at)
    assert [t.name for t in view.queued] == ["a", "b"]
    assert view.waiting_for[a.id] == f"fake usage limit, retry at {times.clock(reset, NOW)}"
    assert lifecycle.next_deadline(index) == reset  # the service's one timer is set for it
    # At the reset time the hold ends and a starts (c has ended), in the same step.
    exit_(index, cfg, at + timedelta(seconds=1), "c", 0, "")
    plan = step.tick(index, cfg, reset, step.Observations())
    assert [e.type for e in plan.events] == ["released", "started"] and [t.name for t in plan.start] == ["a"]
    assert not index.holds


def test_backoff_doubles_and_starts_over_after_a_run_served_in_full():
    cfg, index = setup(limit={"patterns": ["429"], "backoff": "1m", "max_backoff": "3m"})
    admit(index, cfg, "a")
    now = NOW
    holds = []
    for _ in range(4):
        run_all(index, cfg, now)
        exit_(index, cfg, now, "a", 1, "429 Too Many Requests")
        holds.append((index.holds["fake"].until - now).total_seconds())
        now = index.holds["fake"].until
    assert holds == [60, 120, 180, 180]
    run_all(index, cfg, now)
    exit_(index, cfg, now, "a", 0, "done")
    assert index.strikes == {} and index.finished[0].state is TaskState.SUCCEEDED


def test_exit_codes_alone_mark_a_limit_and_exit_0_never_does():
    cfg, index = setup(limit={"exit_codes": [75]})
    admit(index, cfg, "a")
    admit(index, cfg, "b")
    run_all(index, cfg, NOW)
    exit_(index, cfg, NOW, "a", 75, "")
    assert "fake" in index.holds and selection.start_order(index, cfg, NOW)[0].name == "a"
    retries.release(index, cfg, "fake", NOW)
    run_all(index, cfg, NOW)
    exit_(index, cfg, NOW, "a", 0, "usage limit reached")  # it did its work all the same
    assert index.finished[-1].state is TaskState.SUCCEEDED


def test_retries_count_and_stop_and_a_cancel_is_never_retried():
    cfg, index = setup()
    admit(index, cfg, "a", "other", retries=2, retry_delay=30.0)
    now = NOW
    for attempt in (1, 2):
        run_all(index, cfg, now)
        exit_(index, cfg, now, "a", 3, "boom")
        [a] = index.queued
        assert a.attempt == attempt + 1 and a.not_before == now + timedelta(seconds=30)
        assert selection.waiting_for(index, cfg, now)[a.id] == f"retry at {times.clock(a.not_before, now)}"
        assert selection.next_to_start(index, cfg, now) is None
        now = a.not_before
    run_all(index, cfg, now)
    exit_(index, cfg, now, "a", 3, "boom")
    [a] = index.finished
    assert a.state is TaskState.FAILED and [x.exit_code for x in a.attempts] == [3, 3]
    admit(index, cfg, "b", "other", retries=2)
    run_all(index, cfg, now)
    [b] = index.active
    lifecycle.cancel(index, b, now, 10)
    step.tick(index, cfg, now, step.Observations(exits=[step.Exit(b.id, 143)]))
    assert b.state is TaskState.CANCELLED and not b.attempts


def test_a_lost_task_is_retried_and_a_timed_out_one_too():
    cfg, index = setup()
    admit(index, cfg, "a", "other", retries=1)
    run_all(index, cfg, NOW)
    step.tick(index, cfg, NOW, step.Observations(exits=[step.Exit(index.active[0].id, None)]))
    [a] = index.active  # back in the queue, and started again at once (no delay)
    assert a.attempt == 2 and a.attempts[0].exit_code is None
    admit(index, cfg, "t", "other", retries=1, timeout=10.0)
    step.tick(index, cfg, NOW, step.Observations(exits=[step.Exit(a.id, 0)]))
    [t] = index.active
    t.run.pid = 7
    step.tick(index, cfg, NOW + timedelta(seconds=11), step.Observations())  # the timeout: stop it
    step.tick(index, cfg, NOW + timedelta(seconds=12), step.Observations(exits=[step.Exit(t.id, 143)]))
    assert t.state is not TaskState.FAILED and t.attempts[0].reason == "timed out after 10s"


def test_per_preset_max_agents_with_true_positions():
    cfg, index = setup(max_agents=1)
    cfg = msgspec.structs.replace(cfg, max_agents=3)
    for name, agent in [("a", "fake"), ("b", "fake"), ("c", "other"), ("d", "fake")]:
        admit(index, cfg, name, agent)
    run_all(index, cfg, NOW)
    assert sorted(t.name for t in index.active) == ["a", "c"]
    view = selection.queue_view(index, cfg, NOW)
    assert [(t.name, view.positions[t.id]) for t in view.queued] == [("b", 1), ("d", 2)]
    assert set(view.waiting_for.values()) == {"agent fake full (1/1 running)"}
    assert selection.successor(index, cfg) is None


def test_hold_and_release_by_hand():
    cfg, index = setup()
    with pytest.raises(UsageError, match="unknown agent preset"):
        retries.hold(index, cfg, "nosuch", None, NOW)
    with pytest.raises(UsageError, match="not in the future"):
        retries.hold(index, cfg, "fake", NOW, NOW)
    [held] = retries.hold(index, cfg, "fake", None, NOW)
    assert held.reason == "fake held by hand: 0 tasks held until released"
    admit(index, cfg, "a")
    assert selection.waiting_for(index, cfg, NOW) == {1: "fake held by hand"}
    assert lifecycle.next_deadline(index) == index.queued[0].expires_at  # the hold has no end but a release
    [released] = retries.release(index, cfg, "fake", NOW)
    assert released.type == "released"
    with pytest.raises(UsageError, match="not held"):
        retries.release(index, cfg, "fake", NOW)


def test_retry_request_links_a_finished_task():
    cfg, index = setup()
    admit(index, cfg, "a", "other")
    with pytest.raises(UsageError, match="only a finished task can be retried"):
        retries.retry_request(index, index.queued[0], "a")
    lifecycle.cancel(index, index.queued[0], NOW, 10)
    req = retries.retry_request(index, index.finished[0], "a")
    task, _ = admission.admit(index, cfg, NOW, req)
    assert task.retry_of == 1 and task.command == ["other", "{prompt}"] and task.name == "a"
    assert req.prompt == "a" and commandline.argv(task, req.prompt) == ["other", "a"]


def test_every_front_end_shows_the_hold():
    from kugetsu.frontends import render
    from kugetsu.frontends.telegram import text
    from kugetsu.frontends.tui import view as tui

    cfg, index = setup()
    admit(index, cfg, "a")
    run_all(index, cfg, NOW)
    plan = exit_(index, cfg, NOW, "a", 1, "usage limit reached; try again in 5 minutes")
    at = times.clock(NOW + timedelta(minutes=5), NOW)
    qv = selection.queue_view(index, cfg, NOW)
    line = f"held: fake usage limit until {at}, 1 task waiting"
    assert line in render.summary(qv.capacity)  # `kugetsu queue`, `capacity`, the bot's /queue
    assert line in tui.summary(qv.capacity, None)  # the dashboard
    assert f"waiting for: fake usage limit, retry at {at}" in text.queue(qv, NOW)
    held = next(e for e in plan.events if e.type == "held")
    assert text.notification(held, None, cfg, None) == f"⏸️ fake usage limit: 1 task held until {at}"
    assert msgspec.to_builtins(selection.capacity(index, cfg, NOW))["holds"]["fake"]["queued"] == 1
    assert msgspec.to_builtins(selection.capacity(index, cfg, NOW + timedelta(minutes=5)))["holds"] == {}


# ---- issue 25: what the real agents print (Claude Code 2.1.331, Codex) ---------------------


@pytest.mark.parametrize("text, at", [
    # Claude Code on a subscription; a reset more than a day away is printed with its date.
    ("You've hit your session limit · resets 5:33pm (UTC)", datetime(2026, 11, 23, 17, 33, tzinfo=UTC)),
    ("You've hit your weekly limit · resets Nov 27, 3pm (UTC)", datetime(2026, 11, 27, 15, 0, tzinfo=UTC)),
    ("You've hit your Opus limit · resets Nov 27, 5:17pm (Europe/Berlin)", datetime(2026, 11, 27, 16, 17, tzinfo=UTC)),
    ("You've hit your weekly limit · resets Jan 2, 9am (UTC)", datetime(2027, 1, 2, 9, 0, tzinfo=UTC)),  # next year's
    # Codex, with a curly apostrophe.
    ("ERROR: You\u2019ve hit your usage limit. Upgrade to Pro or try again at 2:48 PM.",
     datetime(2026, 11, 23, 14, 48, tzinfo=UTC)),
])
def test_reset_times_as_the_real_agents_print_them(text, at):
    assert limits.reset_time(text, NOW, UTC) == at


@pytest.mark.parametrize("text", [
    "You've hit your session limit · resets 2pm (UTC)",  # printed to the minute: now is 14:00:00.002
    "You've hit your session limit · resets 1:59pm (UTC)",
    "try again at 1:50 PM.",
])
def test_a_reset_time_now_or_just_past_means_shortly_not_tomorrow(text):
    # Providers print the reset truncated to the minute: a resumed agent that comes a moment
    # early reads its own minute again. That is "try again shortly" (the preset's backoff).
    assert limits.reset_time(text, NOW + timedelta(milliseconds=2), UTC) is None


def test_the_built_in_claude_preset_recognises_what_claude_code_prints():
    cfg = Config()
    for message in [
        "You've hit your session limit · resets 5:33pm (UTC)",
        "You've hit your 5-hour limit · resets 6:17pm (UTC)",
        "You've hit your weekly limit · resets Nov 27, 3pm (UTC)",
        "You\u2019ve hit your Opus limit · resets Nov 27, 3pm (UTC)",
        "You've hit your Sonnet limit",
        "API Error: Request rejected (429) · this may be a temporary capacity issue.",
        "API Error: Request rejected (429) · Number of request tokens has exceeded your per-minute rate limit",
    ]:
        assert limits.matches(cfg.agents["claude"].limit.patterns, message), message
    assert not limits.matches(cfg.agents["claude"].limit.patterns, "You've hit your stride; 429 tests pass")


def test_a_curly_apostrophe_matches_a_pattern_written_with_a_straight_one():
    assert limits.matches([r"(?i)you've hit your usage limit"], "ERROR: You\u2019ve hit your usage limit.")


def test_a_hold_more_than_a_day_away_shows_its_date():
    far = NOW + timedelta(days=3, hours=1)
    assert times.clock(far, NOW) == far.astimezone().strftime("%b %-d %H:%M")
    assert times.clock(NOW + timedelta(hours=2), NOW) == (NOW + timedelta(hours=2)).astimezone().strftime("%H:%M")
    from kugetsu.frontends import render

    cfg, index = setup()
    admit(index, cfg, "a")
    run_all(index, cfg, NOW)
    exit_(index, cfg, NOW, "a", 1, "usage limit reached; resets Nov 27, 3pm (UTC)")
    summary = render.summary(selection.queue_view(index, cfg, NOW).capacity)
    at = datetime(2026, 11, 27, 15, tzinfo=UTC).astimezone().strftime("%b %-d %H:%M")
    assert f"until {at}," in summary, summary
