"""The machines of a cluster: who they are, their leases (heartbeats), and fencing.

A service joins with a new `epoch` and renews its lease with heartbeats (every third of
`cluster.lease`), from a thread: a database that does not answer never stalls the service's
loop. Another service that finds a machine silent past the lease marks it gone, in the same
transaction that ends its running tasks as lost (step.tick decides; placement.gone_hosts).
A machine that comes back finds itself gone: before it starts anything it kills what it
still runs of those tasks, then joins again with a new epoch (Service._fence).
"""

from __future__ import annotations

import os
from datetime import datetime

import msgspec
import psycopg

from kugetsu.errors import KugetsuError
from kugetsu.paths import Home, read_file, write_new
from kugetsu.core.placement import HostSeen, host_state


class HostRow(msgspec.Struct, frozen=True, kw_only=True):
    """A machine as `kugetsu hosts` shows it."""

    name: str
    epoch: int
    heartbeat_at: datetime
    max_agents: int
    pid: int | None
    joined_at: datetime
    gone: bool


class NameTaken(KugetsuError):
    """Another home's service holds this machine's name, and its lease is live (exit 1)."""


def machine_id(home: Home) -> str:
    """This home's identity in a cluster: random, made once (0600 in the home). Two homes
    that share a name (two homes on one machine both default to its hostname) have
    different ids, so the second cannot take the first's name by accident (join)."""
    try:
        found = read_file(home.machine_id).decode("ascii", "replace").strip()
    except FileNotFoundError:
        found = ""
    if len(found) == 32 and all(c in "0123456789abcdef" for c in found):
        return found
    made = os.urandom(16).hex()  # missing, or damaged: a new identity (only the service writes it)
    write_new(home.machine_id, f"{made}\n".encode())
    return made


def join(conn: psycopg.Connection, name: str, max_agents: int, machine: str, where: str,
         lease: float) -> tuple[int, datetime]:
    """This machine's service is up: a new epoch, a fresh lease. Returns (epoch, the database's
    now). The name is this home's if its row is (the same machine id: a restart), if no home
    holds it yet, or if its holder is gone or silent past the lease; else NameTaken."""
    row = conn.execute(
        "INSERT INTO kugetsu.hosts (name, epoch, heartbeat_at, max_agents, pid, joined_at, gone, machine, home)"
        " VALUES (%s, 1, clock_timestamp(), %s, %s, clock_timestamp(), false, %s, %s)"
        " ON CONFLICT (name) DO UPDATE SET epoch = kugetsu.hosts.epoch + 1, heartbeat_at = clock_timestamp(),"
        " max_agents = excluded.max_agents, pid = excluded.pid, joined_at = clock_timestamp(), gone = false,"
        " machine = excluded.machine, home = excluded.home"
        " WHERE kugetsu.hosts.machine IS NULL OR kugetsu.hosts.machine = excluded.machine OR kugetsu.hosts.gone"
        " OR kugetsu.hosts.heartbeat_at < clock_timestamp() - make_interval(secs => %s)"
        " RETURNING epoch, heartbeat_at",
        (name, max_agents, os.getpid(), machine, where, lease)).fetchone()
    if row is None:
        raise _taken(conn, name, lease)
    return row[0], row[1]


def _taken(conn: psycopg.Connection, name: str, lease: float) -> NameTaken:
    row = conn.execute("SELECT home, pid, extract(epoch FROM clock_timestamp() - heartbeat_at)"
                       " FROM kugetsu.hosts WHERE name = %s", (name,)).fetchone()
    home, pid, ago = row if row else (None, None, 0.0)
    holder = f"{home or 'another home'}" + (f", pid {pid}" if pid else "") + f", heartbeat {float(ago):.0f}s ago"
    return NameTaken(
        f"host {name!r} is this cluster's name of another kugetsu home ({holder}): two homes under one name"
        f" would end each other's tasks as lost. Give this home its own: `kugetsu config set host NAME`"
        f" (the default, the hostname, is shared by every home on a machine); or stop that home's service:"
        f" its name is free once its lease ({lease:g}s) has run out")


def heartbeat(conn: psycopg.Connection, name: str, epoch: int, max_agents: int) -> bool:
    """Renew the lease. False: this machine was declared gone (or another service took its
    name) meanwhile, and must fence itself before it does anything else."""
    row = conn.execute(
        "UPDATE kugetsu.hosts SET heartbeat_at = clock_timestamp(), max_agents = %s"
        " WHERE name = %s AND epoch = %s AND NOT gone RETURNING 1",
        (max_agents, name, epoch)).fetchone()
    return row is not None


def seen(conn: psycopg.Connection) -> list[HostSeen]:
    rows = conn.execute("SELECT name, heartbeat_at, gone, epoch FROM kugetsu.hosts").fetchall()
    return [HostSeen(name=r[0], heartbeat_at=r[1], gone=r[2], epoch=r[3]) for r in rows]


def mark_gone(conn: psycopg.Connection, names: list[str]) -> None:
    """In the transaction that ends their tasks as lost: the new epoch fences them."""
    conn.execute("UPDATE kugetsu.hosts SET gone = true, epoch = epoch + 1 WHERE name = ANY(%s)", (names,))


def rejoin(conn: psycopg.Connection, name: str, max_agents: int, machine: str, lease: float) -> int:
    """After fencing, in a transaction: back with a new epoch, unless another home took the
    name while this one was away (NameTaken)."""
    row = conn.execute(
        "UPDATE kugetsu.hosts SET gone = false, epoch = epoch + 1, heartbeat_at = clock_timestamp(),"
        " joined_at = clock_timestamp(), max_agents = %s, pid = %s"
        " WHERE name = %s AND machine IS NOT DISTINCT FROM %s RETURNING epoch",
        (max_agents, os.getpid(), name, machine)).fetchone()
    if row is None:
        raise _taken(conn, name, lease)
    return row[0]


def rows(conn: psycopg.Connection) -> list[HostRow]:
    got = conn.execute(
        "SELECT name, epoch, heartbeat_at, max_agents, pid, joined_at, gone FROM kugetsu.hosts ORDER BY name").fetchall()
    return [HostRow(name=r[0], epoch=r[1], heartbeat_at=r[2], max_agents=r[3], pid=r[4], joined_at=r[5], gone=r[6])
            for r in got]


def take_lease(conn: psycopg.Connection, name: str, holder: str, seconds: float) -> bool:
    """Take or renew the lease `name` (the Telegram bot's: exactly one machine runs it) for
    `seconds`; True if `holder` has it now. A lease whose holder stopped renewing it passes
    to the next machine that asks once it has run out."""
    row = conn.execute(
        "INSERT INTO kugetsu.leases (name, holder, until)"
        " VALUES (%s, %s, clock_timestamp() + make_interval(secs => %s))"
        " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, until = excluded.until"
        " WHERE kugetsu.leases.holder = excluded.holder OR kugetsu.leases.until < clock_timestamp()"
        " RETURNING holder", (name, holder, seconds)).fetchone()
    return row is not None


def drop_lease(conn: psycopg.Connection, name: str, holder: str) -> None:
    """Let a lease go at once (a clean stop): the next machine need not wait for it to run out."""
    conn.execute("DELETE FROM kugetsu.leases WHERE name = %s AND holder = %s", (name, holder))


def standing(conn: psycopg.Connection, lease: float) -> tuple[datetime, list[tuple[HostRow, str]]]:
    """Every machine with how it stands now (placement.host_state: up, silent, gone), by the
    database's clock, which is returned too."""
    now = clock(conn)
    return now, [(r, host_state(r.heartbeat_at, r.gone, now, lease)) for r in rows(conn)]


def clock(conn: psycopg.Connection) -> datetime:
    """The database's clock: the one every machine of the cluster goes by."""
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]
