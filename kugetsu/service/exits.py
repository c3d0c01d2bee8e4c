"""How the service learns that agents ended, and ends what they left running.

A pidfd per running agent in the asyncio loop: an exit is seen at once, no polling. When an
agent has ended, whether anything it started may still run is ruled out in microseconds in
the common case (its process group is empty, and no orphan carrying its token was handed to
the service, the subreaper); otherwise its leftovers are looked for (a /proc scan by the
task's token, in a worker thread), signalled as pm says, and watched (a pidfd each) until
they are gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

import msgspec

from kugetsu.core import step

from kugetsu.service import runner
from kugetsu.core.models import Index, Task
from kugetsu.core.placement import ours
from kugetsu.service.processes import Processes
from kugetsu.store.protocol import Txn

log = logging.getLogger("kugetsu.service")


class Ending(msgspec.Struct):
    """A task whose agent has ended while processes it started still run."""

    scan: asyncio.Future[dict[int, int]] | None = None  # a look through /proc for its token
    watches: dict[int, int] = {}  # pid -> pidfd of the leftovers signalled
    seen: set[int] = set()  # every leftover pid found so far
    found: dict[int, int] = {}  # pid -> start of what the last look found (to signal and watch)
    killed: bool = False  # SIGKILL sent (the grace is over)


class Exits:
    def __init__(self, procs: Processes, on_exit: Callable[[], None], request_tick: Callable[[], None]):
        self.procs = procs
        self.on_exit = on_exit  # an agent has exited: tick at once
        self.request_tick = request_tick
        self.watches: dict[int, int] = {}  # task id -> pidfd
        self.exited: set[int] = set()  # task ids whose pidfd fired
        self.clean: set[int] = set()  # exited tasks this tick found to leave nothing running
        self.endings: dict[int, Ending] = {}  # task id -> its leftover processes being ended
        self._zombies: set[int] = set()  # orphans seen dead at the last look, reaped at the next
        self.host: str | None = None  # in a cluster, this machine: other machines' agents are theirs to watch

    def ticked(self) -> None:
        """The exits seen so far are in the transaction just made."""
        self.exited.clear()
        self.clean.clear()

    def has_exited(self, task_id: int) -> bool:
        """Has the task's pidfd fired since the last tick?"""
        return task_id in self.exited

    @property
    def any_exited(self) -> bool:
        return bool(self.exited)

    def mark_exited(self, task_id: int) -> None:
        """The task's agent is gone already (it exited before it could be looked at)."""
        self.exited.add(task_id)

    def mark_clean(self, task_id: int) -> None:
        """The task's agent exited leaving nothing running (found at its early successor's release)."""
        self.clean.add(task_id)

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self.watches.values():
            loop.remove_reader(fd)
            os.close(fd)

    # ---- watching running agents ---------------------------------------------------------

    def sync_watches(self, index: Index) -> None:
        # (A task whose agent has ended while it ends its leftovers has no process to watch.)
        loop = asyncio.get_running_loop()
        active = {t.id: t for t in index.active if t.run.pid is not None and t.run.ended_at is None and ours(t, self.host)}
        for task_id in [i for i in self.watches if i not in active]:
            fd = self.watches.pop(task_id)
            loop.remove_reader(fd)
            os.close(fd)
        for task_id, task in active.items():
            if task_id in self.watches:
                continue
            fd = runner.open_pidfd(task.run.pid, task.run.pid_start)
            if fd is None:  # already gone: an exit like any other, whose commit may wait for the burst
                loop.call_soon(self._on_exit, task_id)
                continue
            self.watches[task_id] = fd
            loop.add_reader(fd, self._on_exit, task_id)

    def _on_exit(self, task_id: int) -> None:
        fd = self.watches.pop(task_id, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        self.exited.add(task_id)
        self.on_exit()  # at once, not a loop iteration later: the next task waits on it

    # ---- what a task's agent leaves behind -----------------------------------------------

    def seen(self, task: Task, first_tick: bool) -> step.Exit:
        """The task's wrapper is gone: its status, and whether anything it started may still
        run. Ruled out in microseconds in the common case (its process group is empty, and no
        orphan carrying its token was handed to this service, the subreaper); not for a
        wrapper another service spawned (its orphans went elsewhere): that takes a look."""
        spawned_here = task.run.pid in self.procs.children or task.run.pid in self.procs.returncodes
        code, reason = self.procs.exit_status(task)
        if spawned_here:
            clean = task.id in self.clean or not self.leftovers_possible(task)
        elif first_tick and task.token:
            # At start-up, an agent that ended while no service ran: look now (one pass over
            # /proc, before anything else runs), so that a start recovered from the crash in
            # this same tick is booked after the end that freed its slot, never beside it.
            clean = not runner.scan_token(task.token)
        else:
            clean = False
        if not clean:
            log.info("%s (#%d) ended (%s); ending what it left running", task.name, task.id, code)
        return step.Exit(task.id, code, reason, leftovers=not clean)

    def leftovers_possible(self, task: Task) -> bool:
        if task.run.pid is not None and runner.group_alive(task.run.pid):
            return True
        if not task.token:
            return False
        tokens, unread = self.orphan_tokens()
        # An orphan whose environment is blank may be this task's, caught mid-exec: the look
        # by token (in a worker thread, a moment later) tells.
        return task.token in tokens or unread

    def orphan_tokens(self) -> tuple[set[str], bool]:
        """The task tokens of this service's children that it did not spawn itself: orphans
        of agents, handed to it as the subreaper; and whether one had a blank environment
        (caught in the middle of an exec, as an agent's `cmd &` often is at the agent's exit).
        Orphans that have exited are reaped here (at the second look, so that a child another
        thread waits for is never taken)."""
        known = self.procs.ours()
        tokens = set()
        unread = False
        zombies = set()
        for pid in runner.own_children():
            if pid in known:
                continue
            if runner.is_zombie(pid):
                zombies.add(pid)
                continue
            env = runner.environ(pid)
            token = runner.token_in(env) if env else None
            if token:
                tokens.add(token)
            unread = unread or env == b""
        for pid in zombies & self._zombies:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        self._zombies = zombies
        return tokens, unread

    def look_for_leftovers(self, txn: Txn) -> list[step.Found]:
        """Tasks whose agent has ended while processes it started still run: look for them (a
        /proc scan by the task's token, in a worker thread) whenever nothing signalled is
        left to wait for, or the grace is over; report what each finished look found."""
        live = {t.id: t for t in txn.index.active if t.run.ended_at is not None and ours(t, self.host)}
        for task_id in [i for i in self.endings if i not in live]:
            self._close_ending(self.endings.pop(task_id))
        found = []
        for task in live.values():
            ending = self.endings.setdefault(task.id, Ending())
            if not task.token:  # a task from before tokens: nothing to look for
                found.append(step.Found(task.id, 0, 0))
                continue
            if ending.scan is None:
                grace_over = task.run.kill_at is not None and txn.now >= task.run.kill_at and not ending.killed
                if not ending.watches or grace_over:
                    self._scan(task, ending)
                continue
            if not ending.scan.done():
                continue
            scan, ending.scan = ending.scan, None
            pids: dict[int, int] = {} if scan.cancelled() or scan.exception() else scan.result()
            ending.seen.update(pids)
            ending.found = pids
            found.append(step.Found(task.id, len(pids), len(ending.seen)))
        return found

    def unlooked(self, index: Index) -> bool:
        """Is a task of ours ended, with leftovers possible, that no look has begun for?"""
        return any(t.run.ended_at is not None and ours(t, self.host) and t.id not in self.endings for t in index.active)

    def signal_leftovers(self, plan: step.Plan, index: Index) -> None:
        """Signal what the looks found (pm chose the signal) and watch each: when all are gone,
        look again. A task pm finished has its look forgotten."""
        loop = asyncio.get_running_loop()
        for task_id in [i for i in self.endings if i not in {t.id for t in index.active}]:
            self._close_ending(self.endings.pop(task_id))
        for task_id, sig in plan.signal_leftovers.items():
            ending = self.endings.get(task_id)
            if ending is None:
                continue
            ending.killed = ending.killed or sig == signal.SIGKILL
            self._close_ending(ending)
            for pid, start in ending.found.items():
                runner.signal_pid(pid, start, signal.Signals(sig))
                fd = runner.open_pidfd(pid, start)
                if fd is not None:
                    ending.watches[pid] = fd
                    loop.add_reader(fd, self._on_leftover_exit, task_id, pid)
            if not ending.watches:  # all gone already: look again
                self.request_tick()

    def _scan(self, task: Task, ending: Ending) -> None:
        assert task.token
        ending.scan = asyncio.get_running_loop().run_in_executor(None, runner.scan_token, task.token)
        ending.scan.add_done_callback(lambda _: self.request_tick())

    def _on_leftover_exit(self, task_id: int, pid: int) -> None:
        ending = self.endings.get(task_id)
        fd = ending.watches.pop(pid, None) if ending else None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        if ending is not None and not ending.watches:
            self.request_tick()  # all that was signalled is gone: look again

    def _close_ending(self, ending: Ending) -> None:
        loop = asyncio.get_running_loop()
        for fd in ending.watches.values():
            loop.remove_reader(fd)
            os.close(fd)
        ending.watches = {}
