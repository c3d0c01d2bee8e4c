"""The README's and docs' example sessions, run for real: a block marked
`<!-- example: SETUP -->` (the line before its fence) is a terminal session; each `$ kugetsu
...` line runs against a temp home prepared by SETUP below, and what it prints must have the
shape the block shows (the same lines and words; numbers and durations may differ, and a
`...` line stands for any lines). So the docs cannot drift from what the program prints."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import REPO, Kugetsu

SLEEP = ["sleep", "60"]  # what `-- ...` runs: an agent that stays while the example looks


def _run_agents(kg: Kugetsu, *names: str, source: str = "cli") -> None:
    for name in names:
        kg.ok("delegate", name, "--source", source, "--", *SLEEP)


def _running(kg: Kugetsu, *names: str) -> None:
    for name in names:
        kg.wait_state(name, "running")


def intro(kg: Kugetsu) -> None:
    kg.config(max_agents=2, default_agent="sim", agents={"sim": {"command": ["sh", "-c", "sleep 60", "{prompt}"]}})
    _run_agents(kg, "earlier")
    _running(kg, "earlier")


def priority(kg: Kugetsu) -> None:  # the README's: the delegates happened before
    kg.config(strategy="priority", max_agents=1)
    _run_agents(kg, "issue-1")
    _running(kg, "issue-1")
    kg.ok("delegate", "docs", "--priority", "low", "--", *SLEEP)
    kg.ok("delegate", "refactor", "--", *SLEEP)
    kg.ok("delegate", "hotfix", "--priority", "urgent", "--", *SLEEP)


def priority_session(kg: Kugetsu) -> None:  # docs/policies.md's: the delegates are in the block
    kg.config(strategy="priority", max_agents=1)
    _run_agents(kg, "issue-1")
    _running(kg, "issue-1")


def fair(kg: Kugetsu) -> None:
    kg.config(strategy="fair", max_agents=1)
    _run_agents(kg, "task-a", source="pm")
    _running(kg, "task-a")
    _run_agents(kg, "task-b", "task-c", source="pm")
    _run_agents(kg, "task-d", "task-e", source="alice")
    _run_agents(kg, "task-f", source="bob")


def per_source(kg: Kugetsu) -> None:
    kg.config(max_agents=3, max_active_per_source=2, max_queued_per_source=2)
    _run_agents(kg, "issue-0", "issue-1", source="pm")
    _running(kg, "issue-0", "issue-1")
    _run_agents(kg, "issue-2", "issue-3", source="pm")


def rate(kg: Kugetsu) -> None:
    kg.config(max_agents=3, min_start_interval_per_source="30s")


def rate_second(kg: Kugetsu) -> None:
    rate(kg)
    _run_agents(kg, "i1", source="pm")


def drop_oldest(kg: Kugetsu) -> None:
    kg.config(max_agents=1, max_queue=2, on_queue_full="drop_oldest")
    _run_agents(kg, "a")
    _running(kg, "a")
    _run_agents(kg, "b", "c", "d")


def preset_x(kg: Kugetsu) -> None:
    kg.config(autostart=False, agents={"x": {"command": ["my-agent", "{prompt}"]}})


SETUPS: dict[str, Callable[[Kugetsu], None]] = {
    "preset-x": preset_x,
    "intro": intro, "priority": priority, "priority-session": priority_session, "fair": fair,
    "per-source": per_source, "rate": rate, "rate-second": rate_second, "drop-oldest": drop_oldest,
}

_MARK = re.compile(r"^<!-- example: ([\w-]+) -->$")


def examples() -> list[tuple[str, str, list[str]]]:
    """(where, setup, the block's lines) of every marked block in README.md and docs/*.md."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = _MARK.match(line)
            if m:
                assert lines[i + 1].startswith("```"), f"{path.name}:{i + 1}: the mark must come right before a fence"
                end = lines.index("```", i + 2)
                found.append((f"{path.relative_to(REPO)}:{i + 2}", m.group(1), lines[i + 2 : end]))
    return found


def shape(line: str) -> str:
    """A line with its numbers and durations made generic, and its spacing collapsed (column
    widths follow the numbers)."""
    line = re.sub(r"\b\d+(?:\.\d+)?(?:ms|s|m|h|d)(?:\d+[smh])?\b", "DUR", line)
    line = re.sub(r"\d+", "N", line)
    return " ".join(line.split())


def matches(expected: list[str], actual: list[str]) -> bool:
    """`actual` has the shape of `expected`, where a `...` line stands for any lines."""
    if not expected:
        return not actual
    if expected[0].strip() == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and shape(expected[0]) == shape(actual[0]) and matches(expected[1:], actual[1:])


def session(block: list[str]) -> list[tuple[list[str], list[str]]]:
    """(argv, the lines shown after it) for each `$ kugetsu` line of a block."""
    out: list[tuple[list[str], list[str]]] = []
    for line in block:
        if line.startswith("$ "):
            command = re.sub(r"\s+#.*$", "", line[2:])
            argv = shlex.split(command)
            assert argv[0] == "kugetsu", line
            if argv[-2:] == ["--", "..."]:
                argv[-1:] = SLEEP
            out.append((argv[1:], []))
        else:
            assert out, f"output before any command: {line!r}"
            out[-1][1].append(line)
    return out


ALL = examples()


def test_the_docs_mark_their_sessions():
    assert len(ALL) >= 8, [where for where, _, _ in ALL]
    assert {setup for _, setup, _ in ALL} <= set(SETUPS)


@pytest.mark.parametrize(("where", "setup", "block"), ALL, ids=[w for w, _, _ in ALL])
def test_example_session_prints_what_the_docs_show(kg, where, setup, block, monkeypatch):
    # The docs show no MEM column: on a loaded machine a session can outlast the service's
    # first measurement of its agents (resources.interval), and `queue` then shows one.
    config = kg.config
    monkeypatch.setattr(kg, "config", lambda **values: config(**{"resources": {"interval": "1h"}, **values}))
    SETUPS[setup](kg)
    for argv, shown in session(block):
        r = kg.run(*argv)
        printed = (r.stdout + r.stderr).rstrip("\n").splitlines()
        assert matches(shown, printed), (
            f"{where}: `kugetsu {' '.join(argv)}` printed\n" + "\n".join(printed) + "\nbut the docs show\n"
            + "\n".join(shown)
        )


async def test_the_dashboard_screen_in_the_docs_is_the_real_one(tmp_path):
    """A block marked `<!-- screen: busy-80x24 -->` is the dashboard on the busy fixture at
    80x24, character for character (trailing blanks aside)."""
    from dashboard_data import UTC, busy_home, clock, until

    from kugetsu.frontends.tui.app import make_app

    blocks = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line == "<!-- screen: busy-80x24 -->":
                end = lines.index("```", i + 2)
                blocks.append((path.name, lines[i + 2 : end]))
    assert len(blocks) >= 2
    app = make_app(busy_home(tmp_path / "home"), clock=clock, tz=UTC, cwd="/")
    async with app.run_test(size=(80, 24)) as pilot:
        events = app.query_one("#events")
        await until(pilot, lambda: events.max_scroll_y and events.scroll_y >= events.max_scroll_y, what="events")
        await pilot.pause()
        screen = ["".join(seg.text for seg in strip).rstrip() for strip in app.screen._compositor.render_strips()]
    for name, block in blocks:
        assert block == screen, f"{name}: the dashboard now looks like this:\n" + "\n".join(screen)
