"""The `kugetsu` command line (docs/architecture.md): the parser built from the command table,
`main` (one command, its errors as one line with their exit code) and `run` (the program, once
thin.run, the console script and `python -m kugetsu`, found `delegate` is not for the service). Each command is a thin shell around the app layer.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import kugetsu

kugetsu._import_msgspec_lean()  # skipped by kugetsu's import for `delegate` (frontends/cli/thin.py); here at the latest
from kugetsu.errors import OK, KugetsuError  # noqa: E402
from kugetsu.frontends.cli.output import _drop_output, _fix, _flush_output, _kept, _say, _undo_dashdash  # noqa: E402
from kugetsu.frontends.cli.parser import _cancel_args, _clean_args, _config_args, _dashboard_args, _delegate_args, _edit_args, _group_args, _hold_args, _json_only, _kill_args, _logs_args, _mcp_args, _no_args, _Parser, _pause_args, _priority_args, _queue_args, _release_args, _remove_args, _retry_args, _schedule_args, _serve_args, _stats_args, _status_args, _store_args, _task_json_args, _telegram_args, _wait_args, _worktrees_args  # noqa: E402
from kugetsu.paths import Home, default_home  # noqa: E402


def _command(module: str, name: str) -> Callable[[Home, argparse.Namespace], int]:
    """A command's function, its module imported when the command runs: `kugetsu queue` loads
    the views and what they use, not every other command's app modules (the CLI's import time)."""

    def call(home: Home, args: argparse.Namespace) -> int:
        from importlib import import_module

        return getattr(import_module(f"kugetsu.frontends.cli.{module}"), name)(home, args)  # type: ignore[no-any-return]

    call.__name__ = name
    return call



def build_parser(only: str | None = None, cls: type[_Parser] = _Parser) -> argparse.ArgumentParser:
    """The whole parser, or (with `only`) just the top level and that one command. `cls`: one
    that prints nothing (thin.py: the service parses a handed-over command line)."""
    from kugetsu import __version__

    p = cls(prog="kugetsu", description="Capacity manager for parallel AI coding agents.")
    p.add_argument("--version", action="version", version=f"kugetsu {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=cls)
    for name, (help_text, add_args, _) in COMMANDS.items():
        if only is None or name == only:
            add_args(sub.add_parser(name, help=help_text, description=help_text))
    return p


def parse(argv: list[str], cls: type[_Parser] = _Parser) -> argparse.Namespace:
    """The command line as the commands read it: the agent's command after `--` apart."""
    command: list[str] = []
    if argv and argv[0] in ("delegate", "schedule", "edit") and "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None, cls).parse_args(argv)
    args.argv_command = command
    return args


def failure(home: Home, err: KugetsuError | OSError) -> tuple[str, int]:
    """A command's failure as the CLI says it: the line for stderr (before escaping) and the
    exit code. An OSError is the last resort: what and where, never a traceback."""
    if isinstance(err, KugetsuError):
        return f"kugetsu: {err}{_fix(err)}", err.code
    from kugetsu.paths import explain

    error = explain(home, err)
    return f"kugetsu: {error}", error.code


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
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
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _drop_output()
        return OK
    except (KugetsuError, OSError) as err:
        line, code = failure(home, err)
        _say(line, file=sys.stderr)
        return code
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


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[Home, argparse.Namespace], int]]] = {
    "delegate": ("admit a task: start it in a free slot or queue it", _delegate_args, _command("tasks", "cmd_delegate")),
    "queue": ("running and queued tasks", _queue_args, _command("views", "cmd_queue")),
    "status": ("one task in full", _status_args, _command("tasks", "cmd_status")),
    "cancel": ("cancel queued or running tasks", _cancel_args, _command("tasks", "cmd_cancel")),
    "logs": ("a task's output", _logs_args, _command("views", "cmd_logs")),
    "wait": ("block until tasks are final (exit 0: all succeeded)", _wait_args, _command("views", "cmd_wait")),
    "priority": ("change a queued task's priority", _priority_args, _command("tasks", "cmd_priority")),
    "edit": ("change a queued task: prompt, priority, expiry, timeout, group, name, directory, preset, command",
             _edit_args, _command("tasks", "cmd_edit")),
    "capacity": ("slots and queue: what a PM agent checks before delegating", _json_only, _command("views", "cmd_capacity")),
    "pause": ("start no queued task (of --group G) until resume; running ones go on (with TASK: stop that task's"
              " processes)", _pause_args, _command("tasks", "cmd_pause")),
    "resume": ("undo pause: queued tasks start again (with TASK: that task's processes go on)", _pause_args, _command("tasks", "cmd_resume")),
    "next": ("start this queued task before every other (limits still apply)", _task_json_args, _command("tasks", "cmd_next")),
    "stash": ("set a queued task aside: it neither starts nor expires until unstash", _task_json_args, _command("tasks", "cmd_stash")),
    "unstash": ("put a stashed task back in its place in the queue", _task_json_args, _command("tasks", "cmd_unstash")),
    "group": ("the pools of config `groups`: add NAME [--max N], remove NAME, list", _group_args, _command("tasks", "cmd_group")),
    "kill": ("send a signal to every process of a running task (-s SIGNAL, default SIGTERM)", _kill_args, _command("tasks", "cmd_kill")),
    "config": ("read and tune config.json", _config_args, _command("admin", "cmd_config")),
    "serve": ("run the service (foreground unless --detach)", _serve_args, _command("serving", "cmd_serve")),
    "shutdown": ("stop the service (agents keep running)", _no_args, _command("serving", "cmd_shutdown")),
    "clean": ("drop finished tasks (and their logs) from the index", _clean_args, _command("tasks", "cmd_clean")),
    "remove": ("drop these finished tasks (and their logs) from the index", _remove_args, _command("tasks", "cmd_remove")),
    "worktrees": ("kugetsu's git worktrees: list, prune", _worktrees_args, _command("admin", "cmd_worktrees")),
    "dashboard": ("the live Textual dashboard: queue, output, events, actions (--web: in a browser)", _dashboard_args,
                  _command("admin", "cmd_dashboard")),
    "stats": ("how it has been doing: outcomes, wait and run times, throughput, utilisation", _stats_args, _command("admin", "cmd_stats")),
    "doctor": ("what is wrong with this installation, each with its fix (exit 1: problems found)", _json_only,
               _command("admin", "cmd_doctor")),
    "demo": ("see kugetsu work on a throw-away home, with a simulated agent", _no_args, _command("admin", "cmd_demo")),
    "telegram": ("the Telegram bot: check its set-up (docs/telegram.md)", _telegram_args, _command("admin", "cmd_telegram")),
    "mcp": ("serve the commands as MCP tools for agents (stdio, or --http)", _mcp_args, _command("admin", "cmd_mcp")),
    "hosts": ("cluster mode: the machines, their slots, running tasks, last heartbeat", _json_only, _command("admin", "cmd_hosts")),
    "store": ("cluster mode: move a file home into PostgreSQL (migrate URL), or back out (export DIR)", _store_args,
              _command("admin", "cmd_store")),
    "hold": ("hold an agent preset: its queued tasks wait (until a time, or release)", _hold_args, _command("tasks", "cmd_hold")),
    "release": ("release a held agent preset: its tasks may start at once", _release_args, _command("tasks", "cmd_release")),
    "retry": ("admit a finished task again, as a new task linked to it (retry_of)", _retry_args, _command("tasks", "cmd_retry")),
    "schedule": ("recurring work: add (cron or every), list, pause, resume, remove, run now", _schedule_args,
                 _command("admin", "cmd_schedule")),
}
