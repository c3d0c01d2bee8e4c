"""The bot through the real python-telegram-bot, a fake Bot API server, the real service
and real agent processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import wait_for
from fakebot import TOKEN, FakeBotAPI

ME, STRANGER = 111, 999


@pytest.fixture
def api() -> Iterator[FakeBotAPI]:
    server = FakeBotAPI().start()
    yield server
    server.close()


def setup(kg, api: FakeBotAPI, **extra: object) -> None:
    telegram = {"token": TOKEN, "api_base_url": api.base_url, "allowed_chat_ids": [ME], "notify_chat_ids": [ME]}
    telegram.update(extra.pop("telegram", {}))  # type: ignore[arg-type]
    kg.config(telegram=telegram, **extra)


def bot_up(kg, api: FakeBotAPI) -> None:
    kg.ok("serve", "--detach")
    wait_for(lambda: api.calls_to("getUpdates"), 15, "the bot to poll")


def reply(api: FakeBotAPI, chat: int, needle: str, timeout: float = 10) -> str:
    calls = wait_for(lambda: api.with_text(chat, needle), timeout, f"a reply with {needle!r}")
    return calls[-1].params["text"]  # type: ignore[index]


def test_queue_lists_running_and_queued_and_refuses_strangers(kg, api):
    setup(kg, api, max_agents=1)
    bot_up(kg, api)
    kg.delegate("busy", 30)
    kg.delegate("next-one", 30)
    kg.delegate("third", 30)
    api.message(ME, "/queue")
    text = reply(api, ME, "Queued")
    assert "1/1 running" in text and "2 queued" in text
    assert "busy" in text and "1. <b>next-one</b>" in text and "2. <b>third</b>" in text
    api.message(STRANGER, "/queue")
    refusal = reply(api, STRANGER, "private")
    assert "busy" not in refusal and "next-one" not in refusal
    assert "refused chat 999" in kg.home.service_log.read_text()
