"""Failover, usage and budgets as pure functions (issue 30): what pm and budgets decide, with an
injected clock, in microseconds."""

from __future__ import annotations

from datetime import timedelta

import msgspec

from conftest import T0

from kugetsu.core import admission, budgets, commandline, lifecycle, retries, selection, step
from kugetsu.agents.report import Usage
from kugetsu.config.model import Config
from kugetsu.core.models import Index, LimitHit, Task, TaskState
from kugetsu.core.policy import route_of

CFG = msgspec.convert({"max_agents": 2, "agents": {
    "a": {"command": ["run-a", "{prompt}"], "env": {"A": "1", "SHARED": "a"}, "fallback": ["b"]},
    "b": {"command": ["run-b", "--prompt", "{prompt}"], "env": {"SHARED": "b"}},
}}, Config)


def admitted(index: Index, **req) -> Task:
    task, _ = admission.admit(index, CFG, T0, admission.Request(cwd="/", prompt="fix it", **req))
    return task


def test_a_task_takes_its_presets_fallback_and_a_failover_renders_the_other_presets_command():
    index = Index()
    task = admitted(index, agent="a", env={"MINE": "x"})
    assert task.route == ["a", "b"] and route_of(task) == ("a", "b")
    assert admitted(index, agent="b").route == []  # b has no fallback
    assert admitted(index, agent="b,a").route == ["b", "a"]
    retries.hold(index, CFG, "a", None, T0)
    [(first, agent), *_] = selection.starts_now(index, CFG, T0)
    assert (first.id, agent) == (task.id, "b")
    [started] = lifecycle.start(index, first, T0, None, CFG, agent)
    assert task.command == ["run-b", "--prompt", "{prompt}"] and task.env == {"SHARED": "b", "MINE": "x"}
    assert commandline.argv(task, "fix it") == ["run-b", "--prompt", "fix it"]
    assert (task.agent, task.fallback_from) == ("b", "a")
    assert started.reason == "fallback from a" and started.value == {"agent": "b", "fallback_from": "a"}


def test_a_run_with_a_session_to_resume_stays_with_its_preset_unless_fresh_starts_are_allowed():
    index = Index()
    task = admitted(index, agent="a")
    task.session, task.first_command, task.command = "s-1", task.command, ["run-a", "--resume", "s-1"]
    assert route_of(task) == ("a",)
    retries.hold(index, CFG, "a", T0 + timedelta(hours=1), T0)
    assert selection.starts_now(index, CFG, T0) == []
    assert selection.waiting_for(index, CFG, T0)[task.id].startswith("a held by hand")
    task.fallback_fresh = True
    [(_, agent)] = selection.starts_now(index, CFG, T0)
    lifecycle.start(index, task, T0, None, CFG, agent)
    assert task.command == ["run-b", "--prompt", "{prompt}"] and task.session is None and task.first_command is None
    assert commandline.argv(task, "fix it") == ["run-b", "--prompt", "fix it"]


def test_every_preset_of_an_order_held_names_each_reason_and_a_full_fallback_is_waited_for():
    cfg = msgspec.convert({**msgspec.to_builtins(CFG), "agents": {**msgspec.to_builtins(CFG.agents),
                                                                  "b": {"command": ["run-b"], "max_agents": 1}}}, Config)
    index = Index()
    first = admitted(index, agent="b")
    step.settle(index, cfg, T0)
    assert first.state is TaskState.RUNNING
    waiting = admitted(index, agent="a")
    retries.hold(index, cfg, "a", None, T0)
    assert selection.waiting_for(index, cfg, T0) == {waiting.id: "a held by hand; agent b full (1/1 running)"}


def test_usage_streamed_mid_run_is_booked_once_and_a_budget_stops_the_run():
    index = Index()
    task = admitted(index, agent="b", source="pm", max_tokens=1000)
    step.settle(index, CFG, T0)
    assert retries.progress(index, CFG, task, Usage(input_tokens=600, output_tokens=10), T0) is None
    why = retries.progress(index, CFG, task, Usage(input_tokens=1200, output_tokens=30), T0)
    assert why == "budget 1,000 tokens exceeded: 1,230 tokens"
    assert index.spend.sources["pm"].input_tokens == 1200 and index.spend.agents["b"].output_tokens == 30
    # At its end, the agent's own figure replaces what was streamed: booked once.
    retries._book_run(index, task, Usage(input_tokens=1250, output_tokens=40, cost_usd=0.2), T0)
    assert task.usage == Usage(input_tokens=1250, output_tokens=40, cost_usd=0.2) and task.run.usage is None
    assert index.spend.sources["pm"] == Usage(input_tokens=1250, output_tokens=40, cost_usd=0.2)


def test_a_run_over_budget_that_hit_a_limit_or_failed_is_not_run_again():
    index = Index()
    task = admitted(index, agent="b", budget_usd=2.0, retries=3)
    step.settle(index, CFG, T0)
    task.usage = Usage(cost_usd=2.13)
    task.run.limit = LimitHit()
    retries.conclude(index, CFG, task, T0, 1)
    assert task.state is TaskState.FAILED and task.reason == "budget 2.00 USD exceeded: 2.13 USD"
    assert task.attempts == [] and "b" not in index.holds


def test_daily_budgets_start_over_at_local_midnight():
    cfg = msgspec.convert({**msgspec.to_builtins(CFG), "budgets": {"sources": {"pm": {"usd": 1}}}}, Config)
    index = Index()
    task = admitted(index, agent="b", source="pm")
    budgets.book(index, task, Usage(cost_usd=1.5), T0)
    assert selection.waiting_for(index, cfg, T0)[task.id].startswith("budget pm 1.50/1.00 USD, resets ")
    midnight = budgets.midnight_after(T0)
    assert selection.next_release(index, cfg, T0) == midnight
    assert selection.plan_starts(index, cfg, midnight) == [task]
    budgets.book(index, task, Usage(cost_usd=0.25), midnight)
    assert index.spend.day == budgets.day_of(midnight) and index.spend.sources["pm"].cost_usd == 0.25
