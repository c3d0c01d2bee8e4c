"""`kugetsu store migrate URL` and `kugetsu store export DIR`: a file home into the cluster's
database, and the database back into a file home.

Both refuse when a side is busy: a service running on the file home (it would go on writing
index.json), live tasks there (their agents would be orphaned from their records), or a
database that already holds a queue (two queues cannot be merged without renumbering).
"""

from __future__ import annotations

import os
import re
from datetime import datetime

import msgspec

from kugetsu.cluster.db import connect, redact
from kugetsu.store.postgres import INSERT_EVENTS, INSERT_HISTORY, UPSERT_PROMPT, PgStore, event_rows
from kugetsu.config.load import read_raw, save_raw, validate
from kugetsu.config.model import LOCAL_KEYS
from kugetsu.app.control import service_holds_lock
from kugetsu.errors import KugetsuError, UsageError
from kugetsu.core.models import Index, decode_task
from kugetsu.paths import Home, atomic_write
from kugetsu.store.files import Store
from kugetsu.store.protocol import encode_index, encoder


class Busy(KugetsuError):
    """A side of a migration is in use (exit 1)."""


def migrate(home: Home, url: str) -> str:
    """Move the queue, history, events and shared config of `home` into the database at `url`,
    then point this machine at it (config.json keeps only its own keys)."""
    if not url.startswith(("postgresql://", "postgres://")):
        raise UsageError(f"store migrate: {url!r} is not a PostgreSQL URL (postgresql://[user@]host[:port]/db)")
    raw = read_raw(home)
    if raw.get("store"):
        raise UsageError(f"{home.config} already points at {redact(str(raw['store']))}: this home is in a cluster")
    validate(raw, home.config)
    if service_holds_lock(home):
        raise Busy("the service of this home is running: stop it first (`kugetsu shutdown`), then migrate")
    file_store = Store(home)
    index = file_store.read()
    if index.live():
        raise Busy(f"{len(index.live())} task(s) are queued or running here: let them finish or cancel them"
                   " (`kugetsu cancel --all`), then migrate")
    events = file_store.read_events()
    history = _history_lines(home)
    prompts = file_store.prompts({t.id for t in index.all_tasks()} | {h[0] for h in history})
    shared = {k: v for k, v in raw.items() if k not in LOCAL_KEYS}
    conn = connect(url, autocommit=True)
    try:
        with conn.transaction():
            row = conn.execute("SELECT doc FROM kugetsu.state WHERE id = 1 FOR UPDATE").fetchone()
            count = conn.execute("SELECT count(*) FROM kugetsu.events").fetchone()
            if (row and bytes(row[0])) or (count and count[0]):
                raise Busy(f"{redact(url)} already holds a kugetsu queue: migrate into an empty database"
                           " (or join this machine to that cluster: `kugetsu config set store URL`)")
            index.outbox = []
            if events:
                index.next_seq = max(index.next_seq, events[-1].seq + 1)
            conn.execute("UPDATE kugetsu.state SET doc = %s, config = %s WHERE id = 1",
                         (encode_index(index), msgspec.json.encode(shared)))
            with conn.cursor() as cur:
                cur.executemany(INSERT_EVENTS, event_rows(events))
                cur.executemany(INSERT_HISTORY, history)
                cur.executemany(UPSERT_PROMPT, [(i, text.encode()) for i, text in prompts.items()])
    finally:
        conn.close()
    # The database holds it all now: this machine follows it, and the file index is kept
    # aside (renamed, not deleted) as the record of what was moved.
    save_raw(home, {**{k: v for k, v in raw.items() if k in LOCAL_KEYS}, "store": url})
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    if home.index.exists():
        os.replace(home.index, home.index.with_name(f"index.json.migrated-{stamp}"))
    if home.journal.exists():  # what was read above, with index.json: the record goes aside with it
        os.replace(home.journal, home.journal.with_name(f"index.journal.migrated-{stamp}"))
    home.head.unlink(missing_ok=True)  # only a summary of the index.json moved aside (store/head.py)
    return (f"moved {len(index.finished)} finished task(s), {len(history)} archived, {len(events)} event(s)"
            f" and the config into {redact(url)}; this machine now uses it (config store). Run `kugetsu serve`"
            " on each machine that runs agents.")


def _history_lines(home: Home) -> list[tuple[int, datetime | None, bytes]]:
    out = []
    try:
        with open(home.history, "rb") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    task = decode_task(line, old=False)  # its id and finish time: the same in both versions
                except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
                    continue  # a line torn by a crash
                out.append((task.id, task.finished_at, line))
    except FileNotFoundError:
        pass
    return out


_ID = re.compile(rb'\{"id":(\d+)')  # an archived task's line starts with its id (history.jsonl)


def export(url: str, target: Home) -> str:
    """The database's queue, events, history and shared config as a file home at `target`
    (which must not hold one): the way back to one machine, and a backup."""
    if target.index.exists() or target.config.exists():
        raise UsageError(f"{target.root} already holds a kugetsu home: export into a new directory")
    store = PgStore(url)
    try:
        index: Index = store.read()
        shared = store.read_config()
        events = store.read_events()
        history = store.history()
        ids = {t.id for t in index.all_tasks()} | {int(m.group(1)) for h in history if (m := _ID.match(h))}
        prompts = store.prompts(ids)
    finally:
        store.close()
    target.ensure()
    for task_id, text in prompts.items():
        atomic_write(target.prompt_file(task_id), text.encode())
    index.outbox = []
    atomic_write(target.index, encode_index(index))
    atomic_write(target.events, b"".join(encoder.encode(e) + b"\n" for e in events))
    atomic_write(target.history, b"".join(h + b"\n" for h in history))
    save_raw(target, shared)
    return (f"exported {len(index.all_tasks())} task(s), {len(history)} archived and {len(events)} event(s)"
            f" to {target.root}")
