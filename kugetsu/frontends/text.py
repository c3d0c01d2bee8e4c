"""Text for a person or a pipe, before any of kugetsu's state is read: a command that only
says a line (`serve --detach`, `shutdown`) loads this, not render.py's views of the queue."""

from __future__ import annotations

import re
from typing import Any

import msgspec

# What a terminal obeys instead of showing: C0 controls (ESC starts the sequences that set the
# window title, clear the screen, move the cursor; CR overwrites the line), DEL, C1 controls
# (U+0080-009F: 0x9B is a CSI of its own to some terminals), and the bidi embeddings, overrides
# and isolates (U+202A-202E, U+2066-2069) that make text read in an order other than stored.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_KEEP_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_SHORT = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escaped(m: re.Match[str]) -> str:
    char = m.group()
    return _SHORT.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def printable(text: str, lines: bool = True) -> str:
    """`text` (a name, a prompt, a reason: anyone's words, an agent's or a chat's) safe to show
    on a terminal or in a widget: each character a terminal would obey is shown escaped, as
    Python writes it (ESC as `\\x1b`, CR as `\\r`, U+202E as `\\u202e`). `lines`: newlines and
    tabs stay (a multi-line field); False escapes them too (a table cell, one line). Every human
    output of the CLI, the dashboard and the bot goes through it; `--json` never does (exact)."""
    unsafe = _UNSAFE_KEEP_LINES if lines else _UNSAFE
    return unsafe.sub(_escaped, text)


def to_json(obj: Any) -> str:
    return msgspec.json.format(msgspec.json.encode(obj), indent=2).decode()
