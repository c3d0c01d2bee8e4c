"""Screenshots of the dashboard on fixture homes: a fixed clock, UTC, fake pids, and no temp
path on screen, so they are the same on every machine. Look at them after --snapshot-update."""

from __future__ import annotations

from dashboard_data import UTC, busy_home, clock, empty_home

from kugetsu.frontends.tui.app import make_app
from kugetsu.frontends.tui.widgets import TaskTable


def app_for(home):  # type: ignore[no-untyped-def]
    return make_app(home, clock=clock, tz=UTC, cwd="/")


def test_empty(snap_compare, tmp_path):
    assert snap_compare(app_for(empty_home(tmp_path / "home")), terminal_size=(80, 24))


def test_busy(snap_compare, tmp_path):
    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(110, 36))


def test_busy_at_80x24(snap_compare, tmp_path):
    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(80, 24))


def selecting(table_id: str, key: str):  # type: ignore[no-untyped-def]
    """A run_before that selects task `key` in a table."""
    async def select(pilot):  # type: ignore[no-untyped-def]
        table = pilot.app.query_one(f"#{table_id}", TaskTable)
        table.focus()
        table.move_cursor(row=table.get_row_index(key))
        await pilot.pause()

    return select


def test_failed_task_selected(snap_compare, tmp_path):
    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(110, 36),
                        run_before=selecting("finished", "2"))


def test_cancel_dialog(snap_compare, tmp_path):
    async def ask_to_cancel(pilot):  # type: ignore[no-untyped-def]
        pilot.app.query_one("#queue", TaskTable).focus()
        await pilot.pause()
        await pilot.press("c")

    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(80, 24), run_before=ask_to_cancel)


def test_paused_and_held_at_80x24(snap_compare, tmp_path):
    """The header's longest line wraps rather than losing `service ...` and `held: ...`; the
    queue says why each task waits (WAITING FOR) and in which GROUP; the footer offers
    `h release` and `P resume all` for the selected task and the queue."""
    from dashboard_data import held_home

    assert snap_compare(app_for(held_home(tmp_path / "home")), terminal_size=(80, 24),
                        run_before=selecting("queue", "11"))
