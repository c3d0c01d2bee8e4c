"""The Telegram notifier's cursors and event feed in cluster mode: in the database, so that
the machine holding the bot's lease delivers from where the previous holder stopped (the
same at-least-once cursor as on one machine: a message is sent, then its cursor moves)."""

from __future__ import annotations

import threading

from kugetsu.store.postgres import PgStore
from kugetsu.core.models import Event


class DbCursors:
    """chat id -> seq of the last event settled for that chat (table kugetsu.cursors)."""

    def __init__(self, url: str):
        self.store = PgStore(url)  # its own connection: feeds write from worker threads
        self._lock = threading.Lock()
        rows = self.store._execute("SELECT chat, seq FROM kugetsu.cursors").fetchall()
        self.seqs = {int(r[0]): int(r[1]) for r in rows}

    def get(self, chat: int) -> int | None:
        return self.seqs.get(chat)

    def set(self, chat: int, seq: int) -> None:
        with self._lock:
            self.store._execute(
                "INSERT INTO kugetsu.cursors (chat, seq) VALUES (%s, %s)"
                " ON CONFLICT (chat) DO UPDATE SET seq = excluded.seq", (chat, seq))
            self.seqs[chat] = seq


class DbTail:
    """Events after a cursor, from the events table."""

    def __init__(self, url: str):
        self.store = PgStore(url)
        self._lock = threading.Lock()

    def after(self, seq: int) -> list[Event]:
        with self._lock:  # one connection, used from worker threads
            return self.store.read_events(seq)
