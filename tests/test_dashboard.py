"""The dashboard's actions through Pilot: each one goes through ops, like the CLI."""

from __future__ import annotations

import json

import pytest
from dashboard_data import UTC, busy_home, empty_home, notes, settled, until

from kugetsu.app import transaction, verbs
from kugetsu.core.models import TaskState
from kugetsu.store.files import Store
from kugetsu.frontends.tui.app import make_app
from kugetsu.frontends.tui.screens import ConfirmCancel, DelegateForm, LogScreen
from kugetsu.frontends.tui.widgets import LogView, TaskTable


def live_home(tmp_path):  # type: ignore[no-untyped-def]
    """The busy fixture on the real clock: the actions run ops, which expire by the real clock."""
    return busy_home(tmp_path / "home", now=transaction.now())


def app_for(home, **kw):  # type: ignore[no-untyped-def]
    return make_app(home, tz=UTC, cwd="/", **kw)


def state_of(home, task_id: int) -> TaskState:  # type: ignore[no-untyped-def]
    return next(t for t in Store(home).read().all_tasks() if t.id == task_id).state


async def focus_task(pilot, table_id: str, task_id: int) -> TaskTable:  # type: ignore[no-untyped-def]
    table = pilot.app.query_one(f"#{table_id}", TaskTable)
    table.focus()
    table.move_cursor(row=table.get_row_index(str(task_id)))
    await until(pilot, lambda: pilot.app.selected == task_id, what=f"task {task_id} selected")
    return table


async def open_form(pilot) -> None:  # type: ignore[no-untyped-def]
    await pilot.press("d")
    assert isinstance(pilot.app.screen, DelegateForm)
    name = pilot.app.screen.query_one("#name")
    await until(pilot, lambda: name.has_focus, what="the name field to take the keys")


async def test_cancel_queued_task_after_confirm(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test() as pilot:
        await focus_task(pilot, "queue", 8)
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmCancel)
        await pilot.press("y")
        await settled(pilot)
        task = next(t for t in Store(home).read().finished if t.id == 8)
        assert (task.state, task.reason) == (TaskState.CANCELLED, "cancelled by dashboard")
        assert "8" not in app.query_one("#queue", TaskTable).keys
        # The selection follows the task into the Finished table: the user sees how it ended.
        assert app.query_one("#finished", TaskTable).cursor_key == "8"
        assert "cancelled issue-19 (#8)" in notes(app)
        # Positions close up, as pm computes them.
        assert [str(c) for c in app.query_one("#queue", TaskTable).get_column("pos")] == ["1", "2", "3", "4"]


async def test_cancel_refused_changes_nothing(tmp_path):
    home = live_home(tmp_path)
    before = home.index.read_bytes()
    app = app_for(home)
    async with app.run_test() as pilot:
        await focus_task(pilot, "queue", 7)
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmCancel)
        await pilot.press("n")
        await settled(pilot)
        assert not isinstance(app.screen, ConfirmCancel)
        assert home.index.read_bytes() == before


async def test_cancel_running_task_returns_at_once_and_shows_stopping(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test() as pilot:
        await focus_task(pilot, "running", 5)
        await pilot.press("c", "y")
        await settled(pilot)
        task = next(t for t in Store(home).read().active if t.id == 5)
        assert task.run.stop is TaskState.CANCELLED  # it ends when its process is gone (the service sees to it)
        assert "stopping" in str(app.query_one("#output", LogView).border_title)
        assert "stopping issue-17 (#5)" in notes(app)


async def test_cancel_of_a_finished_task_is_refused_without_a_dialog(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test() as pilot:
        await focus_task(pilot, "finished", 2)
        await pilot.press("c")
        assert not isinstance(app.screen, ConfirmCancel)
        assert "refactor-db (#2) is already failed" in notes(app)


async def test_delegate_form_admits_through_ops(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test() as pilot:
        await open_form(pilot)
        await pilot.press(*"new-task", "tab", *"say hi", "enter")
        await settled(pilot)
        await until(pilot, lambda: not isinstance(app.screen, DelegateForm), what="the form to close")
        task = next(t for t in Store(home).read().queued if t.name == "new-task")
        assert (task.source, task.agent, task.command) == ("dashboard", "sim", ["sh", "-c", "echo {prompt}"])
        assert Store(home).prompts([task.id]) == {task.id: "say hi"}
        assert "queued new-task (#12), position 6 of 6" in notes(app)
        assert "12" in app.query_one("#queue", TaskTable).keys


async def test_delegate_form_shows_validation_errors_and_stays_open(tmp_path):
    home = live_home(tmp_path)
    before = home.index.read_bytes()
    app = app_for(home)
    async with app.run_test() as pilot:
        await open_form(pilot)
        await pilot.press(*"bad name!", "tab", *"x", "enter")
        await settled(pilot)
        form = app.screen
        assert isinstance(form, DelegateForm)
        assert "invalid task name 'bad name!'" in str(form.query_one("#error").render())
        assert home.index.read_bytes() == before
        await pilot.press("escape")
        assert not isinstance(app.screen, DelegateForm)


@pytest.mark.parametrize(("start", "refused", "allowed", "after"), [(64, "plus", "minus", 63), (1, "minus", "plus", 2)])
async def test_max_agents_keys_validate_like_config_set(tmp_path, start, refused, allowed, after):
    home = empty_home(tmp_path / "home", max_agents=start)
    app = app_for(home)
    async with app.run_test() as pilot:
        await pilot.press(refused)  # beyond 1..64: config set's own validation error, nothing written
        await settled(pilot)
        assert json.loads(home.config.read_text())["max_agents"] == start
        assert [n for n in app._notifications if n.severity == "error" and "max_agents" in n.message]
        await pilot.press(allowed)
        await settled(pilot)
        assert json.loads(home.config.read_text())["max_agents"] == after
        assert f"max_agents = {after}" in notes(app)
        assert str(app.summary.render()).startswith(f"0/{after} running")


async def test_raising_max_agents_starts_the_next_queued_task(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test() as pilot:
        await pilot.press("plus")
        await settled(pilot)
        assert state_of(home, 7) is TaskState.RUNNING
        assert "7" in app.query_one("#running", TaskTable).keys
        assert str(app.summary.render()).startswith("4/4 running · 4 queued")


async def test_selecting_a_task_shows_its_log_and_follows_it(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test() as pilot:
        output = app.query_one("#output", LogView)
        assert app.selected == 4 and "step 2/3: fix the parser" in output.lines
        await focus_task(pilot, "finished", 2)
        assert "RuntimeError: column users.email is not unique" in output.lines
        assert "refactor-db (#2) · failed: exit code 1" in str(output.border_title)
        await focus_task(pilot, "queue", 7)
        assert list(output.lines) == ["(no output yet)"]
        await focus_task(pilot, "running", 4)
        with home.log(4).open("a") as f:
            f.write("step 3/3: run the suite\n")
        await until(pilot, lambda: "step 3/3: run the suite" in output.lines, what="the appended line")
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        full = app.screen.query_one(LogView)
        await until(pilot, lambda: "step 3/3: run the suite" in full.lines, what="the full-screen log")
        await pilot.press("escape")
        assert not isinstance(app.screen, LogScreen)


async def test_changes_from_another_process_show_within_a_second(tmp_path):
    home = live_home(tmp_path)
    app = app_for(home)
    async with app.run_test() as pilot:
        table = app.query_one("#queue", TaskTable)
        await focus_task(pilot, "queue", 9)
        verbs.cancel(home, ["7"], reason="cancelled by cli")  # as the CLI would
        await until(pilot, lambda: "7" not in table.keys, timeout=1.5, what="the cancel to show")
        assert table.cursor_key == "9"  # the cursor stays on its task


async def test_corrupt_index_is_a_notification_not_a_crash(tmp_path):
    home = live_home(tmp_path)
    good = home.index.read_bytes()
    app = app_for(home)
    async with app.run_test() as pilot:
        home.index.write_text("{not json")
        await pilot.press("r")
        assert any("index.json" in n and "not valid JSON" in n for n in notes(app))
        assert app.query_one("#summary").has_class("-error")
        assert "4" in app.query_one("#running", TaskTable).keys  # the last good state stays
        await pilot.press("c", "y")  # an action on a corrupt index fails as a notification too
        await settled(pilot)
        assert app.is_running
        home.index.write_bytes(good)
        await pilot.press("r")
        assert not app.query_one("#summary").has_class("-error")


async def test_help_keys_are_inert_under_a_dialog_and_q_quits(tmp_path):
    from kugetsu.frontends.tui.screens import HelpScreen

    home = live_home(tmp_path)
    before = home.config.read_bytes()
    app = app_for(home)
    async with app.run_test() as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("plus", "d")  # behind the help: neither acts
        await settled(pilot)
        assert isinstance(app.screen, HelpScreen) and home.config.read_bytes() == before
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, what="the app to quit")


async def test_a_structured_log_is_shown_as_text_a_line_once_it_is_whole(tmp_path):
    # Task 5 runs the built-in claude preset: its log is Claude Code's stream-json.
    home = live_home(tmp_path)
    say = {"type": "assistant", "message": {"content": [{"type": "text", "text": "Fixing the parser."}]}}
    call = {"type": "assistant", "message": {"content": [
        {"type": "tool_use", "name": "Edit", "input": {"file_path": "/src/parse.py"}}]}}
    end = json.dumps({"type": "result", "is_error": False, "result": "done", "total_cost_usd": 0.5,
                      "usage": {"input_tokens": 1200, "output_tokens": 30}})
    home.log(5).write_text(json.dumps(say) + "\n" + json.dumps(call) + "\n" + end[:20])
    app = app_for(home)
    async with app.run_test() as pilot:
        output = app.query_one("#output", LogView)
        await focus_task(pilot, "running", 5)
        await until(pilot, lambda: "> Edit(/src/parse.py)" in output.lines, what="the rendered stream")
        assert "Fixing the parser." in output.lines and not any('"type"' in line for line in output.lines)
        with home.log(5).open("a") as f:  # the last line, finished
            f.write(end[20:] + "\n")
        await until(pilot, lambda: any("1,200 tokens in" in line for line in output.lines), what="the end line")
        await pilot.press("l")
        full = app.screen.query_one(LogView)
        await until(pilot, lambda: "> Edit(/src/parse.py)" in full.lines, what="the full-screen log rendered")


async def test_only_the_table_holding_the_selected_task_draws_its_cursor(tmp_path):
    """Every table used to show a highlighted row (three 'selections' on the screen, the
    Output following only one): now only the selected task's row is drawn highlighted, in
    whichever table holds it, and that follows the selection."""
    app = app_for(live_home(tmp_path))

    def marked() -> list[str]:
        return [str(t.id) for t in app.query(TaskTable) if t.has_class("-selected")]

    async with app.run_test() as pilot:
        await settled(pilot)
        await until(pilot, lambda: app.selected is not None, what="a first selection")
        holder = next(t for t in app.query(TaskTable) if str(app.selected) in t.keys)
        assert marked() == [str(holder.id)]
        await focus_task(pilot, "queue", 8)
        await until(pilot, lambda: marked() == ["queue"], what="the mark to follow the selection")
        await focus_task(pilot, "finished", 3)
        await until(pilot, lambda: marked() == ["finished"], what="the mark to follow the selection")
