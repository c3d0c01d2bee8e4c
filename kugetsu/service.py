"""The service (`kugetsu serve`): the one long-running process of a KUGETSU_HOME.

It spawns agents as slots free and learns of their exit at once (a pidfd per agent in the
asyncio loop: no polling), records the result and promotes the next task in the same
transaction. One loop timer wakes it at the earliest of everything that happens at a time
(queue expiry, run timeouts, SIGKILL after the grace, policy wake-ups), another for a
periodic reconcile; the CLI wakes it through a Unix datagram socket after each transaction.
What to do is always decided by pm.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for the types: the service imports them when it first needs them
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

import msgspec

from kugetsu import control, limits, ops, pm, runner, worktree
from kugetsu.config import Config, format_size, load_config
from kugetsu.errors import DiskFull, KugetsuError
from kugetsu.models import Event, Index, Task, TaskState
from kugetsu.paths import Home, atomic_write, read_tail
from kugetsu.deadlines import DeadlineTimer
from kugetsu.store import Store, Txn
from kugetsu.wakeup import WakeSocket

log = logging.getLogger("kugetsu.service")

RECONCILE_EVERY = 5.0  # seconds: a safety net; exits and deadlines do not wait for it
GUARD_RECHECK = 2.0  # seconds between resource readings while the guard holds queued tasks
WARM_AHEAD = 100  # queued tasks whose wrapper waits, started ahead (_sync_warm)
COMMIT_DELAY = 0.02  # seconds an exit's transaction stays open for the exits that follow (_hold)


_FINAL = frozenset(s.value for s in TaskState if s.final)
RETRY_FIRST, RETRY_MAX = 0.1, 5.0  # seconds: backoff while transactions fail (a full disk)


class LetGo(msgspec.Struct):
    """An agent this service let go, not yet in a committed index."""

    pid: int
    start: int | None
    at: datetime  # when it was let go: its started_at


class Ending(msgspec.Struct):
    """A task whose agent has ended while processes it started still run."""

    scan: Any = None  # asyncio.Future[dict[int, int]]: a look through /proc for its token
    watches: dict[int, int] = {}  # pid -> pidfd of the leftovers signalled
    seen: set[int] = set()  # every leftover pid found so far
    found: dict[int, int] = {}  # pid -> start of what the last look found (to signal and watch)
    killed: bool = False  # SIGKILL sent (the grace is over)


class Service:
    def __init__(self, home: Home):
        self.home = home
        self.store = Store(home)
        self.cfg: Config = Config()
        self.children: dict[int, subprocess.Popen[bytes]] = {}  # pid -> Popen of the wrappers this service spawned
        # Agents let go (spawned, or a warm wrapper released) that no committed index records
        # yet: should the commit fail (a full disk), the next transaction records them from
        # here, and never starts them a second time. Cleared by every commit that succeeds.
        self.let_go: dict[int, LetGo] = {}
        self.returncodes: dict[int, int] = {}  # pid -> how a reaped wrapper ended, until committed
        self.endings: dict[int, Ending] = {}  # task id -> its leftover processes being ended
        self.failing: str | None = None  # why the last transaction failed, while it does
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = RETRY_FIRST
        self._clean_exits: set[int] = set()  # exited tasks this tick found to leave nothing running
        self._zombies: set[int] = set()  # orphans seen dead at the last look, reaped at the next
        self.warm: dict[int, runner.Spawned] = {}  # task id -> its wrapper, started ahead, waiting
        self.successor: pm.Successor | None = None  # pm's pick for the next slot to free
        self._released: int | None = None  # the successor, let go at an exit, until pm records it
        self.dropped: list[subprocess.Popen[bytes]] = []  # warm wrappers let go, to reap once they exit
        self.preparing: dict[int, asyncio.Future[Task]] = {}  # task id -> its worktree being created
        self.closing: dict[int, asyncio.Future[tuple[Task, str | None]]] = {}  # task id -> its worktree being closed
        self._close_due = True  # a final task may have an open worktree (at start: one a crash left)
        self._git: ThreadPoolExecutor | None = None  # one worker thread for git: creations never hold the lock or the loop
        self.watches: dict[int, int] = {}  # task id -> pidfd
        self.exited: set[int] = set()  # task ids whose pidfd fired
        self.jobs: dict[str, datetime] = {}  # the policies' wake-ups (rate limit, guard re-check)
        self._reconcile_handle: asyncio.TimerHandle | None = None
        self.listeners: list[Callable[[list[Event]], None]] = []  # told of each transaction's events
        self.telegram: Any = None
        self.metrics: Any = None  # the OpenMetrics endpoint (kugetsu/metrics.py), when config metrics.listen is set
        self.index = Index()
        self._tick_pending = False
        self._first_tick = True
        self.held: Txn | None = None  # a transaction kept open for a burst of exits (_hold)
        self._flush_handle: asyncio.TimerHandle | None = None
        self._config_stamp: object = ...  # what config.json looked like when last read (... = never)
        self._stopping: asyncio.Event | None = None
        self._disk_check = True  # worktrees.max_disk: look at start, then whenever one is kept

    # ---- lifecycle -----------------------------------------------------------------

    def run(self) -> int:
        return asyncio.run(self.main())

    async def main(self) -> int:
        self.home.ensure()
        lock_fd = control.take_service_lock(self.home)
        if not runner.become_subreaper():
            log.warning("cannot become the child subreaper: processes that agents leave behind are found by a /proc scan only")
        self.loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        wakeup = WakeSocket(self.home, self.loop, self.request_tick, self.stop)
        wakeup.open()
        self.timer = DeadlineTimer(self.loop, self._on_deadline)
        self._reconcile_handle = self.loop.call_later(RECONCILE_EVERY, self._reconcile)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stopping.set)
        try:
            # A damaged index stops the service here, before its pid file says it is up;
            # the pid file comes before the first tick, which may already start agents.
            self.store.read()
            atomic_write(self.home.service_pid, f"{os.getpid()}\n".encode())
            self.tick()
            log.info("kugetsu service up (pid %d, home %s, max_agents %d)", os.getpid(), self.home.root, self.cfg.max_agents)
            await self._start_extensions()
            await self._stopping.wait()
            log.info("kugetsu service stopping; running agents keep running")
        finally:
            self._flush()
            await self._stop_extensions()
            self._reconcile_handle.cancel()
            self.timer.cancel()
            if self._git is not None:  # a worktree half-made is recovered by the next service
                self._git.shutdown(wait=False, cancel_futures=True)
            for warm in self.warm.values():  # they exit without running anything
                runner.drop(warm)
            for fd in self.watches.values():
                self.loop.remove_reader(fd)
                os.close(fd)
            wakeup.close()
            self.home.service_pid.unlink(missing_ok=True)
            os.close(lock_fd)
        return 0

    def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    # ---- the tick: one transaction that brings the world in line ---------------------

    def request_tick(self) -> None:
        """Coalesce wake-ups that arrive together into one transaction."""
        if not self._tick_pending:
            self._tick_pending = True
            self.loop.call_soon(self._requested_tick)

    def _requested_tick(self) -> None:
        if self._tick_pending:  # else a tick ran meanwhile (an exit ticks at once) and did it
            self._safe_tick()

    def _on_deadline(self) -> None:
        self._safe_tick()

    def _reconcile(self) -> None:
        """The safety net: a tick every RECONCILE_EVERY seconds, whatever happens."""
        self._reconcile_handle = self.loop.call_later(RECONCILE_EVERY, self._reconcile)
        self._orphan_tokens()  # reaps orphans that exited, also when no agent ends for a while
        self._safe_tick()

    def _safe_tick(self, hold: bool = False) -> None:
        try:
            self.tick(hold)
        except Exception as err:
            self._failed(err)

    def _failed(self, err: Exception) -> None:
        """A transaction failed (a full disk, a damaged index.json, EIO): nothing it decided
        is on disk, what it let go is in `let_go`. Say so once, not on every retry, and try
        again with backoff; running agents are not affected."""
        what = str(err) if isinstance(err, KugetsuError) else f"{type(err).__name__}: {err}"
        if what != self.failing:
            if isinstance(err, KugetsuError):  # e.g. index.json damaged by hand: say what, no traceback
                log.error("%s\nRetrying with backoff; running agents are not affected.", err)
            else:
                log.exception("tick failed; retrying with backoff; running agents are not affected")
        self.failing = what
        if self._retry is None:
            self._retry = self.loop.call_later(self._retry_delay, self._retry_tick)
            self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)

    def _retry_tick(self) -> None:
        self._retry = None
        self._safe_tick()

    def _commit_succeeded(self) -> None:
        """The index on disk now records everything let go and every exit reaped so far."""
        self.let_go.clear()
        self.returncodes.clear()
        if self.failing is not None:
            log.info("the index is written again (after: %s)", self.failing)
            self.failing = None
            self._retry_delay = RETRY_FIRST
            self.request_tick()  # start what waited for a commit that works

    def tick(self, hold: bool = False) -> None:
        """One transaction that brings the world in line: gather what happened (exits,
        leftovers found, starts that no committed index records), let pm.tick decide, carry
        out its plan (spawn, signal), commit. `hold` (after an agent's exit): keep the
        transaction open, lock and all, for COMMIT_DELAY, so that the exits that follow in a
        burst share its commit (`_hold`)."""
        self._tick_pending = False
        txn = self._begin()
        try:
            # Under the index lock, which `config set` holds while it writes config.json:
            # read before it, a lowering of max_agents committed meanwhile was overshot.
            config_changed = self._reload_config()
            cfg, index = self.cfg, txn.index
            obs = pm.Observations(resources=ops.measure(cfg))
            obs.adopted += self._let_go_seen()  # only after a failed commit
            if self.exited and txn.unchanged and not config_changed and self.failing is None:
                self._release_successor(txn)
            obs.exits = [self._exit_seen(t) for t in list(index.active) if t.ended_at is None and t.pid is not None
                         and (t.id in self.exited or not runner.alive(t.pid, t.pid_start))]
            if self.endings or any(t.ended_at is not None for t in index.active):
                obs.found = self._look_for_leftovers(txn)
            if self._first_tick:
                obs.adopted += self._recovered(txn)
            if self.closing:
                self._record_closes(txn)
            plan = pm.tick(index, cfg, txn.now, obs)
            self._take(txn, plan)
            # While commits fail, nothing new is let go: what starts is committed first.
            while self.failing is None and self._spawn(txn, plan.start):
                plan.start = self._take(txn, pm.settle(index, cfg, txn.now, obs.resources)).start
            if self._released is not None:
                self._record_released(txn)
            if hold:
                self._hold(txn)
            else:
                self._cancel_flush()
                self.store.commit(txn)
                self._commit_succeeded()
        except BaseException:
            self.store.abort()
            raise
        self.index = txn.index
        self._released = None
        self.successor = pm.successor(self.index, self.cfg)
        self.exited.clear()
        self._clean_exits.clear()
        self.dropped = [p for p in self.dropped if p.poll() is None]
        if self.preparing:
            self._drop_unwanted_worktrees()
        self._first_tick = False
        for task, sig in plan.signal_groups:
            runner.kill_group(task.pid, task.pid_start, signal.Signals(sig))
        for stray in plan.strays:
            # Let go before a commit that failed, for a task final by now: it must not run on.
            log.warning("task #%d was let go but is no longer queued or running; stopping it", stray.task)
            runner.kill_group(stray.pid, stray.pid_start, signal.SIGKILL)
        self._signal_leftovers(plan)
        self._sync_watches()
        self._sync_jobs()
        self._sync_warm()
        if not hold:
            self._committed(txn.events)

    def _take(self, txn: Txn, plan: pm.Plan) -> pm.Plan:
        """Put a plan's events and archive into the transaction."""
        txn.emit(plan.events)
        txn.archive.extend(plan.archive)
        if any(e.worktree for e in plan.events):  # a worktree task ended: close it after the commit
            self._close_due = True
        return plan

    # ---- what a task's agent leaves behind -----------------------------------------------

    def _exit_seen(self, task: Task) -> pm.Exit:
        """The task's wrapper is gone: its status, and whether anything it started may still
        run. Ruled out in microseconds in the common case (its process group is empty, and no
        orphan carrying its token was handed to this service, the subreaper); not for a
        wrapper another service spawned (its orphans went elsewhere): that takes a look."""
        spawned_here = task.pid in self.children or task.pid in self.returncodes
        code, reason = self._exit_status(task)
        if spawned_here:
            clean = task.id in self._clean_exits or not self._leftovers_possible(task)
        elif self._first_tick and task.token:
            # At start-up, an agent that ended while no service ran: look now (one pass over
            # /proc, before anything else runs), so that a start recovered from the crash in
            # this same tick is booked after the end that freed its slot, never beside it.
            clean = not runner.scan_token(task.token)
        else:
            clean = False
        if not clean:
            log.info("%s (#%d) ended (%s); ending what it left running", task.name, task.id, code)
        # What pm reads in the end of its output (a provider's limit, the session id).
        tail = None
        if task.log and pm.reads_output(self.cfg, task):
            tail = read_tail(task.log, limits.TAIL_BYTES).decode(errors="replace")
        return pm.Exit(task.id, code, reason, leftovers=not clean, tail=tail)

    def _leftovers_possible(self, task: Task) -> bool:
        if task.pid is not None and runner.group_alive(task.pid):
            return True
        return bool(task.token) and task.token in self._orphan_tokens()

    def _orphan_tokens(self) -> set[str]:
        """The task tokens of this service's children that it did not spawn itself: orphans
        of agents, handed to it as the subreaper. Orphans that have exited are reaped here
        (at the second look, so that a child another thread waits for is never taken)."""
        known = set(self.children) | {w.pid for w in self.warm.values()} | {p.pid for p in self.dropped}
        tokens = set()
        zombies = set()
        for pid in runner.own_children():
            if pid in known:
                continue
            if runner.is_zombie(pid):
                zombies.add(pid)
                continue
            token = runner.token_of(pid)
            if token:
                tokens.add(token)
        for pid in zombies & self._zombies:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        self._zombies = zombies
        return tokens

    def _look_for_leftovers(self, txn: Txn) -> list[pm.Found]:
        """Tasks whose agent has ended while processes it started still run: look for them (a
        /proc scan by the task's token, in a worker thread) whenever nothing signalled is
        left to wait for, or the grace is over; report what each finished look found."""
        live = {t.id: t for t in txn.index.active if t.ended_at is not None}
        for task_id in [i for i in self.endings if i not in live]:
            self._close_ending(self.endings.pop(task_id))
        found = []
        for task in live.values():
            ending = self.endings.setdefault(task.id, Ending())
            if not task.token:  # a task from before tokens: nothing to look for
                found.append(pm.Found(task.id, 0, 0))
                continue
            if ending.scan is None:
                grace_over = task.kill_at is not None and txn.now >= task.kill_at and not ending.killed
                if not ending.watches or grace_over:
                    self._scan(task, ending)
                continue
            if not ending.scan.done():
                continue
            scan, ending.scan = ending.scan, None
            pids: dict[int, int] = {} if scan.cancelled() or scan.exception() else scan.result()
            ending.seen.update(pids)
            ending.found = pids
            found.append(pm.Found(task.id, len(pids), len(ending.seen)))
        return found

    def _signal_leftovers(self, plan: pm.Plan) -> None:
        """Signal what the looks found (pm chose the signal) and watch each: when all are gone,
        look again. A task pm finished has its look forgotten."""
        for task_id in [i for i in self.endings if i not in {t.id for t in self.index.active}]:
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
                    self.loop.add_reader(fd, self._on_leftover_exit, task_id, pid)
            if not ending.watches:  # all gone already: look again
                self.request_tick()

    def _scan(self, task: Task, ending: Ending) -> None:
        assert task.token
        ending.scan = self.loop.run_in_executor(None, runner.scan_token, task.token)
        ending.scan.add_done_callback(lambda _: self.request_tick())

    def _on_leftover_exit(self, task_id: int, pid: int) -> None:
        ending = self.endings.get(task_id)
        fd = ending.watches.pop(pid, None) if ending else None
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)
        if ending is not None and not ending.watches:
            self.request_tick()  # all that was signalled is gone: look again

    def _close_ending(self, ending: Ending) -> None:
        for fd in ending.watches.values():
            self.loop.remove_reader(fd)
            os.close(fd)
        ending.watches = {}

    # ---- starts let go before a commit that failed ---------------------------------------

    def _let_go_seen(self) -> list[pm.Adopted]:
        """What this service let go since its last successful commit: a task it started runs,
        whether or not the commit that said so reached the disk, and pm records it (never
        starting it a second time)."""
        return [pm.Adopted(task_id, go.pid, go.start, go.at, str(self.home.log(task_id)))
                for task_id, go in self.let_go.items()]

    # ---- held transactions: one commit for a burst of exits ---------------------------

    def _begin(self) -> Txn:
        """The held transaction, if there is one, else a new one."""
        txn, self.held = self.held, None
        if txn is None:
            return self.store.begin()
        txn.now = ops.now()  # the same transaction, a moment later
        return txn

    def _hold(self, txn: Txn) -> None:
        """Keep `txn` open until COMMIT_DELAY after the exit that opened it. Promotions do not
        wait for it (the next agent is let go before any bookkeeping); what waits is the
        commit, which is most of the service's work per task: with agents that end every few
        ms, one commit per burst instead of one per exit. Meanwhile the lock is held (a CLI
        command waits at most COMMIT_DELAY), so the index stays this service's own."""
        txn.unchanged = True
        self.held = txn
        if self._flush_handle is None:
            self._flush_handle = self.loop.call_later(COMMIT_DELAY, self._flush)

    def _flush(self) -> None:
        """Commit the held transaction."""
        self._cancel_flush()
        txn, self.held = self.held, None
        if txn is None:
            return
        try:
            self.store.commit(txn)
        except Exception as err:
            self._failed(err)  # what it let go is in let_go; exits are seen again
            return
        self._commit_succeeded()
        self._committed(txn.events)

    def _cancel_flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None

    def _committed(self, events: list[Event]) -> None:
        """After a commit: what reads the index from disk, and the listeners, see it now."""
        if self._disk_check and self.cfg.worktrees.max_disk is not None:
            self._disk_check = False
            # Off the loop: measuring worktrees walks their files.
            self.loop.run_in_executor(None, self._enforce_max_disk, self.cfg)
        if self._close_due:
            self._start_closes()
        if self.metrics is not None:  # every commit, the CLI's too: gauges must follow queued tasks
            self.metrics.observe(self.index, self.cfg)
        if events:
            for listener in self.listeners:
                listener(events)
            self._rotate_events()

    def _rotate_events(self) -> None:
        """Keep events.jsonl bounded: only the service rotates it, after a tick that grew it
        (one stat when there is nothing to do, and after the release of the next agent)."""
        size = self.store.rotate_events(self.cfg.events_max_bytes)
        if size is not None:
            log.info("events.jsonl reached %s: it is events.jsonl.1 now, and a new one begins", format_size(size))

    def _reload_config(self) -> bool:
        """Re-read config.json when it changed (it is replaced by rename: a new inode).
        Returns whether it changed."""
        try:
            st = os.stat(self.home.config)
            stamp: object = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._config_stamp:
            return False
        try:
            self.cfg = load_config(self.home)
            self._config_stamp = stamp
        except KugetsuError as err:
            log.error("%s\nKeeping the last valid config.", err)
        return True

    def _release_successor(self, txn: Txn) -> None:
        """An agent has exited and nothing changed since this service's last transaction: let
        the task pm named for the next free slot (pm.successor) run its agent now, before the
        bookkeeping of this transaction, which then records that very start. The write to
        the warm wrapper's pipe comes first; reaping, the exit status and the new plan (about
        0.2 ms of Python) after it. Still under the index lock, and only while the index is
        the one this service committed: a cancel or a config change cannot slip in between."""
        succ = self.successor
        if succ is None or (succ.until is not None and txn.now >= succ.until):
            return  # about to expire, or no answer that holds whichever task ended
        warm = self.warm.get(succ.task.id)
        if warm is None or warm.gate is None:
            return
        # Only a slot that is truly free: each task that ended left nothing running (else it
        # keeps its slot while that is ended, and the tick decides).
        ended = [t for t in txn.index.active if t.id in self.exited]
        for task in ended:
            if task.pid not in self.children or task.ended_at is not None:
                return
            self._reap(task)
            if self._leftovers_possible(task):
                return
            self._clean_exits.add(task.id)
        try:
            runner.release(warm)
        except OSError:  # the wrapper is gone: the tick starts the task afresh
            return
        self._released = succ.task.id
        self.let_go[succ.task.id] = LetGo(warm.pid, warm.start, ops.now())

    def _record_released(self, txn: Txn) -> None:
        """pm.successor promises that the transaction starts the task let go early. Should
        that promise ever break, its agent runs all the same: record it as running rather
        than start it a second time later."""
        task = next((t for t in txn.index.queued if t.id == self._released), None)
        warm = self.warm.pop(self._released, None) if task is not None else None
        if task is None or warm is None:
            return
        log.error("%s (#%d) was let go early but not picked to start; recording it as running", task.name, task.id)
        at = self.let_go[task.id].at
        self._take(txn, pm.adopt(txn.index, txn.now, [pm.Adopted(task.id, warm.pid, warm.start, at, str(self.home.log(task.id)))]))
        self.children[warm.pid] = warm.popen

    def _spawn(self, txn: Txn, tasks: list[Task]) -> bool:
        """Spawn the processes of running tasks that have none (pm's plan.start). Returns
        whether a task could not start (its slot is free again: pm settles once more)."""
        freed = False
        for task in tasks:
            try:
                if not self._worktree_ready(task):
                    continue  # being created off the lock; the tick after it is done starts the agent
            except Exception as err:  # WorktreeError, or whatever git or the disk raised
                self._take(txn, pm.Plan(events=pm.start_failed(txn.index, task, txn.now, 1, f"could not create its worktree: {err}")))
                freed = True
                continue
            cwd, env = self._workplace(task)
            if task.token is None:  # admitted by a kugetsu from before tokens
                task.token = runner.new_token()
            try:
                spawned = self._start_process(task, cwd, env)
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    # Its exit file cannot be allocated: it must not start. The whole
                    # transaction fails, and is retried with backoff.
                    raise DiskFull(f"disk full: cannot start {task.name} (#{task.id}): {err.strerror}") from None
                self._take(txn, pm.Plan(events=pm.start_failed(txn.index, task, txn.now, 127, f"could not start: {err}")))
                freed = True
                continue
            except ValueError as err:  # an argv exec cannot take (NUL byte)
                self._take(txn, pm.Plan(events=pm.start_failed(txn.index, task, txn.now, 127, f"could not start: {err}")))
                freed = True
                continue
            at = self.let_go[task.id].at if task.id == self._released else ops.now()
            self.let_go[task.id] = LetGo(spawned.pid, spawned.start, at)
            self.children[spawned.pid] = spawned.popen
            task.pid, task.pid_start, task.log = spawned.pid, spawned.start, str(self.home.log(task.id))
            pm.record_spawn(txn.index, task, at)
            if spawned.start is None:  # it exited before we could look at it
                self.exited.add(task.id)
        return freed

    def _start_process(self, task: Task, cwd: str, env: dict[str, str]) -> runner.Spawned:
        """The task's warm wrapper if it has one (a promotion is then one write to a pipe),
        else a new process."""
        warm = self.warm.pop(task.id, None)
        if warm is not None:
            if task.id == self._released:
                return warm
            if warm.gate is not None and runner.alive(warm.pid, warm.start):
                runner.release(warm)
                return warm
            self._drop(warm)
        return runner.spawn(self.home, task.id, task.name, task.command, cwd, env, token=task.token)

    def _sync_warm(self) -> None:
        """Keep the wrappers of the first WARM_AHEAD queued tasks in start order started and
        waiting, while every slot is busy (with a free slot, tasks start at once anyway): a
        promotion is then one write to a pipe, and no process is started while agents end
        in quick succession (task-spooler's waiting clients do the same). Who starts is still
        decided by pm in the tick; this only prepares the likely ones. Worktree tasks are not
        warmed: their working directory only exists once they start."""
        want: list[Task] = []
        if self.index.queued and pm.free_slots(self.index, self.cfg) == 0:
            order = pm.start_order(self.index, self.cfg, ops.now())[:WARM_AHEAD]
            want = [t for t in order if not t.repo and t.token]
        wanted = {t.id for t in want}
        for task_id in [i for i in self.warm if i not in wanted]:
            self._drop(self.warm.pop(task_id))
        for task in want:
            if task.id in self.warm:
                continue
            try:
                self.warm[task.id] = runner.spawn(
                    self.home, task.id, task.name, task.command, task.cwd, task.env, warm=True, token=task.token
                )
            except (OSError, ValueError):
                pass  # it gets a normal start, and its error, when its turn comes

    def _drop(self, spawned: runner.Spawned) -> None:
        runner.drop(spawned)
        self.dropped.append(spawned.popen)

    def _recovered(self, txn: Txn) -> list[pm.Adopted]:
        """At start-up, after a crash between starting a task's wrapper and committing it: a
        wrapper of ours (same user, the task's token) that runs its agent (a warm one that
        was never released has no child, and exits when it sees its pipe closed), or the
        exit status it recorded, for a queued task or a running one without a pid."""
        candidates = {t.id: t.token for t in txn.index.queued if self.home.log(t.id).exists()}
        # A task back in the queue (a retry, a provider's limit) has the exit file of its last
        # run until it starts again: that end is booked already.
        booked = {t.id: t.attempts[-1].ended_at for t in txn.index.queued if t.attempts}
        unrecorded = [t for t in txn.index.active if t.pid is None and t.stop is None]
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
            out.append(pm.Adopted(task_id, pid, start, at, str(self.home.log(task_id)), code))
            if running:
                log.info("re-adopted task #%d, pid %d, started before a crash", task_id, pid)
        return out

    def _worktree_ready(self, task: Task) -> bool:
        """A worktree task's worktree is created when it starts (a long queue costs no disk),
        in a worker thread: a slow checkout must hold neither the index lock (every CLI
        command waits on it) nor the loop. True once it exists (its fields are then on the
        task); False while it is being made; raises what creating it raised."""
        if not task.repo or task.worktree_state is not None:
            return True
        future = self.preparing.get(task.id)
        if future is None:
            draft = msgspec.structs.replace(task)  # the thread fills in a copy, never the index

            def create() -> Task:
                worktree.create(self.home, draft)
                return draft

            future = self.loop.run_in_executor(self._git_worker(), create)
            future.add_done_callback(lambda _: self.request_tick())
            self.preparing[task.id] = future
        if not future.done():
            return False
        del self.preparing[task.id]
        if future.cancelled():  # only when the service stops; the next one recovers or retries
            return False
        made = future.result()
        task.worktree, task.base_commit, task.worktree_state = made.worktree, made.base_commit, made.worktree_state
        return True

    def _drop_unwanted_worktrees(self) -> None:
        """A task cancelled (or timed out) while its worktree was being made: remove it."""
        live = {t.id for t in self.index.active}
        for task_id, future in list(self.preparing.items()):
            if future.done() and task_id not in live:
                del self.preparing[task_id]
                if not future.cancelled() and future.exception() is None:
                    self.loop.run_in_executor(self._git_worker(), self._remove_unwanted, future.result())

    def _remove_unwanted(self, made: Task) -> None:
        assert made.worktree
        try:
            worktree.remove(made.repo, Path(made.worktree), made.branch)
            log.info("removed the worktree made for %s (#%d): the task ended before it started", made.name, made.id)
        except Exception as err:
            log.warning("could not remove the worktree %s made for %s (#%d): %s", made.worktree, made.name, made.id, err)

    def _git_worker(self) -> ThreadPoolExecutor:
        if self._git is None:
            from concurrent.futures import ThreadPoolExecutor

            self._git = ThreadPoolExecutor(1, thread_name_prefix="kugetsu-git")
        return self._git

    def _workplace(self, task: Task) -> tuple[str, dict[str, str]]:
        """Where and with what environment the agent runs."""
        if not task.repo:
            return task.cwd, task.env
        assert task.worktree and task.branch
        env = {**task.env, "KUGETSU_WORKTREE": task.worktree, "KUGETSU_BRANCH": task.branch}
        return worktree.agent_cwd(task, Path(task.worktree)), env

    # ---- closing worktrees: git in the worker, the outcome in a later transaction ------

    def _start_closes(self) -> None:
        """After a commit: the worktree of each final task still marked `active` goes to the
        git worker to be kept or removed (worktrees.keep). Inspecting and removing it runs git
        (`status`, `worktree remove`, `branch -D` and the repository's hooks), which can take
        seconds: never on the loop, never under the index lock, so the task has already ended
        and its slot gone to the next one. What became of the worktree is booked by the tick
        after the worker is done (_record_closes). A close that a crash or a stop interrupted
        is found again here: the task is still `active` in the index."""
        self._close_due = False
        for task in self.index.finished:
            if task.worktree_state == "active" and task.id not in self.closing:
                draft = msgspec.structs.replace(task)  # the thread works on a copy, never the index
                future = self.loop.run_in_executor(self._git_worker(), self._close_worktree, draft, self.cfg.worktrees.keep)
                future.add_done_callback(lambda _: self.request_tick())
                self.closing[task.id] = future

    def _close_worktree(self, draft: Task, keep: str) -> tuple[Task, str | None]:
        """In the git worker: keep or remove the worktree; (the task as closed, what to say)."""
        try:
            note = worktree.close(self.home, draft, keep)
        except Exception as err:  # WorktreeError, or the disk: never lose work over it, keep it
            draft.worktree_state, note = "kept", f"worktree kept at {draft.worktree} ({err})"
        return draft, note

    def _record_closes(self, txn: Txn) -> None:
        """Book the worktrees the git worker has closed: the task's worktree_state, its reason
        (the note, e.g. `work kept on branch ...`), and a `worktree` event that says the same."""
        for task_id, future in list(self.closing.items()):
            if not future.done():
                continue
            del self.closing[task_id]
            if future.cancelled():  # only when the service stops; the next one closes it again
                continue
            done, note = future.result()
            task = next((t for t in txn.index.finished if t.id == task_id), None)
            if task is not None:
                if task.worktree_state != "active":
                    continue  # `worktrees prune` got there first, and said so itself
                task.worktree_state = done.worktree_state
                if note:
                    task.reason = f"{task.reason}; {note}" if task.reason else note
            if done.worktree_state == "kept":
                self._disk_check = True
            txn.emit([Event(
                type="worktree", at=txn.now, task=task_id, name=done.name, source=done.source, state=done.state.value,
                reason=note, branch=done.branch, worktree=done.worktree, worktree_state=done.worktree_state,
            )])

    def _reap(self, task: Task) -> None:
        """Reap the task's wrapper, if this service spawned it; how it ended is kept until the
        index records the task's end (should that commit fail, the next one needs it)."""
        popen = self.children.pop(task.pid, None)  # type: ignore[arg-type]
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

    def _exit_status(self, task: Task) -> tuple[int | None, str | None]:
        self._reap(task)
        code = runner.read_exit(self.home, task.id)
        if code is not None:
            return code, None
        returncode = self.returncodes.get(task.pid)  # type: ignore[arg-type]
        if returncode is not None and returncode < 0:
            name = signal.Signals(-returncode).name
            return 128 - returncode, f"killed by {name}"
        return None, None

    def _enforce_max_disk(self, cfg: Config) -> None:
        try:
            for done in ops.enforce_max_disk(self.home, cfg):
                log.info("worktree %s: %s", done.entry.path, done.note)
        except Exception:
            log.exception("worktrees.max_disk check failed")

    # ---- watching processes and deadlines --------------------------------------------

    def _sync_watches(self) -> None:
        # (A task whose agent has ended while it ends its leftovers has no process to watch.)
        active = {t.id: t for t in self.index.active if t.pid is not None and t.ended_at is None}
        for task_id in [i for i in self.watches if i not in active]:
            fd = self.watches.pop(task_id)
            self.loop.remove_reader(fd)
            os.close(fd)
        for task_id, task in active.items():
            if task_id in self.watches:
                continue
            fd = runner.open_pidfd(task.pid, task.pid_start)
            if fd is None:  # already gone: an exit like any other, whose commit may wait for the burst
                self.loop.call_soon(self._on_exit, task_id)
                continue
            self.watches[task_id] = fd
            self.loop.add_reader(fd, self._on_exit, task_id)

    def _on_exit(self, task_id: int) -> None:
        fd = self.watches.pop(task_id, None)
        if fd is not None:
            self.loop.remove_reader(fd)
            os.close(fd)
        self.exited.add(task_id)
        self._safe_tick(hold=True)  # at once, not a loop iteration later: the next task waits on it

    def _sync_jobs(self) -> None:
        """Set the one deadline timer (deadlines.py) at the earliest moment anything falls due:
        pm's deadlines (expiry, run timeouts, SIGKILL after the grace) and the policies'."""
        self.jobs = self._policy_jobs()
        due = min(filter(None, [pm.next_deadline(self.index), *self.jobs.values()]), default=None)
        self.timer.set(due, ops.now())

    def _policy_jobs(self) -> dict[str, datetime]:
        """Wake-ups the scheduling policies need: when a rate limit that holds a task runs
        out (so it starts on time), and a fresh resource reading while the guard holds."""
        index, cfg, now = self.index, self.cfg, ops.now()
        if not index.queued or pm.free_slots(index, cfg) == 0:
            return {}
        jobs = {}
        release = pm.next_release(index, cfg, now)
        if release is not None:
            jobs["rate-limit"] = release
        if pm.guard_hold(cfg, ops.measure(cfg)) is not None:
            # The re-check already set stands until it has come (else every tick would push
            # it back); once it has, the next one is GUARD_RECHECK later, not at once again.
            recheck = self.jobs.get("resource-guard")
            jobs["resource-guard"] = recheck if recheck is not None and recheck > now else now + timedelta(seconds=GUARD_RECHECK)
        return jobs

    # ---- extensions (the Telegram bot) -----------------------------------------------

    async def _start_extensions(self) -> None:
        if self.cfg.metrics.listen is not None:
            from kugetsu import metrics  # prometheus-client is imported only when metrics are on

            self.metrics = metrics.start(self)
        from kugetsu.telegram import resolve_token  # light: no python-telegram-bot yet

        token = resolve_token(self.cfg)
        if not token:
            log.info("telegram bot off: no token (config telegram.token or env KUGETSU_TELEGRAM_TOKEN)")
            return
        try:
            from kugetsu.telegram.bot import TelegramBot  # the heavy import, only with a token

            self.telegram = TelegramBot(self.home, token, lambda: self.cfg)
            self.telegram.start()  # runs in its own task: Telegram being down never blocks us
            self.listeners.append(self.telegram.on_events)
        except Exception:
            log.exception("telegram bot failed to start; the service runs without it")
            self.telegram = None

    async def _stop_extensions(self) -> None:
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)  # waits for its thread's poll (0.5 s): off the loop
        if self.telegram is not None:
            await self.telegram.stop()


def serve(home: Home) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Service(home).run()
