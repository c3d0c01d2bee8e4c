"""Connections to the cluster's PostgreSQL database, and its schema.

Every failure to reach the database becomes `Unreachable` (exit 1, `database unreachable:
...`), never a traceback; the URL is shown without its password.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from kugetsu.errors import KugetsuError, Unreachable
from kugetsu.errors import redact_url as redact

SCHEMA_VERSION = 5
# What brings a database of schema version N to N+1 (run under the advisory lock, in order).
_UPGRADES = {
    # 2: each machine's row names the home that holds it (its machine id, and where it is):
    # two homes under one name would end each other's tasks as lost (hosts.join).
    1: "ALTER TABLE kugetsu.hosts ADD COLUMN IF NOT EXISTS machine text, ADD COLUMN IF NOT EXISTS home text",
    # 3: prompts kept beside the queue, one row each, not inside its document (every commit
    # rewrote them all, and every machine re-read them after each change).
    2: "CREATE TABLE IF NOT EXISTS kugetsu.prompts (id bigint PRIMARY KEY, body bytea NOT NULL)",
    # 4: a row per task (the document keeps counters, pauses and holds): a commit writes the
    # rows it changed, and a machine reads the rows changed since it last looked (`rev`).
    # The tasks of the old document become rows at the first commit (PgStore._load).
    3: """
CREATE TABLE IF NOT EXISTS kugetsu.tasks (
    id bigint PRIMARY KEY,
    list smallint NOT NULL,  -- 0 running (active), 1 queued, 2 finished (kept in the queue's view)
    ord bigint NOT NULL,  -- its place in its list
    rev bigint NOT NULL,  -- the state's revision that last wrote it
    state text NOT NULL,
    name text NOT NULL,
    host text,
    body bytea NOT NULL  -- the task as index.json has it (JSON)
);
CREATE INDEX IF NOT EXISTS tasks_live ON kugetsu.tasks (list, ord) WHERE list < 2;
CREATE INDEX IF NOT EXISTS tasks_rev ON kugetsu.tasks (rev);
ALTER TABLE kugetsu.state ADD COLUMN IF NOT EXISTS rev bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS next_ord bigint NOT NULL DEFAULT 1;
""",
    # 5: a task that leaves the queue (archived, cleaned) leaves a tombstone (list 3, with the
    # revision that removed it) instead of its row going at once: a machine then learns what
    # went from the rows changed since it last looked, without counting or re-reading them all.
    # Tombstones older than PgStore's TOMBSTONE_REVS revisions are swept. A kugetsu of schema 4
    # would take a tombstone for a task: it must not share the database (it refuses schema 5).
    4: "CREATE INDEX IF NOT EXISTS tasks_gone ON kugetsu.tasks (rev) WHERE list = 3",
}
NOTIFY_CHANNEL = "kugetsu"
CONNECT_TIMEOUT = 5  # seconds: a database that does not answer is reported, not waited for
# A network that drops packets (a cable, a firewall) would leave a query waiting for minutes;
# with these, a silent connection fails within about 10 s and is made afresh.
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 3, "keepalives_interval": 2, "keepalives_count": 2,
             "tcp_user_timeout": 10000}
# The other side of a lost connection: a server whose client vanished mid-transaction (a
# machine cut off while it held the queue's row lock) would keep that transaction, and the
# lock, until its own keepalives notice, two hours by default, and every machine would wait.
# kugetsu's transactions last milliseconds: one idle for IDLE_IN_TXN is ended by the server.
# And no client waits for the lock longer than LOCK_WAIT (it says so, and tries again).
IDLE_IN_TXN_MS = 10_000
LOCK_WAIT_MS = 20_000
SESSION = f"-c idle_in_transaction_session_timeout={IDLE_IN_TXN_MS} -c lock_timeout={LOCK_WAIT_MS}"


def process_tag() -> str:
    """What this process's commits NOTIFY with: a service ignores the wake-ups of its own commits."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _why(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def connect(url: str, *, autocommit: bool = True) -> psycopg.Connection:
    try:
        conn = psycopg.connect(url, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT,
                               application_name="kugetsu", options=SESSION, **KEEPALIVE)
    except psycopg.Error as err:
        raise Unreachable(url, _why(err)) from None
    try:
        ensure_schema(conn, url)
    except BaseException:
        conn.close()
        raise
    return conn


@contextmanager
def errors(url: str) -> Iterator[None]:
    """Map a lost connection (the database restarted, the network went) to Unreachable."""
    try:
        yield
    except psycopg.errors.LockNotAvailable:
        raise KugetsuError(f"the queue in {redact(url)} stayed locked for {LOCK_WAIT_MS // 1000}s (another"
                           " machine's transaction, or one the database has not yet ended after a lost"
                           " connection): nothing was changed; try again") from None
    except psycopg.errors.InsufficientPrivilege as err:
        raise KugetsuError(_no_privilege(url, _why(err))) from None
    except psycopg.OperationalError as err:
        raise Unreachable(url, _why(err)) from None


def _no_privilege(url: str, why: str, creating: bool = False) -> str:
    """The database refused this role (psycopg's InsufficientPrivilege): the right that is
    missing, in the server's words, and the statement that grants it. `creating`: kugetsu's
    tables are not there yet, and this role may not create them."""
    import getpass

    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(url)
    except psycopg.Error:
        parts = {}
    role = str(parts.get("user") or os.environ.get("PGUSER") or getpass.getuser())
    if creating:  # kugetsu's tables are missing, or older than this kugetsu
        fix = ("run a kugetsu command once as the database's owner (it creates or upgrades kugetsu's tables),"
               f' or, for a first use, as the owner: `GRANT CREATE ON DATABASE "{parts.get("dbname") or role}"'
               f' TO "{role}"`')
    else:
        fix = (f'as the owner of kugetsu\'s tables, run `GRANT USAGE ON SCHEMA kugetsu TO "{role}"; GRANT SELECT,'
               f' INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA kugetsu TO "{role}"`')
    return (f"the database role {role!r} lacks a privilege in {redact(url)} ({why}): {fix}; or point `store`"
            " at a role that has it (`kugetsu config set store -`)")


_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS kugetsu;
CREATE TABLE IF NOT EXISTS kugetsu.meta (
    id int PRIMARY KEY CHECK (id = 1),
    schema_version int NOT NULL
);
-- The whole queue as one document (the file store's index.json) and the shared config:
-- one row, whose lock serializes every writer of the cluster (admission, promotion, cancel).
CREATE TABLE IF NOT EXISTS kugetsu.state (
    id int PRIMARY KEY CHECK (id = 1),
    doc bytea NOT NULL,
    config bytea NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS kugetsu.events (seq bigint PRIMARY KEY, task bigint, at timestamptz NOT NULL, body bytea NOT NULL);
CREATE INDEX IF NOT EXISTS events_at ON kugetsu.events (at);
CREATE TABLE IF NOT EXISTS kugetsu.history (id bigint NOT NULL, finished_at timestamptz, body bytea NOT NULL);
CREATE INDEX IF NOT EXISTS history_id ON kugetsu.history (id);
-- Machines: a lease renewed by heartbeats; `epoch` grows each time a machine (re)joins or is
-- declared gone, and fences what it still runs of the tasks taken from it.
CREATE TABLE IF NOT EXISTS kugetsu.hosts (
    name text PRIMARY KEY,
    epoch bigint NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    max_agents int NOT NULL,
    pid int,
    joined_at timestamptz NOT NULL,
    gone boolean NOT NULL DEFAULT false
);
CREATE TABLE IF NOT EXISTS kugetsu.log_chunks (
    task bigint NOT NULL,
    pos bigint NOT NULL,
    data bytea NOT NULL,
    PRIMARY KEY (task, pos)
);
CREATE TABLE IF NOT EXISTS kugetsu.leases (name text PRIMARY KEY, holder text NOT NULL, until timestamptz NOT NULL);
CREATE TABLE IF NOT EXISTS kugetsu.cursors (chat bigint PRIMARY KEY, seq bigint NOT NULL);
"""


def ensure_schema(conn: psycopg.Connection, url: str) -> None:
    """Create the tables on first use, and upgrade those of an older kugetsu. Concurrent
    first uses serialize on an advisory lock (CREATE ... IF NOT EXISTS alone races)."""
    with errors(url):
        row = None
        try:
            row = conn.execute("SELECT schema_version FROM kugetsu.meta").fetchone()
        except psycopg.errors.UndefinedTable:
            if not conn.autocommit:
                conn.rollback()
        if row is not None and row[0] >= SCHEMA_VERSION:
            _check_version(row[0], url)
            return
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(7417190341)")
                if row is None:
                    conn.execute(_SCHEMA)
                    conn.execute("INSERT INTO kugetsu.meta VALUES (1, 1) ON CONFLICT DO NOTHING")
                    conn.execute("INSERT INTO kugetsu.state (id, doc) VALUES (1, '') ON CONFLICT DO NOTHING")
                got = conn.execute("SELECT schema_version FROM kugetsu.meta FOR UPDATE").fetchone()
                version = got[0] if got else 1  # another process may have upgraded meanwhile
                for step in range(version, SCHEMA_VERSION):
                    conn.execute(_UPGRADES[step])
                if version < SCHEMA_VERSION:
                    conn.execute("UPDATE kugetsu.meta SET schema_version = %s", (SCHEMA_VERSION,))
        except psycopg.errors.InsufficientPrivilege as err:
            raise KugetsuError(_no_privilege(url, _why(err), creating=True)) from None
        if not conn.autocommit:
            conn.commit()


def _check_version(version: int, url: str) -> None:
    if version > SCHEMA_VERSION:
        raise KugetsuError(f"{redact(url)}: the database was set up by a newer kugetsu (schema {version},"
                           f" this one knows {SCHEMA_VERSION}): upgrade kugetsu on this machine")
