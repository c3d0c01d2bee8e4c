"""Cluster mode's reading side: the machines table, and where a task's log is (here, or shipped).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kugetsu.config.load import host_name, load_config
from kugetsu.config.model import Config
from kugetsu.core.models import Task
from kugetsu.errors import NotClustered
from kugetsu.paths import Home
from kugetsu.store.files import store_of


# ---- cluster -----------------------------------------------------------------------------


def hosts(home: Home) -> list[dict[str, Any]]:
    """`kugetsu hosts`: every machine of the cluster, its slots, running tasks, last heartbeat."""
    cfg = load_config(home)
    store = store_of(cfg, home)
    standing = store.machines(cfg.cluster.lease_s)
    if standing is None:
        raise NotClustered("`kugetsu hosts`")
    t, machines = standing
    index = store.read()
    out = []
    for row, state in machines:
        running = [x for x in index.active if x.host == row.name]
        out.append({
            "name": row.name,
            "state": state,
            "max_agents": row.max_agents,
            "running": len(running),
            "tasks": [x.name for x in running],
            "heartbeat_at": row.heartbeat_at.isoformat(),
            "heartbeat_age": round((t - row.heartbeat_at).total_seconds(), 1),
            "joined_at": row.joined_at.isoformat(),
            "epoch": row.epoch,
            "pid": row.pid,
            "this": row.name == host_name(cfg),
        })
    return out


def output_kind(cfg: Config, task: Task) -> str:
    """What a task's log is (its preset's `output`): how the front ends show it as text."""
    preset = cfg.agents.get(task.agent) if task.agent else None
    return preset.output if preset is not None else "text"


def log_json(home: Home, cfg: Config, task: Task, lines: int | None, max_bytes: int, raw: bool = False) -> dict[str, Any]:
    """The end of a task's output as JSON (`logs --json`, MCP's logs): the last `lines` lines
    within the last `max_bytes` bytes, as UTF-8 text (a structured output as its text unless
    `raw`), the log's whole size and whether the text is only its end."""
    from kugetsu.store import logtail

    path = log_path(home, cfg, task)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        size = 0
    end = logtail.tail(path, lines, max_bytes) if size else logtail.Tail(b"", 0, 0)
    text = end.data.decode("utf-8", errors="replace")
    kind = "text" if raw else output_kind(cfg, task)
    if kind != "text":  # e.g. Claude Code's stream-json: its messages, tool calls and end, as text
        from kugetsu.agents import render_tail

        text = render_tail(kind, text, cut=end.start > 0 and lines is None)
    return {"id": task.id, "name": task.name, "state": task.state.value, "text": text, "size": size,
            "truncated": len(end.data) != end.size}


def log_path(home: Home, cfg: Config, task: Task) -> Path:
    """Where this machine reads a task's output: its log, or in a cluster, for a task that ran
    on another machine, the local mirror of what that machine shipped (brought up to date
    by this call: a follower calls it again for more)."""
    if task.host is None or task.host == host_name(cfg):
        return home.log(task.id)
    return store_of(cfg, home).mirror_log(task.id, home) or home.log(task.id)
