"""The commands about the installation and its service: config, serve, shutdown, hosts, store,
worktrees, mcp, dashboard, stats, doctor, demo, schedule, telegram.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kugetsu.app import config_change, control, machines, reading, recurring, transaction, worktrees
from kugetsu.config.keys import get_value, parse_value
from kugetsu.config.load import load_config
from kugetsu.errors import FAILURE, OK, UsageError
from kugetsu.frontends.cli.output import _count, _read, _say
from kugetsu.frontends.cli.tasks import _request
from kugetsu.frontends.text import to_json
from kugetsu.paths import Home


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
        if C.applies_at_start(args.key) and (cfg.clustered or control.service_holds_lock(home)):
            which = "each machine's service reads" if cfg.clustered else "the running service read"
            _say(f"kugetsu: note: {which} {args.key} when it starts: restart {'each' if cfg.clustered else 'it'} to apply"
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


def cmd_telegram(home: Home, args: argparse.Namespace) -> int:
    from kugetsu.frontends.telegram.check import check  # python-telegram-bot only for this command

    return check(home)
