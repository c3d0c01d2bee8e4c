"""The bot inside `kugetsu serve`: commands, Cancel buttons, access control, lifecycle.

The Application runs in the service's own event loop, driven by hand (initialize, start,
start_polling; then the reverse), inside a background task: an unreachable or failing
Telegram only makes that task wait and retry, never the service. Every action calls the
shared operations of kugetsu.app.ops in a worker thread (they take file locks and fsync).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from telegram import BotCommand, InlineKeyboardButton, InlineKeyboardMarkup, LinkPreviewOptions, Update
from telegram.constants import ParseMode
from telegram.error import InvalidToken, TelegramError
from telegram.ext import (
    Application,
    ApplicationBuilder,
    ApplicationHandlerStop,
    CallbackQueryHandler,
    CommandHandler,
    ContextTypes,
    MessageHandler,
    TypeHandler,
    filters,
)

from kugetsu.app import delegation, reading, recurring, transaction, verbs

from kugetsu.core import admission, selection
from kugetsu.config.load import load_config
from kugetsu.config.model import Config, TelegramConfig
from kugetsu.errors import KugetsuError, redact_url
from kugetsu.core.models import Event, TaskState
from kugetsu.paths import Home
from kugetsu.frontends.telegram import guard_logs, redact, text
from kugetsu.frontends.telegram.notify import BACKOFF_FIRST, BACKOFF_MAX, Notifier

log = logging.getLogger("kugetsu.telegram")

POLL_TIMEOUT = 10  # seconds a getUpdates long poll may wait; stop() interrupts it anyway
REFUSE_EVERY = 60.0  # seconds: at most one refusal a minute per stranger chat
MAX_BUTTONS = 20
REFUSAL = "Sorry, this is a private bot."
_NO_PREVIEW = LinkPreviewOptions(is_disabled=True)


def allowed(cfg: TelegramConfig, chat_id: int | None, user_id: int | None) -> bool:
    """Only listed chats, and, when users are listed too, only those users in them."""
    if chat_id is None or chat_id not in cfg.allowed_chat_ids:
        return False
    return not cfg.allowed_user_ids or user_id in cfg.allowed_user_ids


@dataclass
class Env:
    """What the handlers share, kept in the Application's bot_data."""

    home: Home
    get_cfg: Callable[[], Config]
    refused_at: dict[tuple[int, int | None], float] = field(default_factory=dict)  # (chat, user) -> when
    menu_has_delegate: bool | None = None  # what setMyCommands last registered


def _env(context: ContextTypes.DEFAULT_TYPE) -> Env:
    return context.bot_data["kugetsu"]


async def _reply(update: Update, html: str, markup: InlineKeyboardMarkup | None = None) -> None:
    if update.effective_message is not None:
        await update.effective_message.reply_text(
            html, parse_mode=ParseMode.HTML, reply_markup=markup, link_preview_options=_NO_PREVIEW
        )


# ---- access --------------------------------------------------------------------------------


async def gate(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    """Runs before every handler: strangers get one short refusal and nothing else."""
    env = _env(context)
    cfg = env.get_cfg().telegram
    chat = update.effective_chat
    user = update.effective_user
    if chat is not None and allowed(cfg, chat.id, user.id if user else None):
        if env.menu_has_delegate is not None and env.menu_has_delegate != cfg.allow_delegate:
            # allow_delegate changed since the menu was registered: the owner is here, refresh it
            context.application.create_task(set_commands(context.application, env))
        return
    message = update.effective_message
    is_command = message is not None and (message.text or "").startswith("/")
    if chat is not None and (is_command or update.callback_query is not None):
        # Per chat and user: in an allowed group, each refused member is named in the log.
        key = (chat.id, user.id if user else None)
        last = env.refused_at.get(key, 0.0)
        if time.monotonic() - last > REFUSE_EVERY:
            env.refused_at[key] = time.monotonic()
            log.warning("%s", refusal_advice(cfg, chat.id, user.id if user else None))
            if update.callback_query is not None:
                await update.callback_query.answer(REFUSAL)
            else:
                await _reply(update, REFUSAL)
    raise ApplicationHandlerStop


def refusal_advice(cfg: TelegramConfig, chat_id: int, user_id: int | None) -> str:
    """For the log: who was refused, what exactly is missing, and the command that adds it."""
    who = f"chat {chat_id} (user {user_id if user_id is not None else '?'})"
    user_missing = bool(cfg.allowed_user_ids) and user_id not in cfg.allowed_user_ids
    if chat_id in cfg.allowed_chat_ids:  # then only the user can be missing
        if user_id is None:
            return (f"refused {who}: the chat is allowed, but telegram.allowed_user_ids is set and Telegram"
                    " named no sender (an anonymous group admin or a channel post), so no user can be checked")
        return (f"refused {who}: the chat is allowed, but telegram.allowed_user_ids does not list user"
                f" {user_id}. To allow them: kugetsu config set telegram.allowed_user_ids"
                f" '{sorted({*cfg.allowed_user_ids, user_id})}'")
    advice = f"kugetsu config set telegram.allowed_chat_ids '{sorted({*cfg.allowed_chat_ids, chat_id})}'"
    if user_missing and user_id is not None:
        advice += (f" and, as telegram.allowed_user_ids is set: kugetsu config set telegram.allowed_user_ids"
                   f" '{sorted({*cfg.allowed_user_ids, user_id})}'")
    return f"refused {who}: not allowed. To allow it: {advice}"


# ---- commands --------------------------------------------------------------------------------


async def cmd_help(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    await _reply(update, text.help_text(_env(context).get_cfg().telegram.allow_delegate))


def _queue_view(home: Home) -> tuple[str, InlineKeyboardMarkup | None]:
    cfg, index = reading.read(home)
    now = transaction.now()
    listed = reading.listing(cfg, index, at=now, home=home)  # the CLI's own view, with its notes on why tasks wait
    view = listed.view
    body = text.queue(view, now, listed.measured)
    live = [t for t in view.running if t.run.stop is None] + view.queued
    buttons = [
        [InlineKeyboardButton(f"Cancel {t.name}", callback_data=f"cancel:{t.id}")] for t in live[:MAX_BUTTONS]
    ]
    return body, InlineKeyboardMarkup(buttons) if buttons else None


async def cmd_queue(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    body, markup = await asyncio.to_thread(_queue_view, _env(context).home)
    await _reply(update, body, markup)


async def cmd_capacity(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    cfg, index = await asyncio.to_thread(reading.read, _env(context).home)
    await _reply(update, text.capacity(selection.capacity(index, cfg, transaction.now())))


async def cmd_schedules(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    def look() -> str:
        cfg, index = reading.read(_env(context).home)
        return text.schedules(recurring.schedules_json(cfg, index), transaction.now())

    await _reply(update, await asyncio.to_thread(look))


async def cmd_status(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    if not context.args:
        await _reply(update, "usage: /status TASK (an id or a name)")
        return

    def look() -> str:
        home = _env(context).home
        cfg, index = reading.read(home)
        task = selection.find(index, context.args[0])
        measured = reading.measured(home, cfg, index)  # a running task's memory now (README, "Resources")
        return text.status(reading.task_json(task, selection.positions(index, cfg, transaction.now()).get(task.id), measured=measured,
                                         prompts=reading.prompts(home, [task])))

    await _reply(update, await asyncio.to_thread(look))


def _cancel(home: Home, refs: list[str], chat_id: int) -> str:
    tasks = verbs.cancel(home, refs, reason=f"cancelled by telegram:{chat_id}")
    lines = []
    for t in tasks:
        if t.state is TaskState.RUNNING:
            lines.append(f"stopping {text.task_ref(t)}: cancelled once it exits")
        else:
            lines.append(f"{t.state.value} {text.task_ref(t)}")
    return text.fit(lines) or "nothing to cancel"


async def cmd_cancel(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    if not context.args:
        await _reply(update, "usage: /cancel TASK... (ids or names); /queue has Cancel buttons")
        return
    chat_id = update.effective_chat.id  # type: ignore[union-attr]
    await _reply(update, await asyncio.to_thread(_cancel, _env(context).home, list(context.args), chat_id))


async def on_button(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    query = update.callback_query
    assert query is not None
    action, _, ref = (query.data or "").partition(":")
    if action != "cancel" or not (ref.isascii() and ref.isdigit()):  # ours are ASCII ids; a client may send anything
        await query.answer()
        return
    home = _env(context).home
    try:
        outcome = await asyncio.to_thread(_cancel, home, [ref], query.message.chat.id)  # type: ignore[union-attr]
    except KugetsuError as err:
        await query.answer(text.plain(text.esc(err))[:190])  # an answer has no parse mode: esc for its controls
        return
    await query.answer(text.plain(outcome)[:190])
    body, markup = await asyncio.to_thread(_queue_view, home)
    try:
        await query.edit_message_text(body, parse_mode=ParseMode.HTML, reply_markup=markup)
    except TelegramError as err:  # e.g. "message is not modified", or too old to edit
        log.info("could not refresh the queue message: %s", err)


def _pause(home: Home, ref: str | None, on: bool, chat_id: int) -> str:
    """/pause, /resume: the queue's starts, or (with TASK) a running task's processes."""
    if ref is None:
        changed, cap = verbs.pause(home, None, on)
        if on:
            return "paused: no queued task starts, running ones go on" if changed else "already paused"
        return (f"resumed: {cap.active}/{cap.max_agents} running, {cap.queued} queued" if changed
                else "was not paused")
    task, changed = verbs.pause_task(home, ref, on, by=f"telegram:{chat_id}")
    verb = "paused" if on else "resumed"
    return f"{verb} {text.task_ref(task)}" if changed else f"{text.task_ref(task)} was {'already' if on else 'not'} paused"


async def cmd_pause(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    await _pause_or_resume(update, context, True)


async def cmd_resume(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    await _pause_or_resume(update, context, False)


async def _pause_or_resume(update: Update, context: ContextTypes.DEFAULT_TYPE, on: bool) -> None:
    ref = context.args[0] if context.args else None
    chat_id = update.effective_chat.id  # type: ignore[union-attr]
    await _reply(update, await asyncio.to_thread(_pause, _env(context).home, ref, on, chat_id))


def _retry(home: Home, ref: str) -> str:
    cfg = load_config(home)
    if not cfg.telegram.allow_delegate:  # it starts an agent, as /delegate does
        return "Retrying from Telegram is off with delegating (config telegram.allow_delegate)."
    return _admitted(verbs.retry(home, cfg, ref))


async def cmd_retry(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    if not context.args:
        await _reply(update, "usage: /retry TASK (a finished task: it runs again as a new task)")
        return
    await _reply(update, await asyncio.to_thread(_retry, _env(context).home, context.args[0]))


def _admitted(adm: delegation.Admission) -> str:
    if adm.position is None:
        return f"started {text.task_ref(adm.task)}, slot {adm.task.run.slot}/{adm.max_agents}"
    return f"queued {text.task_ref(adm.task)}, position {adm.position} of {adm.queued}"


def _delegate(home: Home, name: str, prompt: str, chat_id: int) -> str:
    cfg = load_config(home)  # fresh: allow_delegate may have just been switched
    if not cfg.telegram.allow_delegate:
        return "Delegating from Telegram is off (config telegram.allow_delegate)."
    cwd = os.path.expanduser(cfg.telegram.delegate_cwd or "~")
    req = admission.Request(cwd=cwd, name=name, prompt=prompt, source=f"telegram:{chat_id}")
    return _admitted(delegation.delegate(home, cfg, req))


async def cmd_delegate(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    parts = (update.effective_message.text or "").split(maxsplit=2)  # type: ignore[union-attr]
    if len(parts) < 3:
        await _reply(update, "usage: /delegate NAME PROMPT")
        return
    chat_id = update.effective_chat.id  # type: ignore[union-attr]
    await _reply(update, await asyncio.to_thread(_delegate, _env(context).home, parts[1], parts[2], chat_id))


async def cmd_unknown(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    command = (update.effective_message.text or "").split()[0]  # type: ignore[union-attr]
    addressee = command.partition("@")[2]
    if addressee and addressee.lower() != (context.bot.username or "").lower():
        return  # a command for another bot in a shared group
    await _reply(update, "Unknown command; /help lists what I can do.")


async def on_error(update: object, context: ContextTypes.DEFAULT_TYPE) -> None:
    err = context.error
    if isinstance(update, Update) and isinstance(err, KugetsuError):
        await _reply(update, text.esc(f"{err}{text.fix(err)}"))  # no such task, queue full...: the user's to fix
        return
    log.error("a handler failed", exc_info=err)
    if isinstance(update, Update) and not isinstance(err, TelegramError):
        try:
            await _reply(update, "Something went wrong; the service log has the details.")
        except TelegramError:
            pass


# ---- lifecycle ---------------------------------------------------------------------------------


def build(token: str, home: Home, get_cfg: Callable[[], Config]) -> Application:
    cfg = get_cfg().telegram
    app = ApplicationBuilder().token(token).base_url(cfg.api_base_url).job_queue(None).build()
    app.bot_data["kugetsu"] = Env(home, get_cfg)
    app.add_handler(TypeHandler(Update, gate), group=-1)
    for name, handler in (
        ("start", cmd_help), ("help", cmd_help), ("queue", cmd_queue), ("status", cmd_status),
        ("capacity", cmd_capacity), ("cancel", cmd_cancel), ("delegate", cmd_delegate), ("schedules", cmd_schedules),
        ("pause", cmd_pause), ("resume", cmd_resume), ("retry", cmd_retry),
    ):
        app.add_handler(CommandHandler(name, handler))
    app.add_handler(CallbackQueryHandler(on_button))
    app.add_handler(MessageHandler(filters.COMMAND, cmd_unknown))
    app.add_error_handler(on_error)
    return app


async def set_commands(app: Application, env: Env) -> None:
    """Register the commands for the client's menu; /delegate only when it is allowed."""
    allow = env.get_cfg().telegram.allow_delegate
    env.menu_has_delegate = allow
    try:
        await app.bot.set_my_commands([BotCommand(n, d) for n, d in text.COMMANDS if allow or n not in ("delegate", "retry")])
    except TelegramError as err:  # only the client's menu suffers; the next message retries
        env.menu_has_delegate = not allow
        log.warning("setMyCommands failed (%s); the commands still work", err)


class TelegramBot:
    """The bot and the notifier, as one extension of the service."""

    def __init__(self, home: Home, token: str, get_cfg: Callable[[], Config], poll_timeout: float = POLL_TIMEOUT):
        self.home = home
        self.token = token
        self.get_cfg = get_cfg
        self.poll_timeout = poll_timeout
        self.app: Application | None = None
        self.notifier: Notifier | None = None
        self._task: asyncio.Task[None] | None = None
        self._poll_errors = 0

    def start(self) -> None:
        guard_logs(self.token)
        self._task = asyncio.create_task(self._run(), name="telegram")

    def on_events(self, events: list[Event]) -> None:
        """A service listener: new events are committed; wake the notifier."""
        if self.notifier is not None:
            self.notifier.wake()

    async def _run(self) -> None:
        try:
            self.app = app = build(self.token, self.home, self.get_cfg)
            if not await self._initialize(app):
                return
            cfg = self.get_cfg().telegram
            log.info("telegram bot @%s up (API %s)", app.bot.username, redact_url(cfg.api_base_url))
            if not cfg.allowed_chat_ids:
                log.warning(
                    "telegram.allowed_chat_ids is empty: the bot answers nobody. Send /start to the bot,"
                    " find your chat id in this log, then: kugetsu config set telegram.allowed_chat_ids '[ID]'"
                )
            self.notifier = Notifier(self.home, app.bot, self.get_cfg)
            self.notifier.sync()
            self.notifier.start()
            await set_commands(app, app.bot_data["kugetsu"])
            await app.start()
            await app.updater.start_polling(  # type: ignore[union-attr]
                timeout=self.poll_timeout, bootstrap_retries=-1, error_callback=self._poll_error
            )
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.error("telegram bot stopped by an unexpected error: %s", redact(err, self.token), exc_info=err)

    async def _initialize(self, app: Application) -> bool:
        """getMe until Telegram answers; False if it refuses the token (retrying cannot help)."""
        delay = BACKOFF_FIRST
        while True:
            try:
                await app.initialize()
                return True
            except InvalidToken:
                log.error("telegram refused the bot token (getMe): check telegram.token; the bot is off")
                return False
            except TelegramError as err:
                log.warning("cannot reach the Bot API (%s); retrying in %.1fs", redact(err, self.token), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)

    def _poll_error(self, err: TelegramError) -> None:
        # python-telegram-bot retries with its own backoff; one line, not a traceback each time
        self._poll_errors += 1
        if self._poll_errors in (1, 10) or self._poll_errors % 100 == 0:
            log.warning("polling failed %d times (%s); retrying", self._poll_errors, redact(err, self.token))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.notifier is not None:
            await self.notifier.stop()
        app = self.app
        if app is None:
            return
        for step in (
            lambda: app.updater.stop() if app.updater and app.updater.running else None,
            lambda: app.stop() if app.running else None,
            app.shutdown,
        ):
            try:
                coro = step()
                if coro is not None:
                    await asyncio.wait_for(coro, 3)
            except Exception as err:  # stopping must go on: the service is shutting down
                log.warning("while stopping: %s", redact(err, self.token))
