"""The commands that show the queue and wait on it: queue, capacity, logs (one task or several,
--follow), wait.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

from kugetsu.app import control, machines, reading, transaction
from kugetsu.config.load import cluster_host, load_config
from kugetsu.config.units import format_duration
from kugetsu.core import selection
from kugetsu.config.model import Config
from kugetsu.core.models import Index, QueueCounts, TaskState
from kugetsu.errors import FAILURE, OK, TIMED_OUT, UsageError
from kugetsu.frontends.cli.output import _kept, _Output, _print_json, _read, _Rendered, _say, _task_filter
from kugetsu.frontends.text import to_json
from kugetsu.paths import Home, nofollow


def cmd_queue(home: Home, args: argparse.Namespace) -> int:
    cfg, index = _read(home)
    control.ensure_service(home, cfg, index)
    return show_queue(home, cfg, index, args, control.service_pid(home) is not None)


def show_queue(home: Home, cfg: Config, index: Index, args: argparse.Namespace, served: bool,
               out: TextIO | None = None) -> int:
    """What `queue` prints, to `out` (default stdout): here, or in the service for a CLI that
    handed its command line over (frontends/cli/thin.py), from the index it keeps. `served`:
    a service runs (the text says so)."""
    from kugetsu.frontends import render

    keep = _task_filter(args.group, args.state, args.source)
    view = reading.listing(cfg, index, finished=args.all, home=home, keep=None if keep == selection.TaskFilter() else keep,
                           limit=args.limit)
    if args.json:
        shown = reading.queue_json(view, home)
        if out is None:
            _kept.append(shown)  # this process exits next: not freed object by object
            _print_json(shown)
        else:
            print(to_json(shown), file=out)
    else:
        _say(render.queue_text(view, served), file=out)
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


def cmd_capacity(home: Home, args: argparse.Namespace) -> int:
    cfg, index, counts = reading.read_head(home)  # the queued tasks counted, not decoded
    control.ensure_service(home, cfg, index, counts.queued)
    return show_capacity(cfg, index, counts, args.json)


def show_capacity(cfg: Config, index: Index, counts: QueueCounts | None, as_json: bool, out: TextIO | None = None) -> int:
    """What `capacity` prints, to `out` (default stdout): here, or in the service for a CLI
    that handed its command line over (frontends/cli/thin.py), from the index it keeps.
    `counts`: the queued tasks' numbers when `index.queued` was not decoded (read_head); None:
    counted from index.queued (selection.capacity)."""
    from kugetsu.frontends import render

    if as_json:
        print(to_json(reading.capacity_json(cfg, index, counts)), file=out)
    else:
        _say(render.summary(selection.capacity(index, cfg, transaction.now(), counts)), file=out)
    return OK
