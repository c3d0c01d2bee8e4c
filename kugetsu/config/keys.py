"""Dotted keys (`kugetsu config get/set agents.claude.command`): reading, setting, removing,
which apply only at the service's start, and masking secrets for display.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import msgspec.inspect

from kugetsu.config.explain import _did_you_mean
from kugetsu.config.model import _NESTED, Config, GroupConfig
from kugetsu.errors import UsageError, redact_url


# ---- dotted keys -----------------------------------------------------------------------


def parse_value(text: str) -> object:
    """A command-line value: JSON when it parses (5, true, null, [1,2]), else the plain string."""
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def _check_key(key: str) -> list[str]:
    parts = key.split(".")
    if not all(parts):
        raise UsageError(f"bad key {key!r}: use names separated by dots, e.g. telegram.allowed_chat_ids")
    top = parts[0]
    if top not in Config.__struct_fields__:
        raise UsageError(f"unknown config key {key!r}{_did_you_mean(key)}")
    nested = _NESTED.get(top)
    if nested is not None and len(parts) > 1 and parts[1] not in nested.__struct_fields__:
        raise UsageError(f"unknown config key {key!r}{_did_you_mean(key)}")
    if top == "groups" and len(parts) > 2 and parts[2] not in GroupConfig.__struct_fields__:
        raise UsageError(f"unknown config key {key!r}; a group has: {', '.join(GroupConfig.__struct_fields__)}")
    return parts


def get_value(cfg: Config, key: str) -> object:
    node: object = msgspec.to_builtins(cfg)
    parts = _check_key(key)
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            import difflib

            close = difflib.get_close_matches(part, list(node), n=1) if isinstance(node, dict) else []
            meant = ".".join(parts[:i] + close[:1])
            raise UsageError(f"config key {key!r} is not set" + (f" (did you mean {meant!r}?)" if close else ""))
        node = node[part]
    return node


# What the service reads once, when it starts (the listeners it opens): a change applies at its
# next start; every other key applies at once.
AT_START = ("metrics", "telegram.token", "telegram.api_base_url")


def applies_at_start(key: str) -> bool:
    return key == "telegram" or any(key == k or key.startswith(k + ".") for k in AT_START)


def has_value(cfg: Config, key: str) -> bool:
    """Does the effective config hold `key` (set, or a default)? `config unset agents.x`
    leaves none."""
    try:
        get_value(cfg, key)
    except UsageError:
        return False
    return True


def with_value(raw: dict[str, Any], key: str, value: object, *, remove: bool = False) -> dict[str, Any]:
    """A copy of the raw config with `key` set to `value` (or removed, back to its default)."""
    import json

    parts = _check_key(key)
    new = json.loads(json.dumps(raw))
    node = new
    for part in parts[:-1]:
        child = node.get(part)
        if child is None and not remove:
            child = node[part] = {}
        if not isinstance(child, dict):
            if remove:
                return new
            raise UsageError(f"cannot set {key!r}: {part!r} is not an object")
        node = child
    if remove:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value
    return new


# A key holding a secret: the bot token, and what people name their secrets in a preset's
# `env` (GITHUB_TOKEN, OPENAI_API_KEY, ...), which the config shows and events record too.
_SECRET_KEY = re.compile(r"(token|secret|password|passwd|api_?key)$", re.IGNORECASE)
MASK = "***"


def mask_secrets(value: Any, key: str = "") -> Any:
    """`value` (the value of config key `key`, dotted or not) as it may be shown or written to
    events: every secret in it, at any depth, replaced by "***": the values of secret keys,
    and the password of a URL under any key (the store's, a preset's DATABASE_URL)."""
    if _SECRET_KEY.search(key) and value not in (None, "", [], {}):
        return MASK
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: mask_secrets(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    return value


def masked(cfg: Config) -> dict[str, Any]:
    """The effective config for display: no secret shown."""
    return mask_secrets(msgspec.to_builtins(cfg))
