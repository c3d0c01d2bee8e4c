"""Screenshots of the dashboard on fixture homes: a fixed clock, UTC, fake pids, and no temp
path on screen, so they are the same on every machine. Look at them after --snapshot-update."""

from __future__ import annotations

from dashboard_data import UTC, busy_home, clock, empty_home

from kugetsu.tui.app import make_app
from kugetsu.tui.widgets import TaskTable


def app_for(home):  # type: ignore[no-untyped-def]
    return make_app(home, clock=clock, tz=UTC, cwd="/")


def test_empty(snap_compare, tmp_path):
    assert snap_compare(app_for(empty_home(tmp_path / "home")), terminal_size=(80, 24))


def test_busy(snap_compare, tmp_path):
    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(110, 36))


def test_busy_at_80x24(snap_compare, tmp_path):
    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(80, 24))


def test_failed_task_selected(snap_compare, tmp_path):
    async def select_failed(pilot):  # type: ignore[no-untyped-def]
        table = pilot.app.query_one("#finished", TaskTable)
        table.focus()
        table.move_cursor(row=table.get_row_index("2"))
        await pilot.pause()

    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(110, 36), run_before=select_failed)


def test_cancel_dialog(snap_compare, tmp_path):
    async def ask_to_cancel(pilot):  # type: ignore[no-untyped-def]
        pilot.app.query_one("#queue", TaskTable).focus()
        await pilot.pause()
        await pilot.press("c")

    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(80, 24), run_before=ask_to_cancel)
