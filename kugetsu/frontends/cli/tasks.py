"""The commands that change tasks: delegate, edit, status, cancel, priority, pause/resume, next,
stash/unstash, group, kill, clean/remove, hold/release, retry.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple, TextIO

from kugetsu.app import control, delegation, reading, transaction, verbs
from kugetsu.config.load import load_config
from kugetsu.core import admission, selection
from kugetsu.core.models import Task, TaskState
from kugetsu.errors import FAILURE, OK, UsageError
from kugetsu.frontends.cli.output import _count, _read, _say, _task_filter
from kugetsu.frontends.cli.views import _wait_for
from kugetsu.frontends.text import to_json
from kugetsu.paths import Home


# ---- commands -----------------------------------------------------------------------------


class Via(NamedTuple):
    """What `delegate` reads from and writes to its process: here, this process's; in the
    service, the CLI's that handed the request over (frontends/cli/thin.py), whose cwd and
    environment came with it and whose output goes back to it. `caller`: the service's own
    transaction and wake-up (None: this process's)."""

    out: TextIO
    err: TextIO
    cwd: str
    environ: Mapping[str, str]
    caller: delegation.Caller | None = None
    prompt: bytes | None = None  # --prompt-file's bytes, read by the CLI (None: read them here)


def cmd_delegate(home: Home, args: argparse.Namespace, via: Via | None = None) -> int:
    via = via or Via(sys.stdout, sys.stderr, "", os.environ)
    cfg = load_config(home)
    req = _request(args, via.cwd, via.environ, via.prompt)
    unused = admission.unused_prompt_text(cfg, req, "the command after --")
    if unused:
        print(f"kugetsu: warning: {unused}", file=via.err)
    adm = delegation.delegate(home, cfg, req, via.caller)
    _priority_ignored(cfg.strategy, args.priority, via.err)
    if not args.json:
        _say_admitted(adm, via.out)
    if args.wait:  # the task just admitted, by id: never an older task of the same name
        code = _wait_for(home, [adm.task.id], None)
        if args.json:
            from kugetsu.store.files import open_store

            final = next(t for t in open_store(home).read().all_tasks() if t.id == adm.task.id)
            print(to_json(reading.task_json(final, None, prompts=reading.prompts(home, [final]))))
        return code
    if args.json:
        print(to_json(reading.task_json(adm.task, adm.position, prompts=reading.prompts(home, [adm.task]))), file=via.out)
    return OK


def _say_admitted(adm: delegation.Admission, out: TextIO) -> None:
    from kugetsu.frontends import render

    _say(render.admitted(adm.task, adm.position, adm.queued, adm.max_agents, adm.waiting_for), file=out, flush=True)


def delegate_found(home: Home, args: argparse.Namespace, token: str) -> int | None:
    """What `delegate` prints of the task the service admitted with `token` and ended before it
    said so (frontends/cli/thin.py); None: it did not admit it, and the command runs here."""
    adm = delegation.admitted(home, token)
    if adm is None:
        return None
    if args.json:
        print(to_json(reading.task_json(adm.task, adm.position, prompts=reading.prompts(home, [adm.task]))))
    else:
        _say_admitted(adm, sys.stdout)
    return OK


def _request(args: argparse.Namespace, cwd: str = "", environ: Mapping[str, str] = os.environ,
             prompt_data: bytes | None = None) -> admission.Request:
    """delegate's options as a request (delegate, schedule add). `cwd`: the caller's working
    directory, relative paths are taken from ("": this process's); `prompt_data`: _read_prompt's."""
    prompt = _read_prompt(args, prompt_data)
    return admission.Request(
        cwd=os.path.normpath(os.path.join(cwd or os.getcwd(), args.cwd or "")),  # os.path.abspath, from `cwd`
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
        env=_env_pairs(args.env, environ),
    )


def _env_pairs(values: list[str], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """--env K=V --env K2: the variables, in order (K alone: this shell's value of K)."""
    env: dict[str, str] = {}
    for value in values:
        if not isinstance(value, str) or not value:
            raise UsageError("--env: give NAME=VALUE, or NAME to pass this shell's value")
        name, eq, text = value.partition("=")
        if not eq:
            if name not in environ:
                raise UsageError(f"--env {name}: not set in this shell; give --env {name}=VALUE")
            text = environ[name]
        env[name] = text
    return env


def _read_prompt(args: argparse.Namespace, data: bytes | None = None) -> str | None:
    """--prompt TEXT, or the text of --prompt-file F (- for stdin), or None. `data`: F's bytes,
    read already (by the CLI that handed the command to the service: thin.py)."""
    if not args.prompt_file:
        return args.prompt  # type: ignore[no-any-return]
    try:  # bytes, decoded as they are: no newline translation, the prompt arrives verbatim
        if data is None and args.prompt_file == "-":
            data = sys.stdin.buffer.read()
        elif data is None:
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

def _priority_ignored(cfg_strategy: str, level: str, err: TextIO | None = None) -> None:
    """Under `fifo` a priority changes nothing: say so rather than let it look obeyed."""
    if cfg_strategy == "fifo" and level != "normal":
        _say("kugetsu: note: priority is ignored under strategy fifo (`kugetsu config set strategy priority`"
             " makes it count)", file=err or sys.stderr)


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
            print(to_json(_running_json(home, task)))
        elif on:
            _say(f"{task.name} (#{task.id}) {'paused' if changed else 'was already paused'}: its processes are"
                 f" stopped and keep slot {task.run.slot}; `kugetsu resume {task.name}` lets them go on")
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
    return _moved(verbs.next_task(home, args.task), args, "moved to the front")


def cmd_stash(home: Home, args: argparse.Namespace) -> int:
    return _moved(verbs.stash_task(home, args.task, True), args, "stashed")


def cmd_unstash(home: Home, args: argparse.Namespace) -> int:
    return _moved(verbs.stash_task(home, args.task, False), args, "unstashed")


def _moved(moved: tuple[Task, int | None, bool], args: argparse.Namespace, verb: str) -> int:
    task, position, changed = moved
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


def _running_json(home: Home, task: Task) -> dict[str, object]:
    """The object of a task a verb acted on as it runs (pause, kill): with its use now, as
    `status` shows it (its record gets its peak and CPU time when the run ends)."""
    return reading.task_json(task, None, measured=reading.last_measured(home, load_config(home)))


def cmd_kill(home: Home, args: argparse.Namespace) -> int:
    import signal

    text = args.signal.strip().upper()
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise UsageError(f"kill -s {args.signal!r}: no such signal; e.g. TERM, INT, HUP, USR1, KILL or a number") from None
    task, sent = verbs.signal_task(home, args.task, sig)
    if args.json:
        print(to_json(_running_json(home, task)))
    else:
        _say(f"sent {sig.name} to {task.name} (#{task.id})" + ("" if sent else ": no process of it was left"))
    return OK

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
