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
    from kugetsu.agents.report import Report, Usage

KINDS = ("text", "claude", "codex", "opencode")

# How much of the end of a structured log is read at an agent's exit: its last lines are long
# (Claude Code's `result` carries the final message, usage per model, denials with their
# inputs), and a cut line cannot be read. Plain text: limits.TAIL_BYTES.
TAIL_BYTES = 128 * 1024

# The versions of the real CLIs the test suite runs (tests/agent_clis.json pins the same):
# their wording, flags and structured output are known to be read right. `kugetsu doctor`
# reports each installed one's version and warns about a newer one.
VERIFIED = {"claude": "2.1.331", "codex": "0.169.0", "opencode": "1.18.33"}


def version_tuple(text: str) -> tuple[int, ...] | None:
    """The first dotted version in a CLI's `--version` output (`2.1.331 (Claude Code)`,
    `codex-cli 0.169.0`), as numbers for comparing."""
    import re

    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def _module(kind: str):  # type: ignore[no-untyped-def]
    if kind not in KINDS or kind == "text":
        return None
    return importlib.import_module(f"kugetsu.agents.{kind}")


def read(kind: str, tail: str, now: datetime) -> Report | None:
    """What the end of a log of this kind says; None for plain text (the patterns read it)."""
    module = _module(kind)
    return module.read(tail, now) if module is not None else None


def progress(kind: str, tail: str) -> Usage | None:
    """What the running run of a log of this kind has used so far, where the kind's stream
    says it mid-run (Claude Code: each turn's usage); None where it says so only at the end."""
    module = _module(kind)
    reader = getattr(module, "progress", None)
    return reader(tail) if reader is not None else None


def render(kind: str, line: str) -> str | None:
    """One line of a log of this kind as a person reads it; None: nothing to show. Plain text
    (and a line that is not the kind's structure) shows as it is."""
    module = _module(kind)
    return module.render(line) if module is not None else line


class Renderer:
    """A log of this kind as the text a person reads, fed as it grows: each whole line
    rendered (a line still being written waits for its end). Plain text passes as it is."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.partial = ""

    def feed(self, text: str, last: bool = False) -> str:
        """The readable text of what `text` adds; `last`: the log is complete (a final line
        without its newline is shown too)."""
        if self.kind == "text" or self.kind not in KINDS:
            return text
        lines = (self.partial + text).split("\n")
        self.partial = "" if last else lines.pop()
        shown = (render(self.kind, line) for line in lines if line.strip())
        return "".join(t + "\n" for t in shown if t is not None)


def render_tail(kind: str, text: str, cut: bool) -> str:
    """The readable text of the end of a log (`cut`: it starts mid-file, so its first line
    is a fragment and is left out)."""
    if kind == "text" or kind not in KINDS:
        return text
    if cut:
        text = text[text.find("\n") + 1:] if "\n" in text else ""
    return Renderer(kind).feed(text, last=True)
