"""The Telegram bot and notifications (issue 3).

This package's own top level stays free of python-telegram-bot: the service and the CLI
import it to find out whether a token is configured, and that must cost nothing. The
heavy import happens in bot.py, notify.py and check.py, only when a token is there.
"""

from __future__ import annotations

import logging
import os

from kugetsu.config.model import Config

TOKEN_ENV = "KUGETSU_TELEGRAM_TOKEN"


def resolve_token(cfg: Config) -> str | None:
    """The bot token: the environment wins over config.json, so a secret store can supply it."""
    return os.environ.get(TOKEN_ENV) or cfg.telegram.token or None


def redact(text: object, token: str | None) -> str:
    """`text` with the token masked: error messages of the library and of httpx may carry it."""
    out = str(text)
    if token:
        out = out.replace(token, "***")
        secret = token.partition(":")[2]  # the part after the bot id is what matters
        if len(secret) >= 8:
            out = out.replace(secret, "***")
    return out


class RedactToken(logging.Filter):
    """Masks the token in every record a handler emits, whatever logger made it."""

    def __init__(self, token: str):
        super().__init__()
        self.token = token

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message, self.token)
        if record.exc_info and record.exc_info[1] is not None:
            # A traceback quotes the exception's text, which may hold the token (InvalidToken's
            # does). Formatters use a ready exc_text as it is.
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info), self.token)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def guard_logs(token: str) -> None:
    """Keep the token out of the service log: httpx logs each request URL (token inside) at
    INFO, and python-telegram-bot's InvalidToken quotes the token."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    root = logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, RedactToken) for f in handler.filters):
            handler.addFilter(RedactToken(token))
