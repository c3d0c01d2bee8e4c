"""What every command shares: reading the queue, writing for a person (escaped) or for a pipe
(JSON, raw bytes), output that cannot be written, and the wording of an error's fix in the
CLI's terms.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kugetsu.errors import KugetsuError, UsageError
from kugetsu.frontends.text import printable, to_json
from kugetsu.paths import Home

# Imported where used: every command loads this module (main.py), and one that reads nothing
# (`serve --detach`: ~25 ms before it starts the service) should not load the reading of the queue.
if TYPE_CHECKING:
    from kugetsu.config.model import Config
    from kugetsu.core import selection
    from kugetsu.core.models import Index


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _fix(err: KugetsuError) -> str:
    """How to fix an error, in the CLI's terms (pm's errors name no flag: each front end words it)."""
    from kugetsu import errors as E

    if isinstance(err, E.EmptyPrompt):
        return "; give --prompt TEXT with the task in it"
    if isinstance(err, E.NeedsPrompt):
        return ": give --prompt TEXT or --prompt-file FILE (or a command after --)"
    if isinstance(err, E.NoSuchTask):
        return "; `kugetsu queue --all` lists the tasks kugetsu knows"
    if isinstance(err, E.UnknownGroup):
        return f"; define it with `kugetsu group add {err.group} --max 1`"
    if isinstance(err, E.QueueFull):
        return " (`kugetsu capacity`)"
    if isinstance(err, E.CommandNotFound) and err.elsewhere:
        return (". Give its full path, set PATH in the preset's env, or restart the service from this shell"
                " (`kugetsu shutdown`; the next command starts it)")
    if isinstance(err, E.CommandNotFound):
        return "; install it, pick another preset with --agent, or give the command after --"
    from kugetsu.config.explain import InvalidConfig

    if isinstance(err, InvalidConfig) and err.setting and err.key == err.setting and (err.suggestion or "").startswith('"'):
        return f"\nOn the command line: kugetsu config set {err.key} '{err.suggestion}'"
    if isinstance(err, E.InvalidHost):
        return " (`kugetsu hosts` lists the machines)"
    if isinstance(err, E.UnknownDependency):
        return "; --after takes ids (#12) or names of tasks kugetsu knows (`kugetsu queue --all`)"
    if isinstance(err, E.AmbiguousName):
        return (f"; wait on an id, e.g. `kugetsu wait #{err.ids[-1]}` (`delegate --json` prints the id of the task"
                " it admitted; `delegate --wait` waits for it)")
    return ""


_STRING_OPTIONS = ("name", "prompt", "prompt_file", "agent", "cwd", "source", "group", "base", "task", "key", "value",
                   "bind", "host", "url", "dir", "cron", "tz", "signal")
_OTHER_OPTIONS = ("expire_after", "timeout", "older_than", "lines", "since", "retry_delay", "until", "at", "delay", "every",
                  "max")
_LIST_OPTIONS = ("state",)  # repeatable (append): each value as above


def _undo_dashdash(args: argparse.Namespace) -> None:
    """argparse (CPython < 3.13) turns an option value of exactly "--" (`--prompt=--`) into
    an empty list, which would reach the index as a list where a string belongs (and make
    index.json unreadable). Give it back as the string it was, or refuse it."""
    for key in _STRING_OPTIONS:
        if getattr(args, key, None) == []:
            setattr(args, key, "--")
    for key in _OTHER_OPTIONS:
        if getattr(args, key, None) == []:
            raise UsageError(f"--{key.replace('_', '-')}: '--' is not a valid value")
    for key in _LIST_OPTIONS:
        if isinstance(values := getattr(args, key, None), list):
            setattr(args, key, ["--" if v == [] else v for v in values])


# What a brief command decoded or built, kept to its end: cli.run exits without freeing it
# object by object (14 ms for a 10,000-task queue); the kernel takes the memory back at once.
_kept: list[object] = []


def _read(home: Home) -> tuple[Config, Index]:
    from kugetsu.app import reading

    cfg, index = reading.read(home)
    _kept.append(index)
    return cfg, index


def _say(text: object = "", **kw: Any) -> None:
    """print() for a person: names, prompts, paths and reasons in it are anyone's text (an
    agent's, a chat's), so what a terminal would obey in it (an OSC that retitles the window, a
    screen clear, a CR, a bidi override) is shown escaped (text.printable). --json output
    never comes here: it stays exact."""
    print(printable(str(text)), **kw)


def _print_json(obj: object) -> None:
    """print(to_json(obj)), without decoding a long queue's JSON to text to encode it again."""
    if getattr(sys.stdout, "buffer", None) is None:
        print(to_json(obj))
        return
    import msgspec

    data = msgspec.json.format(msgspec.json.encode(obj), indent=2)
    _flush_output()
    out = _Output()
    out.write(data)
    out.write(b"\n")  # not appended to the JSON: that would copy it once more
    out.flush()


class _Output:
    """sys.stdout's bytes, for output too long to copy into text (logs, queue --json). A
    write that fails (a full disk under `> file`) is one line on stderr and exit 1, not a
    traceback, nor taken for kugetsu's own disk being full.

    `shown`: the bytes are an agent's output on their way to a terminal, where its escape
    sequences would be obeyed (retitle the window, clear the screen, rewrite what is shown):
    they are decoded as they come (a character split between two reads waits for its end;
    an invalid byte reads `\\x9b`) and shown escaped (text.printable)."""

    def __init__(self, shown: bool = False) -> None:
        self.raw = sys.stdout.buffer
        self._decoder = None
        if shown:
            import codecs

            self._decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")

    def write(self, data: bytes) -> None:
        if self._decoder is not None:
            data = printable(self._decoder.decode(data)).encode()
        _writing(self.raw.write, data)

    def flush(self) -> None:
        _writing(self.raw.flush)


class _Rendered:
    """An agent's structured output (its preset's `output`) as the text a person reads
    (kugetsu.agents.Renderer), written to `out` as it comes."""

    def __init__(self, out: _Output, kind: str) -> None:
        import codecs

        from kugetsu import agents

        self.out, self.lines = out, agents.Renderer(kind)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, data: bytes, last: bool = False) -> None:
        self.out.write(self.lines.feed(self.decoder.decode(data, final=last), last).encode())

    def flush(self) -> None:
        self.out.flush()


def _writing(write: Callable[..., object], *args: bytes) -> None:
    try:
        write(*args)
    except BrokenPipeError:  # its reader went away (`| head`): main ends quietly
        raise
    except OSError as err:
        _drop_output()
        raise KugetsuError(f"could not write the output: {err.strerror or err}") from None


def _flush_output() -> None:
    """Write out what print() buffered, failing as _Output does."""
    _writing(sys.stdout.flush)


def _drop_output() -> None:
    """stdout cannot be written (its reader is gone, its disk is full): what is still buffered
    goes nowhere, instead of failing once more when Python exits."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass

def _task_filter(group: str | None = None, states: list[str] | None = None, source: str | None = None) -> selection.TaskFilter:
    from kugetsu.core import selection

    try:
        return selection.task_filter(group, states, source)
    except UsageError as err:
        raise UsageError(f"--state: {err}") from None
