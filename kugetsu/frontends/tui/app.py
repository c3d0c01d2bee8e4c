"""The dashboard app: a live view of one KUGETSU_HOME and the usual actions at one key.

Live without a service of its own: once a second it stats index.json, config.json and
events.jsonl (the index is replaced by rename, so inode + mtime + size tell a change from
any process) and re-reads only what changed. Actions run the shared ops functions (the CLI's
own transactions) in thread workers, so a lock wait or an fsync never freezes the screen.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import datetime, tzinfo
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import DataTable, Footer, Static

from kugetsu.app import config_change, control, delegation, machines, reading, transaction, verbs

from kugetsu.core import step
from kugetsu.config.load import host_name, load_config
from kugetsu.config.model import Config
from kugetsu.errors import KugetsuError
from kugetsu.core.models import Event, Index, Task, TaskState
from kugetsu.paths import Home
from kugetsu.store.files import open_store
from kugetsu.frontends.tui import view
from kugetsu.frontends.tui.screens import (SOURCE, ConfirmCancel, DelegateForm, EditForm, HelpScreen, LogScreen, SchedulesScreen,
                                 describe_error)
from kugetsu.frontends.text import printable
from kugetsu.frontends.tui.widgets import LogView, StateTable, TaskTable, plain

EVENTS_SHOWN = 100
NOTHING_SELECTED = "(no task selected;\nd delegates one)"  # two lines: the pane is 31 columns wide at 80
Stamp = tuple[int, int, int]


def _stamp(path: os.PathLike[str]) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class Dashboard(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "kugetsu"
    ENABLE_COMMAND_PALETTE = False
    # Below 100 columns the Events pane takes more of the bottom row (app.tcss): its four
    # columns do not fit in half of 80.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]
    # The footer must fit 80 columns: it shows the keys that apply to the selected task
    # (check_action hides the others), and one entry for each pair of a key's two meanings
    # (p pauses a running task, or resumes a paused one: two bindings, one shown at a time).
    BINDINGS = [
        Binding("c", "cancel", "cancel"),
        Binding("d", "delegate", "delegate"),
        Binding("e", "edit('name')", "edit"),
        Binding("u", "edit('priority')", "priority"),
        Binding("p", "pause_task(True)", "pause"),
        Binding("p", "pause_task(False)", "resume"),
        Binding("t", "retry", "retry"),
        Binding("h", "hold(True)", "hold"),
        Binding("h", "hold(False)", "release"),
        Binding("P", "pause_queue(True)", "pause all", key_display="P"),
        Binding("P", "pause_queue(False)", "resume all", key_display="P"),
        Binding("l", "log", "log"),
        Binding("w", "schedules", "schedules", show=False),  # the footer must fit 80 columns: in `?`
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit"),
        # Last: what 80 columns cut first when a queued task's keys take the room (`?` lists all).
        Binding("n", "next", "next"),
        Binding("z", "stash(True)", "stash"),
        Binding("z", "stash(False)", "unstash"),
        Binding("s", "stats", "stats"),
        Binding("plus,equals_sign", "max_agents(1)", "agents", key_display="+/-"),  # one entry for the pair
        Binding("minus", "max_agents(-1)", "fewer agents", show=False),
        Binding("r", "refresh", "refresh", show=False),  # it refreshes by itself
    ]

    selected: reactive[int | None] = reactive(None, init=False)
    web_tab = False  # run by `dashboard --web` for one browser tab

    def __init__(self, home: Home, *, clock: Callable[[], datetime] = transaction.now, tz: tzinfo | None = None,
                 poll: float = 1.0, cwd: str | None = None):
        super().__init__()
        self.home = home
        self.store = open_store(home)
        self.clock = clock
        self.tz = tz  # None: local time; tests pin it
        self.poll = poll
        self.cwd = cwd or os.getcwd()
        self.cfg = Config()
        self.index = Index()
        self.events: list[Event] = []
        self.service_pid: int | None = None
        self.measured: dict[int, step.Measured] = {}  # the running tasks' use (usage.json), read each refresh
        self.error: str | None = None
        self._stamps: dict[str, Stamp] = {}
        self._selected_table: TaskTable | None = None
        self._config_lock = threading.Lock()  # +/- read-modify-write: two quick presses make +2
        self._keys: object = None  # what the footer's keys were chosen by (see _show)

    # ---- layout --------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static("", id="summary")
        with Vertical(id="tables"):
            yield TaskTable(view.RUNNING_COLUMNS, key_column="id", id="running")
            yield TaskTable(view.QUEUE_COLUMNS, key_column="id", fill_column="why", squeeze_column="source", id="queue")
            yield TaskTable(view.FINISHED_COLUMNS, key_column="id", fill_column="reason", id="finished")
        with Horizontal(id="bottom"):
            yield LogView(poll=self.poll, id="output")
            yield StateTable(view.EVENT_COLUMNS, fill_column="reason", squeeze_column="task", id="events", show_cursor=False)
        yield Footer(compact=True)  # every key of a selected task in 80 columns

    def on_mount(self) -> None:
        if self.web_tab:
            # Textual's web driver only asks the app to quit at SIGTERM, which never happens
            # while its output is stuck (a browser that stopped reading): a tab has no
            # terminal to restore, so it ends at once.
            import asyncio
            import signal

            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, os._exit, 0)
        # Kept by reference: App.query_one searches the current screen, which may be a dialog.
        self.summary = self.query_one("#summary", Static)
        self.running = self.query_one("#running", TaskTable)
        self.queue = self.query_one("#queue", TaskTable)
        self.finished = self.query_one("#finished", TaskTable)
        self.events_table = self.query_one("#events", StateTable)
        self.output = self.query_one("#output", LogView)
        for widget, title in ((self.events_table, "Events"), (self.output, "Output")):
            widget.border_title = title
        self._count_hidden()
        self.refresh_view(force=True)
        first = next((t for t in self._task_tables() if t.row_count), self.running)
        first.focus()
        self._select_from(first)
        if self.selected is None:
            self.watch_selected(None)
        self.set_interval(self.poll, self.refresh_view)

    def _task_tables(self) -> list[TaskTable]:
        return [self.running, self.queue, self.finished]

    # ---- reading ---------------------------------------------------------------------

    def refresh_view(self, force: bool = False) -> None:
        """Re-read what changed on disk and bring every pane up to date (called each second)."""
        if not self.screen_stack:  # the app is closing: its timer may fire once more (CI, once)
            return
        try:
            stamps = self._stamps_now()
            changed = {k for k, v in stamps.items() if force or self._stamps.get(k) != v}
            if changed & {"index", "config"}:
                self.cfg, self.index = load_config(self.home), self.store.read()
            if "events" in changed:
                self.events = self.store.tail_events(EVENTS_SHOWN)
        except (KugetsuError, OSError) as err:  # e.g. a corrupt index, or one made unreadable
            self._report(describe_error(err))  # keep showing the last good state; retry next tick
        else:
            self._stamps = stamps
            if self.error:
                self.error = None
                self.notify("the files read cleanly again", title="recovered")
        self.service_pid = control.service_pid(self.home)
        self.measured = reading.measured(self.home, self.cfg, self.index) if not self.cfg.clustered else {}
        self._show()

    def _stamps_now(self) -> dict[str, object]:
        """What tells that the index, the config or the events changed since the last look."""
        row = self.store.stamp()  # index.json's identity, or the cluster's queue row's version
        if not self.cfg.clustered:
            return {"index": row, "config": _stamp(self.home.config), "events": _stamp(self.home.events)}
        # A cluster: the row's version stands for all three (events and the shared config are
        # committed with it).
        self._sync_remote_log()
        return {"index": row, "config": (row, _stamp(self.home.config)), "events": row}

    def _sync_remote_log(self) -> None:
        """A task that runs on another machine of the cluster: bring its mirrored output up to
        date (the output pane follows the mirror file)."""
        task = self.selected_task()
        if task is not None and task.host is not None and task.host != host_name(self.cfg):
            machines.log_path(self.home, self.cfg, task)

    def notify(self, message: str, *, title: str = "", severity: Any = "information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Every notification, the screens' too: its message quotes names, reasons and paths
        (anyone's text), so it is never read as markup (see widgets.plain)."""
        super().notify(printable(message), title=title, severity=severity, timeout=timeout, markup=False)

    def _report(self, message: str) -> None:
        if message != self.error:  # once per problem, not once a second
            self.error = message
            self.notify(message, title="cannot read", severity="error", timeout=10)

    def _show(self) -> None:
        now = self.clock()
        summary = self.summary
        # Once per refresh, for every pane: the CLI's own view, with the resource guard's and
        # placement's notes (why a task waits), and the running tasks' measured use.
        queue = reading.listing(self.cfg, self.index, at=now).view
        text = view.summary(queue.capacity, self.service_pid, self.measured)
        summary.update(plain(text + (" · files unreadable: see notification" if self.error else "")))
        summary.set_class(self.service_pid is None, "-down")
        summary.set_class(self.error is not None, "-error")
        self.running.sync(view.running_rows(queue, now, self.tz))
        self.queue.sync(view.queue_rows(queue, now))
        self.finished.sync(view.finished_rows(self.index, now))
        events = self.events_table
        before = events.row_count and events.keys[-1]
        # The newest event is at the bottom: keep it in view, unless the user scrolled up to
        # read older ones (then the pane stays where they put it).
        following = not events.row_count or events.scroll_y >= events.max_scroll_y
        events.sync(view.event_rows(self.events, now, self.tz))
        if events.row_count and events.keys[-1] != before and following:
            # After the next layout: only then does the table know its new height. Unless the
            # user scrolled meanwhile (between this refresh and that layout): their place wins.
            y = events.scroll_y
            self.call_after_refresh(lambda: events.scroll_y == y and events.scroll_end(animate=False, immediate=True))
        self._follow_selection()
        task = self.selected_task()
        run = task.run if task else None
        keys = (task and (task.state, run and run.stop, run and run.paused_at, task.agent in self.index.holds,
                          task.stashed_at is None), self.index.paused)
        if keys != self._keys:  # a state change of the selected task changes its keys (the footer)
            self._keys = keys
            self.refresh_bindings()
        self.output.border_title = plain(view.task_title(self.selected_task(), self.measured))
        self._mark_selection()
        self.call_after_refresh(self._count_hidden)

    TABLE_TITLES = {"running": "Running", "queue": "Queue", "finished": "Finished"}

    def _count_hidden(self) -> None:
        """Each task pane's title says how many of its rows do not fit ("Queue · +3 more")."""
        for table in self._task_tables():
            hidden = table.rows_hidden
            title = self.TABLE_TITLES[str(table.id)] + (f" · +{hidden} more" if hidden else "")
            if table.border_title != title:
                table.border_title = title

    def on_resize(self) -> None:
        self.call_after_refresh(self._count_hidden)

    # ---- selection -------------------------------------------------------------------

    def selected_task(self) -> Task | None:
        return next((t for t in self.index.all_tasks() if t.id == self.selected), None)

    def _mark_selection(self) -> None:
        """One highlighted row on the screen: the selected task's (the Output shows it), in
        whichever table holds it. The other tables keep their cursor, not drawn until they
        are focused (app.tcss): every table showing a highlighted row read as several
        selections."""
        key = None if self.selected is None else str(self.selected)
        for table in self._task_tables():
            table.set_class(key is not None and key in table.keys, "-selected")

    def _select_from(self, table: TaskTable) -> None:
        key = table.cursor_key
        if key is not None:
            self._selected_table = table
            self.selected = int(key)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        table = event.data_table
        if isinstance(table, TaskTable) and table.has_focus and event.row_key.value:
            self._selected_table = table
            self.selected = int(event.row_key.value)

    def on_descendant_focus(self, event: Any) -> None:
        if isinstance(event.widget, TaskTable):
            self._select_from(event.widget)

    def _follow_selection(self) -> None:
        """Keep the selected task selected as it moves queue -> running -> finished: when it
        leaves the focused table, focus follows it (only then: never against the user's tab)."""
        if self.selected is None:  # e.g. the first task just arrived in the focused table
            focused = self.focused
            if isinstance(focused, TaskTable) and focused.row_count:
                self._select_from(focused)
            return
        key = str(self.selected)
        was = self._selected_table
        now = next((t for t in self._task_tables() if key in t.keys), None)
        if now is None:  # it left the index (clean): select whatever the cursor is on
            if was is not None and was.has_focus:
                key = was.cursor_key
                self.selected = int(key) if key else None
            return
        if now is was and now.has_focus:
            # The focused table's cursor is the truth: sync kept it on its own row, and a
            # highlight the user (or a test) just made may not have reached `selected` yet.
            # Moving it back to `selected` here undid that move, one reload in a few hundred.
            return
        now.select_key(key)
        if now is not was:
            self._selected_table = now
            if was is not None and was.has_focus and self.screen is self.screen_stack[0]:
                now.focus(scroll_visible=False)

    def watch_selected(self, selected: int | None) -> None:
        self.refresh_bindings()  # the footer's keys follow the selected task's state
        output = self.output
        task = self.selected_task()
        path = None if selected is None else self.home.log(selected) if task is None else machines.log_path(self.home, self.cfg, task)
        output.follow(path, NOTHING_SELECTED if selected is None else "(no output yet)",
                      "text" if task is None else machines.output_kind(self.cfg, task))
        output.border_title = plain(view.task_title(self.selected_task(), self.measured))
        self._mark_selection()

    # ---- actions ---------------------------------------------------------------------

    MAIN_ONLY = {"cancel", "delegate", "max_agents", "log", "stats", "refresh", "help", "edit", "pause_task", "retry",
                 "hold", "pause_queue", "next", "stash"}

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # App bindings stay live under a dialog: `d` or `+` must not act behind a question.
        if action in self.MAIN_ONLY and self.screen is not self.screen_stack[0]:
            return False
        task = self.selected_task()
        # The keys of the selected task's state only (False hides them from the footer). `c`
        # and `l` stay: pressing them says why they do nothing (no task, already final).
        if action == "edit":
            return task is not None and task.state is TaskState.QUEUED
        if action == "pause_task":
            return (task is not None and task.state is TaskState.RUNNING and task.run.stop is None
                    and (task.run.paused_at is None) == parameters[0])
        if action == "retry":
            return task is not None and task.state.final
        if action == "next":
            return task is not None and task.state is TaskState.QUEUED and task.stashed_at is None
        if action == "stash":
            return task is not None and task.state is TaskState.QUEUED and (task.stashed_at is None) == parameters[0]
        if action == "hold":
            return (task is not None and task.agent is not None and not task.state.final
                    and (task.agent in self.index.holds) != parameters[0])
        if action == "pause_queue":
            return self.index.paused != parameters[0]
        return True

    def action_refresh(self) -> None:
        self.refresh_view(force=True)
        self.output.poll()

    def action_help(self) -> None:
        states = ("queued", "running", "stopping", "paused", "succeeded", "failed", "cancelled", "expired", "lost")
        self.push_screen(HelpScreen(self.running.legend(states)))

    def action_stats(self) -> None:
        from kugetsu.frontends.tui.stats import StatsScreen  # the stats module reads history: only when asked

        self.push_screen(StatsScreen(self.home, self.clock))

    def action_schedules(self) -> None:
        self.push_screen(SchedulesScreen(self.home, self.clock, self.poll))

    def action_log(self) -> None:
        task = self.selected_task()
        if task is None:
            self.notify("select a task first (tab and arrow keys)", severity="warning")
            return
        self.push_screen(LogScreen(self.home, task, self.poll, machines.output_kind(self.cfg, task)))

    def action_cancel(self) -> None:
        task = self.selected_task()
        if task is None:
            self.notify("select a task first (tab and arrow keys)", severity="warning")
        elif task.state.final:
            self.notify(f"{task.name} (#{task.id}) is already {task.state.value}", severity="warning")
        else:
            self.push_screen(ConfirmCancel(task, self.cfg.kill_grace_s),
                             callback=lambda yes: self._cancel(task.id) if yes else None)

    @work(thread=True, group="actions")
    def _cancel(self, task_id: int) -> None:
        # A thread: the transaction locks and fsyncs. A running task's cancel returns right
        # after its SIGTERM; the row shows it stopping until the service records the end.
        try:
            (task,) = verbs.cancel(self.home, [str(task_id)], reason=f"cancelled by {SOURCE}")
        except Exception as err:
            self._done(describe_error(err), error=True)
            return
        verb = "cancelled" if task.state.final else "stopping"
        self._done(f"{verb} {task.name} (#{task.id})")

    def action_edit(self, field: str) -> None:
        task = self.selected_task()
        if task is not None:
            self.push_screen(EditForm(self.home, task, field), callback=lambda saved: saved and self._edited(task))

    def _edited(self, task: Task) -> None:
        self.notify(f"edited {task.name} (#{task.id})")
        self.refresh_view(force=True)

    def action_pause_task(self, on: bool) -> None:
        task = self.selected_task()
        if task is not None:
            self._act(lambda: verbs.pause_task(self.home, str(task.id), on, by=SOURCE),
                      f"{'paused' if on else 'resumed'} {task.name} (#{task.id})")

    def action_next(self) -> None:
        task = self.selected_task()
        if task is not None:
            self._act(lambda: verbs.next_task(self.home, str(task.id), by=SOURCE), f"{task.name} (#{task.id}) moved to the front")

    def action_stash(self, on: bool) -> None:
        task = self.selected_task()
        if task is not None:
            self._act(lambda: verbs.stash_task(self.home, str(task.id), on, by=SOURCE),
                      f"{'stashed' if on else 'unstashed'} {task.name} (#{task.id})" + (" (z puts it back)" if on else ""))

    def action_pause_queue(self, on: bool) -> None:
        self._act(lambda: verbs.pause(self.home, None, on),
                  "paused: no queued task starts" if on else "resumed: queued tasks start again")

    def action_hold(self, on: bool) -> None:
        task = self.selected_task()
        if task is not None and task.agent is not None:
            agent = task.agent
            self._act(lambda: verbs.hold(self.home, agent, None) if on else verbs.release(self.home, agent),
                      f"{'held' if on else 'released'} {agent}" + (" until released (h)" if on else ""))

    def action_retry(self) -> None:
        task = self.selected_task()
        if task is not None:
            def retry() -> None:
                adm = verbs.retry(self.home, load_config(self.home), str(task.id))
                self.call_from_thread(self._delegated, adm)

            self._act(retry, None)

    @work(thread=True, group="actions")
    def _act(self, act: Callable[[], object], said: str | None) -> None:
        """An action through ops in a thread (the transaction locks and fsyncs); its error is
        a notification."""
        try:
            act()
        except Exception as err:
            self._done(describe_error(err), error=True)
            return
        if said is not None:
            self._done(said)

    def action_delegate(self) -> None:
        form = DelegateForm(self.home, sorted(self.cfg.agents), self.cfg.default_agent, self.cwd)
        self.push_screen(form, callback=self._delegated)

    def _delegated(self, admission: delegation.Admission | None) -> None:
        if admission is None:
            return
        t = admission.task
        if admission.position is None:
            self.notify(f"started {t.name} (#{t.id}), slot {t.run.slot}/{admission.max_agents}")
        else:
            self.notify(f"queued {t.name} (#{t.id}), position {admission.position} of {admission.queued}")
        self.refresh_view(force=True)

    def action_max_agents(self, delta: int) -> None:
        self._change_max_agents(delta)

    @work(thread=True, group="actions")
    def _change_max_agents(self, delta: int) -> None:
        try:
            with self._config_lock:
                value = load_config(self.home).max_agents + delta
                cfg = config_change.set_config(self.home, "max_agents", value)
        except Exception as err:
            self._done(describe_error(err), error=True)
            return
        self._done(f"max_agents = {cfg.max_agents}")

    def _done(self, message: str, error: bool = False) -> None:
        """From a worker thread: tell the user, and show the result at once."""
        def finish() -> None:
            self.notify(message, severity="error" if error else "information", timeout=8 if error else 4)
            self.refresh_view(force=True)

        self.call_from_thread(finish)


def make_app(home: Home | str | os.PathLike[str], **kw: Any) -> Dashboard:
    """The dashboard for one home; tests pass a fixed `clock` and `tz` for stable screenshots."""
    return Dashboard(home if isinstance(home, Home) else Home(home), **kw)


def run(home: Home) -> int:
    import os

    app = make_app(home)
    if os.environ.get("KUGETSU_WEB_TAB"):  # a web dashboard's tab (kugetsu/frontends/web.py)
        from kugetsu.frontends import web

        web.guard_tab()
        app.web_tab = True
    app.run()
    return 0
