"""`kugetsu telegram check`, a service with a refused token, and the pure parts of the bot."""

from __future__ import annotations

import os
import socket
from datetime import datetime, timedelta, timezone

import pytest
from conftest import wait_for
from fakebot import TOKEN
from test_telegram_bot import ME, api, setup  # noqa: F401  (api is a fixture)

from kugetsu.core import selection
from kugetsu.config.model import Config, TelegramConfig
from kugetsu.errors import KugetsuError, UsageError
from kugetsu.core.models import Index, Run, Task, TaskState
from kugetsu.paths import Home
from kugetsu.frontends.telegram import redact, text
from kugetsu.frontends.telegram.bot import allowed
from kugetsu.frontends.telegram.check import check
from kugetsu.store.events import EventTail

SECRET = TOKEN.split(":")[1]


def test_check_reports_bot_and_reaches_notify_chats(kg, api):
    setup(kg, api, telegram={"notify_chat_ids": [ME, 222], "allowed_chat_ids": []})
    r = kg.run("telegram", "check")
    assert r.returncode == 0, r.stderr
    assert "answers nobody" in r.stdout
    assert "@kugetsu_test_bot" in r.stdout and f"chat {ME}" in r.stdout
    assert [c.params["chat_id"] for c in api.sent()] == [ME, 222]
    assert not api.calls_to("getUpdates")  # a check never steals the service's updates


def test_check_errors_are_clear_and_never_show_the_token(kg, api, monkeypatch):
    setup(kg, api, telegram={"token": "123456:WRONG-token-zyxwvutsrq"})
    r = kg.run("telegram", "check")  # through the CLI once: exit code and stderr
    assert r.returncode == 1 and "refused the token" in r.stderr
    assert "WRONG-token" not in r.stdout + r.stderr

    monkeypatch.delenv("KUGETSU_TELEGRAM_TOKEN", raising=False)
    kg.config()
    with pytest.raises(UsageError, match="no bot token"):  # exit 2
        check(kg.home)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/bot"
    setup(kg, api, telegram={"api_base_url": dead})
    with pytest.raises(KugetsuError, match="cannot reach the Bot API") as err:
        check(kg.home)
    assert err.value.code == 1 and SECRET not in str(err.value)
    monkeypatch.setenv("KUGETSU_TELEGRAM_TOKEN", TOKEN)  # env wins over config
    setup(kg, api, telegram={"token": "123456:WRONG-token-zyxwvutsrq"})
    assert check(kg.home) == 0


def test_service_with_refused_token_keeps_scheduling(kg, api):
    setup(kg, api, telegram={"token": "123456:WRONG-token-zyxwvutsrq"})
    kg.delegate("fine", 0)
    kg.wait_state("fine", "succeeded")
    log = wait_for(lambda: "refused the bot token" in (t := kg.home.service_log.read_text()) and t, 10, "the log")
    assert "WRONG-token" not in log and SECRET not in log


def test_no_token_means_no_bot(kg):
    kg.config()
    kg.delegate("plain", 0)
    kg.wait_state("plain", "succeeded")
    wait_for(lambda: "telegram bot off: no token" in kg.home.service_log.read_text(), 10, "the log line")


# ---- pure parts ------------------------------------------------------------------------


def test_access_rules():
    open_to = TelegramConfig(allowed_chat_ids=[1, 2])
    assert allowed(open_to, 1, 99) and not allowed(open_to, 3, 99) and not allowed(open_to, None, 1)
    users = TelegramConfig(allowed_chat_ids=[1], allowed_user_ids=[7])
    assert allowed(users, 1, 7) and not allowed(users, 1, 8) and not allowed(users, 2, 7)
    assert not allowed(TelegramConfig(), 1, 1)  # empty allow-list: nobody


def _task(i: int, now: datetime, **kw: object) -> Task:
    return Task(id=i, name=f"task-{i}", command=["x"], cwd="/", created_at=now, source="<pm & co>", **kw)


def test_long_listings_are_cut_and_escaped():
    now = datetime.now(timezone.utc)
    queued = [_task(i, now, expires_at=now + timedelta(hours=1)) for i in range(2, 400)]
    running = [_task(1, now, state=TaskState.RUNNING, run=Run(slot=1), started_at=now)]
    index = Index(next_id=400, active=running, queued=queued)
    out = text.queue(selection.queue_view(index, Config(), now), now)
    assert len(out) < 4096 and out.endswith("more") and "... and " in out
    assert "&lt;pm &amp; co&gt;" in out and "<pm" not in out
    huge = text.pre("x<" * 5000)
    assert len(huge) < 4096 and huge.startswith("<pre>...") and "<" not in huge[5:-6]


def test_redact():
    assert redact(f"url /bot{TOKEN}/getMe", TOKEN) == "url /bot***/getMe"
    assert SECRET not in redact(f"The token `{SECRET}` was rejected", TOKEN)


def _event(seq: int) -> bytes:
    return b'{"seq":%d,"type":"started","at":"2026-01-01T00:00:00+00:00"}\n' % seq


def test_event_tail_reads_each_complete_line_once(tmp_path):
    home = Home(tmp_path)
    home.events.write_bytes(_event(1) + b'{"seq":2,"type":"succ')
    tail = EventTail(home)
    assert [e.seq for e in tail.after(0)] == [1]
    with open(home.events, "ab") as f:
        f.write(b'eeded","at":"2026-01-01T00:00:01+00:00"}\n')
    assert [e.seq for e in tail.after(1)] == [2]
    assert tail.after(0) == []


def test_event_tail_follows_a_rotation_without_losing_or_repeating_a_line(tmp_path):
    home = Home(tmp_path)
    home.events.write_bytes(_event(1) + _event(2))
    tail = EventTail(home)
    assert [e.seq for e in tail.after(0)] == [1, 2]
    with open(home.events, "ab") as f:
        f.write(_event(3))  # appended, then rotated before the tail looked again
    os.replace(home.events, home.events_old)
    assert [e.seq for e in tail.after(2)] == [3]  # the rest of the old file; no new one yet
    assert tail.after(3) == []
    home.events.write_bytes(_event(4))
    assert [e.seq for e in tail.after(3)] == [4]
    with open(home.events, "ab") as f:
        f.write(_event(5))
    os.replace(home.events, home.events_old)
    home.events.write_bytes(_event(6))
    assert [e.seq for e in tail.after(4)] == [5, 6]
    # A new tail (a restarted service) whose cursor lies in the rotated file reads it first.
    assert [e.seq for e in EventTail(home).after(4)] == [5, 6]
    assert [e.seq for e in EventTail(home).after(5)] == [6]
