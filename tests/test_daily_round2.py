"""Issue 27, daily use second round: what a new user hit, each through the real program
(the real CLI in subprocesses, the real service, the bot against the fake Bot API, the MCP
SDK's client)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import wait_for


# ---- broken 1: status of a task made with --after ----------------------------------------


def test_status_of_a_task_with_after_shows_its_dependencies(kg):
    kg.config(autostart=False)
    kg.ok("delegate", "a", "--", "sleep", "1")
    kg.ok("delegate", "b", "--after", "a", "--", "true")
    out = kg.ok("status", "b")
    assert "after" in out and "#1" in out, out


def test_telegram_status_of_a_task_with_after(kg):
    from fakebot import FakeBotAPI
    from test_telegram_bot import ME, bot_up, reply, setup

    api = FakeBotAPI().start()
    try:
        setup(kg, api, max_agents=1)
        bot_up(kg, api)
        kg.delegate("a", 30)
        kg.ok("delegate", "b", "--after", "a", "--", "true")
        api.message(ME, "/status b")
        text = reply(api, ME, "after")
        assert "#1" in text and "went wrong" not in text, text
    finally:
        kg.run("shutdown")
        api.close()


async def test_mcp_status_of_a_task_with_after(kg):
    pytest.importorskip("mcp")
    from test_mcp import connect, text

    kg.config(autostart=False)
    kg.ok("delegate", "a", "--", "true")
    kg.ok("delegate", "b", "--after", "a", "--", "true")
    async with connect(kg) as c:
        r = await c.call_tool("status", {"task": "b"})
    assert not r.is_error, text(r)
    assert r.structured_content["after"] == [1] and "#1" in text(r)
