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
    api.message(ME, "/help")
    assert "/cancel" in reply(api, ME, "/queue") and "/delegate" not in api.texts(ME)[-1]
    api.message(ME, "/frobnicate@someone_else_bot")  # another bot's: not ours to answer
    api.message(ME, "/frobnicate")
    reply(api, ME, "Unknown command")
    api.message(ME, "/queue")
    text = reply(api, ME, "Queued")
    assert "1/1 running" in text and "2 queued" in text
    assert "busy" in text and "1. <b>next-one</b>" in text and "2. <b>third</b>" in text
    api.message(STRANGER, "/queue")
    refusal = reply(api, STRANGER, "private")
    assert "busy" not in refusal and "next-one" not in refusal
    assert "refused chat 999" in kg.home.service_log.read_text()
    assert len(api.with_text(ME, "Unknown command")) == 1


def test_an_empty_allow_list_answers_nobody_and_the_log_says_how_to_fix_it(kg, api):
    setup(kg, api, telegram={"allowed_chat_ids": []})
    bot_up(kg, api)
    kg.delegate("secret-task", 30)
    api.message(STRANGER, "/queue")
    refusal = reply(api, STRANGER, "private")
    assert "secret-task" not in refusal
    log = wait_for(lambda: (t := kg.home.service_log.read_text()) and "refused chat 999" in t and t, 10, "the refusal log")
    assert "allowed_chat_ids is empty: the bot answers nobody" in log  # type: ignore[operator]
    assert "kugetsu config set telegram.allowed_chat_ids '[999]'" in log  # type: ignore[operator]


def test_cancel_buttons_and_delegate(kg, api, tmp_path):
    setup(kg, api, max_agents=1, default_agent="say",
          agents={"say": {"command": ["sh", "-c", "echo {prompt}; sleep 30"]}},
          telegram={"delegate_cwd": str(tmp_path)})
    bot_up(kg, api)
    kg.delegate("busy", 30)
    kg.delegate("q1", 30)
    kg.delegate("q2", 30)

    api.message(ME, "/cancel q1")
    assert "cancelled <b>q1</b>" in reply(api, ME, "q1</b>")
    assert kg.task("q1")["state"] == "cancelled"
    api.message(ME, "/status q1")
    assert "cancelled by telegram:111" in reply(api, ME, "<pre>")
    api.message(ME, "/status nope")
    assert "no task 'nope'" in reply(api, ME, "no task")

    api.message(ME, "/queue")
    reply(api, ME, "Queued")
    listing = api.with_text(ME, "Queued")[-1]
    buttons = [b for row in listing.params["reply_markup"]["inline_keyboard"] for b in row]
    assert [b["text"] for b in buttons] == ["Cancel busy", "Cancel q2"]
    api.press(STRANGER, buttons[0]["callback_data"], listing.result["message_id"])
    wait_for(lambda: api.calls_to("answerCallbackQuery"), 10, "the refusal")
    api.press(ME, buttons[0]["callback_data"], listing.result["message_id"])
    kg.wait_state("busy", "cancelled")
    answers = [c.params.get("text", "") for c in api.calls_to("answerCallbackQuery")]
    assert "private" in answers[0] and "busy" in answers[1]
    edited = wait_for(lambda: api.calls_to("editMessageText"), 10, "the listing to refresh")
    refreshed = edited[-1].params["text"]
    # Refreshed right after the SIGTERM: `busy` is either gone already or shown as stopping.
    busy_lines = [line for line in refreshed.splitlines() if "<b>busy</b>" in line]
    assert "q2" in refreshed and all("stopping" in line for line in busy_lines), refreshed
    assert kg.task("busy")["reason"] == f"cancelled by telegram:{ME}"

    api.message(ME, "/delegate fresh write the docs")
    assert "off" in reply(api, ME, "allow_delegate")
    kg.ok("config", "set", "telegram.allow_delegate", "true")
    api.message(ME, "/delegate fresh write the docs")
    assert "queued <b>fresh</b>" in reply(api, ME, "fresh</b>") and "position 1 of 1" in api.texts(ME)[-1]
    task = kg.task("fresh")
    assert task["source"] == f"telegram:{ME}" and task["cwd"] == str(tmp_path)
    assert task["command"] == ["sh", "-c", "echo {prompt}; sleep 30"] and task["prompt"] == "write the docs"
    api.message(STRANGER, "/delegate sneaky rm -rf /")  # refused silently: one refusal a minute
    api.message(ME, "/capacity")
    reply(api, ME, "1/1 running")
    assert all(t["name"] != "sneaky" for t in kg.json("queue", "--all")["queued"])
    menus = [{c["command"] for c in call.params["commands"]} for call in api.calls_to("setMyCommands")]
    assert "delegate" not in menus[0] and "delegate" in menus[-1] and "queue" in menus[-1]


def test_unicode_digits_get_a_clear_answer_not_something_went_wrong(kg, api):
    setup(kg, api, max_agents=1)
    bot_up(kg, api)
    for name in ("one", "two", "three"):
        kg.delegate(name, 30)
    api.message(ME, "/status ²")
    assert "no task" in reply(api, ME, "²")
    api.message(ME, "/cancel ٣")  # Arabic-Indic three: a name, not task #3
    assert "no task" in reply(api, ME, "٣")
    api.press(ME, "cancel:³", 1)  # a client may send any callback data
    wait_for(lambda: api.calls_to("answerCallbackQuery"), 10, "the button's answer")
    assert kg.task("3")["state"] == "queued"
    assert not api.with_text(ME, "Something went wrong")
    assert "Traceback" not in kg.home.service_log.read_text()


GROUP = -100500


def test_a_refused_member_of_an_allowed_group_is_told_to_be_added_as_a_user(kg, api):
    setup(kg, api, telegram={"allowed_chat_ids": [ME, GROUP], "allowed_user_ids": [ME]})
    bot_up(kg, api)
    api.message(GROUP, "/queue", user_id=ME)
    reply(api, GROUP, "running")
    api.message(GROUP, "/queue", user_id=STRANGER)
    reply(api, GROUP, "private")
    log = wait_for(lambda: (t := kg.home.service_log.read_text()) and f"refused chat {GROUP}" in t and t, 10, "the log")
    line = next(x for x in log.splitlines() if f"refused chat {GROUP}" in x)  # type: ignore[union-attr]
    assert "telegram.allowed_user_ids does not list user 999" in line, line
    assert f"kugetsu config set telegram.allowed_user_ids '[{ME}, {STRANGER}]'" in line, line
    assert "allowed_chat_ids" not in line, line  # the group is allowed already: no advice to add it


def test_queue_status_and_capacity_show_the_fallback_memory_and_budgets(kg, api):
    """Issues 29 and 30 in the bot: a running task's preset (a fallback's, as the CLI words it)
    and its measured memory in /queue, its use in /status, memory and budgets in /capacity."""
    from test_resources import grown, hog

    setup(kg, api, max_agents=2, max_memory="1G", budgets={"sources": {"pm": {"usd": 20}}},
          resources={"mode": "sampling", "interval": "0.1s"},
          agents={"fake": {"command": ["true", "{prompt}"]}, "other": {"command": [*hog(kg, "m", 40, 30), "{prompt}"]}})
    bot_up(kg, api)
    kg.ok("hold", "fake")
    kg.ok("delegate", "m", "--agent", "fake,other", "--source", "pm", "--memory", "300M", "--prompt", "go")
    wait_for(lambda: grown(kg, "m") >= 40, 10, "the hog to grow")
    wait_for(lambda: (kg.task("m").get("rss") or 0) > 35 * 1024**2, 10, "a measurement")
    api.message(ME, "/queue")
    line = next(x for x in reply(api, ME, "Running").splitlines() if "<b>m</b>" in x)
    assert "other (fallback from fake)" in line and "(peak " in line and "of 300.0M" in line, line
    api.message(ME, "/status m")
    status = reply(api, ME, "<pre>")
    assert "other (fallback from fake)" in status and "rss " in status and "peak_memory " in status, status
    api.message(ME, "/capacity")
    cap = reply(api, ME, "declared")
    assert "memory 300.0M of 1.0G declared" in cap and "budgets today: pm 0.00/20.00 USD" in cap, cap
    kg.ok("cancel", "m")
