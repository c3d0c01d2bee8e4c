"""The agents' processes as the service holds them: the wrappers it spawned (reaped to learn
how they ended), the warm wrappers started ahead of their turn, the starts no committed index
records yet, and the agents adopted at start-up after a crash. How a wrapper is started,
identified and signalled is in runner.py; when to start what is decided by pm.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

import msgspec

from kugetsu.app import transaction

from kugetsu.core import commandline, policy, selection, step

from kugetsu.frontends import render

from kugetsu.service import runner, worktree
from kugetsu.service.spares import SpareExits
from kugetsu.config.model import Config
from kugetsu.core.models import Index, Task, TaskState
from kugetsu.paths import Home, atomic_write, nofollow
from kugetsu.core.placement import ours
from kugetsu.store.protocol import Txn

if TYPE_CHECKING:  # only for the types: runner imports it when it first spawns
    import subprocess

log = logging.getLogger("kugetsu.service")

# How many queued tasks have their wrapper started ahead, waiting (sync_warm): as many as the
# next promotions can use (issue 31), which selection.warm_ahead reckons from the last runs'
# length: those that would start within WARM_WINDOW seconds, at least one a slot, at most
# WARM_AHEAD. Agents that run for minutes keep max_agents wrappers waiting, not 100 idle `sh`
# (13 MB of PSS at a long queue). Quick ones keep up to WARM_AHEAD: started ahead, while the
# agents before them run, they make a drain's promotions one write to a pipe each. Spawned
# as the drain goes instead (one more at each start), the wrappers' starts took the CPU of
# the drain's agents: a 100-task drain at one slot took 352 ms instead of 296 (tsp 307; 5
# interleaved rounds), and with 2 x max_agents the service's CPU was 2.57 ms a task instead
# of 1.46. With fewer than selection.PACE_LEAST runs to go by (a new home), WARM_AHEAD.
WARM_AHEAD = 100
WARM_WINDOW = 30.0
# When they are spawned. Each is a fork and exec, ~1.5 ms, in the service's loop: a hundred
# in one go held it for 150-200 ms after a start or a burst of delegations, and an agent
# that ended meanwhile waited that long for its successor. So those of the next WARM_NOW
# promotions a slot are spawned at once (as a drain goes: one a tick, right after its
# successor was let go), and the rest one a turn of the loop once no tick came for
# WARM_IDLE seconds: spread over a quick drain instead, they came between an agent's end
# and its successor's start (promotion p95 4 -> 8 ms).
WARM_NOW = 2
WARM_IDLE = 0.02

_FINAL = frozenset(s.value for s in TaskState if s.final)


def limited(cfg: Config, task: Task) -> bool:
    """Has the task a memory or process limit (in cgroup mode: cgroups of its own)?"""
    return bool(policy.memory_of(cfg, task) or step.max_procs_of(cfg, task))


class LetGo(msgspec.Struct):
    """An agent this service let go, not yet in a committed index."""

    pid: int
    start: int | None
    at: datetime  # when it was let go: its started_at


class Processes:
    def __init__(self, home: Home, prompts: Callable[[list[int]], dict[int, str]]):
        self.home = home
        self.prompts = prompts  # the store's: a task's prompt is put into its argv as it starts (commandline.argv)
        self.children: dict[int, subprocess.Popen[bytes]] = {}  # pid -> Popen of the wrappers this service spawned
        # Agents let go (spawned, or a warm wrapper released) that no committed index records
        # yet: should the commit fail (a full disk), the next transaction records them from
        # here, and never starts them a second time. Cleared by every commit that succeeds.
        self.let_go: dict[int, LetGo] = {}
        self.returncodes: dict[int, int] = {}  # pid -> how a reaped wrapper ended, until committed
        self.warm: dict[int, runner.Spawned] = {}  # task id -> its wrapper, started ahead, waiting
        self.dropped: list[subprocess.Popen[bytes]] = []  # warm wrappers let go, to reap once they exit
        self._pending: list[Task] = []  # the tasks sync_warm wants warm, last first, not looked at yet
        self._stored: dict[int, str] | None = None  # their prompts, read when first needed
        self.host: str | None = None  # in a cluster, this machine: other machines' tasks are theirs
        # cgroup mode (service._confine): the cgroups a task with limits starts in, as its
        # wrapper's environment; such a task gets no warm wrapper (its cgroups are its run's).
        self.confine: Callable[[Task], dict[str, str] | None] | None = None
        self.spares = SpareExits(home)  # ended tasks' exit files, used again by the next spawns

    def committed(self, index: Index) -> None:
        """The index on disk (`index`) now records everything let go and every exit reaped so far."""
        self.let_go.clear()
        self.returncodes.clear()
        self.spares.committed(index)

    # ---- what the service records as it lets agents go ----------------------------------

    def let_go_now(self, task_id: int, pid: int, start: int | None, at: datetime) -> None:
        """An agent was let go (its warm wrapper released): no committed index records it yet."""
        self.let_go[task_id] = LetGo(pid, start, at)

    def let_go_at(self, task_id: int) -> datetime:
        return self.let_go[task_id].at

    def started(self, task_id: int, spawned: runner.Spawned, at: datetime) -> None:
        """A wrapper this service spawned (or released) for a task runs its agent: reaped by
        this service, and recorded as let go until a commit records it."""
        self.let_go_now(task_id, spawned.pid, spawned.start, at)
        self.adopt_child(spawned.popen)

    def adopt_child(self, popen: subprocess.Popen[bytes]) -> None:
        self.children[popen.pid] = popen

    def spawned(self, pid: int | None) -> bool:
        """Is `pid` a wrapper this service spawned and has not reaped yet?"""
        return pid in self.children

    def warm_of(self, task_id: int) -> runner.Spawned | None:
        return self.warm.get(task_id)

    def take_warm(self, task_id: int) -> runner.Spawned | None:
        return self.warm.pop(task_id, None)

    def close(self) -> None:
        """The service stops: warm wrappers exit without running anything."""
        self._pending = []
        for warm in self.warm.values():
            runner.drop(warm)

    def ours(self) -> set[int]:
        """The pids of the wrappers this service started (its children that are no orphans)."""
        return set(self.children) | {w.pid for w in self.warm.values()} | {p.pid for p in self.dropped}

    # ---- starting ----------------------------------------------------------------------

    def start(self, task: Task, cwd: str, env: dict[str, str], released: bool) -> runner.Spawned:
        """The task's warm wrapper if it has one (a promotion is then one write to a pipe),
        else a new process. `released`: its warm wrapper was let go already."""
        warm = self.warm.pop(task.id, None)
        if warm is not None and released:
            return warm
        argv = self._argv(task, self._prompts([task]))
        confine = self.confine(task) if self.confine is not None else None
        if warm is not None and confine is not None:
            self.drop(warm)  # started before its limits were known to need cgroups
            warm = None
        if warm is not None:
            if warm.gate is not None and warm.argv == argv and warm.env == env and runner.alive(warm.pid, runner.start_of(warm)):
                runner.release(warm)
                return warm
            self.drop(warm)
        return runner.spawn(self.home, task.id, task.name, argv, cwd, env, token=task.token, depth=task.depth,
                            confine=confine, header=render.attempt_header(task), spares=self.spares)

    def _argv(self, task: Task, stored: dict[int, str]) -> list[str]:
        """commandline.argv of the task; a {prompt_file} preset's file is made here first, on the
        machine that runs the agent (the file store's own copy is that file already; in a
        cluster the prompt is a row of the database). ValueError: its prompt is missing."""
        if not task.prompted:  # its command as given: sync_warm asks this of 100 tasks a tick
            return task.command
        prompt = commandline.prompt_of(task, stored)
        if not commandline.wants_file(task):
            return commandline.argv(task, prompt)
        path = self.home.prompt_file(task.id)
        if prompt is not None:
            data = prompt.encode()
            try:
                with open(path, "rb", opener=nofollow) as f:
                    same = f.read(len(data) + 1) == data
            except FileNotFoundError:
                same = False
            if not same:
                atomic_write(path, data)
        return commandline.argv(task, prompt, str(path))

    def _prompts(self, tasks: list[Task]) -> dict[int, str]:
        """The stored prompts of those tasks whose argv takes one (one read for the lot)."""
        prompted = [t.id for t in tasks if t.prompted]
        return self.prompts(prompted) if prompted else {}

    def sync_warm(self, index: Index, cfg: Config, ahead: int, first: list[Task] | None = None) -> bool:
        """Keep the wrappers of the first `ahead` queued tasks in start order started and
        waiting, while every slot is busy (with a free slot, tasks start at once anyway): a
        promotion is then one write to a pipe, and no process is started while agents end
        in quick succession (task-spooler's waiting clients do the same). Who starts is still
        decided by pm in the tick; this only prepares the likely ones. Worktree tasks are not
        warmed: their working directory only exists once they start. The first ones are picked
        without sorting the whole queue (start_order's `first`); `first`: those, when the caller
        has them already. Drops the wrappers no longer wanted and spawns those of the next
        promotions (WARM_NOW a slot) at once; True when more are left, for warm_more."""
        want: list[Task] = []
        if index.queued and selection.free_slots(index, cfg) == 0:
            order = first if first is not None else selection.start_order(index, cfg, transaction.now(), ahead)
            want = [t for t in order if not t.repo and t.token and not (self.confine and limited(cfg, t))]
        wanted = {t.id for t in want}
        for task_id in [i for i in self.warm if i not in wanted]:
            self.drop(self.warm.pop(task_id))
        now = WARM_NOW * max(cfg.max_agents, 1)
        self._next(want[:now])
        self.warm_more(now)
        self._next(want[now:])
        return bool(self._pending)

    def _next(self, tasks: list[Task]) -> None:
        """What warm_more spawns next: these tasks' wrappers, in this order."""
        self._pending = tasks[::-1]  # popped from the end: the first in start order first
        self._stored = None  # their prompts, read once if one is needed

    def warm_more(self, most: int) -> bool:
        """Spawn up to `most` of the wrappers the last sync_warm found missing, in its order
        (its index: every change of the index calls sync_warm again, which starts the list
        afresh). True when some are left."""
        spawned = 0
        while self._pending:
            task = self._pending[-1]
            if self._stored is None:
                try:
                    self._stored = self._prompts(self._pending)
                except Exception:  # the store did not answer: normal starts, and their errors, in their turn
                    self._stored = {}
            try:
                argv: list[str] | None = self._argv(task, self._stored)
            except (OSError, ValueError):
                argv = None
            if task.id in self.warm:
                if self.warm[task.id].argv == argv and self.warm[task.id].env == task.env:
                    self._pending.pop()
                    continue
                self.drop(self.warm.pop(task.id))  # its prompt was edited, its preset changed: stale
            if argv is None:
                self._pending.pop()
                continue
            if spawned == most:
                return True
            self._pending.pop()
            spawned += 1
            try:
                self.warm[task.id] = runner.spawn(
                    self.home, task.id, task.name, argv, task.cwd, task.env, warm=True, token=task.token,
                    depth=task.depth, header=render.attempt_header(task), spares=self.spares,
                )
            except (OSError, ValueError):
                pass  # it gets a normal start, and its error, when its turn comes
        return False

    def stop_warming(self) -> None:
        """A tick begins: what the last sync_warm left to spawn waits for the next one, which
        sees the tasks this tick starts (a tick that fails calls none: no wrapper is warmed
        for a task it let go)."""
        self._pending = []

    def drop(self, spawned: runner.Spawned) -> None:
        runner.drop(spawned)
        self.dropped.append(spawned.popen)

    def forget_dropped(self) -> None:
        """Dropped warm wrappers that have exited (poll reaps them) need no more looking at."""
        self.dropped = [p for p in self.dropped if p.poll() is None]

    # ---- how a wrapper ended -------------------------------------------------------------

    def reap(self, task: Task) -> None:
        """Reap the task's wrapper, if this service spawned it; how it ended is kept until the
        index records the task's end (should that commit fail, the next one needs it)."""
        popen = self.children.pop(task.run.pid, None)  # type: ignore[arg-type]
        if popen is None:
            return
        try:
            # It has exited: this only reaps it (poll: wait(timeout) costs a sleep loop).
            returncode = popen.poll()
            if returncode is None:
                returncode = popen.wait(timeout=5)
            self.returncodes[popen.pid] = returncode
        except Exception:
            log.warning("wrapper of %s (#%d) did not reap; continuing", task.name, task.id)

    def exit_status(self, task: Task) -> tuple[int | None, str | None]:
        self.reap(task)
        code = runner.read_exit(self.home, task.id)
        if code is not None:
            self.spares.booked(task.id)
            return code, None
        returncode = self.returncodes.get(task.run.pid)  # type: ignore[arg-type]
        if returncode is not None and returncode < 0:
            name = signal.Signals(-returncode).name
            return 128 - returncode, f"killed by {name}"
        return None, None

    # ---- starts no committed index records -------------------------------------------------

    def let_go_seen(self) -> list[step.Adopted]:
        """What this service let go since its last successful commit: a task it started runs,
        whether or not the commit that said so reached the disk, and pm records it (never
        starting it a second time)."""
        return [step.Adopted(task_id, go.pid, go.start, go.at, str(self.home.log(task_id)))
                for task_id, go in self.let_go.items()]

    def recovered(self, txn: Txn) -> list[step.Adopted]:
        """At start-up, after a crash between starting a task's wrapper and committing it: a
        wrapper of ours (same user, the task's token) that runs its agent (a warm one that
        was never released has no child, and exits when it sees its pipe closed), or the
        exit status it recorded, for a queued task or a running one without a pid."""
        # logs/ listed once (a look for each queued task's log was most of the start-up of a
        # service at 50,000 queued), and the ids its logs name looked up: one pass of int
        # lookups over the queue, only when there is a log at all (a name made for each queued
        # task was 16 ms of the start at 50,000).
        try:
            logged = {int(name[:-4]) for name in os.listdir(self.home.logs)
                      if name.endswith(".log") and name[:-4].isascii() and name[:-4].isdigit()}
        except OSError:
            logged = set()
        queued = [t for t in txn.index.queued if t.id in logged] if logged else []
        candidates = {t.id: t.token for t in queued}
        # A task back in the queue (a retry, a provider's limit) has the exit file of its last
        # run until it starts again: that end is booked already.
        booked = {t.id: t.attempts[-1].ended_at for t in queued if t.attempts}
        unrecorded = [t for t in txn.index.active if t.run.pid is None and t.run.stop is None and ours(t, self.host)]
        candidates.update((t.id, t.token) for t in unrecorded)
        if not candidates:
            return []
        for task in unrecorded:
            worktree.recover(self.home, task)  # a worktree created just before the crash
        wrappers = runner.find_wrappers(self.home, candidates)  # one look at /proc for the lot
        # Its start is unknown: at the latest exit recorded here (the slot it took), if that
        # was before its own end.
        ends = [t for e in txn.events if e.task is not None and e.state in _FINAL
                if (t := runner.exit_time(self.home, e.task)) is not None]
        out = []
        for task_id in candidates:
            found = wrappers.get(task_id)
            running = found is not None and runner.has_children(found[0])
            code = runner.read_exit(self.home, task_id) if not running else None
            if not running and code is None:
                continue
            end = runner.exit_time(self.home, task_id) if code is not None else None
            if end is not None and task_id in booked and end <= booked[task_id]:
                continue
            before = [t for t in ends if end is None or t <= end]
            at = max(before) if before else (end or txn.now)
            pid, start = found if running else (None, None)
            out.append(step.Adopted(task_id, pid, start, at, str(self.home.log(task_id)), code))
            if running:
                log.info("re-adopted task #%d, pid %d, started before a crash", task_id, pid)
            else:  # it left no process to record: the task ends with no pid
                log.info("task #%d started before a crash and ended with exit status %d: booked", task_id, code)
        return out
