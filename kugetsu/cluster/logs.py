"""Agents' output across machines: each service ships the logs of its running agents to the
database in bounded chunks; a command on another machine mirrors them into a local file, so
`logs` (and --follow), the dashboard's output pane, the bot's excerpts and the MCP `logs`
tool read a file as they do on one machine.

A chunk is (task, pos, data): `pos` is the byte offset in the agent's log, so a chunk sent
twice (a retry after a lost reply) is the same row, and a mirror knows where it stands by
its own size. At most `cluster.log_max_size` of a task's output is shipped; beyond it the
log stays on its machine, and the mirror says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import psycopg

from kugetsu.store import logtail
from kugetsu.paths import open_file

CHUNK = 64 * 1024  # bytes per row: a burst of output is a few rows, not one huge one
ROUND = 64  # rows at most per read or write: memory stays at 4 MiB whatever cluster.log_max_size


def shipped(conn: psycopg.Connection, task: int) -> int:
    """How much of a task's log the database has: where shipping resumes after a restart."""
    row = conn.execute("SELECT coalesce(max(pos + length(data)), 0) FROM kugetsu.log_chunks WHERE task = %s",
                       (task,)).fetchone()
    return int(row[0]) if row else 0


def ship(conn: psycopg.Connection, task: int, path: Path, start: int, cap: int) -> int:
    """Send what the log has past `start`, up to `cap` bytes in all, at most ROUND chunks a
    call (the next round sends more). Returns the new offset. Once the log was capped on
    disk (log_max_size), what follows its head is no longer at the offsets it had: shipping
    stops there."""
    if start >= cap:
        return start
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return start
    rows = []
    with os.fdopen(fd, "rb") as f:
        if logtail.dropped(fd) != (0, 0):
            cap = min(cap, logtail.HEAD)
        f.seek(start)
        data = f.read(max(0, min(cap - start, ROUND * CHUNK)))
    for i in range(0, len(data), CHUNK):
        rows.append((task, start + i, data[i : i + CHUNK]))
    if rows:
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO kugetsu.log_chunks (task, pos, data) VALUES (%s, %s, %s)"
                            " ON CONFLICT DO NOTHING", rows)
    return start + len(data)


def mirror(conn: psycopg.Connection, task: int, path: Path) -> int:
    """Bring the local mirror of a task's log up to what the database has. Returns its size.
    The caller made its directory (a private one: paths.Home.mirror_dir)."""
    fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
    with os.fdopen(fd, "r+b") as f:
        have = os.fstat(f.fileno()).st_size
        while True:  # ROUND rows at a time: never the whole shipped log in memory
            rows = conn.execute(
                "SELECT pos, data FROM kugetsu.log_chunks WHERE task = %s AND pos + length(data) > %s"
                " ORDER BY pos LIMIT %s", (task, have, ROUND)).fetchall()
            start = have
            for pos, data in rows:
                if pos > have:
                    return have  # a gap (a chunk still on its way): the next look fills it
                data = bytes(data)[have - pos :]
                f.write(data)
                have += len(data)
            if len(rows) < ROUND or have == start:
                return have
