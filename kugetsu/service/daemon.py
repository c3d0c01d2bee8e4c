"""The service (`kugetsu serve`): the one long-running process of a KUGETSU_HOME.

This module holds its lifecycle and its executor: each tick gathers what happened
(observations), asks step.tick what to do, carries out the plan and commits, in one store
transaction. It spawns agents as slots free and learns of their exit at once, records the
result and promotes the next task in the same transaction. One APScheduler job (started after
the first tick) wakes it at the earliest of everything that happens at a time (queue expiry,
run timeouts, SIGKILL after the grace, policy wake-ups), others fire the recurring schedules, a loop timer runs a
periodic reconcile; the CLI wakes it through a
Unix datagram socket after each transaction. What to do is always decided by pm.

Its parts: processes.py (spawned, warm and adopted wrappers), exits.py (exit watching and
leftovers), worktree_worker.py (git in a worker thread), deadlines.py (APScheduler: deadlines, schedules),
wakeup.py (the socket), control.py (the single-instance lock, start/stop from outside).
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import logging
import os
import signal
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from datetime import datetime
from typing import TYPE_CHECKING

import msgspec

from kugetsu import agents

from kugetsu.app import control, machines, recurring, transaction, worktrees

from kugetsu.core import lifecycle, limits, placement, policy, retries, skew, step
from kugetsu.core.look import Chain

from kugetsu.service import runner, usage

from kugetsu.store import logtail, tracking
from kugetsu.config.load import host_name, load_config
from kugetsu.config.model import Config
from kugetsu.config.units import format_size
from kugetsu.errors import DiskFull, KugetsuError, Unreachable
from kugetsu.service.exits import Ending, Exits
from kugetsu.service.fastpath import FastPath, HeldCommit, QueueMemo
from kugetsu.agents.report import Usage
from kugetsu.core.models import Event, Index, Task, TaskState
from kugetsu.core.lifecycle import GUARD_RECHECK
from kugetsu.paths import Home, atomic_write, read_head
from kugetsu.service.processes import WARM_AHEAD, WARM_IDLE, LetGo, Processes
from kugetsu.store.files import open_store
from kugetsu.store.protocol import Txn
from kugetsu.service.handoff import HandoffSocket
from kugetsu.service.wakeup import WakeSocket
from kugetsu.service.worktree_worker import WorktreeWorker, workplace

if TYPE_CHECKING:  # imported only where used: psycopg in cluster mode, the others when configured
    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    from kugetsu.cluster.member import Member
    from kugetsu.service.deadlines import DeadlineTimer, ScheduleJobs
    from kugetsu.frontends.metrics import Metrics
    from kugetsu.frontends.telegram.bot import TelegramBot

__all__ = ["COMMIT_DELAY", "GUARD_RECHECK", "RECONCILE_EVERY", "WARM_AHEAD", "Ending", "LetGo", "Service", "serve"]

log = logging.getLogger("kugetsu.service")

_FINAL_STATES = frozenset(s.value for s in TaskState if s.final)

RECONCILE_EVERY = 5.0  # seconds: a safety net; exits and deadlines do not wait for it
LOG_CHECK_EVERY = 2.0  # seconds between looks at the running agents' log sizes (log_max_size)
USAGE_CHECK_EVERY = 1.0  # seconds between reads of the usage streaming agents report mid-run (budgets)
# Seconds without a commit that changed the queue before the heap is given back (Service._trim).
TRIM_AFTER = 0.25
COMMIT_DELAY = 0.02  # seconds an exit's transaction stays open for the exits that follow (fastpath.HeldCommit)
RETRY_FIRST, RETRY_MAX = 0.1, 5.0  # seconds: backoff while transactions fail (a full disk)
# Seconds between two sweeps of finished runs' cgroups (Service._sweep_soon): a sweep takes the
# live tasks' attempts, a copy of every queued task's place (0.3 ms a task of a 4-slot drain at
# 50,000 queued when each end swept), and a cgroup of a run over may wait a second to go.
SWEEP_EVERY = 1.0
SWEEP_TRIES = 30  # sweeps, a second apart, while a run's cgroup is not empty yet (its last processes dying)


class Service:
    def __init__(self, home: Home):
        self.home = home
        self.store = open_store(home)
        self.cfg: Config = Config()
        self.procs = Processes(home, lambda ids: self.store.prompts(ids))
        self.exits = Exits(self.procs, lambda: self._safe_tick(hold=True), self.request_tick)
        self.worktrees = WorktreeWorker(home, self.request_tick)
        self.failing: str | None = None  # why the last transaction failed, while it does
        # The failure is the tick's own (a bug: an exception that is not a write's or the
        # store's): another transaction's commit (a held one flushed) does not end it.
        self._tick_broken = False
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = RETRY_FIRST
        self.memo = QueueMemo()  # what is derived from the queue, kept while it is the same
        # The Looks at the queue, each carrying from the one before what its change left true
        # (core/look.py: a drain's promotion asked ~17 passes of the whole queue without)
        self.looks = Chain(tracking.Assignments(), verify=tracking.VERIFY)
        self.fast = FastPath(home, self.procs, self.exits, self.memo)  # the successor, let go early at an exit
        self.jobs: dict[str, datetime] = {}  # the policies' wake-ups (rate limit, guard re-check)
        # APScheduler's, made after the first tick (_start_scheduler), which leaves what it
        # would have armed in _unarmed: (the plan's release,); None: nothing left to arm.
        self.scheduler: AsyncIOScheduler | None = None
        self.timer: DeadlineTimer | None = None
        self.schedule_jobs: ScheduleJobs | None = None
        self._unarmed: tuple[datetime | None] | None = None
        self._reconcile_handle: asyncio.TimerHandle | None = None
        self.listeners: list[Callable[[list[Event]], None]] = []  # told of each transaction's events
        self.telegram: TelegramBot | None = None
        self.metrics: Metrics | None = None  # the OpenMetrics endpoint, when config metrics.listen is set
        self.index = Index()
        self._last_now: datetime | None = None  # the clock of the last transaction committed (correct_clock)
        self._tick_pending = False
        self._first_tick = True
        # A transaction kept open for a burst of exits (fastpath.HeldCommit).
        self.held = HeldCommit(self.store, lambda: self.loop, self._held_committed, self._failed)
        self._config_stamp: object = ...  # what config.json looked like when last read (... = never)
        self._stopped = False  # the service is stopping: no more ticks (main's finally)
        self._stopping: asyncio.Event | None = None
        self._disk_check = True  # worktrees.max_disk: look at start, then whenever one is kept
        self.member: Member | None = None  # cluster mode: this machine's lease, wake-ups, shipped output
        self._termed: set[int] = set()  # tasks whose stop this service has signalled (one SIGTERM each)
        self._watched_logs: dict[int, str] = {}  # this machine's agents' logs, for log_max_size
        # Budgets: each running run's usage so far, read from its stream, for the next tick.
        self._progress: dict[int, Usage] = {}
        self._usage_check: asyncio.TimerHandle | None = None
        self._usage_sizes: dict[int, int] = {}  # each budgeted log's size at its last read
        self._log_check: asyncio.TimerHandle | None = None
        self._compacting: set[int] = set()  # logs being compacted in a worker thread
        self._cap_failed: set[int] = set()  # logs that could not be compacted (said once)
        # Resources (usage.py): the mode in force, where tasks' cgroups go, the last measurement.
        self.resource_mode = "sampling"
        self.cgroup_base: usage.Base | None = None
        self.sampler = usage.Sampler(home, "sampling")
        self.measured: dict[int, step.Measured] = {}
        self._measure_handle: asyncio.TimerHandle | None = None
        self._measuring = False
        self._cgroups_left = False  # cgroup mode: runs over whose cgroups could not be removed yet
        self._sweep_handle: asyncio.TimerHandle | None = None  # the next sweep, when one was asked for too soon
        self._swept_at = -SWEEP_EVERY  # loop time of the last sweep
        # The heap's free pages go back to the kernel once the queue rests (Service._trim).
        self._trim_handle: asyncio.TimerHandle | None = None
        self._warm_handle: asyncio.TimerHandle | None = None  # the next turn's warm_more
        self._queue_version: int | None = None  # the store's queue_version at the last commit
        self._queue_changed_at = 0.0  # when (loop time) a commit last found it changed

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
        handoff: HandoffSocket | None = None
        self._reconcile_handle = self.loop.call_later(RECONCILE_EVERY, self._reconcile)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stopping.set)
        try:
            # A damaged index stops the service here, before its pid file says it is up;
            # the pid file comes before the first tick, which may already start agents.
            self.store.append_commits()  # folded into index.json as it stops (below)
            self.store.read_ahead()  # kept for the first tick: decoded once
            self._join_cluster()
            self._resources_mode()
            atomic_write(self.home.service_pid, f"{os.getpid()}\n".encode())
            if self.member is None:  # one machine: `kugetsu delegate` hands its request over
                handoff = self._open_handoff()
            # A first tick that fails (a full disk, a record no rule foresaw) is said and retried
            # with backoff, as every later one: the service stays up for the tasks it can serve.
            self._safe_tick()
            log.info("kugetsu service up (pid %d, home %s, max_agents %d)", os.getpid(), self.home.root, self.cfg.max_agents)
            # APScheduler's import (60-90 ms) in a worker thread: the loop meanwhile serves the
            # ends and promotions of the agents the first tick started. Run in the loop, it held
            # the first promotions back 40-60 ms (a drain of 100 through 4 slots begun as the
            # service came up: 0.31-0.40 s, against 0.20-0.26 s once it had settled).
            await asyncio.to_thread(importlib.import_module, "kugetsu.service.deadlines")
            self._start_scheduler()
            await self._start_extensions()
            await self._stopping.wait()
            log.info("kugetsu service stopping; running agents keep running")
        finally:
            self.held.flush()
            # No tick from here on: the exits still to come are booked by the next service, as
            # while none runs (a tick that a timer or a wake-up ran after procs.close() found
            # its warm wrappers dropped and spawned the tasks afresh, with no service to watch them).
            self._stopped = True
            self._book_measured()
            await self._stop_extensions()
            if self.member is not None:
                await asyncio.to_thread(self.member.stop)
            self._reconcile_handle.cancel()
            for handle in (self._log_check, self._usage_check, self._measure_handle, self._trim_handle, self._warm_handle,
                           self._sweep_handle):
                if handle is not None:
                    handle.cancel()
            self.home.usage.unlink(missing_ok=True)  # no service, no measurement to show
            if self.cgroup_base is not None:
                # The last ends' sweep may still be due (SWEEP_EVERY): done here, so that a
                # service stopped right after a run leaves no cgroup of it behind.
                usage.remove_finished(self.cgroup_base, usage.Attempts(self.index.live()), self.index.next_id)
                usage.remove_base(self.cgroup_base)
            if self.timer is not None:
                self.timer.cancel()
            if self.scheduler is not None:
                self.scheduler.shutdown(wait=False)
            self.worktrees.shutdown()
            self.procs.close()
            self.exits.close()
            self.store.fold()  # the last commit: index.json alone is the state while no service runs
            wakeup.close()
            if handoff is not None:
                handoff.close()
            self.home.service_pid.unlink(missing_ok=True)
            os.close(lock_fd)
        return 0

    def _open_handoff(self) -> HandoffSocket | None:
        """The delegate socket (frontends/cli/thin.py): a CLI's delegate, admitted by the very
        cmd_delegate in this loop's transaction (`_handed_transaction`), answered with its output."""
        from kugetsu.frontends.cli import thin  # the CLI's half: what a request says, what it prints

        sock = HandoffSocket(self.home, self.loop, thin.answerer(self.home, self._handed_transaction, self._handed,
                                                                 partial(self._handed_transaction, False), self.looks))
        try:
            return sock if sock.open() else None
        except OSError as err:  # the CLI delegates in its own process, as without a service
            log.warning("no delegate socket (%s): delegates run in the CLI", err)
            return None

    @contextmanager
    def _handed_transaction(self, changes: bool = True) -> Iterator[tuple[Txn, Config]]:
        """A handed-over delegate's transaction: the store's, in this loop, after a burst's held
        commit (so that one failing does not take the other's work with it). It is a CLI's
        transaction in all but the process: it records nothing this service let go (what a
        failed tick let go stays for the next tick), and the queue it changes is not the one
        the fast path's successor was picked from: none is let go early until the tick it asks
        for (`_handed`) picks again, although the store finds the index its own. Not `changes`:
        a handed-over read (`capacity`), which writes nothing, and the successor stands."""
        self.held.flush()
        with self.store.transaction() as txn:
            yield txn, transaction.config_in(self.home, txn)  # as under the lock, as the CLI reads it
            if changes:
                self.fast.successor = None

    def _handed(self) -> None:
        """A handed-over delegate committed: spawn what it started, as its datagram would."""
        self.request_tick()

    @property
    def here(self) -> str | None:
        """This machine's name in a cluster (other machines' tasks are theirs); None: one machine."""
        return self.member.name if self.member is not None else None

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
        self.exits.orphan_tokens()  # reaps orphans that exited, also when no agent ends for a while
        self._safe_tick()

    def _safe_tick(self, hold: bool = False) -> None:
        if self._stopped:
            return
        try:
            self.tick(hold)
        except Exception as err:
            self._failed(err)

    def _failed(self, err: Exception) -> None:
        """A transaction failed (a full disk, a damaged index.json, EIO): nothing it decided
        is on disk, what it let go is in `let_go`. Say so once, not on every retry, and try
        again with backoff; running agents are not affected."""
        what = str(err) if isinstance(err, KugetsuError) else f"{type(err).__name__}: {err}"
        if isinstance(err, Unreachable) and self.failing is not None and self.failing.startswith("database unreachable"):
            what = self.failing  # one outage, however each attempt words its failure
        if what != self.failing:
            if isinstance(err, KugetsuError):  # e.g. index.json damaged by hand: say what, no traceback
                log.error("%s\nRetrying with backoff; running agents are not affected.", err)
            else:
                log.exception("tick failed; retrying with backoff; running agents are not affected")
        self.failing = what
        self._tick_broken = not isinstance(err, (KugetsuError, OSError))
        if self._retry is None:
            self._retry = self.loop.call_later(self._retry_delay, self._retry_tick)
            self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)

    def _retry_tick(self) -> None:
        self._retry = None
        self._safe_tick()

    def _commit_succeeded(self, index: Index, ticked: bool = True) -> None:
        """The index on disk now records everything let go and every exit reaped so far.
        `ticked`: by a whole tick. A held transaction's flush proves the disk writes again,
        not that a tick that raised works now: that one stays on its backoff (else each flush
        asked for the failing tick at once: 47 failures a second, 100 MB of log in 30 min)."""
        self.procs.committed(index)
        self._trim_later()
        if self.failing is not None and (ticked or not self._tick_broken):
            log.info("the index is written again (after: %s)", self.failing)
            self.failing = None
            self._retry_delay = RETRY_FIRST
            self.request_tick()  # start what waited for a commit that works

    def _trim_later(self) -> None:
        """After a commit that changed the queue or read it afresh (the store's queue_version;
        the buffers that scale with the queue were allocated), the heap is trimmed once
        TRIM_AFTER passed without another: not during a drain, whose commits reuse those pages,
        nor at an idle tick (a trim that finds nothing to give back still costs ms at depth)."""
        version = self.store.queue_version()
        if version is None or version == self._queue_version:  # the cluster store: no such version
            return
        self._queue_version = version
        self._queue_changed_at = self.loop.time()
        if self._trim_handle is None:
            self._trim_handle = self.loop.call_later(TRIM_AFTER, self._trim)

    def _trim(self) -> None:
        wait = self._queue_changed_at + TRIM_AFTER - self.loop.time()
        if wait > 0:  # changed again meanwhile
            self._trim_handle = self.loop.call_later(wait, self._trim)
            return
        self._trim_handle = None
        self.loop.run_in_executor(None, runner.trim_heap)  # off the loop: ms at depth

    def tick(self, hold: bool = False) -> None:
        """One transaction that brings the world in line: gather what happened (exits,
        leftovers found, starts that no committed index records), let step.tick decide, carry
        out its plan (spawn, signal), commit, then act on what the commit made true. `hold`
        (after an agent's exit): keep the transaction open, lock and all, for COMMIT_DELAY, so
        that the exits that follow in a burst share its commit (fastpath.HeldCommit)."""
        self._tick_pending = False
        self.procs.stop_warming()
        hold = hold and self.member is None  # a cluster's row lock is every machine's: never held
        hold = hold and not self.held.overdue()  # held for COMMIT_DELAY already: committed now
        # A held transaction already records every agent let go since the last commit (it let
        # them go): only a transaction read afresh, after a commit that failed, lacks them.
        resumed = self.held.holding
        txn = self.held.begin()
        committed_running = {t.id for t in txn.index.active}
        try:
            obs = self._gather(txn, resumed)
            plan = step.tick(txn.index, self.cfg, txn.now, obs, self.looks.latest(txn.index.queued))
            deferred = self._execute(txn, plan, obs, committed_running)
            if hold:
                self.held.hold(txn, COMMIT_DELAY)
            else:
                self.held.commit(txn)
                self._commit_succeeded(txn.index)
        except BaseException:
            self.store.abort()
            raise
        self._after(txn, plan, hold, deferred)

    def _gather(self, txn: Txn, resumed: bool) -> step.Observations:
        """What happened since the last tick, as step.tick reads it: exits (the successor let go
        first, when nothing else changed), leftovers found, starts no committed index records,
        this machine's measurements and, in a cluster, every machine's lease."""
        # Under the index lock, which `config set` holds while it writes config.json:
        # read before it, a lowering of max_agents committed meanwhile was overshot.
        config_changed = self._reload_config(txn)
        cfg, index = self.cfg, txn.index
        # Times a command wrote from a wrong clock, before anything is decided from them;
        # against this service's previous transaction only while it has been up. Only an
        # index another process wrote: what this service wrote is by its own clock.
        wrong = None if txn.unchanged else skew.correct_clock(
            index, cfg, txn.now, None if self._first_tick else self.index, self._last_now)
        if wrong is not None:
            index.clock_error = wrong
            log.warning("clock error: %s", skew.describe_clock_error(wrong))
        obs = step.Observations(resources=transaction.measure(cfg), measured=list(self.measured.values()))
        if self.member is not None:
            self._observe_cluster(txn, obs)
        here = self.here
        if not resumed:
            # Only after a failed commit. Read into the held transaction, they came back as
            # 'strays' once their task had ended in it: a SIGKILL per exit per tick for
            # groups that were gone (21,120 for 200 tasks at 4 slots).
            obs.adopted += self.procs.let_go_seen()
        if self.exits.any_exited and txn.unchanged and not config_changed and self.failing is None:
            self.fast.release(txn)
        obs.exits = [self._with_output(self.exits.seen(t, self._first_tick), t) for t in list(index.active)
                     if t.run.ended_at is None and t.run.pid is not None and placement.ours(t, here)
                     # /proc's word on every agent, watched or not: it finds those that ended
                     # before their pidfd's callback ran, booked in this tick (a 4-slot drain
                     # without it spent ~0.6 ms more of the service's CPU a task: a tick each)
                     and (self.exits.has_exited(t.id) or not runner.alive(t.run.pid, t.run.pid_start))]
        if self.cgroup_base is not None and obs.exits:
            obs.measured += self._kernel_said(index, obs.exits)
        if self.exits.endings or any(t.run.ended_at is not None for t in index.active):
            obs.found = self.exits.look_for_leftovers(txn)
        if self._first_tick:
            obs.adopted += self.procs.recovered(txn)
        if self.worktrees.closing and self.worktrees.record_closes(txn):
            self._disk_check = True
        obs.progress, self._progress = self._progress, {}
        return obs

    def _execute(self, txn: Txn, plan: step.Plan, obs: step.Observations, committed_running: set[int]) -> bool:
        """Carry out what must happen before the commit: the plan's events into the
        transaction, machines gone, the starts spawned. Returns whether starts were deferred
        to the next tick (a cluster spawns only what a commit made this machine's)."""
        cfg, index = self.cfg, txn.index
        for task, err in plan.set_aside:  # once: a task set aside is final
            log.error("%s (#%d) set aside as failed: handling its end raised %s: %s; the other tasks go on",
                      task.name, task.id, type(err).__name__, err, exc_info=err)
        self._take(txn, plan)
        if plan.gone:
            self._declare_gone(txn, plan.gone)
        deferred = False
        if self.member is None:
            # While commits fail, nothing new is let go: what starts is committed first.
            while self.failing is None and self._spawn(txn, plan.start):
                plan.start = self._take(txn, step.settle(index, cfg, txn.now, obs.resources,
                                                                  look=self.looks.latest(index.queued))).start
                plan.release_at = step.release_at(index, cfg, txn.now)  # a slot given again
        else:
            # A cluster: only a start already committed as this machine's is spawned. Were
            # it spawned before its commit, a commit lost with the connection would leave it
            # queued in the database, for another machine to start a second time.
            ready = [t for t in plan.start if t.id in committed_running]
            deferred = len(ready) < len(plan.start)
            if self.failing is None and self._spawn(txn, ready):
                self._take(txn, step.settle(index, cfg, txn.now, obs.resources, obs.here,
                                                      self.looks.latest(index.queued)))
                plan.release_at = step.release_at(index, cfg, txn.now)
                deferred = True
        unpicked = self.fast.unpicked(txn)
        if unpicked is not None:
            self._take(txn, unpicked)
        return deferred

    def _after(self, txn: Txn, plan: step.Plan, hold: bool, deferred: bool) -> None:
        """After the commit (or while it is held): the signals the plan sends, the watches, the
        deadline job, the warm wrappers of the next promotions, the periodic looks."""
        self.index = txn.index
        self._last_now = txn.now
        here = self.here
        # Held: not committed yet, the queue may differ from the last commit's.
        self.memo.at(None if hold else self.store.queue_version())
        # What the successor, the next expiry and the warm wrappers' order ask of the whole
        # queue, asked once: nothing below changes the index.
        look = self.looks.of(self.index.queued)
        self.exits.ticked()
        self.procs.forget_dropped()
        if self.worktrees.preparing:
            self.worktrees.drop_unwanted(self.index)
        self._first_tick = False
        self._signal(plan)
        self.exits.signal_leftovers(plan, self.index)
        self.exits.sync_watches(self.index)
        if self.exits.unlooked(self.index):
            # An agent this tick booked as ended with leftovers possible (an adopted one,
            # whose orphans went to another service): its look starts now, not at the next
            # wake-up (the reconcile, up to 5 s on), so its end and the next start wait for
            # nothing.
            self.request_tick()
        self._sync_jobs(plan.release_at, look)
        if self.member is None:  # in a cluster the next task may start on another machine
            if self.fast.warm(self.index, self.cfg, look):
                self._warm_later(WARM_IDLE)
        else:
            self.member.shipping({t.id: self.home.log(t.id) for t in self.index.active if t.host == self.member.name})
        # After the warm wrappers' order: the successor is its first task when that is a sort.
        self.fast.committed(self.index, self.cfg, look)
        self._watch_logs(here)
        self._watch_usage(here)
        self._watch_resources(here)
        if self.cgroup_base is not None and any(e.task is not None and e.state in _FINAL_STATES for e in plan.events):
            self._sweep_soon()
        if not hold:
            self._committed(txn.events)
        if deferred:
            self.request_tick()  # the starts this tick committed: spawned by the next one

    def _warm_later(self, delay: float) -> None:
        """The rest of the warm wrappers, one a turn of the loop, once no tick came for
        WARM_IDLE (processes.WARM_NOW). As timers, not call_soon: a turn of asyncio's loop
        runs what its poll found ready (an agent's exit, a request) before the timers due, so
        an exit that comes while one is spawned waits for that one alone."""
        if self._warm_handle is not None:
            self._warm_handle.cancel()
        self._warm_handle = self.loop.call_later(delay, self._warm_more)

    def _warm_more(self) -> None:
        self._warm_handle = None
        if not self._stopped and self.procs.warm_more(1):
            self._warm_later(0)

    def _signal(self, plan: step.Plan) -> None:
        """The plan's signals to process groups. A stop's SIGTERM goes once per task, from this
        service alone, on one machine as in a cluster (a cancel marks the task stopping and
        wakes the service), then SIGCONT: a task paused (`pause TASK`, SIGSTOP to its whole
        tree) acts on it once it runs again."""
        for task, sig in plan.signal_groups:
            if sig == signal.SIGTERM:
                if task.id in self._termed:
                    continue  # a stop asked for is signalled once, not at every tick
                self._termed.add(task.id)
            runner.kill_group(task.run.pid, task.run.pid_start, signal.Signals(sig))
            if sig == signal.SIGTERM:
                runner.kill_group(task.run.pid, task.run.pid_start, signal.SIGCONT)
                if task.run.paused_s and task.token:  # was paused: what left its group was stopped too (off the loop)
                    self.loop.run_in_executor(None, runner.signal_tree, task.run.pid, task.run.pid_start, task.token,
                                              signal.SIGCONT)
        if self._termed:
            self._termed &= {t.id for t in self.index.active}
        for stray in plan.strays:
            # Let go before a commit that failed, for a task final by now: it must not run on.
            log.warning("task #%d was let go but is no longer queued or running; stopping it", stray.task)
            runner.kill_group(stray.pid, stray.pid_start, signal.SIGKILL)

    # ---- resources: measured use, limits (usage.py) ---------------------------------------

    def _resources_mode(self) -> None:
        """Decide once, at start, how use is measured and limits enforced: cgroups where this
        service may make them (config resources.mode auto or cgroup), else sampling."""
        cfg = load_config(self.home)
        why = "resources.mode is sampling"
        if cfg.resources.mode != "sampling":
            mode, why = usage.probe(self.home)
            if mode == "cgroup":
                self.cgroup_base = usage.cgroup_base(self.home)
            elif cfg.resources.mode == "cgroup":
                log.error("resources.mode is cgroup, but %s: measuring by sampling instead", why)
            self.resource_mode = mode
        self.sampler.mode = self.resource_mode
        last = usage.read(self.home)
        if last is not None:
            # A service killed while tasks ran (one that stops books their use, _book_measured):
            # its last look holds what their records do not, the peaks above all.
            self.measured = dict(last.tasks)
            self.sampler.resume(last)
        self.procs.confine = self._confine if self.cgroup_base is not None else None
        # Runs that ended while the service was down leave their cgroups: the first look removes them.
        self._cgroups_left = self.cgroup_base is not None
        log.info("resources: %s mode (%s)", self.resource_mode, why)

    def _confine(self, task: Task) -> dict[str, str] | None:
        """cgroup mode: the cgroups a task with limits starts in (its wrapper joins them before
        its agent runs), as the wrapper's environment says it; None: no limit, none needed."""
        memory, procs = policy.memory_of(self.cfg, task), step.max_procs_of(self.cfg, task)
        if self.cgroup_base is None or not (memory or procs):
            return None
        try:
            groups = usage.make_groups(self.cgroup_base, task.id, task.attempt, memory, procs)
        except OSError as err:
            log.warning("cannot create the cgroups of %s (#%d): %s; its limits are enforced by sampling",
                        task.name, task.id, err)
            return None
        self._cgroups_left = True  # to be removed once the run is over
        return {runner.CGROUP_VAR: groups.procs_files()}

    def _kernel_said(self, index: Index, exits: list[step.Exit]) -> list[step.Measured]:
        """cgroup mode: what the kernel did to the tasks that just ended (an OOM kill, a fork
        refused), read at once (a few bytes of /sys): their end is booked as over a limit."""
        out = []
        attempts = {t.id: t.attempt for t in index.active}
        for e in exits:
            groups = usage.groups_of(self.cgroup_base, e.task, attempts.get(e.task, 0))
            if groups is None:
                continue
            oom, refused, peak = groups.read()
            if oom or refused:
                seen = self.measured.get(e.task)
                out.append(step.Measured(task=e.task, memory=0, peak=max(peak, seen.peak if seen else 0),
                                       cpu=seen.cpu if seen else 0.0, procs=0, oom_kills=oom, forks_refused=refused,
                                       attempt=attempts.get(e.task, 0)))
        return out

    def _book_measured(self) -> None:
        """The service stops, its agents run on: what it measured of them goes on their records
        (step.over_limits books it only when a run ends), for the next service to go on from."""
        if not self.measured or self.member is not None or self.failing is not None:
            return  # in a cluster every tick booked it; a store that fails is not written now
        try:
            with self.store.transaction() as txn:
                step.book_all(txn.index, list(self.measured.values()))
        except Exception as err:  # a full disk: the next service goes on from what /proc shows
            log.warning("could not book the running tasks' measured use: %s", err)

    def _watch_resources(self, here: str | None) -> None:
        """After each tick: while this machine runs agents, measure them every
        resources.interval (usage.Sampler, in a worker thread)."""
        if self._measure_handle is None and (self._cgroups_left or any(t.run.pid and placement.ours(t, here)
                                                                        for t in self.index.active)):
            self._measure_handle = self.loop.call_later(self.cfg.resources.interval_s, self._measure)

    def _sweep_soon(self) -> None:
        """A sweep now, or (one ran less than SWEEP_EVERY ago) one when it is up: a drain's
        ends share one."""
        if self._sweep_handle is not None:
            return  # one is due: it sees these ends too
        wait = self._swept_at + SWEEP_EVERY - self.loop.time()
        if wait <= 0:
            self._sweep()
        else:
            self._sweep_handle = self.loop.call_later(wait, self._sweep_due)

    def _sweep_due(self, tries: int = SWEEP_TRIES) -> None:
        self._sweep_handle = None
        if not self._stopped:
            self._sweep(tries)

    def _sweep(self, tries: int = SWEEP_TRIES) -> None:
        """cgroup mode: remove the cgroups of runs that are over, off the loop; while some are
        not empty yet (their last processes being killed), again a second later (`tries` times)."""
        # Every live task's attempt, not as a dict of them (usage.Attempts): at each end of a
        # drain at 50,000 queued that cost 25 ms.
        self._swept_at = self.loop.time()
        live = usage.Attempts(self.index.live())
        job = self.loop.run_in_executor(None, usage.remove_finished, self.cgroup_base, live, self.index.next_id)
        job.add_done_callback(lambda done: self._swept(done, tries))

    def _swept(self, done: asyncio.Future[int], tries: int) -> None:
        """Some were not empty yet: the next sweep a second later, unless one is due anyway (the
        retries and the ends' sweeps are one a second together)."""
        if (done.exception() is None and done.result() and tries > 1 and self._sweep_handle is None
                and not self._stopped):
            self._sweep_handle = self.loop.call_later(SWEEP_EVERY, self._sweep_due, tries - 1)

    def _measure(self) -> None:
        self._measure_handle = None
        here = self.here
        tasks = {t.id: t.token for t in self.index.active if t.run.pid and t.token and placement.ours(t, here)}
        if self._measuring:
            return  # the last look has not finished (a loaded machine): the next one waits for it
        if not tasks and not self.measured and not self._cgroups_left:
            return
        self._cgroups_left = False
        self._measuring = True
        groups = {}
        if self.cgroup_base is not None:
            groups = {t.id: usage.groups_of(self.cgroup_base, t.id, t.attempt)
                      for t in self.index.active if t.id in tasks}
        # The sampler needs the running tasks' attempts; usage.remove_finished every live
        # task's: the queued ones' are kept while the queue is the same (a dict of 50,000 at
        # every look, every 2 s, idle, otherwise).
        live: Mapping[int, int] = {t.id: t.attempt for t in self.index.active}
        if self.cgroup_base is not None:
            live = ChainMap(live, self.memo.get("attempts", None, lambda: usage.Attempts(list(self.index.queued))))
        job = self.loop.run_in_executor(None, self._measure_job, tasks, groups, live, self.index.next_id)
        job.add_done_callback(self._measured)

    def _measure_job(self, tokens: dict[int, str], groups: dict[int, usage.TaskGroups | None], live: Mapping[int, int],
                     next_id: int) -> dict[int, step.Measured]:
        measured = self.sampler.measure(tokens, groups, live)
        self.sampler.publish(measured, transaction.now())
        if self.cgroup_base is not None and usage.remove_finished(self.cgroup_base, live, next_id):
            self._cgroups_left = True  # a look once more, until they are gone
        return measured

    def _measured(self, done: asyncio.Future[dict[int, step.Measured]]) -> None:
        self._measuring = False
        err = done.exception()
        if err is not None:
            log.warning("measuring the running tasks failed: %s", err)
            measured = self.measured
        else:
            measured = self.measured = done.result()
        tasks = {t.id: t for t in self.index.active}
        if any(step.limit_exceeded(self.cfg, t, m) for m in measured.values() if (t := tasks.get(m.task)) is not None):
            self.request_tick()  # pm decides: over a limit, stopped
        if self._measure_handle is None and (tasks or measured or self._cgroups_left):
            self._measure_handle = self.loop.call_later(self.cfg.resources.interval_s, self._measure)

    # ---- log_max_size: each log capped on disk -------------------------------------------

    def _watch_logs(self, here: str | None) -> None:
        """After each tick: the logs of this machine's running agents are looked at every
        LOG_CHECK_EVERY seconds while there are any (none: no timer). A task that ended is
        looked at once more (its last burst)."""
        if self.cfg.log_max_bytes is None:
            self._watched_logs.clear()
            return
        for t in self.index.active:
            if t.log and placement.ours(t, here):
                self._watched_logs[t.id] = t.log
        if self._watched_logs and self._log_check is None:
            self._log_check = self.loop.call_later(LOG_CHECK_EVERY, self._check_logs)

    def _check_logs(self) -> None:
        """One stat per watched log; a log over log_max_size is compacted in a worker thread
        (a copy of a quarter of the cap: never on the loop)."""
        self._log_check = None
        cap = self.cfg.log_max_bytes
        running = {t.id for t in self.index.active}
        for task_id, path in list(self._watched_logs.items()):
            if task_id not in running:
                del self._watched_logs[task_id]  # this look is its last
            if cap is None or task_id in self._compacting:
                continue
            try:
                size = os.stat(path).st_size
            except OSError:
                continue
            if size > cap:
                self._compacting.add(task_id)
                job = self.loop.run_in_executor(None, logtail.compact, path, cap)
                job.add_done_callback(lambda done, task_id=task_id, size=size: self._compacted(task_id, size, done))
        if self._watched_logs:
            self._log_check = self.loop.call_later(LOG_CHECK_EVERY, self._check_logs)

    def _budgeted(self, here: str | None) -> list[Task]:
        """This machine's running tasks whose agent reports usage mid-run, while a budget
        could stop them (their own, or a daily one), or while they probe a quota's new window
        (its first turn ends the probe)."""
        daily = self.cfg.budgets.enabled
        probes = {w.probe for w in self.index.windows.values() if w.probe is not None}
        return [t for t in self.index.active if t.log and t.run.ended_at is None and t.run.stop is None
                and placement.ours(t, here)
                and (daily or t.budget_usd is not None or t.max_tokens is not None or t.id in probes)
                and machines.output_kind(self.cfg, t) == "claude"]

    def _watch_usage(self, here: str | None) -> None:
        """After each tick: while a budgeted task's agent streams its usage, its log's end is
        read every USAGE_CHECK_EVERY seconds (a timer only then)."""
        if self._usage_check is None and self._budgeted(here):
            self._usage_check = self.loop.call_later(USAGE_CHECK_EVERY, self._check_usage, here)

    def _check_usage(self, here: str | None) -> None:
        """What each budgeted run has used so far; a change is booked by a tick (retries.progress),
        which stops a task past its budget."""
        self._usage_check = None
        sizes = {}
        for task in self._budgeted(here):
            try:
                sizes[task.id] = size = os.stat(task.log).st_size  # type: ignore[arg-type]
                if self._usage_sizes.get(task.id) == size:
                    continue  # nothing new since the last read
                tail = logtail.tail(task.log, max_bytes=agents.TAIL_BYTES).data.decode(errors="replace")
            except OSError:
                continue
            run = agents.progress("claude", tail)
            if run is not None and run != task.run.usage:
                self._progress[task.id] = run
        self._usage_sizes = sizes
        if self._progress:
            self.request_tick()
        else:
            self._watch_usage(here)

    def _compacted(self, task_id: int, size: int, done: asyncio.Future[int]) -> None:
        self._compacting.discard(task_id)
        err = done.exception()
        if err is not None:  # e.g. a link planted in its place: said once, the next look retries
            if task_id not in self._cap_failed:
                self._cap_failed.add(task_id)
                log.warning("could not cap task #%d's log (%s); retrying", task_id, err)
        elif done.result():
            log.debug("task #%d's log was %d bytes: %d dropped (log_max_size)", task_id, size, done.result())

    def _with_output(self, seen: step.Exit, task: Task) -> step.Exit:
        """What pm reads in the end of an agent's output (a provider's limit, the session id)."""
        if not task.log or not retries.reads_output(self.cfg, task):
            return seen
        kind = machines.output_kind(self.cfg, task)
        size = agents.TAIL_BYTES if kind != "text" else limits.TAIL_BYTES
        tail = logtail.tail(task.log, max_bytes=size).data
        if kind == "codex":
            # Codex names its thread in a run's first line alone (after a few lines of
            # stderr): a log longer than the tail keeps its first lines with it, or a long run
            # cut short by a limit could not be resumed.
            tail = read_head(task.log, size, 4096) + tail
        return msgspec.structs.replace(seen, tail=tail.decode(errors="replace"))

    def _take(self, txn: Txn, plan: step.Plan) -> step.Plan:
        """Put a plan's events and archive into the transaction."""
        txn.emit(plan.events)
        txn.archive.extend(plan.archive)
        if any(e.worktree for e in plan.events):  # a worktree task ended: close it after the commit
            self.worktrees.close_due = True
        return plan

    # ---- after a commit ------------------------------------------------------------

    def _held_committed(self, txn: Txn) -> None:
        """A held transaction reached the disk (fastpath.HeldCommit.flush)."""
        self._commit_succeeded(txn.index, ticked=False)
        self._committed(txn.events)

    def _committed(self, events: list[Event]) -> None:
        """After a commit: what reads the index from disk, and the listeners, see it now."""
        if self._disk_check and self.cfg.worktrees.max_disk is not None:
            self._disk_check = False
            # Off the loop: measuring worktrees walks their files.
            self.loop.run_in_executor(None, self._enforce_max_disk, self.cfg)
        if self.worktrees.close_due:
            self.worktrees.start_closes(self.index, self.cfg.worktrees.keep)
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

    def _reload_config(self, txn: Txn | None = None) -> bool:
        """Re-read config.json when it changed (it is replaced by rename: a new inode), and in
        a cluster the shared config when the transaction brought a new one. Returns whether
        it changed."""
        try:
            st = os.stat(self.home.config)
            stamp: object = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if txn is not None and txn.shared_config:
            stamp = (stamp, txn.shared_config)
        if stamp == self._config_stamp:
            return False
        try:
            self.cfg = transaction.config_in(self.home, txn) if txn is not None else load_config(self.home)
            self._config_stamp = stamp
        except KugetsuError as err:
            log.error("%s\nKeeping the last valid config.", err)
        return True

    def _spawn(self, txn: Txn, tasks: list[Task]) -> bool:
        """Spawn the processes of running tasks that have none (pm's plan.start). Returns
        whether a task could not start (its slot is free again: pm settles once more)."""
        freed = False
        for task in tasks:
            try:
                if not self.worktrees.ready(task):
                    continue  # being created off the lock; the tick after it is done starts the agent
            except Exception as err:  # WorktreeError, or whatever git or the disk raised
                self._take(txn, step.Plan(events=step.start_failed(txn.index, task, txn.now, 1, f"could not create its worktree: {err}")))
                freed = True
                continue
            cwd, env = workplace(task)
            if task.token is None:  # admitted by a kugetsu from before tokens
                task.token = runner.new_token()
            at = self.fast.start_time(task.id)  # before the agent is let go, never after
            try:
                spawned = self.procs.start(task, cwd, env, released=self.fast.is_released(task.id))
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    # Its exit file cannot be allocated: it must not start. The whole
                    # transaction fails, and is retried with backoff.
                    raise DiskFull(f"disk full: cannot start {task.name} (#{task.id}): {err.strerror}") from None
                self._take(txn, step.Plan(events=step.start_failed(txn.index, task, txn.now, 127, f"could not start: {err}")))
                freed = True
                continue
            except ValueError as err:  # an argv exec cannot take (NUL byte)
                self._take(txn, step.Plan(events=step.start_failed(txn.index, task, txn.now, 127, f"could not start: {err}")))
                freed = True
                continue
            self.procs.started(task.id, spawned, at)
            task.run.pid, task.run.pid_start, task.log = spawned.pid, spawned.start, str(self.home.log(task.id))
            lifecycle.record_spawn(txn.index, task, at)
            if spawned.start is None:  # it exited before we could look at it
                self.exits.mark_exited(task.id)
        return freed

    # ---- cluster mode (docs/architecture.md §10) ------------------------------------------------

    def _join_cluster(self) -> None:
        cfg = load_config(self.home)
        if cfg.store is None:
            return
        from kugetsu.cluster.member import Member  # psycopg: cluster mode only

        slots = cfg.host_max_agents if cfg.host_max_agents is not None else cfg.max_agents
        loop = self.loop
        self.member = Member(cfg.store, host_name(cfg), slots, cfg.cluster.lease_s, self.home,
                             cfg.cluster.log_max_bytes, lambda: loop.call_soon_threadsafe(self.request_tick))
        self.member.start()
        self.member.watch(self.store)
        self.procs.host = self.exits.host = self.member.name
        from kugetsu.cluster.member import SCHEDULER_LEASE

        # The schedules fire on one machine, the lease's holder (their tasks run anywhere).
        # One that takes the lease over registers them afresh: what fell due while no one
        # held it is found missed, and coalesced as after a restart.
        self.member.want(SCHEDULER_LEASE, lambda held: loop.call_soon_threadsafe(self._scheduler_lease, held),
                         "the schedules' lease")

    def _scheduler_lease(self, held: bool) -> None:
        if held:
            if self.schedule_jobs is not None:  # else they are registered afresh as it is made
                self.schedule_jobs.restart()
            self.request_tick()

    def _fires_here(self) -> bool:
        if self.member is None:
            return True
        from kugetsu.cluster.member import SCHEDULER_LEASE

        return self.member.holds(SCHEDULER_LEASE)

    def _observe_cluster(self, txn: Txn, obs: step.Observations) -> None:
        """Every machine's lease, and the directories queued tasks need that this machine
        lacks; first of all, if this machine was declared gone while it was away, fence."""
        member = self.member
        assert member is not None
        with self.store.guarded() as conn:  # the transaction's connection
            obs.hosts = member.observe(conn)
            if member.fenced:
                self._fence(txn)
                try:
                    member.rejoin(conn)
                except KugetsuError as err:  # hosts.NameTaken: another home has this name now
                    log.error("%s. This service stops.", err)
                    self.stop()
                    raise
                obs.hosts = member.observe(conn)
        needed = {placement.needs_dir(t) for t in txn.index.queued}
        # Its own memory budget (max_memory is a machine's own key): what its tasks may declare here.
        obs.here = msgspec.structs.replace(member.here(frozenset(d for d in needed if not os.path.isdir(d))),
                                           max_memory=self.cfg.memory_budget)

    def _fence(self, txn: Txn) -> None:
        """This machine was declared gone: the tasks it ran were ended as lost and their slots
        given away. Whatever of them still runs here is killed now, before anything starts."""
        assert self.member is not None
        mine = {t.id for t in txn.index.active if t.host == self.member.name}
        stale = [t for t in self.index.active if t.host == self.member.name and t.id not in mine and t.run.pid]
        for task in stale:
            log.warning("%s (#%d) was ended as lost while this machine was away: killing it", task.name, task.id)
            runner.kill_group(task.run.pid, task.run.pid_start, signal.SIGKILL)
            if task.token:
                for pid, start in runner.scan_token(task.token).items():
                    runner.signal_pid(pid, start, signal.SIGKILL)

    def _declare_gone(self, txn: Txn, names: list[str]) -> None:
        from kugetsu.cluster import hosts

        log.warning("machine(s) %s stopped answering (lease expired): their running tasks are lost", ", ".join(names))
        with self.store.guarded() as conn:
            hosts.mark_gone(conn, names)

    def _enforce_max_disk(self, cfg: Config) -> None:
        try:
            for done in worktrees.enforce_max_disk(self.home, cfg):
                log.info("worktree %s: %s", done.entry.path, done.note)
        except Exception:
            log.exception("worktrees.max_disk check failed")

    # ---- watching processes and deadlines --------------------------------------------

    def _sync_jobs(self, release: datetime | None, look: policy.Look | None = None) -> None:
        """Set the deadline job (deadlines.py) at the earliest moment anything falls due:
        pm's deadlines (expiry, run timeouts, SIGKILL after the grace) and the policies'
        (`release`: the plan's, computed by step.tick from this very index). `look`: of this
        index's queue, when the caller has one."""
        timer, schedule_jobs = self.timer, self.schedule_jobs
        if timer is None or schedule_jobs is None:  # the first tick: armed as the scheduler starts
            self._unarmed = (release,)  # not the Look: the scheduler starts after an await (the import)
            return
        now = transaction.now()
        self.jobs = lifecycle.policy_wakeups(self.index, self.cfg, now, transaction.measure(self.cfg), self.jobs, release)
        expiry = self.memo.get("expiry", None, lambda: lifecycle.queue_deadline(self.index, look))
        due = min(filter(None, [lifecycle.next_deadline(self.index, expiry), *self.jobs.values()]), default=None)
        timer.set(due, now)
        if self.index.schedules or schedule_jobs.rules:
            schedule_jobs.sync(self.index.schedules, now, self.cfg.schedule_missed)
        else:
            schedule_jobs.catch_up = False  # none yet: one added later starts at its next firing

    def _start_scheduler(self) -> None:
        """APScheduler (deadlines.py), started after the first tick, which then arms what it
        asked for: its import (~35 ms with importlib.metadata) is not paid before the first
        agent starts. A deadline already due fires at once (misfire_grace_time None)."""
        from kugetsu.service.deadlines import DeadlineTimer, ScheduleJobs, new_scheduler

        self.scheduler = new_scheduler()
        self.scheduler.start()
        self.timer = DeadlineTimer(self.scheduler, self._on_deadline)
        self.schedule_jobs = ScheduleJobs(self.scheduler, self._fire_schedule)
        if self._unarmed is not None:  # else the first tick failed: its retry arms them
            # The last tick's release, with the queue looked at afresh, once: a commit since
            # (during the import) may have moved that tick's Look on.
            (release,) = self._unarmed
            self._unarmed = None
            self._sync_jobs(release)

    async def _fire_schedule(self, name: str, at: datetime) -> None:
        """A schedule's firing (deadlines.ScheduleJobs): delegated in a worker thread (its
        checks look at the file system and may run git), recorded on the schedule. In a
        cluster every service has the job and the lease's holder fires it; should two fire
        at once (the lease changing hands), the firing's transaction lets the first one
        through and the other finds it done (schedules.should_fire)."""
        if not self._fires_here():
            return  # a cluster: the machine holding the schedules' lease fires them
        try:
            firing = await asyncio.to_thread(recurring.fire_schedule, self.home, name, at)
        except Exception as err:
            log.error("schedule %s: firing at %s failed: %s", name, at.isoformat(), err)
            return
        if firing is not None:
            log.info("schedule %s: %s", name, firing.note)

    # ---- extensions (the Telegram bot) -----------------------------------------------

    async def _start_extensions(self) -> None:
        if self.cfg.metrics.listen is not None:
            from kugetsu.frontends import metrics  # prometheus-client is imported only when metrics are on

            self.metrics = metrics.start(self)
        from kugetsu.frontends.telegram import resolve_token  # light: no python-telegram-bot yet

        token = resolve_token(self.cfg)
        if not token:
            log.info("telegram bot off: no token (config telegram.token or env KUGETSU_TELEGRAM_TOKEN)")
            return
        if self.member is not None:  # a cluster: only the machine holding the bot's lease runs it
            loop = self.loop
            self.member.want_bot(lambda held: loop.call_soon_threadsafe(
                lambda: asyncio.ensure_future(self._bot_lease_changed(held, token))))
            return
        self._start_bot(token)

    async def _bot_lease_changed(self, held: bool, token: str) -> None:
        if held and self.telegram is None:
            self._start_bot(token)
        elif not held and self.telegram is not None:
            bot, self.telegram = self.telegram, None
            self.listeners.remove(bot.on_events)
            await bot.stop()

    def _start_bot(self, token: str) -> None:
        try:
            from kugetsu.frontends.telegram.bot import TelegramBot  # the heavy import, only with a token

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
    import faulthandler
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <service pid>` writes every thread's stack to the log: what a service that
    # seems stuck is doing, without stopping it.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    return Service(home).run()
