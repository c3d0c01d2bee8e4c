"""The `kugetsu` command line (docs/architecture.md §5). Each command is a thin shell around ops."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from kugetsu.app import config_change, control, delegation, machines, reading, recurring, transaction, verbs, worktrees

from kugetsu.core import admission, selection

from kugetsu.service import runner
from kugetsu.config.keys import get_value, parse_value
from kugetsu.config.load import cluster_host, load_config
from kugetsu.config.model import Config
from kugetsu.config.units import format_duration, parse_duration, parse_size
from kugetsu.errors import FAILURE, OK, TIMED_OUT, KugetsuError, UsageError
from kugetsu.core.models import PRIORITIES, Index, Task, TaskState
from kugetsu.paths import Home, default_home, nofollow, read_tail
from kugetsu.frontends.render import printable, to_json


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _size(text: str) -> int:
    try:
        return parse_size(text, "--memory")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _at_least_one(text: str) -> int:
    """A whole number of 1 or more (--slots, --max-procs)."""
    n = _positive_int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {text!r}")
    return n


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()):  # "²".isdigit() is true, and int() refuses it
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(text)


# Each command's arguments. Only the parser of the command being run is built: argparse
# looks up a translation catalog on disk for every help string, and building all of them
# cost 42 ms of a call that agents make all day.


def _delegate_args(d: argparse.ArgumentParser) -> None:
    d.usage = "kugetsu delegate [NAME] [options] [-- CMD ARGS...]"
    d.add_argument("name", nargs="?", help="task name (default task-<id>)")
    _request_args(d)
    d.add_argument("--json", action="store_true", help="print the task object (with --wait: once it is final)")
    d.add_argument("--wait", action="store_true",
                   help="once admitted, block until the task is final; exit codes of `kugetsu wait`")
    _start_args(d)


def _request_args(d: argparse.ArgumentParser) -> None:
    """What a task is to run and how: delegate's, and each firing's of a schedule."""
    g = d.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="the prompt for the agent preset")
    g.add_argument("--prompt-file", metavar="F", help="read the prompt from a file (- for stdin)")
    d.add_argument("--agent", metavar="PRESET[,FALLBACK...]",
                   help="agent preset (config `agents`); several, in order: while one is held, start on the next")
    d.add_argument("--fallback-fresh", action="store_true", default=None,
                   help="a run interrupted with a session may start afresh on a fallback (default: it waits to resume)")
    d.add_argument("--budget-usd", metavar="USD", type=float, help="stop the task once its runs cost more")
    d.add_argument("--max-tokens", metavar="N", type=_positive_int, help="stop the task once its runs used more tokens")
    d.add_argument("--cwd", metavar="DIR", help="working directory (default: here)")
    d.add_argument("--source", metavar="WHO", default="cli", help="who delegates (pm, telegram:<chat>, ...)")
    d.add_argument("--priority", choices=PRIORITIES, default="normal")
    d.add_argument("--group", metavar="NAME", help="run in this pool (config `groups`): it needs a slot there too")
    d.add_argument("--expire-after", metavar="DUR", type=_duration, help="expire if still queued after DUR")
    d.add_argument("--timeout", metavar="DUR", type=_duration, help="stop the agent after running DUR")
    d.add_argument("--after", metavar="TASK[,TASK...]", action="append", default=[],
                   help="start only once these tasks have succeeded; if one ends otherwise, this one is cancelled")
    wt = d.add_mutually_exclusive_group()
    wt.add_argument("--worktree", action="store_true", default=None,
                    help="run the agent in its own git worktree on branch kugetsu/NAME")
    wt.add_argument("--no-worktree", dest="worktree", action="store_false",
                    help="not in a worktree, whatever the preset or config say")
    d.add_argument("--base", metavar="REF", help="the worktree's starting point (default: HEAD now)")
    d.add_argument("--host", metavar="NAME", help="cluster mode: run it on this machine only (`kugetsu hosts`)")
    d.add_argument("--retries", metavar="N", type=_positive_int, default=0,
                   help="run it again, as the same task, up to N times when it fails or is lost")
    d.add_argument("--retry-delay", metavar="DUR", type=_duration, help="wait DUR before each retry")
    d.add_argument("--memory", metavar="SIZE", type=_size,
                   help="memory it may use (4G, 512M): it starts when that fits max_memory; over it, it is stopped")
    d.add_argument("--max-procs", metavar="N", type=_at_least_one, help="its processes at most (a fork storm is stopped)")
    d.add_argument("--slots", metavar="N", type=_at_least_one, help="slots of max_agents (and of its group) it takes")
    d.add_argument("--env", metavar="K=V", action="append", default=[],
                   help="set this variable in the agent's environment (repeatable); K alone passes this shell's"
                        " value of K (a secret stays off the command line)")


def _start_args(p: argparse.ArgumentParser) -> None:
    when = p.add_mutually_exclusive_group()
    when.add_argument("--at", metavar="TIME", help="start no earlier than TIME (02:00, 3pm, ISO 8601; the next one"
                      " to come); until then it waits in the queue, keeping its place")
    when.add_argument("--delay", metavar="DUR", type=_duration, help="start no earlier than DUR from now (30m, 2h)")


def _hold_args(h: argparse.ArgumentParser) -> None:
    h.add_argument("agent", metavar="AGENT", help="the agent preset whose queued tasks wait")
    h.add_argument("--until", metavar="T", help="until a time (15:00, 3pm, ISO 8601) or for a duration (30m);"
                   " default: until `kugetsu release AGENT`")
    h.add_argument("--json", action="store_true", help="print the preset's hold after it")


def _release_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("agent", metavar="AGENT", help="the agent preset to release")
    r.add_argument("--json", action="store_true", help="print the preset's hold after it")


def _retry_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("task", metavar="TASK", help="a finished task (id or name): admitted again as a new task")
    r.add_argument("--json", action="store_true", help="print the new task object")


def _queue_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--all", action="store_true", help="also recent finished tasks")
    _filter_args(q)
    q.add_argument("--json", action="store_true")


def _filter_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--group", metavar="NAME", help="only the tasks of this pool (config `groups`)")
    q.add_argument("--state", metavar="S[,S...]", action="append",
                   help="only tasks in these states (queued, running, succeeded, failed, cancelled, expired, lost,"
                        " or finished for any final one)")
    q.add_argument("--source", metavar="WHO", help="only the tasks this source delegated")


def _status_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("task", metavar="TASK")
    s.add_argument("--json", action="store_true")


def _cancel_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("tasks", metavar="TASK", nargs="*")
    c.add_argument("--all", action="store_true", help="every queued and running task")
    c.add_argument("--json", action="store_true")


def _logs_args(lg: argparse.ArgumentParser) -> None:
    lg.add_argument("tasks", metavar="TASK", nargs="+", help="several: each line prefixed with its task's name")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing until the tasks end")
    lg.add_argument("--lines", "-n", type=_positive_int, metavar="N", help="only the last N lines")
    lg.add_argument("--raw", action="store_true",
                    help="the bytes exactly as the agent wrote them (by default a structured output is shown as"
                         " text, and on a terminal control characters are shown escaped, not obeyed)")
    lg.add_argument("--json", action="store_true",
                    help="a list of {id, name, state, text, size, truncated}: the end of each log (8 MiB at most)")


def _wait_args(w: argparse.ArgumentParser) -> None:
    w.add_argument("tasks", metavar="TASK", nargs="*")
    w.add_argument("--all", action="store_true", help="every task queued or running now")
    w.add_argument("--group", metavar="NAME", help="every task of this pool queued or running now")
    w.add_argument("--timeout", metavar="DUR", type=_duration)
    w.add_argument("--json", action="store_true", help="print the tasks once final (a list)")



def _priority_args(pr: argparse.ArgumentParser) -> None:
    pr.add_argument("task", metavar="TASK")
    pr.add_argument("level", choices=PRIORITIES)
    pr.add_argument("--json", action="store_true")


def _edit_args(e: argparse.ArgumentParser) -> None:
    e.epilog = "A new command goes after --: kugetsu edit TASK -- CMD ARGS... (checked as delegate checks it)."
    e.add_argument("task", metavar="TASK")
    g = e.add_mutually_exclusive_group()
    g.add_argument("--prompt", help="a new prompt (a task of an agent preset)")
    g.add_argument("--prompt-file", metavar="F", help="the new prompt from a file (- for stdin)")
    e.add_argument("--priority", choices=PRIORITIES)
    e.add_argument("--expire-after", metavar="DUR", type=_duration, help="expire if still queued DUR from now")
    e.add_argument("--timeout", metavar="DUR", type=_duration, help="stop the agent after running DUR")
    g.add_argument("--prompt-editor", action="store_true",
                   help="edit the prompt in $VISUAL or $EDITOR (default vi); an unchanged file changes nothing")
    e.add_argument("--group", metavar="NAME", help="run in this pool (config `groups`)")
    _start_args(e)
    e.add_argument("--name", metavar="NAME", help="a new name (unique among queued and running tasks)")
    e.add_argument("--cwd", metavar="DIR", help="a new working directory")
    e.add_argument("--agent", metavar="PRESET", help="another agent preset, run with the task's prompt")
    e.add_argument("--json", action="store_true", help="print the task object")


def _pause_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", metavar="TASK", nargs="?",
                   help="a running task: stop (SIGSTOP) / continue (SIGCONT) its processes; without it, the queue")
    p.add_argument("--group", metavar="NAME", help="only this pool's tasks (config `groups`)")
    p.add_argument("--json", action="store_true", help="print the capacity after it (with TASK: the task)")


def _task_json_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", metavar="TASK", help="a queued task (id or name)")
    p.add_argument("--json", action="store_true", help="print the task object")


def _group_args(gr: argparse.ArgumentParser) -> None:
    gsub = gr.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_Parser)
    add = gsub.add_parser("add", help="a new pool (config `groups`): tasks delegated with --group NAME need a slot in it")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--max", metavar="N", type=_positive_int, default=1, help="its slots (default 1)")
    rm = gsub.add_parser("remove", help="drop a pool (refused while a queued or running task is in it)")
    rm.add_argument("name", metavar="NAME")
    ls = gsub.add_parser("list", help="the pools: slots, running, queued, paused")
    ls.add_argument("--json", action="store_true")


def _kill_args(k: argparse.ArgumentParser) -> None:
    k.add_argument("-s", "--signal", metavar="SIGNAL", default="SIGTERM",
                   help="a signal name (TERM, SIGUSR1, INT) or number; default SIGTERM")
    k.add_argument("task", metavar="TASK", help="a running task: every process it runs gets the signal")
    k.add_argument("--json", action="store_true", help="print the task object")


def _json_only(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")


def _config_args(cf: argparse.ArgumentParser) -> None:
    csub = cf.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = csub.add_parser("show", help="the effective config (secrets masked)")
    show.add_argument("--json", action="store_true")
    csub.add_parser("get", help="one value").add_argument("key")
    cs = csub.add_parser("set", help="validate, write, apply at once",
                         description="Validate, write and apply at once. VALUE - reads the value from standard input"
                         " (one line), so a secret never appears on a command line, where any local user can read"
                         " it: printf '%s' \"$TOKEN\" | kugetsu config set telegram.token -")
    cs.add_argument("key")
    cs.add_argument("value", help="JSON (5, true, null, [1,2]) or a plain string; - reads it from standard input"
                    " (one line; on a terminal it is not echoed)")
    csub.add_parser("unset", help="back to the default").add_argument("key")
    csub.add_parser("path", help="where config.json is")
    csub.add_parser("check", help="validate config.json and index.json")


def _serve_args(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--detach", action="store_true")


def _clean_args(cl: argparse.ArgumentParser) -> None:
    cl.add_argument("--older-than", metavar="DUR", type=_duration)
    cl.add_argument("--state", metavar="S[,S...]", action="append",
                    help="only finished tasks in these states (succeeded, failed, cancelled, expired, lost)")
    cl.add_argument("--json", action="store_true", help="print the tasks removed")


def _remove_args(rm: argparse.ArgumentParser) -> None:
    rm.add_argument("tasks", metavar="TASK", nargs="+", help="finished tasks (ids or names)")
    rm.add_argument("--json", action="store_true", help="print the tasks removed")


def _worktrees_args(wts: argparse.ArgumentParser) -> None:
    wts.add_argument("--json", action="store_true")
    wsub = wts.add_subparsers(dest="action", metavar="ACTION")
    wp = wsub.add_parser("prune", help="remove the worktrees of finished tasks")
    wp.add_argument("--older-than", metavar="DUR", type=_duration, help="only tasks finished more than DUR ago")
    wp.add_argument("--force", action="store_true", help="also uncommitted changes and unmerged branches")
    wp.add_argument("--json", action="store_true")


def _schedule_args(sc: argparse.ArgumentParser) -> None:
    ssub = sc.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_Parser)
    add = ssub.add_parser("add", help="a schedule: each firing delegates a task NAME-YYYYmmdd-HHMMSS")
    add.add_argument("name", metavar="NAME", help="the schedule's name: its tasks are NAME-YYYYmmdd-HHMMSS")
    _request_args(add)
    add.add_argument("--json", action="store_true", help="print the schedule as `schedule list --json` does")
    add.usage = 'kugetsu schedule add NAME (--cron "0 2 * * 1-5" | --every 6h) [--tz ZONE] [delegate\'s options] [-- CMD...]'
    when = add.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", metavar="LINE", help="a crontab line: minute hour day month weekday (0,7 = Sunday),"
                      " or 6 fields with seconds first")
    when.add_argument("--every", metavar="DUR", type=_duration, help="every DUR (30m, 6h), counted from now")
    add.add_argument("--tz", metavar="ZONE", help="--cron in this IANA zone (Europe/Paris); default: this machine's, kept with it")
    add.add_argument("--overlap", action="store_true", help="fire even while its last task is still queued or running")
    ls = ssub.add_parser("list", help="every schedule, its next firing, its last task and how it ended")
    ls.add_argument("--json", action="store_true")
    for action, what in (("pause", "stop firing until resume"), ("resume", "fire again"),
                         ("remove", "delete it (its tasks stay)"), ("run", "fire it now, once")):
        one = ssub.add_parser(action, help=what)
        one.add_argument("name", metavar="NAME")
        one.add_argument("--json", action="store_true")


def _telegram_args(tg: argparse.ArgumentParser) -> None:
    tgsub = tg.add_subparsers(dest="action", metavar="ACTION", required=True)
    tgsub.add_parser("check", help="validate the token (getMe) and send a test message to each notify chat")


def _stats_args(st: argparse.ArgumentParser) -> None:
    st.add_argument("--since", metavar="DUR", type=_duration, help="the window: the last DUR (default 24h)")
    # The names of stats.BY, spelled out: the stats module is imported only when it runs.
    st.add_argument("--by", choices=("source", "agent", "group", "host", "day"),
                    help="one row per source, agent, group, host or (local) day")
    st.add_argument("--json", action="store_true")


def _dashboard_args(db: argparse.ArgumentParser) -> None:
    db.add_argument("--web", action="store_true", help="serve it to a browser (textual-serve: the `web` extra)")
    db.add_argument("--bind", metavar="ADDR", help="with --web: HOST:PORT to listen on (default 127.0.0.1:8000)")
    db.add_argument("--allow-remote", action="store_true", help="with --web: allow a non-loopback --bind")


def _mcp_args(m: argparse.ArgumentParser) -> None:
    m.description = ("Serve kugetsu's commands as MCP tools for an agent (a PM agent that delegates):"
                     " over stdio for the client that starts it, or over streamable HTTP. See docs/mcp.md.")
    m.add_argument("--http", metavar="HOST:PORT", help="serve streamable HTTP at http://HOST:PORT/mcp instead of"
                   " stdio; every request needs the bearer token mcp.token (config set mcp.token -)")
    m.add_argument("--allow-remote", action="store_true",
                   help="allow --http on an address that is not loopback (anyone reaching it has only the token"
                   " between them and running commands as you)")


def _no_args(p: argparse.ArgumentParser) -> None:
    pass


def _store_args(sp: argparse.ArgumentParser) -> None:
    ssub = sp.add_subparsers(dest="action", metavar="ACTION", required=True)
    mg = ssub.add_parser("migrate", help="move this home's queue, history, events and config into the database"
                         " and switch this machine to it")
    mg.add_argument("url", metavar="URL", help="postgresql://[user@]host[:port]/database")
    ex = ssub.add_parser("export", help="write the cluster's queue, history, events and config into a new file home")
    ex.add_argument("dir", metavar="DIR", help="a new directory: the file home to create")


class _Parser(argparse.ArgumentParser):
    """argparse's errors worded like kugetsu's others: one line saying what was wrong and
    where the options are, exit 2 (not a usage dump and `error: argument ...`). Options are
    never abbreviated: `--pri` meaning `--priority` today would mean something else the day
    an option `--private` is added (scripts and agents must not break on a new option)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        import re

        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        if message.endswith("expected one argument"):
            message = message.replace("expected one argument", "needs a value after it (a value starting with '-'"
                                      " must be written --option=VALUE)")
        choice = re.search(r"invalid choice: '(.*)' \(choose from (.*)\)$", message)
        if choice:  # a typo (`kugetsu delgate`): the one it was meant to be, not the whole list
            close = _close(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
            if close:
                message = f"{message[:choice.start()]}invalid choice: '{choice.group(1)}' (did you mean '{close}'?)"
        if message.startswith("unrecognized arguments:"):
            message += self._unrecognized_hint(message.split(":", 1)[1].split())
        self.exit(2, f"kugetsu: {message}; `{self.prog} --help` lists the options\n")

    def _unrecognized_hint(self, words: list[str]) -> str:
        """A mistyped option (`queue --al`): the option meant. Words that are no option (an
        unquoted prompt's): how to pass them."""
        option = next((w.split("=", 1)[0] for w in words if w.startswith("-")), None)
        if option is None:
            return " (a value with spaces needs quotes; a command to run goes after --)"
        close = _close(option, self._options_of_command())
        return f" (did you mean {close}?)" if close else ""

    def _options_of_command(self) -> list[str]:
        """The option strings of the command being parsed (and of its own subcommands)."""
        parsers: list[argparse.ArgumentParser] = [self]
        words = sys.argv[1:]
        for parser in parsers:
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    parsers += [p for name, p in action.choices.items() if name in words]
        return [o for p in parsers for a in p._actions for o in a.option_strings]

    def _get_formatter(self) -> argparse.HelpFormatter:
        # argparse makes one at every add_argument, and its own asks shutil for the terminal's
        # width (importing shutil costs 2 ms of every command): the same width, from os.
        return self.formatter_class(prog=self.prog, width=_columns() - 2)  # type: ignore[call-arg]


def _close(word: str, known: list[str]) -> str | None:
    import difflib

    found = difflib.get_close_matches(word, known, n=1, cutoff=0.75)  # `bogus` is no `logs`
    return found[0] if found else None


def _columns() -> int:
    """shutil.get_terminal_size().columns: $COLUMNS, else the terminal's, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (with `only`) just the top level and that one command."""
    from kugetsu import __version__

    p = _Parser(prog="kugetsu", description="Capacity manager for parallel AI coding agents.")
    p.add_argument("--version", action="version", version=f"kugetsu {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name, (help_text, add_args, _) in COMMANDS.items():
        if only is None or name == only:
            add_args(sub.add_parser(name, help=help_text, description=help_text))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if argv and argv[0] in ("delegate", "schedule", "edit") and "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    args.argv_command = command
    home = default_home()
    _kept.clear()  # main called again in one process: the last call's are done with
    collecting = gc.isenabled()
    if args.command in _BRIEF:
        # It reads the index, maybe writes it, and exits: the cyclic garbage collector would
        # only walk the decoded index over and over (40 ms of 200 with 10,000 tasks), and
        # what it could free goes back to the system at exit anyway.
        gc.disable()
    try:
        _undo_dashdash(args)
        code = COMMANDS[args.command][2](home, args)
        _flush_output()  # here, so that a failed write of the output is said like any error
        return code
    except KugetsuError as err:
        _say(f"kugetsu: {err}{_fix(err)}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _drop_output()
        return OK
    except OSError as err:  # the last resort: one line that says what and where, never a traceback
        from kugetsu.paths import explain

        error = explain(home, err)
        _say(f"kugetsu: {error}", file=sys.stderr)
        return error.code
    finally:
        if collecting:
            gc.enable()


_BRIEF = frozenset(("delegate", "queue", "status", "capacity"))  # the hot path of a PM agent: see main and run


def run() -> NoReturn:
    """The `kugetsu` program (console script and `python -m kugetsu`): main, and for the
    brief commands an exit without the interpreter's teardown. Everything they write is
    closed or flushed by then, they start no thread and register nothing at exit; tearing
    down the modules and freeing what they decoded is work for nothing (7 ms of a bare
    `python -c pass`, more with an index loaded), and the kernel frees it all at once."""
    code = main()  # its output is flushed (or dropped, when it could not be written)
    if sys.argv[1:2] and sys.argv[1] in _BRIEF:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # dropped already: nothing left to say
            pass
        os._exit(code)
    sys.exit(code)


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


# ---- commands -----------------------------------------------------------------------------


def cmd_delegate(home: Home, args: argparse.Namespace) -> int:
    cfg = load_config(home)
    req = _request(args)
    unused = admission.unused_prompt_text(cfg, req, "the command after --")
    if unused:
        print(f"kugetsu: warning: {unused}", file=sys.stderr)
    adm = delegation.delegate(home, cfg, req)
    _priority_ignored(cfg.strategy, args.priority)
    if not args.json:
        from kugetsu.frontends import render

        _say(render.admitted(adm.task, adm.position, adm.queued, adm.max_agents, adm.waiting_for), flush=True)
    if args.wait:  # the task just admitted, by id: never an older task of the same name
        code = _wait_for(home, [adm.task.id], None)
        if args.json:
            from kugetsu.store.files import open_store

            final = next(t for t in open_store(home).read().all_tasks() if t.id == adm.task.id)
            print(to_json(reading.task_json(final, None, prompts=reading.prompts(home, [final]))))
        return code
    if args.json:
        print(to_json(reading.task_json(adm.task, adm.position, prompts=reading.prompts(home, [adm.task]))))
    return OK


def _request(args: argparse.Namespace) -> admission.Request:
    """delegate's options as a request (delegate, schedule add)."""
    prompt = _read_prompt(args)
    return admission.Request(
        cwd=os.path.abspath(args.cwd or os.getcwd()),
        name=args.name,
        command=args.argv_command or None,
        prompt=prompt,
        agent=args.agent,
        source=args.source,
        priority=args.priority,
        group=args.group,
        expire_after=args.expire_after,
        timeout=args.timeout,
        worktree=args.worktree,
        base=args.base,
        pinned_host=args.host,
        after=_after_refs(args.after),
        retries=args.retries,
        retry_delay=args.retry_delay,
        start_at=delegation.start_time(getattr(args, "at", None), getattr(args, "delay", None)),
        fallback_fresh=args.fallback_fresh,
        budget_usd=args.budget_usd,
        max_tokens=args.max_tokens,
        memory=args.memory,
        max_procs=args.max_procs,
        slots=args.slots,
        env=_env_pairs(args.env),
    )


def _env_pairs(values: list[str]) -> dict[str, str]:
    """--env K=V --env K2: the variables, in order (K alone: this shell's value of K)."""
    env: dict[str, str] = {}
    for value in values:
        if not isinstance(value, str) or not value:
            raise UsageError("--env: give NAME=VALUE, or NAME to pass this shell's value")
        name, eq, text = value.partition("=")
        if not eq:
            if name not in os.environ:
                raise UsageError(f"--env {name}: not set in this shell; give --env {name}=VALUE")
            text = os.environ[name]
        env[name] = text
    return env


def _read_prompt(args: argparse.Namespace) -> str | None:
    """--prompt TEXT, or the text of --prompt-file F (- for stdin), or None."""
    if not args.prompt_file:
        return args.prompt  # type: ignore[no-any-return]
    try:  # bytes, decoded as they are: no newline translation, the prompt arrives verbatim
        if args.prompt_file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.prompt_file, "rb") as f:
                data = f.read()
        text = data.decode("utf-8")
    except OSError as err:
        raise UsageError(f"cannot read --prompt-file: {err}") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"--prompt-file {args.prompt_file}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if admission.empty_prompt(text):  # admission refuses it too; here the file is what to fix
        where = "standard input" if args.prompt_file == "-" else f"the file {args.prompt_file}"
        raise UsageError(f"--prompt-file: {where} is empty{' (only white space)' if text else ''}: write the"
                         " task's instructions in it")
    return text


def cmd_edit(home: Home, args: argparse.Namespace) -> int:
    prompt = _edit_prompt(home, args.task) if args.prompt_editor else _read_prompt(args)
    change = admission.Edit(prompt=prompt, priority=args.priority, expire_after=args.expire_after,
                     timeout=args.timeout, group=args.group, name=args.name, cwd=args.cwd, agent=args.agent,
                     command=args.argv_command or None, start_at=delegation.start_time(args.at, args.delay))
    if change.empty():
        if args.prompt_editor:
            _say("unchanged: the prompt was saved as it was", file=sys.stderr)
            return OK
        raise UsageError("nothing to change: give --prompt, --prompt-file, --prompt-editor, --priority,"
                         " --expire-after, --timeout, --group, --name, --cwd, --agent, --at, --delay or a command"
                         " after --")
    task, position, changed = verbs.edit(home, args.task, change)
    if args.priority:
        _priority_ignored(load_config(home).strategy, args.priority)
    if args.json:
        print(to_json(reading.task_json(task, position, prompts=reading.prompts(home, [task]))))
        return OK
    where = f"position {position}" if position is not None else "started"
    _say(f"{'edited' if changed else 'unchanged'} {task.name} (#{task.id}), {where}")
    return OK


def _edit_prompt(home: Home, ref: str) -> str | None:
    """`edit --prompt-editor`: the queued task's prompt in $VISUAL or $EDITOR (vi), in a private
    temp file; the text saved, or None when it was saved unchanged. The edit itself is checked
    again in its transaction (the task may have started meanwhile)."""
    import shlex
    import subprocess
    import tempfile

    _, index = reading.read(home)
    task = selection.find(index, ref)
    if task.state is not TaskState.QUEUED:
        raise UsageError(f"task {task.name} (#{task.id}) is {task.state.value}; only a queued task can be edited",
                         code=FAILURE)
    before = reading.prompts(home, [task]).get(task.id, task.prompt) or ""  # kept beside the index
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    fd, name = tempfile.mkstemp(prefix=f"kugetsu-{task.name}-", suffix=".md")  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(before.encode())
        try:
            code = subprocess.call([*shlex.split(editor), name])
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot run the editor {editor!r} ($VISUAL, $EDITOR): {err}") from None
        if code != 0:
            raise UsageError(f"the editor {editor!r} exited with status {code}: nothing was changed")
        with open(name, "rb") as f:
            data = f.read()
    finally:
        os.unlink(name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"the edited prompt is not UTF-8 text ({err.reason} at byte {err.start}): nothing was"
                         " changed") from None
    return None if text == before else text


def _after_refs(values: list[str]) -> list[str]:
    """--after A,B --after C: the task refs, in order."""
    refs = [ref.strip() for value in values if isinstance(value, str) for ref in value.split(",")]
    if any(not isinstance(v, str) for v in values) or any(not ref for ref in refs):
        raise UsageError("--after: give task ids or names separated by commas, e.g. --after issue-16,#12")
    return refs


# What a brief command decoded or built, kept to its end: cli.run exits without freeing it
# object by object (14 ms for a 10,000-task queue); the kernel takes the memory back at once.
_kept: list[object] = []


def _read(home: Home) -> tuple[Config, Index]:
    cfg, index = reading.read(home)
    _kept.append(index)
    return cfg, index


def cmd_queue(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends import render

    cfg, index = _read(home)
    control.ensure_service(home, cfg, index)
    keep = _task_filter(args.group, args.state, args.source)
    view = reading.listing(cfg, index, finished=args.all, home=home, keep=None if keep == selection.TaskFilter() else keep)
    if args.json:
        _kept.append(shown := reading.queue_json(view, home))
        _print_json(shown)
    else:
        _say(render.queue_text(view, control.service_pid(home) is not None))
    return OK


def _say(text: object = "", **kw: Any) -> None:
    """print() for a person: names, prompts, paths and reasons in it are anyone's text (an
    agent's, a chat's), so what a terminal would obey in it (an OSC that retitles the window, a
    screen clear, a CR, a bidi override) is shown escaped (render.printable). --json output
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
    an invalid byte reads `\\x9b`) and shown escaped (render.printable)."""

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


def cmd_status(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends import render

    cfg, index = _read(home)
    control.ensure_service(home, cfg, index)
    task = selection.find(index, args.task)
    obj = reading.status_json(home, index, cfg, task)
    if args.json:
        print(to_json(obj))
    else:
        _say(render.task_lines(obj))
    return OK


def cmd_cancel(home: Home, args: argparse.Namespace) -> int:
    if not args.tasks and not args.all:
        raise UsageError("name the tasks to cancel (id or name), or use --all")
    from kugetsu.app import waiting

    # The final states: running tasks once their processes are gone (SIGKILL after kill_grace).
    out = waiting.cancel(home, args.tasks, everything=args.all, reason="cancelled by cli")
    if args.json:
        print(to_json(reading.tasks_json(out, prompts=reading.prompts(home, out))))
    else:
        from kugetsu.frontends import render

        _say(render.cancelled(out))
    return OK


def _log_output(args: argparse.Namespace) -> _Output:
    """`logs` writes the bytes as the agent wrote them to a pipe or a file (what a script or
    `> file` wants) and with --raw; to a terminal, escaped (_Output's `shown`)."""
    return _Output(shown=not args.raw and sys.stdout.isatty())


def cmd_logs(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.store import logtail
    from kugetsu.store.files import open_store

    store = open_store(home)
    if args.json:  # one object a task, in a list: the end of each log (at most 8 MiB of it) as text
        if args.follow:
            raise UsageError("logs: --json prints the logs as they are now; it cannot --follow")
        cfg, index = load_config(home), store.read()
        tasks = [selection.find(index, ref) for ref in args.tasks]
        print(to_json([machines.log_json(home, cfg, t, args.lines, logtail.WINDOW, args.raw) for t in tasks]))
        return OK
    if len(args.tasks) > 1:
        return _logs_of_several(home, args)
    task = selection.find(store.read(), args.tasks[0])
    cfg = load_config(home)
    path = machines.log_path(home, cfg, task)
    kind = "text" if args.raw else machines.output_kind(cfg, task)
    base = _log_output(args)
    out: Any = base if kind == "text" else _Rendered(base, kind)
    try:
        f = open(path, "rb", opener=nofollow)
    except FileNotFoundError:
        f = None
    # A queued task's wrapper waits with its log already made: empty reads as "nothing yet".
    if not args.follow and (f is None or os.fstat(f.fileno()).st_size == 0):
        if f is not None:
            f.close()
        _say(f"(no output yet: {task.name} is {task.state.value})", file=sys.stderr)
        return OK
    follower = None
    if f is not None and args.lines is not None:  # a bounded window from the end, long lines cut
        end = logtail.tail(path, args.lines)
        out.write(end.data)
        follower = logtail.Follower(f, end.size)
    elif f is not None:  # all of it, as asked: streamed, never held
        follower = logtail.Follower(f, 0)
        while chunk := follower.read():
            out.write(chunk)
    out.flush()
    if args.follow and task.state is TaskState.QUEUED:  # nothing to show until it starts: say why
        cfg, index = reading.read(home)
        position = selection.positions(index, cfg, transaction.now()).get(task.id)
        _say(f"(waiting: {task.name} is queued" + (f", position {position})" if position else ")"), file=sys.stderr)
    while args.follow:
        task = selection.find(store.read(), str(task.id))
        path = machines.log_path(home, cfg, task)  # in a cluster: what the task's machine shipped since
        if follower is None and path.exists():
            follower = logtail.Follower(open(path, "rb", opener=nofollow), 0)
        if follower is not None:
            chunk = follower.read()
            _say_missed(follower, task.name)
            if chunk:
                out.write(chunk)
                out.flush()
                continue
        if task.state.final:
            break
        from kugetsu.app import waiting

        waiting.wait_change(home, [task], 1.0, here=cluster_host(cfg))
    if isinstance(out, _Rendered):
        out.write(b"", last=True)
        out.flush()
    return OK


def _say_missed(follower: Any, name: str) -> None:
    """Output the service dropped (log_max_size) before a follower read it: said on stderr."""
    if follower.missed:
        print(f"(kugetsu: {follower.missed} bytes of {name}'s output were dropped by log_max_size before they"
              " were shown)", file=sys.stderr)
        follower.missed = 0


def _logs_of_several(home: Home, args: argparse.Namespace) -> int:
    """`logs A B ...`: each task's output, every line prefixed `NAME | `; with --follow,
    lines as they come, whole lines only (a task's last partial line once it has ended)."""
    from kugetsu.app import waiting
    from kugetsu.store import logtail
    from kugetsu.store.files import open_store

    store = open_store(home)
    index = store.read()
    tasks = list({t.id: t for t in (selection.find(index, ref) for ref in args.tasks)}.values())
    names = [t.name for t in tasks]
    prefix = {t.id: (f"{t.name}#{t.id}" if names.count(t.name) > 1 else t.name).encode() + b" | " for t in tasks}
    out = _log_output(args)
    followers: dict[int, Any] = {}
    partial = {t.id: b"" for t in tasks}

    def emit(task_id: int, data: bytes, last: bool) -> None:
        lines = (partial[task_id] + data).split(b"\n")
        tail = lines.pop()  # after the last newline: a line still being written
        if len(tail) > logtail.LINE_MAX:  # a line that never ends is shown cut, not held
            lines.append(logtail.cut_lines(tail))
            tail = b""
        if last and tail:
            lines.append(tail)
        partial[task_id] = b"" if last else tail
        if kinds[task_id] != "text":  # whole lines only, so each rendered on its own
            shown = agents.Renderer(kinds[task_id]).feed(b"\n".join(lines).decode(errors="replace"), last=True)
            lines = [line.encode() for line in shown.splitlines()]
        out.write(b"".join(prefix[task_id] + line + b"\n" for line in lines))

    def read_all(task_id: int, last: bool) -> bool:
        wrote = False
        while data := followers[task_id].read() if task_id in followers else b"":
            emit(task_id, data, last=False)
            wrote = True
        if last:
            emit(task_id, b"", last=True)
        return wrote

    cfg = load_config(home)
    kinds = {t.id: "text" if args.raw else machines.output_kind(cfg, t) for t in tasks}
    from kugetsu import agents

    try:
        for t in tasks:
            path = machines.log_path(home, cfg, t)
            try:
                f = open(path, "rb", opener=nofollow)
            except FileNotFoundError:
                f = None
            size = os.fstat(f.fileno()).st_size if f is not None else 0
            if not size and not args.follow:
                _say(f"(no output yet: {t.name} is {t.state.value})", file=sys.stderr)
            if f is not None and args.lines is not None:
                end = logtail.tail(path, args.lines)
                followers[t.id] = logtail.Follower(f, end.size)
                emit(t.id, end.data, last=not args.follow or t.state.final)
            elif f is not None:
                followers[t.id] = logtail.Follower(f, 0)
                read_all(t.id, last=not args.follow or t.state.final)
        out.flush()
        live = [t for t in tasks if not t.state.final] if args.follow else []
        queued = [t for t in live if t.state is TaskState.QUEUED]
        if queued:  # nothing to show of them until they start: say why
            positions = selection.positions(index, cfg, transaction.now())
            _say("(waiting: " + ", ".join(f"{t.name} is queued, position {positions.get(t.id, '-')}" for t in queued)
                 + ")", file=sys.stderr)
        while live:
            now_index = {t.id: t for t in store.read().all_tasks()}
            wrote = False
            for t in list(live):
                state = now_index.get(t.id, t)
                path = machines.log_path(home, cfg, state)  # in a cluster: what its machine shipped since
                if t.id not in followers and path.exists():
                    followers[t.id] = logtail.Follower(open(path, "rb", opener=nofollow), 0)
                data = followers[t.id].read() if t.id in followers else b""
                if t.id in followers:
                    _say_missed(followers[t.id], t.name)
                if data or state.state.final:
                    emit(t.id, data, last=state.state.final and not data)
                    wrote = wrote or bool(data)
                if state.state.final and not data:
                    live.remove(t)
            out.flush()
            if live and not wrote:
                waiting.wait_change(home, [now_index.get(t.id, t) for t in live], 1.0,
                                    here=cluster_host(cfg))
    finally:
        for follower in followers.values():
            follower.f.close()
    return OK


def cmd_wait(home: Home, args: argparse.Namespace) -> int:
    if bool(args.tasks) + args.all + (args.group is not None) != 1:
        raise UsageError("wait: give TASK..., --all or --group NAME (one of them)")
    cfg, index = reading.read(home)
    control.ensure_service(home, cfg, index)
    if not args.tasks:  # the live tasks now: one that is admitted later is not waited for
        tasks = [t for t in index.live() if args.all or t.group == args.group]
        if not tasks:
            _say("kugetsu: nothing to wait for: no task" + (f" of group {args.group}" if args.group else "")
                 + " is queued or running", file=sys.stderr)
        return _wait_for(home, [t.id for t in tasks], args.timeout, args.json)
    # A name only one task ever bore is that task, finished or not (`delegate x; wait x`): no
    # note; a name several finished tasks bore is refused by find_to_wait (which one?).
    tasks = [selection.find_to_wait(index, ref) for ref in args.tasks]
    return _wait_for(home, [t.id for t in tasks], args.timeout, args.json)


def _wait_for(home: Home, ids: list[int], timeout: float | None, as_json: bool = False) -> int:
    """Block until the tasks are final: 0 all succeeded, 1 otherwise (each failure on
    stderr), 124 on timeout. `wait` and `delegate --wait`."""
    from kugetsu.app import waiting
    from kugetsu.store.files import open_store

    done = waiting.wait_final(home, ids, timeout, settle=True)
    if not done:
        _say(f"kugetsu: timed out after {format_duration(timeout or 0)}", file=sys.stderr)
        return TIMED_OUT
    tasks = {t.id: t for t in open_store(home).read().all_tasks()}
    if as_json:  # only once every task is final: a timeout prints nothing on stdout
        print(to_json(reading.tasks_json([tasks[i] for i in ids])))
    bad = [tasks[i] for i in ids if tasks[i].state is not TaskState.SUCCEEDED]
    for t in bad:
        _say(f"{t.name} (#{t.id}) {t.state.value}" + (f": {t.reason}" if t.reason else ""), file=sys.stderr)
    return FAILURE if bad else OK


def _priority_ignored(cfg_strategy: str, level: str) -> None:
    """Under `fifo` a priority changes nothing: say so rather than let it look obeyed."""
    if cfg_strategy == "fifo" and level != "normal":
        _say("kugetsu: note: priority is ignored under strategy fifo (`kugetsu config set strategy priority`"
             " makes it count)", file=sys.stderr)


def cmd_priority(home: Home, args: argparse.Namespace) -> int:
    task, position = verbs.set_priority(home, args.task, args.level)
    _priority_ignored(load_config(home).strategy, args.level)
    if args.json:
        print(to_json(reading.task_json(task, position, prompts=reading.prompts(home, [task]))))
    else:
        from kugetsu.frontends import render

        _say(render.priority_changed(task, position))
    return OK


def cmd_pause(home: Home, args: argparse.Namespace) -> int:
    return _pause(home, args, True)


def cmd_resume(home: Home, args: argparse.Namespace) -> int:
    return _pause(home, args, False)


def _pause(home: Home, args: argparse.Namespace, on: bool) -> int:
    if args.task is not None:  # one running task's processes; without TASK, the queue (as before)
        if args.group is not None:
            raise UsageError(f"{'pause' if on else 'resume'}: give TASK or --group NAME, not both")
        task, changed = verbs.pause_task(home, args.task, on)
        if args.json:
            print(to_json(reading.task_json(task, None)))
        elif on:
            _say(f"{task.name} (#{task.id}) {'paused' if changed else 'was already paused'}: its processes are"
                 f" stopped and keep slot {task.slot}; `kugetsu resume {task.name}` lets them go on")
        else:
            _say(f"{task.name} (#{task.id}) {'resumed' if changed else 'was not paused'}")
        return OK
    changed, cap = verbs.pause(home, args.group, on)
    if args.json:
        print(to_json(cap))
        return OK
    what = f"group {args.group}" if args.group else "kugetsu"
    if on:
        _say(f"{what} {'paused' if changed else 'was already paused'}: no queued task"
             f"{' of group ' + args.group if args.group else ''} starts, running ones go on;"
             f" `kugetsu resume{' --group ' + args.group if args.group else ''}` lets them start again")
    else:
        _say(f"{what} {'resumed' if changed else 'was not paused'}: {cap.active}/{cap.max_agents} running,"
             f" {cap.queued} queued")
        if cap.paused or cap.paused_groups:
            from kugetsu.frontends import render

            _say(f"still{render.paused_note(cap).replace(' · ', ' ', 1)}")
    return OK


def cmd_next(home: Home, args: argparse.Namespace) -> int:
    return _moved(home, args, lambda index, task, now: admission.move_next(index, task, now), "moved to the front")


def cmd_stash(home: Home, args: argparse.Namespace) -> int:
    return _moved(home, args, lambda index, task, now: admission.stash(task, now, True), "stashed")


def cmd_unstash(home: Home, args: argparse.Namespace) -> int:
    return _moved(home, args, lambda index, task, now: admission.stash(task, now, False), "unstashed")


def _moved(home: Home, args: argparse.Namespace, change: Callable[..., Any], verb: str) -> int:
    task, position, changed = verbs.queued_change(home, args.task, change)
    if args.json:
        print(to_json(reading.task_json(task, position)))
        return OK
    where = (f"position {position}" if position is not None else "started" if task.state is TaskState.RUNNING
             else f"set aside (`kugetsu unstash {task.name}`)" if task.stashed_at else "no position")
    _say(f"{task.name} (#{task.id}) {verb if changed else 'unchanged'}, {where}")
    return OK


def cmd_group(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends import render

    if args.action == "add":
        verbs.group_add(home, args.name, args.max)
        _say(f"group {args.name} added: {args.max} slot{'s' if args.max != 1 else ''}; `kugetsu delegate --group"
             f" {args.name} ...` runs in it")
        return OK
    if args.action == "remove":
        verbs.group_remove(home, args.name)
        _say(f"group {args.name} removed")
        return OK
    cfg, index = _read(home)
    rows = verbs.groups_json(cfg, index)
    if args.json:
        print(to_json(rows))
    elif not rows:
        _say("no groups: `kugetsu group add NAME --max N` makes one")
    else:
        _say(render.table(["GROUP", "SLOTS", "RUNNING", "QUEUED", "PAUSED"],
                          [[r["name"], str(r["max_agents"]), str(r["active"]), str(r["queued"]),
                            "yes" if r["paused"] else "-"] for r in rows], right={1, 2, 3}))
    return OK


def cmd_kill(home: Home, args: argparse.Namespace) -> int:
    import signal

    text = args.signal.strip().upper()
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise UsageError(f"kill -s {args.signal!r}: no such signal; e.g. TERM, INT, HUP, USR1, KILL or a number") from None
    task, sent = verbs.signal_task(home, args.task, sig)
    if args.json:
        print(to_json(reading.task_json(task, None)))
    else:
        _say(f"sent {sig.name} to {task.name} (#{task.id})" + ("" if sent else ": no process of it was left"))
    return OK


def cmd_capacity(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends import render

    cfg, index = _read(home)
    control.ensure_service(home, cfg, index)
    cap = selection.capacity(index, cfg, transaction.now())
    if args.json:
        print(to_json(reading.capacity_json(cfg, index)))
    else:
        _say(render.summary(cap))
    return OK


def cmd_config(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.config import keys as C
    from kugetsu.config.model import KEY_HELP

    if args.action == "path":
        print(home.config)  # for scripts: $(kugetsu config path)
        return OK
    if args.action == "check":
        cfg = load_config(home)
        from kugetsu.store.files import open_store

        index = open_store(home).read()
        _say(f"ok: {home.config} ({'defaults' if not home.config.exists() else 'valid'}),"
             f" {home.index} ({_count(len(index.all_tasks()), 'task')})")
        return OK
    if args.action in ("set", "unset"):
        value = None if args.action == "unset" else parse_value(_stdin_value(args.key) if args.value == "-" else args.value)
        cfg = config_change.set_config(home, args.key, value, remove=args.action == "unset")
        if not C.has_value(cfg, args.key):  # an entry removed (agents.x): no default to show
            print(f"{args.key} removed")
        else:
            print(f"{args.key} = {to_json(C.mask_secrets(get_value(cfg, args.key), args.key))}")
        if C.applies_at_start(args.key) and (cfg.store is not None or control.service_holds_lock(home)):
            which = "each machine's service reads" if cfg.store else "the running service read"
            _say(f"kugetsu: note: {which} {args.key} when it starts: restart {'each' if cfg.store else 'it'} to apply"
                 " (`kugetsu shutdown && kugetsu serve --detach`)", file=sys.stderr)
        return OK
    cfg = load_config(home)
    if args.action == "get":
        value = C.mask_secrets(get_value(cfg, args.key), args.key)
        print(value if isinstance(value, str) else to_json(value))
        return OK
    shown = C.masked(cfg)
    if args.json:
        print(to_json(shown))
        return OK
    from kugetsu.frontends import render

    _say(render.config_lines(shown, KEY_HELP))
    return OK


def _stdin_value(key: str) -> str:
    """`config set KEY -`: the value from standard input, one line, its newline stripped.
    A secret given this way is on no command line (any local user can read argv in /proc)."""
    example = f"printf '%s' \"$VALUE\" | kugetsu config set {key} -"
    try:
        if sys.stdin is None:
            raise UsageError(f"config set {key} -: there is no standard input to read the value from; {example}")
        if sys.stdin.isatty():  # pasted: not echoed, so it stays off the screen too
            line, rest = _read_unechoed(f"value for {key} (not echoed, then Enter): "), ""
        else:
            line = sys.stdin.readline()
            rest = sys.stdin.read()
    except UnicodeDecodeError as err:
        raise UsageError(f"config set {key} -: standard input is not UTF-8 text ({err.reason})") from None
    value = line.removesuffix("\n").removesuffix("\r")
    if rest.strip():
        raise UsageError(f"config set {key} -: expected one line on standard input, got more; nothing was changed")
    if not value:
        raise UsageError(f"config set {key} -: standard input was empty; give the value there, e.g. {example}")
    return value


def _read_unechoed(prompt: str) -> str:
    """One line from the terminal on stdin, echo off (getpass would want a controlling tty)."""
    import termios

    fd = sys.stdin.fileno()
    before = termios.tcgetattr(fd)
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~termios.ECHO
    print(prompt, end="", file=sys.stderr, flush=True)
    termios.tcsetattr(fd, termios.TCSAFLUSH, quiet)
    try:
        return sys.stdin.readline()
    finally:
        termios.tcsetattr(fd, termios.TCSAFLUSH, before)
        print(file=sys.stderr)


def cmd_serve(home: Home, args: argparse.Namespace) -> int:
    control.check_wakeable(home)  # the service binds its socket there: say so now, not in its log
    if args.detach:
        child = control.start_service(home)
        if child is None:
            pid = control.service_pid(home)
            _say(f"kugetsu service already running{f' (pid {pid})' if pid else ''}")
            return OK
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pid = control.service_pid(home)
            if pid:
                _say(f"kugetsu service started (pid {pid}), log: {home.service_log}")
                return OK
            if runner.process_start(child) is None:  # it exited: say why now, not in 10 s
                raise KugetsuError(f"the service stopped at once; the end of {home.service_log}:\n"
                                   + _last_lines(home.service_log))
            time.sleep(0.05)
        raise KugetsuError(f"the service did not come up within 10s; see {home.service_log}")
    from kugetsu.service.daemon import serve

    return serve(home)


def _last_lines(path: os.PathLike[str], count: int = 4) -> str:
    lines = read_tail(path, 4096).decode(errors="replace").splitlines()[-count:]
    return "\n".join(f"  {line}" for line in lines) or "  (no log)"


def cmd_shutdown(home: Home, args: argparse.Namespace) -> int:
    control.check_wakeable(home)  # else "no service is running" would hide why it cannot be told
    if not control.service_holds_lock(home):
        _say("no kugetsu service is running")
        return OK
    # The lock is held: a service is up, or still coming up (autostarted by the command just
    # before, its socket not bound yet): it is told as soon as it listens, never missed.
    pid, told = None, False
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        pid = control.service_pid(home) or pid
        if not control.service_holds_lock(home):  # not just its pid file gone: wholly stopped
            _say(f"kugetsu service stopped{f' (pid {pid})' if pid else ''}; running agents keep running")
            return OK
        told = told or control.send(home, b"shutdown", warn=False)  # tried again until it listens
        time.sleep(0.02)
    raise KugetsuError(f"the service{f' (pid {pid})' if pid else ''} did not stop within 15s")


def cmd_hosts(home: Home, args: argparse.Namespace) -> int:
    rows = machines.hosts(home)
    if args.json:
        print(to_json(rows))
        return OK
    from kugetsu.frontends import render

    _say(render.hosts_table(rows) if rows else "no machine has joined yet: run `kugetsu serve` on each machine")
    return OK


def cmd_store(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.cluster import migrate

    if args.action == "migrate":
        _say(migrate.migrate(home, args.url))
        return OK
    url = load_config(home).store
    if url is None:
        raise UsageError("store export: this machine is not in a cluster (config `store` is not set)")
    _say(migrate.export(url, Home(args.dir)))
    return OK


def _task_filter(group: str | None = None, states: list[str] | None = None, source: str | None = None) -> selection.TaskFilter:
    try:
        return selection.task_filter(group, states, source)
    except UsageError as err:
        raise UsageError(f"--state: {err}") from None


def cmd_clean(home: Home, args: argparse.Namespace) -> int:
    states = _task_filter(states=args.state).states
    return _removed(verbs.clean(home, args.older_than, states), args.json)


def cmd_remove(home: Home, args: argparse.Namespace) -> int:
    return _removed(verbs.remove(home, args.tasks), args.json, named=True)


def _removed(gone: list[Task], as_json: bool, named: bool = False) -> int:
    """What `clean` and `remove` say (`remove` names the tasks it was given)."""
    if as_json:
        print(to_json(reading.tasks_json(gone)))
    else:
        _say(f"removed {_count(len(gone), 'finished task')} from the index"
             + (f": {', '.join(f'{t.name} (#{t.id})' for t in gone)}" if named else ""))
    return OK


def cmd_worktrees(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends import render
    from kugetsu.service import worktree

    if args.action == "prune":
        done = worktrees.prune_worktrees(home, args.older_than, args.force)
        if args.json:
            print(to_json([{"path": str(p.entry.path), "task": p.entry.task.id if p.entry.task else None,
                            "branch": p.entry.branch, "removed": p.removed, "note": p.note} for p in done]))
            return OK
        for p in done:
            who = f"{p.entry.task.name} (#{p.entry.task.id})" if p.entry.task else f"{p.entry.path.name} (no task)"
            _say(f"{'removed' if p.removed else 'kept'} {who}: {p.note}")
        if not done:
            _say("no worktrees of finished tasks to prune")
        return OK
    index = reading.read(home)[1]
    rows = [_worktree_row(e, worktree.disk_usage(e.path)) for e in worktree.entries(home, index.all_tasks())]
    if args.json:
        print(to_json(rows))
    elif not rows:
        _say(f"no worktrees (they live in {home.root / 'worktrees'})")
    else:
        _say(render.worktrees_table(rows, transaction.now()))
    return OK


def _worktree_row(e: Any, size: int) -> dict[str, Any]:
    from datetime import datetime, timezone

    t = e.task
    created = t.started_at if t and t.started_at else datetime.fromtimestamp(e.path.stat().st_mtime, timezone.utc)
    return {
        "task": t.id if t else None, "name": t.name if t else None, "state": t.state.value if t else None,
        "worktree_state": t.worktree_state if t else None, "branch": e.branch, "path": str(e.path),
        "repo": t.repo if t else e.repo, "size": size, "created_at": created.isoformat(),
    }


def cmd_mcp(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends.mcp import run  # the MCP SDK and pydantic (~0.5 s): only this command pays

    if args.allow_remote and not args.http:
        raise UsageError("--allow-remote goes with --http HOST:PORT")
    return run(home, args.http, args.allow_remote)


def cmd_dashboard(home: Home, args: argparse.Namespace) -> int:
    if args.web:
        from kugetsu.frontends import web

        return web.serve(home, args.bind or web.DEFAULT_BIND, args.allow_remote)
    if args.bind or args.allow_remote:
        raise UsageError("--bind and --allow-remote go with --web")
    from kugetsu.frontends.tui.app import run  # textual costs ~100 ms to import: only this command pays

    return run(home)


def cmd_stats(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.app import stats  # only this command (and the dashboard) reads the history

    cfg, index = reading.read(home)
    control.ensure_service(home, cfg, index)
    window = stats.load(home, cfg, index, args.since or stats.DEFAULT_WINDOW, transaction.now())
    report = stats.summarise(window, args.by)
    if args.json:
        print(to_json(report))
    else:
        _say(stats.render(report))
    return OK


def cmd_doctor(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends import doctor

    checks = doctor.run(home)
    if args.json:
        print(to_json(doctor.report(checks)))
    else:
        _say(doctor.render(checks))
    return OK if all(c.ok for c in checks) else FAILURE


def cmd_demo(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends.demo import run_demo

    return run_demo()


def cmd_schedule(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends import render

    if args.action == "list":
        cfg, index = _read(home)
        rows = recurring.schedules_json(cfg, index)
        print(to_json(rows) if args.json else render.schedules_table(rows, transaction.now()))
        return OK
    if args.action == "add":
        cfg = load_config(home)
        if args.source == "cli":  # not given: its tasks say where they come from
            args.source = f"schedule:{args.name}"
        sched = recurring.schedule_add(home, cfg, args.name, cron=args.cron, every=args.every, tz=args.tz,
                                 req=_request(args), overlap=args.overlap)
        row = next(r for r in recurring.schedules_json(cfg, reading.read(home)[1]) if r["name"] == sched.name)
        print(to_json(row) if args.json else f"added schedule {sched.name}, next firing {render.when(row['next_fire'], transaction.now())}")
        return OK
    if args.action == "run":
        firing = recurring.fire_schedule(home, args.name)
        assert firing is not None  # by hand: always recorded
        if args.json:
            print(to_json({"note": firing.note, "task": reading.task_json(firing.task, firing.admission.position)
                           if firing.task and firing.admission else None}))
        else:
            _say(f"{args.name}: {firing.note}")
        return OK if firing.task is not None else FAILURE
    events = recurring.schedule_change(home, args.name, args.action)
    past = {"pause": "paused", "resume": "resumed", "remove": "removed"}[args.action]
    _say(f"{past} schedule {args.name}" if events else f"schedule {args.name} was already {past}")
    return OK


def cmd_hold(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.core import limits

    until = None
    if args.until is not None:
        until = limits.parse_until(args.until, transaction.now())
        if until is None:
            raise UsageError(f"--until {args.until!r} is neither a time (15:00, 3pm, 2026-11-23T15:00Z) nor a"
                             " duration (30m, 2h)")
    return _held(home, args, verbs.hold(home, args.agent, until))


def cmd_release(home: Home, args: argparse.Namespace) -> int:
    return _held(home, args, verbs.release(home, args.agent))


def _held(home: Home, args: argparse.Namespace, events: list[Any]) -> int:
    """What `hold` and `release` say: the event's words, or (--json) the preset's hold now."""
    if args.json:
        print(to_json(verbs.hold_json(home, args.agent, [e.reason for e in events])))
        return OK
    for event in events:
        _say(event.reason)
    return OK


def cmd_retry(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends import render

    cfg = load_config(home)
    adm = verbs.retry(home, cfg, args.task)
    if args.json:
        print(to_json(reading.task_json(adm.task, adm.position, prompts=reading.prompts(home, [adm.task]))))
    else:
        _say(render.admitted(adm.task, adm.position, adm.queued, adm.max_agents, adm.waiting_for))
    return OK


def cmd_telegram(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends.telegram.check import check  # python-telegram-bot only for this command

    return check(home)


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[Home, argparse.Namespace], int]]] = {
    "delegate": ("admit a task: start it in a free slot or queue it", _delegate_args, cmd_delegate),
    "queue": ("running and queued tasks", _queue_args, cmd_queue),
    "status": ("one task in full", _status_args, cmd_status),
    "cancel": ("cancel queued or running tasks", _cancel_args, cmd_cancel),
    "logs": ("a task's output", _logs_args, cmd_logs),
    "wait": ("block until tasks are final (exit 0: all succeeded)", _wait_args, cmd_wait),
    "priority": ("change a queued task's priority", _priority_args, cmd_priority),
    "edit": ("change a queued task: prompt, priority, expiry, timeout, group, name, directory, preset, command",
             _edit_args, cmd_edit),
    "capacity": ("slots and queue: what a PM agent checks before delegating", _json_only, cmd_capacity),
    "pause": ("start no queued task (of --group G) until resume; running ones go on (with TASK: stop that task's"
              " processes)", _pause_args, cmd_pause),
    "resume": ("undo pause: queued tasks start again (with TASK: that task's processes go on)", _pause_args, cmd_resume),
    "next": ("start this queued task before every other (limits still apply)", _task_json_args, cmd_next),
    "stash": ("set a queued task aside: it neither starts nor expires until unstash", _task_json_args, cmd_stash),
    "unstash": ("put a stashed task back in its place in the queue", _task_json_args, cmd_unstash),
    "group": ("the pools of config `groups`: add NAME [--max N], remove NAME, list", _group_args, cmd_group),
    "kill": ("send a signal to every process of a running task (-s SIGNAL, default SIGTERM)", _kill_args, cmd_kill),
    "config": ("read and tune config.json", _config_args, cmd_config),
    "serve": ("run the service (foreground unless --detach)", _serve_args, cmd_serve),
    "shutdown": ("stop the service (agents keep running)", _no_args, cmd_shutdown),
    "clean": ("drop finished tasks (and their logs) from the index", _clean_args, cmd_clean),
    "remove": ("drop these finished tasks (and their logs) from the index", _remove_args, cmd_remove),
    "worktrees": ("kugetsu's git worktrees: list, prune", _worktrees_args, cmd_worktrees),
    "dashboard": ("the live Textual dashboard: queue, output, events, actions (--web: in a browser)", _dashboard_args,
                  cmd_dashboard),
    "stats": ("how it has been doing: outcomes, wait and run times, throughput, utilisation", _stats_args, cmd_stats),
    "doctor": ("what is wrong with this installation, each with its fix (exit 1: problems found)", _json_only,
               cmd_doctor),
    "demo": ("see kugetsu work on a throw-away home, with a simulated agent", _no_args, cmd_demo),
    "telegram": ("the Telegram bot: check its set-up (docs/telegram.md)", _telegram_args, cmd_telegram),
    "mcp": ("serve the commands as MCP tools for agents (stdio, or --http)", _mcp_args, cmd_mcp),
    "hosts": ("cluster mode: the machines, their slots, running tasks, last heartbeat", _json_only, cmd_hosts),
    "store": ("cluster mode: move a file home into PostgreSQL (migrate URL), or back out (export DIR)", _store_args,
              cmd_store),
    "hold": ("hold an agent preset: its queued tasks wait (until a time, or release)", _hold_args, cmd_hold),
    "release": ("release a held agent preset: its tasks may start at once", _release_args, cmd_release),
    "retry": ("admit a finished task again, as a new task linked to it (retry_of)", _retry_args, cmd_retry),
    "schedule": ("recurring work: add (cron or every), list, pause, resume, remove, run now", _schedule_args,
                 cmd_schedule),
}
