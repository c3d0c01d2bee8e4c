"""Agents' structured output (README, "Agents"): one reader per output kind.

A preset's `output` names the kind its agent prints. `read` turns the end of a run's log into
a Report (session, limit, usage, denials, error); `render` turns one structured line into the
text a person reads (`kugetsu logs`). Pure functions of text and a clock; each kind's module is
imported only when a preset of that kind is read.
"""

from __future__ import annotations

import importlib
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kugetsu.agents.report import Report

KINDS = ("text", "claude", "codex", "opencode")


def _module(kind: str):  # type: ignore[no-untyped-def]
    if kind not in KINDS or kind == "text":
        return None
    return importlib.import_module(f"kugetsu.agents.{kind}")


def read(kind: str, tail: str, now: datetime) -> Report | None:
    """What the end of a log of this kind says; None for plain text (the patterns read it)."""
    module = _module(kind)
    return module.read(tail, now) if module is not None else None


def render(kind: str, line: str) -> str | None:
    """One line of a log of this kind as a person reads it; None: nothing to show. Plain text
    (and a line that is not the kind's structure) shows as it is."""
    module = _module(kind)
    return module.render(line) if module is not None else line
