"""Delivery of events.jsonl to the notify chats, at least once and normally exactly once.

One asyncio task per chat reads the events after that chat's cursor, sends each one the
config asks for, and only then moves the cursor (a small JSON file in KUGETSU_HOME,
written atomically). A crash between the send and the cursor write repeats one message;
nothing else can repeat or be lost, across restarts and outages alike. Each chat has its
own cursor so that one unreachable chat never holds back or duplicates another.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING
from datetime import timedelta
from pathlib import Path

from telegram import Bot, LinkPreviewOptions
from telegram.constants import ParseMode
from telegram.error import BadRequest, Forbidden, InvalidToken, RetryAfter, TelegramError

from kugetsu.config.model import Config
from kugetsu.core.models import Event, Task
from kugetsu.app import machines
from kugetsu.store import logtail
from kugetsu.app.transaction import now
from kugetsu.paths import Home, atomic_write, read_file
from kugetsu.store.events import EventTail
from kugetsu.store.files import open_store
from kugetsu.frontends.telegram import text

if TYPE_CHECKING:  # cluster mode only: psycopg
    from kugetsu.cluster.feeds import DbCursors, DbTail

log = logging.getLogger("kugetsu.telegram")

BACKOFF_FIRST = 0.5  # seconds; doubles on each failure in a row
BACKOFF_MAX = 60.0
RECHECK = 1.0  # seconds between looks at events.jsonl when nobody woke us (architecture: no component polls faster than once a second)
# With no cursor yet (the bot was just set up), events older than this are history, not news.
FIRST_RUN_WINDOW = timedelta(minutes=10)
_NO_PREVIEW = LinkPreviewOptions(is_disabled=True)


def retry_after_seconds(err: RetryAfter) -> float:
    with warnings.catch_warnings():  # the int-or-timedelta deprecation: we accept both
        warnings.simplefilter("ignore")
        value = err.retry_after
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


class Cursors:
    """chat id -> seq of the last event settled (delivered, or not wanted) for that chat."""

    def __init__(self, path: Path):
        self.path = path
        # Feeds write from worker threads, and atomic_write's temp file name is fixed.
        self._lock = threading.Lock()
        try:
            raw = json.loads(read_file(path))
            self.seqs = {int(k): int(v) for k, v in raw.items()}
        except FileNotFoundError:
            self.seqs = {}
        except (ValueError, AttributeError, TypeError):
            log.error("%s does not parse; starting notifications from recent events", path)
            self.seqs = {}
        except OSError as err:  # e.g. a symlink planted there: never followed (ELOOP)
            log.error("cannot read %s (%s); starting notifications from recent events", path, err.strerror)
            self.seqs = {}

    def get(self, chat: int) -> int | None:
        return self.seqs.get(chat)

    def set(self, chat: int, seq: int) -> None:
        with self._lock:
            self.seqs[chat] = seq
            data = json.dumps({str(k): v for k, v in sorted(self.seqs.items())}, indent=1).encode() + b"\n"
            atomic_write(self.path, data)


def cursor_path(home: Home) -> Path:
    return home.root / "telegram-cursor.json"


class Notifier:
    def __init__(self, home: Home, bot: Bot, get_cfg: Callable[[], Config]):
        self.home = home
        self.store = open_store(home)
        self.bot = bot
        self.get_cfg = get_cfg
        # In a cluster the cursors and the feed are in the database: the bot may move to
        # another machine (its lease), and delivers from where the last holder stopped.
        self.cluster = get_cfg().store
        self.cursors: Cursors | DbCursors
        self._tail: Callable[[], EventTail | DbTail]
        if self.cluster is None:
            self.cursors, self._tail = Cursors(cursor_path(home)), lambda: EventTail(home)
        else:
            from kugetsu.cluster import feeds

            url = self.cluster
            self.cursors, self._tail = feeds.DbCursors(url), lambda: feeds.DbTail(url)
        self.feeds: dict[int, asyncio.Task[None]] = {}
        self.wakes: dict[int, asyncio.Event] = {}
        self.tails: dict[int, EventTail | DbTail] = {}
        self._said_no_chats = False
        self._watcher: asyncio.Task[None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch(), name="telegram-notify-watch")

    def sync(self) -> None:
        """One feed per notify chat in the current config; config changes apply at once."""
        chats = set(self.get_cfg().telegram.notify_chat_ids)
        if not chats and not self._said_no_chats:
            log.info("telegram.notify_chat_ids is empty: no notifications are sent")
            self._said_no_chats = True
        for chat in [c for c in self.feeds if c not in chats]:
            self.feeds.pop(chat).cancel()
            self.wakes.pop(chat, None)
            self.tails.pop(chat, None)
        for chat in chats - set(self.feeds):
            self.wakes[chat] = asyncio.Event()
            self.wakes[chat].set()
            self.tails[chat] = self._tail()
            self.feeds[chat] = asyncio.create_task(self._feed(chat), name=f"telegram-notify-{chat}")

    def wake(self) -> None:
        """New events are committed (the service's own transactions say so at once)."""
        self.sync()
        for event in self.wakes.values():
            event.set()

    async def _watch(self) -> None:
        """Once a second: config changes (notify chats), and events.jsonl grown by a CLI
        transaction the service did not see as its own."""
        stamp = self._stamp()
        while True:
            await asyncio.sleep(RECHECK)
            try:
                self.sync()
                if (now_stamp := self._stamp()) != stamp:
                    stamp = now_stamp
                    self.wake()
            except Exception:
                log.exception("notification watcher failed; retrying")

    async def stop(self) -> None:
        tasks = list(self.feeds.values()) + ([self._watcher] if self._watcher else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.feeds.clear()

    # ---- one chat ----------------------------------------------------------------------

    async def _feed(self, chat: int) -> None:
        wake = self.wakes[chat]
        while True:
            await wake.wait()
            wake.clear()  # before reading: what lands while we send sets it again
            try:
                if self.cursors.get(chat) is None:
                    await asyncio.to_thread(self.cursors.set, chat, await asyncio.to_thread(self._first_cursor))
                await self._deliver(chat)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("notifications to chat %d failed unexpectedly; retrying in %.0fs", chat, BACKOFF_MAX)
                await asyncio.sleep(BACKOFF_MAX)
                wake.set()

    async def _deliver(self, chat: int) -> None:
        """Send what is new for `chat`, moving its cursor after each message Telegram took."""
        cursor = self.cursors.get(chat) or 0
        events = await asyncio.to_thread(self.tails[chat].after, cursor)
        if cursor and events and events[0].seq > cursor + 1:
            # Seqs have no holes: these were rotated out before this feed read them. Said,
            # rather than skipped in silence (the log and the chat both hear of it).
            first, last = cursor + 1, events[0].seq - 1
            log.warning("notifications for chat %d: events %d to %d left the event log unsent", chat, first, last)
            size = None if self.cluster else self.get_cfg().events_max_size
            await self._send(chat, text.events_missed(first, last, size))
        unsaved = False
        for event in events:
            if text.wanted(event, self.get_cfg().telegram.events):
                message = await asyncio.to_thread(self._message, event)
                await self._send(chat, message)
                await asyncio.to_thread(self.cursors.set, chat, event.seq)
                unsaved = False
            else:
                unsaved = True  # saved with the next delivery or at the end: fewer fsyncs
            cursor = event.seq
        if unsaved:
            await asyncio.to_thread(self.cursors.set, chat, cursor)

    def _first_cursor(self) -> int:
        """Where a chat without a cursor starts. A chat added to a working set-up gets what
        happens from now on; on the very first set-up, the service was likely started by
        the very delegate whose events the user expects, so the last minutes count too."""
        events = self.store.read_events(0)
        if self.cursors.seqs:
            return events[-1].seq if events else 0
        cut = now() - FIRST_RUN_WINDOW
        return max((e.seq for e in events if e.at < cut), default=0)

    def _stamp(self) -> object:
        if self.cluster is not None:
            return self.store.tail_events(1)  # the last event: new ones change it
        try:
            st = os.stat(self.home.events)
            return st.st_size, st.st_mtime_ns
        except FileNotFoundError:
            return 0, 0

    def _message(self, event: Event) -> str:
        task = self._task(event.task) if event.task is not None else None
        tail = None
        if event.type in ("failed", "lost") and event.task is not None:
            cfg = self.get_cfg()
            tail = _log_tail(self.home.log(event.task) if task is None else machines.log_path(self.home, cfg, task),
                             "text" if task is None else machines.output_kind(cfg, task))
        return text.notification(event, task, self.get_cfg(), tail)

    def _task(self, task_id: int) -> Task | None:
        try:
            return next((t for t in self.store.read().all_tasks() if t.id == task_id), None)
        except Exception:  # an unreadable index must not stop notifications; durations are optional
            return None

    async def _send(self, chat: int, message: str) -> bool:
        """Send until Telegram takes it. False if Telegram refuses it for good (bad chat,
        bot blocked): retrying could never succeed, and it must not block the chat forever."""
        delay = BACKOFF_FIRST
        failures = 0
        parse_mode: str | None = ParseMode.HTML
        last_warned = 0.0
        while True:
            try:
                await self.bot.send_message(chat, message, parse_mode=parse_mode, link_preview_options=_NO_PREVIEW)
                if failures:
                    log.info("delivered to chat %d after %d failed attempts", chat, failures)
                return True
            except RetryAfter as err:
                wait = retry_after_seconds(err)
                log.warning("flood control for chat %d, waiting %.0fs as asked", chat, wait)
                await asyncio.sleep(wait)
                continue
            except BadRequest as err:
                if parse_mode and "parse" in str(err).lower():
                    message, parse_mode = text.plain(message), None  # our HTML was wrong: say it plainly
                    continue
                log.error("telegram refused a notification for chat %d (%s); skipping it", chat, err)
                return False
            except Forbidden as err:
                log.error("the bot may not write to chat %d (%s); skipping a notification", chat, err)
                return False
            except InvalidToken:
                delay = BACKOFF_MAX  # revoked token: nothing gets through until it is fixed; keep the events
                error = "the token was refused; fix telegram.token and restart the service"
            except TelegramError as err:
                error = str(err)
            failures += 1
            if failures == 1 or time.monotonic() - last_warned > 60:
                log.warning("cannot notify chat %d (%s); retrying in %.1fs", chat, error, delay)
                last_warned = time.monotonic()
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)


def _log_tail(path: Path, kind: str = "text", size: int = 8192) -> str | None:
    """The last lines of a task's log, as text (a structured output rendered: kugetsu.agents)."""
    from kugetsu.agents import render_tail

    try:
        # JSON lines say less per byte than text: a structured output is read further back.
        end = logtail.tail(path, max_bytes=size * (8 if kind != "text" else 1))
    except OSError:
        return None
    data = end.data
    if kind != "text":
        data = render_tail(kind, data.decode("utf-8", "replace"), cut=end.start > 0).encode()
    return text.tail_lines(data)
