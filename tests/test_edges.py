"""Edges of the Hardening issue, through the real CLI: secrets never shown, odd digits,
a runtime dir or home that is not ours, symlinks planted in the home, a full disk."""

from __future__ import annotations

import json


SECRET = "123456:AAEsecretSECRETsecret"


def test_a_token_is_never_printed_nor_written_to_events_at_any_depth(kg):
    out = kg.ok("config", "set", "telegram", json.dumps({"token": SECRET, "allowed_chat_ids": [1]}))
    assert SECRET not in out and '"token": "***"' in out
    out = kg.ok("config", "set", "agents.gh", json.dumps({"command": ["gh"], "env": {"GITHUB_TOKEN": SECRET, "X": "y"}}))
    assert SECRET not in out and '"X": "y"' in out
    for args in (("get", "telegram"), ("get", "telegram.token"), ("get", "agents"), ("get", "agents.gh.env"),
                 ("show",), ("show", "--json")):
        shown = kg.ok("config", *args)
        assert SECRET not in shown and "***" in shown, args
    assert json.loads(kg.ok("config", "get", "telegram"))["allowed_chat_ids"] == [1]
    assert SECRET not in kg.home.events.read_text()
    assert [e["value"]["token"] for e in kg.events("config") if e["key"] == "telegram"] == ["***"]
    assert json.loads(kg.home.config.read_text())["telegram"]["token"] == SECRET  # stored as given
