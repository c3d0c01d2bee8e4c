"""User and agent text is shown as text (issue 24, items 7 and 8): Rich/Textual markup in it is
never read as markup (a `[/]` crashed the dashboard, a `[@click=app.quit]` would be a live
action), and control characters in it (an OSC title, a screen clear, a carriage return, a bidi
override) reach no terminal: the human output shows them escaped, `--json` stays exact."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import msgspec
from dashboard_data import UTC, ago, settled, until, write_config

from kugetsu.app import transaction
from kugetsu.core.models import Event, Index, Run, Task, TaskState
from kugetsu.paths import Home, atomic_write
from kugetsu.store.protocol import encode_index
from kugetsu.frontends.tui.app import make_app
from kugetsu.frontends.tui.screens import DelegateForm, LogScreen
from kugetsu.frontends.tui.widgets import TaskTable

QUIT = "[@click=app.quit]quit[/]"  # markup with an action: if parsed, a click quits the app
PRESET = "[/]x"  # `kugetsu hold '[/]x'` crashed every dashboard start while the hold lasted
GROUP = "[bold"
REASON = "cwd /tmp/x[/]y was removed before the task started"
LINK = "[link=https://evil.example]docs[/link]"


def _plain(markup: str | None) -> str:
    """A border title (Textual hands it back as markup) as the text on screen."""
    from textual.content import Content

    return Content.from_markup(markup or "").plain


def hostile_home(root: Path) -> Home:
    """A home whose every free-text field holds markup; the hold and the pause go through the
    real CLI."""
    home = Home(root)
    write_config(home, max_agents=2, groups={GROUP: {"max_agents": 1}},
                 agents={"sim": {"command": ["sh", "-c", "echo {prompt}"]},
                         PRESET: {"command": ["sh", "-c", "echo {prompt}"]}})
    now = transaction.now()
    ago.now = now
    running = Task(id=1, name="run-1", state=TaskState.RUNNING, command=["sim"], cwd="/w", source=LINK,
                   agent=PRESET, created_at=ago(minutes=5), started_at=ago(minutes=4), run=Run(pid=2**22 + 1, slot=1))
    queued = Task(id=2, name="wait-2", state=TaskState.QUEUED, command=["sim"], cwd="/w", source="[bold]",
                  group=GROUP, created_at=ago(minutes=3))
    finished = [
        Task(id=3, name="gone-3", state=TaskState.FAILED, command=["sim"], cwd="/tmp/x[/]y", source="cli",
             created_at=ago(minutes=9), finished_at=ago(minutes=8), reason=REASON),
        Task(id=4, name="quit-4", state=TaskState.FAILED, command=["sim"], cwd="/w", source="cli",
             created_at=ago(minutes=7), finished_at=ago(minutes=6), exit_code=1, reason=QUIT),
    ]
    index = Index(next_id=5, next_seq=3, active=[running], queued=[queued], finished=finished)
    atomic_write(home.index, encode_index(index))
    events = [Event(type="failed", at=ago(minutes=8), task=3, name="gone-3", source="cli", reason=REASON, seq=1),
              Event(type="failed", at=ago(minutes=6), task=4, name="quit-4", source="cli", reason=QUIT, seq=2)]
    home.events.write_bytes(b"".join(msgspec.json.encode(e) + b"\n" for e in events))
    home.log(4).write_text(f"agent says {QUIT}\n")
    env = {**os.environ, "KUGETSU_HOME": str(root)}
    for args in (["hold", PRESET], ["pause", "--group", GROUP]):
        subprocess.run([sys.executable, "-m", "kugetsu", *args], env=env, check=True, capture_output=True, timeout=60)
    return home


async def test_the_dashboard_shows_markup_in_user_text_as_text(tmp_path):
    home = hostile_home(tmp_path / "home")
    app = make_app(home, tz=UTC, cwd="/")
    async with app.run_test(size=(160, 40)) as pilot:
        await settled(pilot)
        summary = str(app.query_one("#summary").render())
        assert f"{PRESET} held by hand" in summary and GROUP in summary
        finished = app.query_one("#finished", TaskTable)
        assert [str(c) for c in finished.get_row("4")][-1] == QUIT
        assert [str(c) for c in finished.get_row("3")][-1] == REASON
        running = app.query_one("#running", TaskTable)
        assert LINK in [str(c) for c in running.get_row("1")]
        # The Output pane's title names the task and how it ended: its reason, as written.
        finished.focus()
        finished.move_cursor(row=finished.get_row_index("4"))
        await until(pilot, lambda: app.selected == 4, what="task 4 selected")
        assert QUIT in _plain(app.query_one("#output").border_title)
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        title = app.screen.query_one("#log-title")
        assert QUIT in str(title.render())
        # A markup action in the text is no action: clicking it leaves the app running.
        await pilot.click("#log-title", offset=(len(str(title.render())) - 4, 0))
        await pilot.pause()
        assert app.is_running and isinstance(app.screen, LogScreen)
        await pilot.press("escape")
        finished.move_cursor(row=finished.get_row_index("3"))
        await until(pilot, lambda: app.selected == 3, what="task 3 selected")
        assert REASON in _plain(app.query_one("#output").border_title)
        assert app.is_running


async def test_the_delegate_form_and_notifications_show_markup_as_text(tmp_path):
    """The form's errors quote what was typed; a home whose path holds markup is named in the
    notifications: both as written."""
    root = tmp_path / "x[" / "]y"
    home = hostile_home(root)
    app = make_app(home, tz=UTC, cwd="/")
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("d")
        form = app.screen
        assert isinstance(form, DelegateForm)
        await until(pilot, lambda: form.query_one("#name").has_focus, what="the name field")
        await pilot.press(*"[/]", "tab", *"[bold]x", "enter")
        await settled(pilot)
        assert "'[/]'" in str(form.query_one("#error").render())
        await pilot.press("escape")
        home.index.write_text("{not json")
        await pilot.press("r")
        await settled(pilot)
        notes = [str(n.message) for n in app._notifications]
        assert any(str(root) in n for n in notes), notes
        assert app.is_running


# ---- the CLI: control characters ------------------------------------------------------------

TITLE = "\x1b]0;pwned\x07"  # OSC 0: sets the terminal window's title
CLEAR = "\x1b[2J"
RLO = "\u202e"  # right-to-left override: `evil\u202etxt.sh` reads as `evilhs.txt`
ATTACK = f"fix {TITLE}the bug{CLEAR}\rnow {RLO}gnp.exe"
TERMINAL = ("\x1b", "\x07", "\r", RLO, "\x9b")


def obeyed(text: str) -> list[str]:
    return [c for c in TERMINAL if c in text]


def shown(kg, *args: str) -> str:  # type: ignore[no-untyped-def]
    """What the command prints, byte for byte (text mode would turn a CR into a newline)."""
    r = subprocess.run([sys.executable, "-m", "kugetsu", *args], env=kg.env, capture_output=True, timeout=60)
    assert r.returncode == 0, r
    return r.stdout.decode("utf-8", "surrogateescape")


def test_status_queue_and_hold_show_control_characters_escaped_and_json_exact(kg, tmp_path):
    preset, group = "p\x1b[31m", "g\x1b]0;x\x07"
    cwd = tmp_path / f"dir{CLEAR}{RLO}"
    cwd.mkdir()
    kg.config(autostart=False, max_agents=1, groups={group: {"max_agents": 1}},
              agents={preset: {"command": ["sh", "-c", "echo {prompt}"]}})
    kg.ok("delegate", "t1", "--agent", preset, "--group", group, "--cwd", str(cwd), "--prompt", ATTACK)
    status = shown(kg, "status", "t1")
    assert obeyed(status) == [], status
    assert "fix \\x1b]0;pwned\\x07the bug\\x1b[2J\\rnow \\u202egnp.exe" in status
    assert f"dir\\x1b[2J\\u202e" in status  # the cwd
    exact = kg.json("status", "t1")
    assert (exact["prompt"], exact["cwd"], exact["agent"], exact["group"]) == (ATTACK, str(cwd), preset, group)
    queue = shown(kg, "queue")
    assert obeyed(queue) == [] and "g\\x1b]0;x\\x07" in queue, queue
    held = shown(kg, "hold", preset)
    assert obeyed(held) == [] and "p\\x1b[31m held by hand" in held, held
    queue = shown(kg, "queue")
    assert obeyed(queue) == [] and "p\\x1b[31m held by hand" in queue, queue
    assert [t["prompt"] for t in kg.json("queue")["active"]] == [ATTACK]


def test_the_bot_shows_a_prompt_from_the_chat_with_its_controls_escaped(kg, tmp_path):
    """A prompt from Telegram with a bidi override and ESCs: /status shows them escaped (a
    chat client reorders text at a U+202E just as a terminal does)."""
    from fakebot import TOKEN, FakeBotAPI
    from test_telegram_bot import ME, reply

    api = FakeBotAPI().start()
    try:
        kg.config(max_agents=1, default_agent="say", agents={"say": {"command": ["sh", "-c", "sleep 30"]}},
                  telegram={"token": TOKEN, "api_base_url": api.base_url, "allowed_chat_ids": [ME],
                            "allow_delegate": True, "delegate_cwd": str(tmp_path)})
        kg.ok("serve", "--detach")
        api.message(ME, f"/delegate hostile {ATTACK}")
        reply(api, ME, "hostile</b>")
        assert kg.task("hostile")["prompt"] == ATTACK  # kept exact: only what is shown is escaped
        api.message(ME, "/status hostile")
        shown = reply(api, ME, "<pre>")
        # (a <pre> drops colour and cursor sequences quietly, as for a log: `\x1b[2J` goes)
        assert obeyed(shown) == [] and "fix \\x1b]0;pwned\\x07the bug\\rnow \\u202egnp.exe" in shown, shown
    finally:
        api.close()


def on_terminal(kg, *args: str) -> str:  # type: ignore[no-untyped-def]
    """What the command writes when its stdout is a terminal (a pty), its newlines as written
    (the pty's own CRLF translation undone)."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kugetsu", *args], env=kg.env, stdout=slave,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        os.close(slave)
        slave = -1
        out = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1)
            try:
                chunk = os.read(master, 65536) if ready else b"x"[:0]
            except OSError:  # EIO: the child's end is closed
                break
            if ready and not chunk:
                break
            out += chunk
        assert proc.wait(timeout=30) == 0
        return out.decode("utf-8", "surrogateescape").replace("\r\n", "\n")
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


def test_logs_on_a_terminal_show_an_agents_controls_escaped_and_piped_or_raw_as_written(kg):
    """An agent's output is input: on a terminal `logs` shows its escape sequences instead of
    obeying them; through a pipe (a file, a script) and with --raw it is the bytes written."""
    written = (ATTACK + "\n").encode() + b"bad byte \x9b[31m\n"
    kg.ok("delegate", "loud", "--", "sh", "-c", 'printf "%s\\n" "$1"; printf "bad byte \\233[31m\\n"', "sh", ATTACK)
    kg.wait_state("loud", "succeeded")
    piped = subprocess.run([sys.executable, "-m", "kugetsu", "logs", "loud"], env=kg.env, capture_output=True,
                           timeout=60)
    assert piped.stdout == written
    shown = on_terminal(kg, "logs", "loud")
    assert obeyed(shown) == [], shown
    assert shown == "fix \\x1b]0;pwned\\x07the bug\\x1b[2J\\rnow \\u202egnp.exe\nbad byte \\x9b[31m\n"
    several = on_terminal(kg, "logs", "loud", "loud", "--lines", "1")
    assert obeyed(several) == [] and "loud | bad byte \\x9b[31m" in several, several
    raw = on_terminal(kg, "logs", "--raw", "loud")
    assert raw.encode("utf-8", "surrogateescape") == written


def test_a_command_or_prompt_that_is_not_utf8_is_refused_in_one_line_and_nothing_is_written(kg, tmp_path):
    """An argument with a byte that is no UTF-8 (a shell's $'\\x9b') was a UnicodeEncodeError
    traceback from the index's encoder; now a clear refusal, before anything is written."""
    kg.config(autostart=False, agents={"p": {"command": ["sh", "-c", "echo {prompt}"]}})
    os.mkdir(bytes(tmp_path) + b"/\xff")
    for extra in ([b"--", b"echo", b"a\x9bb"], [b"--agent", b"p", b"--prompt", b"a\xffb"],
                  [b"--cwd", bytes(tmp_path) + b"/\xff", b"--", b"true"]):
        r = subprocess.run([sys.executable, "-m", "kugetsu", "delegate", "t", *extra], env=kg.env,
                           capture_output=True, timeout=60)
        err = r.stderr.decode()
        assert r.returncode == 2 and "Traceback" not in err and err.count("\n") == 1, (extra, err)
        assert err.startswith("kugetsu: ") and "UTF-8" in err, err
        assert not kg.home.index.exists()
