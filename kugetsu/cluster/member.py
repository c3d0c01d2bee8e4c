"""A service's membership in a cluster: its lease, its wake-ups, fencing.

Two threads, so that a slow or unreachable database never stalls the service's loop:
- heartbeats renew the lease every third of `cluster.lease`; a failed one is retried with
  backoff and logged once; `since` (from when the heartbeats have come through without a
  gap) feeds placement.gone_hosts;
- a LISTEN connection wakes the service at once when another process commits (the store's
  NOTIFY), and once more after each reconnect (a notification may have been missed).
What the service does with a lease (ending a silent machine's tasks, fencing itself) is
decided by pm in its tick; this module only reads and writes the hosts table.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import psycopg

from kugetsu.cluster import hosts, logs
from kugetsu.cluster.db import LOCK_WAIT_MS, NOTIFY_CHANNEL, connect, process_tag
from kugetsu.store.protocol import StoreProtocol
from kugetsu.errors import KugetsuError  # Unreachable, and a role refused its privileges (db.errors)
from kugetsu.paths import Home
from kugetsu.core.placement import Here, HostSeen

log = logging.getLogger("kugetsu.cluster")

BACKOFF_FIRST, BACKOFF_MAX = 0.2, 5.0  # seconds between attempts to reach a database that is away
SHIP_EVERY = 0.5  # seconds between shipments of agents' new output
BOT_LEASE = "telegram"  # the lease of the one machine that runs the Telegram bot
SCHEDULER_LEASE = "scheduler"  # the lease of the one machine that fires the recurring schedules
STUCK = LOCK_WAIT_MS / 1000 + 10  # seconds: past any lock wait a session allows (db.LOCK_WAIT_MS)
LISTEN_POLL = 0.5  # seconds: how long the listener waits for a notification before it looks at `stop`


class Lease:
    """A lease this machine competes for (hosts.take_lease), and what to do when it changes."""

    def __init__(self, name: str, what: str, on_change: Callable[[bool], None]):
        self.name, self.what, self.on_change = name, what, on_change
        self.held = False
        self.renewed = 0.0  # time.monotonic() of the last renewal


class Member:
    def __init__(self, url: str, name: str, max_agents: int, lease: float, home: Home, log_cap: int,
                 wake: Callable[[], None]):
        self.url, self.name, self.max_agents, self.lease = url, name, max_agents, lease
        self.home, self.log_cap = home, log_cap
        self.wake = wake  # thread-safe: schedules a tick on the service's loop
        self._logs: dict[int, Path] = {}  # the running agents' logs (set by the service)
        self._pending: dict[int, Path] = {}  # every log with output still to ship
        self._lock = threading.Lock()
        # Leases of work one machine does for the whole cluster (the Telegram bot, the
        # schedules' firings), by name, when this machine wants them: on_change(True) once it
        # holds one, on_change(False) once it may no longer count on it.
        self.leases: dict[str, Lease] = {}
        self._watched: StoreProtocol | None = None
        self._shipped: dict[int, int] = {}  # task id -> bytes of its log the database has
        self.epoch: int | None = None
        self.machine = ""  # this home's machine id (hosts.machine_id), read at join
        self.since: datetime | None = None  # heartbeats have come through without a gap since then
        self.fenced = False  # the lease was taken from us: fence before anything else
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- the threads -------------------------------------------------------------------

    def start(self) -> None:
        self.join()
        for target in (self._heartbeats, self._listen, self._ship, self._watchdog):
            thread = threading.Thread(target=target, name=f"kugetsu-{target.__name__.strip('_')}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def join(self) -> None:
        """Join (or rejoin) with a new epoch: the database's clock is `since`."""
        self.machine = hosts.machine_id(self.home)
        conn = connect(self.url)
        try:
            self.epoch, self.since = hosts.join(conn, self.name, self.max_agents, self.machine,
                                                f"{socket.gethostname()}:{self.home.root}", self.lease)
        finally:
            conn.close()
        self.fenced = False
        log.info("joined the cluster as %s (epoch %d, %d slots)", self.name, self.epoch, self.max_agents)

    def _heartbeats(self) -> None:
        conn: psycopg.Connection | None = None
        failing: str | None = None
        delay = BACKOFF_FIRST
        while not self._stop.wait(self.lease / 3 if failing is None else delay):
            try:
                if conn is None or conn.closed:
                    conn = connect(self.url)
                ok = hosts.heartbeat(conn, self.name, self.epoch or 0, self.max_agents)
            except (KugetsuError, psycopg.Error) as err:
                if conn is not None:
                    conn.close()
                conn = None
                self.since = None  # a gap: others' silence is no proof until a whole lease passes again
                self._renew_leases(None)
                if str(err) != failing:
                    log.error("heartbeat failed: %s; retrying with backoff (running agents are not affected)", err)
                failing = str(err)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            if failing is not None:
                log.info("the database answers again")
                failing, delay = None, BACKOFF_FIRST
                self.wake()
            if not ok:
                if not self.fenced:
                    log.warning("this machine was declared gone (its lease ran out): fencing")
                self.fenced = True
                self.wake()
            elif self.since is None:
                self.since = hosts.clock(conn)
            self._renew_leases(conn if ok else None)
        if conn is not None:
            for lease in list(self.leases.values()):
                if lease.held:
                    try:
                        hosts.drop_lease(conn, lease.name, self.name)
                    except psycopg.Error:
                        pass  # it runs out by itself
            conn.close()

    def watch(self, store: StoreProtocol) -> None:
        """Guard the service's own connection (its loop waits on it): see _watchdog."""
        self._watched = store

    def _watchdog(self) -> None:
        """A statement of the service's loop that waits longer than STUCK for its answer
        (longer than any lock wait the session allows) will not get one: a connection black-
        holed on the way, a server that hangs. Its socket is shut down so that the loop goes
        on (the statement fails as `database unreachable`, and is tried again afresh)."""
        while not self._stop.wait(1.0):
            store = self._watched
            if store is not None and store.waiting_for() > STUCK:
                log.error("a statement has waited %.0fs for the database: dropping that connection", STUCK)
                store.interrupt()

    def want_bot(self, on_bot: Callable[[bool], None]) -> None:
        """Compete for the Telegram bot's lease from now on (the first try is at once)."""
        self.want(BOT_LEASE, on_bot, "the Telegram bot's lease")

    def want(self, name: str, on_change: Callable[[bool], None], what: str) -> None:
        """Compete for the lease `name` from now on (the first try is at once)."""
        self.leases[name] = Lease(name, what, on_change)
        try:
            conn = connect(self.url)
            try:
                self._renew_leases(conn)
            finally:
                conn.close()
        except KugetsuError:
            pass  # the heartbeats try again

    def holds(self, name: str) -> bool:
        lease = self.leases.get(name)
        return lease is not None and lease.held

    def _renew_leases(self, conn: psycopg.Connection | None) -> None:
        """Renew (or try to take) each lease wanted; without a connection, give one up once
        it may have run out, before another machine can take it."""
        for lease in list(self.leases.values()):
            held = lease.held
            if conn is not None:
                try:
                    held = hosts.take_lease(conn, lease.name, self.name, self.lease)
                except psycopg.Error:
                    conn = None
                else:
                    if held:
                        lease.renewed = time.monotonic()
            if conn is None and held and time.monotonic() - lease.renewed > self.lease * 2 / 3:
                held = False
            if held != lease.held:
                lease.held = held
                log.info("%s %s", "holding" if held else "gave up", lease.what)
                lease.on_change(held)

    def _listen(self) -> None:
        tag = process_tag()
        delay = BACKOFF_FIRST
        while not self._stop.is_set():
            conn: psycopg.Connection | None = None
            try:
                conn = connect(self.url)
                conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                delay = BACKOFF_FIRST
                self.wake()  # whatever was committed while we were not listening
                while not self._stop.is_set():
                    # A bounded wait, so that a stop is seen within LISTEN_POLL seconds.
                    if any(note.payload != tag for note in conn.notifies(timeout=LISTEN_POLL)):
                        self.wake()
            except (KugetsuError, psycopg.Error):
                if self._stop.wait(delay):
                    break
                delay = min(delay * 2, BACKOFF_MAX)
            finally:
                if conn is not None:
                    conn.close()

    def shipping(self, running: dict[int, Path]) -> None:
        """The logs of this machine's running agents, after each tick. Every task seen here is
        shipped until its last output is, even one that ran between two shipments."""
        with self._lock:
            self._logs = running
            self._pending.update(running)

    def _ship(self) -> None:
        """Every SHIP_EVERY seconds: the new output of each agent, up to the cap; a task no
        longer running gets the rest of its output shipped, then is forgotten."""
        conn: psycopg.Connection | None = None
        while not self._stop.wait(SHIP_EVERY):
            with self._lock:
                pending, running = dict(self._pending), set(self._logs)
            try:
                if conn is None or conn.closed:
                    conn = connect(self.url)
                for task_id, path in pending.items():
                    start = self._shipped.get(task_id)
                    if start is None:
                        start = logs.shipped(conn, task_id)
                    self._shipped[task_id] = logs.ship(conn, task_id, path, start, self.log_cap)
                    # It has ended and nothing was left to send (a round sends a bounded part):
                    # that was the last of it.
                    if task_id not in running and self._shipped[task_id] == start:
                        with self._lock:
                            if task_id not in self._logs:
                                self._pending.pop(task_id, None)
                                self._shipped.pop(task_id, None)
            except (KugetsuError, psycopg.Error):
                if conn is not None:
                    conn.close()
                conn = None  # the heartbeat thread says so in the log; the next round retries
        if conn is not None:
            conn.close()

    # ---- in the service's transaction ----------------------------------------------------

    def here(self, missing: frozenset[str]) -> Here:
        return Here(name=self.name, max_agents=self.max_agents, missing=missing, since=self.since)

    def observe(self, conn: psycopg.Connection) -> list[HostSeen]:
        """Every machine's lease, and whether ours was taken (then `fenced`)."""
        machines = hosts.seen(conn)  # one look at the table per tick
        me = next((h for h in machines if h.name == self.name), None)
        if me is None or me.epoch != self.epoch or me.gone:
            self.fenced = True
        return machines

    def rejoin(self, conn: psycopg.Connection) -> None:
        """After fencing, in the same transaction: back, with a new epoch."""
        self.epoch = hosts.rejoin(conn, self.name, self.max_agents, self.machine, self.lease)
        self.since = hosts.clock(conn)
        self.fenced = False
        log.info("rejoined the cluster as %s (epoch %d)", self.name, self.epoch)
