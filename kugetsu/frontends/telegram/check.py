"""`kugetsu telegram check`: is the bot set up right? getMe, then a test message to each
notify chat, with errors that say what to fix and never show the token."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from telegram import Bot
from telegram.error import Forbidden, InvalidToken, NetworkError, TelegramError, TimedOut

from kugetsu.config.load import load_config
from kugetsu.config.model import Config
from kugetsu.errors import OK, KugetsuError, UsageError
from kugetsu.paths import Home
from kugetsu.frontends.telegram import TOKEN_ENV, redact, resolve_token


def check(home: Home) -> int:
    cfg = load_config(home)
    token = resolve_token(cfg)
    if not token:
        raise UsageError(
            "no bot token: BotFather gives it (docs/telegram.md); set it from standard input, off the command"
            " line where any local user could read it: `printf '%s' \"$TOKEN\" | kugetsu config set telegram.token -`"
            f" (or put it in env {TOKEN_ENV} in the service's environment)"
        )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs URLs, token inside
    return asyncio.run(_check(cfg, token))


@asynccontextmanager
async def connected(cfg: Config, token: str) -> AsyncIterator[Bot]:
    """A bot that has passed getMe (its name and id known), shut down afterwards; else a
    KugetsuError that says what to fix and never shows the token. `kugetsu doctor` uses it too."""
    tg = cfg.telegram
    bot = Bot(token, base_url=tg.api_base_url)
    try:
        try:
            await bot.initialize()  # getMe
        except InvalidToken:
            raise KugetsuError(
                "Telegram refused the token (getMe said unauthorized): copy it again from BotFather"
                " and set telegram.token"
            ) from None
        except (NetworkError, TimedOut) as err:
            raise KugetsuError(
                f"cannot reach the Bot API at {tg.api_base_url} ({redact(err, token)}); check the network"
                " and telegram.api_base_url"
            ) from None
        yield bot
    finally:
        try:
            await bot.shutdown()
        except TelegramError:
            pass


async def _check(cfg: Config, token: str) -> int:
    tg = cfg.telegram
    async with connected(cfg, token) as bot:
        print(f"ok: token valid, bot @{bot.username} (id {bot.id})")
        if not tg.allowed_chat_ids:
            print("warning: telegram.allowed_chat_ids is empty, so the bot answers nobody")
        if not tg.notify_chat_ids:
            print("note: telegram.notify_chat_ids is empty, so no notifications are sent")
        failed = 0
        for chat in tg.notify_chat_ids:
            try:
                await bot.send_message(chat, "kugetsu: test message from `kugetsu telegram check`")
                print(f"ok: test message sent to chat {chat}")
            except Forbidden as err:
                failed += 1
                print(f"error: chat {chat}: {redact(err, token)} (send /start to the bot from that chat first)")
            except TelegramError as err:
                failed += 1
                print(f"error: chat {chat}: {redact(err, token)} (is the chat id right?)")
        if failed:
            raise KugetsuError(f"{failed} of {len(tg.notify_chat_ids)} notify chats could not be reached")
        return OK
