"""What the dashboard shows at 80x24 and where its Events pane stands, through Pilot on the
real app (issue 19 items 8, 12, 13)."""

from __future__ import annotations

import msgspec
from dashboard_data import UTC, busy_home, clock, until

from kugetsu.core.models import Event
from kugetsu.frontends.tui.app import make_app
from kugetsu.frontends.tui.widgets import StateTable, TaskTable


def app_for(home):  # type: ignore[no-untyped-def]
    return make_app(home, clock=clock, tz=UTC, cwd="/", poll=0.1)


def screen_text(app) -> list[str]:  # type: ignore[no-untyped-def]
    return ["".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()]


def at_end(table) -> bool:  # type: ignore[no-untyped-def]
    return table.max_scroll_y > 0 and table.scroll_y >= table.max_scroll_y


async def test_events_pane_opens_on_the_newest_and_follows_new_ones(tmp_path):
    home = busy_home(tmp_path / "home")
    app = app_for(home)
    async with app.run_test(size=(80, 24)) as pilot:
        events = app.query_one("#events", StateTable)
        await until(pilot, lambda: at_end(events), what="the Events pane at its newest line")
        assert any("bot-fix" in line for line in screen_text(app))  # the newest event is on screen
        with home.events.open("ab") as f:  # a new event arrives while the user reads the end
            f.write(msgspec.json.encode(Event(type="queued", at=clock(), task=11, name="bot-docs", seq=10,
                                              position=5)) + b"\n")
        await until(pilot, lambda: "10" in events.keys and at_end(events), what="the new event in view")
        events.scroll_to(y=0, animate=False, immediate=True)  # the user scrolls up: it stays there
        await pilot.pause()
        with home.events.open("ab") as f:
            f.write(msgspec.json.encode(Event(type="config", at=clock(), key="max_agents", value=4, seq=11)) + b"\n")
        await until(pilot, lambda: "11" in events.keys, what="the second new event")
        await pilot.pause()
        assert events.scroll_y == 0


async def test_80x24_shows_every_running_task_and_counts_what_does_not_fit(tmp_path):
    app = app_for(busy_home(tmp_path / "home"))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.pause()
        text = "\n".join(screen_text(app))
        for name in ("issue-16", "issue-17", "bot-fix"):  # all three running tasks
            assert name in text, text
        lines = screen_text(app)
        top = next(i for i, line in enumerate(lines) if line.startswith("─Queue"))
        bottom = next(i for i, line in enumerate(lines) if line.startswith("─Finished"))
        shown = sum(1 for line in lines[top:bottom] for name in ("issue-18", "issue-19", "lint-all", "issue-20",
                                                                    "bot-docs") if name in line)
        assert 0 < shown < 5
        assert lines[top].startswith(f"─Queue · +{5 - shown} more"), lines[top]
        above_footer = lines[-2]
        assert not any(ch in above_footer for ch in "▁▂▃▄▅▆▇█▉▊▋▌▍▎▏"), above_footer  # no scrollbar glyph
        header = next(line for line in lines if "EVENT" in line)
        assert "DETAIL" in header, header
        # A cut cell says so: the DETAIL of the failed event ends in an ellipsis or shows whole.
        assert not any(line.rstrip().endswith(("cancelled by c", "cancelled by")) for line in lines)


async def test_a_stopping_task_is_named_stopping_in_the_running_pane(tmp_path):


    from kugetsu.core.models import TaskState
    from kugetsu.paths import atomic_write
    from kugetsu.store.files import Store
    from kugetsu.store.protocol import encode_index

    home = busy_home(tmp_path / "home")
    index = Store(home).read()
    index.active[2].run.stop = TaskState.CANCELLED
    atomic_write(home.index, encode_index(index))
    app = app_for(home)
    async with app.run_test(size=(110, 36)) as pilot:
        await pilot.pause()
        line = next(line for line in screen_text(app) if "bot-fix" in line)
        assert "stopping" in line, line


async def test_delegate_form_errors_speak_the_forms_terms_not_the_clis(tmp_path):
    from dashboard_data import settled

    from kugetsu.frontends.tui.screens import DelegateForm

    home = busy_home(tmp_path / "home", agents={"sim": {"command": ["sh", "-c", "echo {prompt}"]},
                                                "gone": {"command": ["no-such-agent-kg", "{prompt}"]}})
    app = app_for(home)
    async with app.run_test(size=(110, 36)) as pilot:
        await pilot.press("d")
        form = app.screen
        assert isinstance(form, DelegateForm)
        await until(pilot, lambda: form.query_one("#name").has_focus, what="the form")
        await pilot.press(*"t1", "enter")  # no prompt
        await settled(pilot)
        shown = str(form.query_one("#error").render())
        assert "Prompt field" in shown and "--" not in shown, shown
        form.query_one("#agent").value = "gone"
        form.query_one("#prompt").value = "hi"
        await pilot.press("enter")
        await settled(pilot)
        shown = str(form.query_one("#error").render())
        assert "no-such-agent-kg" in shown and "another agent preset" in shown and "--" not in shown, shown
