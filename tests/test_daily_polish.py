"""Issue 19's polish: what a newcomer reads, through the real CLI (config errors, `queue`,
`status`, the README's own examples)."""

from __future__ import annotations

import json

import pytest


def _set(kg, key, value):
    r = kg.run("config", "set", key, value)
    return r.returncode, r.stderr.strip()


def test_config_set_type_error_names_the_real_key_and_how_to_quote(kg):
    kg.config(autostart=False, agents={"x": {"command": ["sh", "-c", "sleep $FAKE_DUR"]}})
    before = kg.home.config.read_bytes()
    code, err = _set(kg, "agents.x.env.FAKE_DUR", "30")
    assert code == 2, err
    assert "agents.x.env.FAKE_DUR" in err and "[...]" not in err
    assert "expected a string, got 30" in err
    assert """kugetsu config set agents.x.env.FAKE_DUR '"30"'""" in err
    assert "Traceback" not in err
    assert kg.home.config.read_bytes() == before


def test_config_unknown_key_under_a_preset_lists_the_presets_keys(kg):
    kg.config(autostart=False)
    code, err = _set(kg, "agents.x.comand", '["a"]')
    assert code == 2
    assert "unknown key 'agents.x.comand'" in err
    assert "command, env, worktree" in err and "max_queue" not in err


def test_config_bad_choice_lists_the_choices(kg):
    kg.config(autostart=False)
    code, err = _set(kg, "strategy", "lifo")
    assert code == 2
    assert "'lifo'" in err and "fifo, priority, fair" in err
    code, err = _set(kg, "worktrees.keep", "sometimes")
    assert code == 2 and "changed, always, never" in err
    code, err = _set(kg, "groups.g.max_agents", "100")
    assert code == 2 and "groups.g.max_agents" in err and "at most 64" in err


def test_config_file_with_the_error_names_the_file_and_the_key(kg):
    kg.config(agents={"x": {"command": ["a"], "worktre": True}})
    r = kg.run("config", "check")
    assert r.returncode == 2
    assert str(kg.home.config) in r.stderr
    assert "agents.x.worktre" in r.stderr and "command, env, worktree" in r.stderr
    kg.config(agents={"x": {"command": ["a"], "env": {"OK": "1", "FAKE_DUR": 30}}})
    r = kg.run("config", "check")
    assert r.returncode == 2
    assert str(kg.home.config) in r.stderr and "'agents.x.env.FAKE_DUR'" in r.stderr
    assert 'expected a string, got 30' in r.stderr and '"30"' in r.stderr
    kg.config(strategy="lifo")
    r = kg.run("config", "check")
    assert r.returncode == 2 and "'strategy'" in r.stderr and "fifo, priority, fair" in r.stderr
