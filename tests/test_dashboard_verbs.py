"""Issue 27 in the dashboard, through Pilot: the WAITING FOR and GROUP columns (from the CLI's
own view), a header that wraps at 80x24, and the keys for pause/resume (of a task and of the
queue), priority, retry, hold/release, edit, next and stash, each shown in the footer only where it applies,
each going through ops like the CLI."""

from __future__ import annotations

from dashboard_data import UTC, busy_home, held_home, notes, settled, until

from kugetsu.app import transaction
from kugetsu.core.models import TaskState
from kugetsu.store.files import Store
from kugetsu.frontends.tui.app import make_app
from kugetsu.frontends.tui.screens import ConfirmCancel, EditForm
from kugetsu.frontends.tui.widgets import TaskTable


def live_home(tmp_path):  # type: ignore[no-untyped-def]
    return busy_home(tmp_path / "home", now=transaction.now())


def app_for(home, **kw):  # type: ignore[no-untyped-def]
    return make_app(home, tz=UTC, cwd="/", **kw)


def task(home, task_id: int):  # type: ignore[no-untyped-def]
    return next(t for t in Store(home).read().all_tasks() if t.id == task_id)


def footer(app) -> list[str]:  # type: ignore[no-untyped-def]
    """The footer's entries on the current screen, `key description`."""
    return [f"{k.key_display or k.key} {k.description}" for k in app.screen.query("FooterKey")]


async def select(pilot, table_id: str, task_id: int) -> None:  # type: ignore[no-untyped-def]
    table = pilot.app.query_one(f"#{table_id}", TaskTable)
    table.focus()
    # Focused first: a row highlighted before the focus lands selects nothing (the app takes
    # a highlight for a selection only in the focused table).
    # 15 s: a 2-core machine running the suite with two workers took over 5 s (CI, once).
    await until(pilot, lambda: table.has_focus, timeout=15, what=f"{table_id} focused")
    table.move_cursor(row=table.get_row_index(str(task_id)))
    await until(pilot, lambda: pilot.app.selected == task_id, timeout=15, what=f"task {task_id} selected")
    await pilot.pause()


async def press_on(pilot, table_id: str, task_id: int, key: str) -> None:  # type: ignore[no-untyped-def]
    """Select a task, press a key, and let the action's worker finish."""
    await select(pilot, table_id, task_id)
    await pilot.press(key)
    await settled(pilot)


async def test_footer_shows_the_keys_of_the_selected_tasks_state(tmp_path):
    app = app_for(live_home(tmp_path))
    async with app.run_test(size=(80, 24)) as pilot:
        await select(pilot, "running", 4)
        keys = footer(app)
        assert {"c cancel", "p pause", "h hold", "P pause all", "l log", "? help", "q quit"} <= set(keys), keys
        assert not {"e edit", "t retry", "p resume"} & set(keys)
        await select(pilot, "queue", 8)
        keys = footer(app)
        assert {"c cancel", "e edit", "u priority", "h hold"} <= set(keys) and "p pause" not in keys, keys
        await select(pilot, "finished", 2)
        keys = footer(app)
        assert "t retry" in keys and "e edit" not in keys and "p pause" not in keys, keys
        await pilot.press("c")  # the cancel dialog: its own keys, y and n
        await select(pilot, "queue", 8)
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmCancel)
        await pilot.pause()
        assert footer(app) == ["y yes, cancel it", "n no, keep it"]
        await pilot.press("n")


async def test_p_pauses_and_resumes_the_selected_running_task(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test(size=(80, 24)) as pilot:
        await press_on(pilot, "running", 5, "p")
        assert task(home, 5).run.paused_at is not None and "paused issue-17 (#5)" in notes(app)
        assert "paused" in [str(c) for c in app.query_one("#running", TaskTable).get_row("5")]
        await until(pilot, lambda: "p resume" in footer(app), what="the footer to offer resume")
        await pilot.press("p")
        await settled(pilot)
        assert task(home, 5).run.paused_at is None and "resumed issue-17 (#5)" in notes(app)


async def test_shift_p_pauses_the_queue_and_the_header_says_so(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("P")
        await settled(pilot)
        assert Store(home).read().paused
        assert "paused" in str(app.query_one("#summary").render())
        await until(pilot, lambda: "P resume all" in footer(app), what="resume all")
        await pilot.press("P")
        await settled(pilot)
        assert not Store(home).read().paused


async def test_h_holds_and_releases_the_selected_tasks_preset(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test(size=(80, 24)) as pilot:
        await press_on(pilot, "queue", 7, "h")  # opencode
        hold = Store(home).read().holds["opencode"]
        assert hold.until is None and "held opencode" in " ".join(notes(app))
        await until(pilot, lambda: "h release" in footer(app), what="release")
        await pilot.press("h")
        await settled(pilot)
        assert "opencode" not in Store(home).read().holds


async def test_t_retries_the_selected_finished_task(tmp_path):
    from kugetsu.paths import atomic_write
    from kugetsu.store.protocol import encode_index

    home = live_home(tmp_path)
    index = Store(home).read()
    failed = next(t for t in index.finished if t.id == 2)
    failed.cwd, failed.command, failed.agent = str(tmp_path), ["true"], None  # one that can run here
    atomic_write(home.index, encode_index(index))
    app = app_for(home)
    async with app.run_test(size=(80, 24)) as pilot:
        await press_on(pilot, "finished", 2, "t")
        again = [t for t in Store(home).read().queued if t.retry_of == 2]
        assert [t.name for t in again] == ["refactor-db"]
        assert any("refactor-db (#12)" in n for n in notes(app))


async def test_n_moves_the_selected_queued_task_to_the_front_and_z_stashes_and_unstashes_it(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test(size=(80, 24)) as pilot:
        await press_on(pilot, "queue", 11, "n")  # bot-docs, the last
        assert task(home, 11).first > 0 and "bot-docs (#11) moved to the front" in notes(app)
        await until(pilot, lambda: "z stash" in footer(app) and "n next" in footer(app), what="next and stash offered")
        # At 80 columns the new keys come after `? help` and `q quit`, which stay on the screen.
        shown = {f"{k.key_display or k.key} {k.description}": k.region.right for k in app.screen.query("FooterKey")}
        assert shown["? help"] <= 80 and shown["q quit"] <= 80, shown
        await pilot.press("z")
        await settled(pilot)
        assert task(home, 11).stashed_at is not None and "stashed bot-docs (#11) (z puts it back)" in notes(app)
        await until(pilot, lambda: "stashed" in [str(c) for c in app.query_one("#queue", TaskTable).get_row("11")],
                    what="WAITING FOR stashed")
        # A stashed task has no place to move to: `n` is not offered, `z` puts it back.
        await until(pilot, lambda: "z unstash" in footer(app) and "n next" not in footer(app), what="unstash offered")
        await pilot.press("z")
        await settled(pilot)
        assert task(home, 11).stashed_at is None and "unstashed bot-docs (#11)" in notes(app)


async def test_e_and_u_edit_a_queued_task_through_ops(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test(size=(80, 24)) as pilot:
        await select(pilot, "queue", 9)
        await pilot.press("e")
        assert isinstance(app.screen, EditForm)
        await pilot.pause()
        assert "esc close" in footer(app)
        name = app.screen.query_one("#name")
        name.value = "issue-18"  # taken: the error stays in the form
        await pilot.press("enter")
        await until(pilot, lambda: "already queued or running" in str(app.screen.query_one("#error").render()),
                    what="the error in the form")
        name.value = "lint-everything"
        await pilot.press("enter")
        await settled(pilot)
        assert not isinstance(app.screen, EditForm)
        assert task(home, 9).name == "lint-everything"
        await until(pilot, lambda: "lint-everything" in [str(c) for c in app.query_one("#queue", TaskTable).get_row("9")])
        await pilot.press("u")
        assert isinstance(app.screen, EditForm)
        await until(pilot, lambda: app.screen.query_one("#priority").has_focus, what="priority focused")
        app.screen.query_one("#priority").value = "urgent"
        await pilot.click("#submit")
        await settled(pilot)
        assert task(home, 9).priority == "urgent"
        assert task(home, 9).state is TaskState.QUEUED


async def test_queue_shows_group_and_waiting_for_and_the_header_wraps_at_80x24(tmp_path):
    app = app_for(held_home(tmp_path / "home"))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        table = app.query_one("#queue", TaskTable)
        row = [str(c) for c in table.get_row("10")]  # issue-20, in group gpu
        assert "gpu" in row and "paused" in row
        summary = app.query_one("#summary")
        text = str(summary.render())
        assert "service not running" in text and "held:" in text
        assert summary.size.height == 2  # wrapped, not cut


async def test_help_lists_every_key_and_fits_80x24(tmp_path):
    app = app_for(busy_home(tmp_path / "home"))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        parts = list(app.screen.query("#help Static"))
        text = " ".join(str(p.render()) for p in parts)
        for key in ("e / u", "p  pause", "P  pause", "h  hold", "t  retry", "n  the selected", "z  stash", "Colours", "paused"):
            assert key in text, key
        assert all(p.region.bottom <= 23 and p.region.height for p in parts)  # inside the frame, none cut
