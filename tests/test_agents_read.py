"""The structured-output readers (kugetsu/agents) are total: whatever an agent, a broken
stream or a hostile file prints, `read` returns a Report and `render` a line or None, never
an exception (they run inside the service's step and `kugetsu logs`). Property tests over
JSON of every shape in the places the readers look, plus cut and mixed lines."""

from __future__ import annotations

import importlib
import json
from datetime import datetime, timezone
from typing import get_args

from hypothesis import given, settings
from hypothesis import strategies as st

from kugetsu import agents
from kugetsu.agents.report import Report
from kugetsu.config.model import AgentPreset

NOW = datetime(2026, 11, 24, 17, 0, tzinfo=timezone.utc)
MODULES = [importlib.import_module(f"kugetsu.agents.{k}") for k in agents.KINDS if k != "text"
           and importlib.util.find_spec(f"kugetsu.agents.{k}") is not None]

scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4), max_leaves=12)
KEYS = ["type", "subtype", "session_id", "message", "content", "error", "result", "is_error", "usage", "total_cost_usd",
        "permission_denials", "rate_limit_info", "resetsAt", "status", "errors", "input", "text", "tool_name",
        "tool_input", "item", "part", "thread_id", "msg", "info", "tokens", "cost", "properties", "sessionID"]
TYPES = ["system", "assistant", "user", "result", "rate_limit_event", "error", "turn.completed", "turn.failed",
         "thread.started", "item.completed", "step_finish", "text", "tool_use"]
obj = st.fixed_dictionaries({"type": st.sampled_from(TYPES) | value}, optional={k: value for k in KEYS if k != "type"})
line = st.one_of(obj.map(json.dumps), st.text(max_size=60), obj.map(json.dumps).map(lambda s: s[: len(s) // 2]))


@settings(max_examples=150, deadline=None)
@given(st.lists(line, max_size=8))
def test_read_and_render_never_raise(lines):
    tail = "\n".join(lines)
    for module in MODULES:
        report = module.read(tail, NOW)
        assert isinstance(report, Report)
        for one in lines:
            shown = module.render(one)
            assert shown is None or isinstance(shown, str)
        assert isinstance(agents.Renderer(module.__name__.rsplit(".", 1)[1]).feed(tail, last=True), str)


NASTY = [
    {"type": "result", "permission_denials": 5, "usage": {"input_tokens": 10**30, "output_tokens": -3},
     "total_cost_usd": float("inf"), "is_error": True, "result": 7, "errors": "x"},
    {"type": "result", "usage": "lots", "total_cost_usd": "1", "permission_denials": [None, 3, {"tool_input": 5}]},
    {"type": "assistant", "message": {"content": 5}, "error": {"deep": [1, 2]}},
    {"type": "assistant", "message": {"content": [{"type": "tool_use", "input": {"file_path": 5}}, 3, "x"]}},
    {"type": "user", "message": {"content": [{"type": "tool_result", "is_error": True, "content": [1]}]}},
    {"type": "rate_limit_event", "rate_limit_info": {"status": "rejected", "resetsAt": 1e300}},
    {"type": "rate_limit_event", "rate_limit_info": ["rejected"]},
    {"type": "system", "subtype": "init", "session_id": "--dangerously-skip-permissions x"},
    {"type": "item.completed", "item": 3}, {"type": "step_finish", "part": {"tokens": "x"}},
    {"type": "turn.completed", "usage": {"input_tokens": True}}, {"type": "error", "message": None},
]


def test_hostile_values_are_read_as_nothing_said():
    import msgspec

    from kugetsu.core.models import Task

    tail = "\n".join(json.dumps(o) for o in NASTY) + '\n{"type":"result","usage":{"input_t'
    for module in MODULES:
        report = module.read(tail, NOW)
        assert report.session is None or not report.session.startswith("-")
        task = Task(id=1, name="x", command=["x"], cwd="/", created_at=NOW, usage=report.usage)
        msgspec.json.decode(msgspec.json.encode(task), type=Task)  # what the index stores, it can read back
        for o in NASTY:
            module.render(json.dumps(o))


def test_the_preset_key_takes_every_kind():
    hint = AgentPreset.__annotations__["output"]
    assert get_args(eval(hint, vars(importlib.import_module("kugetsu.config.model")))) == agents.KINDS
