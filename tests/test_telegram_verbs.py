"""Issue 27's verbs in the bot (real python-telegram-bot, fake Bot API, real service and
agents): /pause and /resume of the queue or of one task, /retry when delegating is allowed."""

from __future__ import annotations

from conftest import wait_for
from test_telegram_bot import ME, api, bot_up, reply, setup  # noqa: F401  (api is a fixture)


def test_pause_resume_and_retry_from_the_bot(kg, api, tmp_path):  # noqa: F811
    setup(kg, api, max_agents=1)
    bot_up(kg, api)
    kg.delegate("busy", 30)
    kg.wait_state("busy", "running")
    api.message(ME, "/pause busy")
    assert "paused <b>busy</b>" in reply(api, ME, "paused <b>busy")
    t = kg.task("busy")
    assert t["paused_at"] and t["state"] == "running"
    assert any(e["type"] == "paused" and e["reason"] == f"paused by telegram:{ME}" for e in kg.events())
    api.message(ME, "/resume busy")
    reply(api, ME, "resumed <b>busy")
    assert kg.task("busy")["paused_at"] is None
    api.message(ME, "/pause")
    reply(api, ME, "no queued task starts")
    assert kg.json("capacity")["paused"] is True
    api.message(ME, "/resume")
    reply(api, ME, "resumed: 1/1 running")
    api.message(ME, "/pause nope")
    assert "no task 'nope'" in reply(api, ME, "no task")

    kg.ok("cancel", "busy")
    api.message(ME, "/retry busy")
    assert "off" in reply(api, ME, "allow_delegate")
    kg.ok("config", "set", "telegram.allow_delegate", "true")
    api.message(ME, "/retry busy")
    assert "started <b>busy</b>" in reply(api, ME, "started <b>busy")
    wait_for(lambda: [t["retry_of"] for t in kg.json("queue")["active"]] == [1], 10, "the retry to run")
    api.message(ME, "/help")
    assert "/pause TASK" in reply(api, ME, "/retry TASK")
