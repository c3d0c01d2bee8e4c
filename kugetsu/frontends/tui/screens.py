"""The dashboard's dialogs and full screens: confirm cancel, delegate form, full-screen log, help."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from datetime import datetime

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, Select, Static
from textual.worker import Worker, WorkerState

from kugetsu.app import delegation, reading, recurring, verbs

from kugetsu.core import admission
from kugetsu.config.load import load_config
from kugetsu.config.units import format_duration
from kugetsu.errors import KugetsuError
from kugetsu.core.models import PRIORITIES, Task, TaskState
from kugetsu.paths import Home
from kugetsu.frontends.tui.view import task_title
from kugetsu.frontends.tui.widgets import LogView, plain

SOURCE = "dashboard"


def describe_error(err: BaseException) -> str:
    """A failed action's message for a person, with the fix in the dashboard's terms (pm's
    errors name no CLI flag)."""
    from kugetsu.errors import NeedsPrompt

    if isinstance(err, NeedsPrompt):
        return f"{err}: fill in the Prompt field (or give a command)"
    from kugetsu.errors import CommandNotFound

    if isinstance(err, CommandNotFound):
        return f"{err}: install it, or pick another agent preset"
    return str(err) if isinstance(err, KugetsuError) else f"{type(err).__name__}: {err}"


class ConfirmCancel(ModalScreen[bool]):
    """`y` cancels the task, `n` or escape keeps it."""

    BINDINGS = [Binding("y", "answer(True)", "yes, cancel it"), Binding("n,escape", "answer(False)", "no, keep it")]

    def __init__(self, task: Task, kill_grace: float):
        super().__init__()
        self.target = task
        self.kill_grace = kill_grace

    def compose(self) -> ComposeResult:
        t = self.target
        if t.state is TaskState.RUNNING:
            what = (f"It is running: its process group gets SIGTERM now, SIGKILL after"
                    f" {format_duration(self.kill_grace)}, and its slot goes to the next task.")
        else:
            what = "It is queued: it leaves the queue and never starts."
        with Vertical(id="dialog"):
            yield Label(plain(f"Cancel {t.name} (#{t.id})?"), id="question")
            yield Static(what, id="consequence")
            with Horizontal(id="buttons"):
                yield Button("Yes, cancel (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")
        yield Footer()  # its own keys (y, n), not the dashboard's behind it

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class DelegateForm(ModalScreen["delegation.Admission | None"]):
    """Name, prompt, agent preset (and working directory). Submits through delegation.delegate, the
    CLI's own admission; its errors (bad name, unknown command, queue full) stay in the form."""

    BINDINGS = [Binding("escape", "dismiss_form", "close"), Binding("enter", "submit", "delegate", show=True,
                                                                   key_display="enter")]

    def action_submit(self) -> None:
        self._submit()

    def __init__(self, home: Home, agents: list[str], default_agent: str, cwd: str):
        super().__init__()
        self.home = home
        self.agents = agents
        self.default_agent = default_agent
        self.cwd = cwd

    def compose(self) -> ComposeResult:
        with Vertical(id="form"):
            yield Label("Delegate a task", id="form-title")
            with Horizontal(classes="field"):
                yield Label("Name")
                yield Input(placeholder="optional: task-<id>", id="name", compact=True)
            with Horizontal(classes="field"):
                yield Label("Prompt")
                yield Input(placeholder="what the agent should do", id="prompt", compact=True)
            with Horizontal(classes="field"):
                yield Label("Agent")
                yield Select([(plain(a), a) for a in self.agents], value=self.default_agent, allow_blank=False,
                             id="agent", compact=True)
            with Horizontal(classes="field"):
                yield Label("Directory")
                yield Input(value=self.cwd, id="cwd", compact=True)
            yield Static("", id="error")
            with Horizontal(id="form-buttons"):
                yield Button("Delegate", variant="primary", id="submit")
                yield Button("Close", id="close")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#name", Input).focus()

    def action_dismiss_form(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#close")
    def _close(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#submit")
    @on(Input.Submitted)
    def _submit(self) -> None:
        name = self.query_one("#name", Input).value.strip()
        prompt = self.query_one("#prompt", Input).value
        cwd = os.path.abspath(os.path.expanduser(self.query_one("#cwd", Input).value.strip() or self.cwd))
        req = admission.Request(cwd=cwd, name=name or None, prompt=prompt or None,
                         agent=str(self.query_one("#agent", Select).value), source=SOURCE)
        self.query_one("#error", Static).update("delegating…")
        self._delegate(req)

    @work(thread=True, exclusive=True, group="delegate")
    def _delegate(self, req: admission.Request) -> delegation.Admission | Refused:
        # A thread: admission takes the index lock and fsyncs; the UI must not wait on it.
        # The form closes once this worker has finished (on_worker_state_changed): a worker
        # that dismissed its own screen would be cancelled by that dismissal while running.
        try:
            return delegation.delegate(self.home, load_config(self.home), req)
        except Exception as err:  # every failure is shown in the form, never a crash
            return Refused(describe_error(err))

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "delegate" and event.state is WorkerState.SUCCESS:
            _close_or_show(self, event.worker.result)


@dataclass(frozen=True)
class Refused:
    """A form's action that failed: its message stays in the form."""

    message: str


def _close_or_show(form: ModalScreen[Any], result: object) -> None:
    """A form's worker has finished: close the form with its result, or show why not."""
    if isinstance(result, Refused):
        form.query_one("#error", Static).update(plain(result.message))
    else:
        form.dismiss(result)


class EditForm(ModalScreen[bool]):
    """A queued task's name, prompt and priority (`e`, or `u` to start at the priority):
    submits what changed through verbs.edit, the CLI's own transaction; its errors stay here."""

    BINDINGS = [Binding("escape", "close", "close"), Binding("enter", "submit", "save", key_display="enter")]

    def __init__(self, home: Home, task: Task, focus: str = "name"):
        super().__init__()
        self.home = home
        self.target = task
        self.start = focus
        # Its prompt, kept beside the index (None: a command given at delegation has none).
        self.prompt = reading.prompts(home, [task]).get(task.id, task.prompt)

    def compose(self) -> ComposeResult:
        t = self.target
        with Vertical(id="form"):
            yield Label(plain(f"Edit {t.name} (#{t.id})"), id="form-title")
            with Horizontal(classes="field"):
                yield Label("Name")
                yield Input(value=t.name, id="name", compact=True)
            with Horizontal(classes="field"):
                yield Label("Prompt")
                # A command given at delegation has no prompt to change (admission.edit says so).
                yield Input(value=self.prompt or "", id="prompt", compact=True, disabled=self.prompt is None)
            with Horizontal(classes="field"):
                yield Label("Priority")
                yield Select([(p, p) for p in PRIORITIES], value=t.priority, allow_blank=False, id="priority",
                             compact=True)
            yield Static("", id="error")
            with Horizontal(id="form-buttons"):
                yield Button("Save", variant="primary", id="submit")
                yield Button("Close", id="close")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(f"#{self.start}").focus()

    def action_close(self) -> None:
        self.dismiss(False)

    @on(Button.Pressed, "#close")
    def _close(self) -> None:
        self.dismiss(False)

    def action_submit(self) -> None:
        self._submit()

    @on(Button.Pressed, "#submit")
    @on(Input.Submitted)
    def _submit(self) -> None:
        t = self.target
        name = self.query_one("#name", Input).value.strip()
        prompt = self.query_one("#prompt", Input).value
        priority = str(self.query_one("#priority", Select).value)
        change = admission.Edit(name=name if name != t.name else None,
                         prompt=prompt if self.prompt is not None and prompt != self.prompt else None,
                         priority=priority if priority != t.priority else None)
        if change.empty():
            self.dismiss(False)
            return
        self.query_one("#error", Static).update("saving…")
        self._edit(change)

    @work(thread=True, exclusive=True, group="edit")
    def _edit(self, change: admission.Edit) -> bool | Refused:
        try:
            verbs.edit(self.home, str(self.target.id), change)
        except Exception as err:  # shown in the form, never a crash
            return Refused(describe_error(err))
        return True

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker.group == "edit" and event.state is WorkerState.SUCCESS:
            _close_or_show(self, event.worker.result)


class LogScreen(Screen[None]):
    """One task's output, full screen, following while it runs."""

    BINDINGS = [Binding("escape,l", "app.pop_screen", "back")]

    def __init__(self, home: Home, task: Task, poll: float, kind: str = "text"):
        super().__init__()
        self.home = home
        self.target = task
        self.poll = poll
        self.kind = kind  # its preset's output: a structured one is shown as text

    def compose(self) -> ComposeResult:
        yield Static(plain(task_title(self.target)), id="log-title")
        yield LogView(poll=self.poll, id="full-log")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(LogView).follow(self.home.log(self.target.id), kind=self.kind)


HELP = """\
[b]kugetsu dashboard[/b] (the footer shows the keys of the selected task)
[b]Running[/b]   tasks holding a slot: start time, elapsed, pid
[b]Queue[/b]     waiting tasks in start order (position 1 starts next)
[b]Finished[/b]  the latest finished tasks, newest first
[b]Output[/b]    the live tail of the selected task's log
[b]Events[/b]    what just happened (events.jsonl)

[b]tab[/b] / [b]shift+tab[/b]  move between tables    [b]↑ ↓[/b]  select a task
[b]c[/b]  cancel the selected task (asks first; [b]y[/b] confirms)
[b]d[/b]  delegate a new task (name, prompt, agent preset)
[b]e[/b] / [b]u[/b]  edit the selected queued task: name, prompt, priority
[b]p[/b]  pause / resume the selected running task (its processes)
[b]P[/b]  pause / resume the queue (no queued task starts)
[b]h[/b]  hold / release the selected task's agent preset
[b]t[/b]  retry the selected finished task (a new task)
[b]n[/b]  the selected queued task starts next    [b]z[/b]  stash / unstash it (set aside)
[b]+[/b] / [b]-[/b]  raise / lower max_agents (as `kugetsu config set` does)
[b]l[/b]  full-screen log    [b]s[/b]  stats of the last hour    [b]w[/b]  schedules
[b]r[/b]  refresh now (it refreshes by itself)    [b]q[/b]  quit (tasks keep running)
"""


class SchedulesScreen(ModalScreen[None]):
    """`kugetsu schedule list` in the dashboard: each schedule, when it fires next, its last
    task and how that stands or ended, refreshed with the dashboard's poll."""

    BINDINGS = [Binding("escape,w,q", "app.pop_screen", "close")]

    def __init__(self, home: Home, clock: Callable[[], datetime], poll: float):
        super().__init__()
        self.home, self.clock, self.poll = home, clock, poll

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Static("[b]Schedules[/b]  (`kugetsu schedule add NAME --cron LINE | --every DUR -- CMD`)")
            yield Static("", id="schedules")

    def on_mount(self) -> None:
        self.show()
        self.set_interval(self.poll, self.show)

    def show(self) -> None:
        from kugetsu.frontends import render

        try:
            cfg, index = reading.read(self.home)
            body = render.schedules_table(recurring.schedules_json(cfg, index), self.clock())
        except Exception as err:  # a damaged index: say it here, the dashboard says it too
            body = f"cannot read the schedules: {err}"
        self.query_one("#schedules", Static).update(Text(body))


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "close")]

    def __init__(self, legend: Text):
        super().__init__()
        self.legend = legend

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Static(HELP)
            yield Static(Text("Colours: ") + self.legend)
