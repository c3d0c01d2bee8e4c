"""The command line's arguments: each command's options (one function per command), their value
types (durations, sizes, counts), and the parser's own error wording.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from kugetsu.config.units import parse_duration, parse_size
from kugetsu.core.models import PRIORITIES


def _duration(text: str, zero: bool = False) -> float:
    try:
        return parse_duration(text, zero=zero)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _delay(text: str) -> float:
    """`--delay DUR`, 0 included: `edit --delay 0` ends a task's wait for its start time."""
    return _duration(text, zero=True)


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
    when.add_argument("--delay", metavar="DUR", type=_delay,
                      help="start no earlier than DUR from now (30m, 2h; 0: at once)")


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
    q.add_argument("--limit", metavar="N", type=_at_least_one,
                   help="only the first N queued tasks (that match), in start order; the rest are counted")
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
