"""The service's OpenMetrics / Prometheus endpoint (config `metrics.listen`, off by default).

prometheus-client serves the figures from its own thread (start_http_server), so a scrape
never runs on the service's asyncio loop. The figures are not read from files by that
thread: after each commit the service hands its committed index to `observe` (on the loop,
microseconds), which sets the gauges and counts what changed since the last look: tasks
admitted, started and final (by state), their wait and run times, and how long each start
that a freed slot allowed came after the agent's exit (promotion latency). A look sees
every transaction, the CLI's too, since the service ticks after each of them.

Counters start at zero with the service, as counters do; the histograms count from then on.
This module, and prometheus-client with it, is imported only when metrics are on.

Any local user can connect to the endpoint, and prometheus-client's own server spends a
thread on each connection for as long as it stays open. Ours (`_Server`) serves at most
MAX_CONNECTIONS at once (one more is closed at once, no thread) and gives each request
REQUEST_TIMEOUT seconds in all to arrive (a client sending a byte at a time is cut off too).
"""

from __future__ import annotations

import io
import logging
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily

from kugetsu.core import policy, selection

from kugetsu.frontends import guard

from kugetsu.service import runner
from kugetsu.config.model import Config, is_loopback
from kugetsu.agents.report import Usage
from kugetsu.core.models import Index, Task, decode_task
from kugetsu.paths import read_tail

if TYPE_CHECKING:  # the service starts this module, never the other way round
    from kugetsu.service.daemon import Service

log = logging.getLogger("kugetsu.metrics")
# No `*_created` series beside each counter and histogram: kugetsu_service_start_time_seconds
# says when they all began. (A process-wide setting: this process is the service.)
disable_created_metrics()

# Seconds. Waits and runs of agents go from instants to a day; a promotion is milliseconds.
WAIT_BUCKETS = (0.1, 1, 5, 15, 30, 60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400)
RUN_BUCKETS = (1, 10, 30, 60, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400)
PROMOTION_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

MAX_CONNECTIONS = 8  # scrapes served at once: Prometheus sends one at a time per target
# Seconds for a whole request to arrive (a scraper's takes a millisecond), and for each write.
REQUEST_TIMEOUT = guard.HEADER_TIMEOUT


class _Deadline(io.RawIOBase):
    """A connection's reads, all due by one instant: each read of a client that sends its
    request a byte at a time is quick, so a timeout per read would never end it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline = time.monotonic() + REQUEST_TIMEOUT

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(REQUEST_TIMEOUT)  # the answer's writes


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = io.BufferedReader(_Deadline(self.connection))

    def log_message(self, format: str, *args: object) -> None:
        pass  # no line per scrape in the service log


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 64  # a burst is accepted (and the excess closed) rather than left in SYN limbo

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler]):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # all slots busy: closed now, no thread
            return
        try:
            super().process_request(request, client_address)  # type: ignore[arg-type]
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)  # type: ignore[arg-type]
        finally:
            self.slots.release()

    def handle_error(self, request: object, client_address: object) -> None:  # type: ignore[override]
        if not isinstance(sys.exc_info()[1], OSError):  # a timeout or a reset is the client's business
            log.exception("metrics: a scrape failed")


class _Telegram:
    """kugetsu_telegram_undelivered_events{chat}: committed events not yet settled for each
    notify chat (sent, or not wanted). Read at scrape time from the notifier's cursors in
    memory and the last seq the service committed: no file is read."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("kugetsu_telegram_undelivered_events",
                                   "Committed events not yet delivered (or skipped) for a notify chat", labels=["chat"])
        bot = self.metrics.service.telegram
        notifier = bot.notifier if bot is not None else None
        cursors = notifier.cursors if notifier is not None else None
        seqs = dict(cursors.seqs) if cursors is not None else {}  # a copy: the notifier writes it from threads
        for chat, seq in sorted(seqs.items()):
            family.add_metric([str(chat)], max(0, self.metrics.last_seq - seq))
        yield family


class _Usage:
    """What the running tasks use (README, "Resources"), as the service last measured it, read
    at scrape time from its memory (no file, no /proc): per task (by id, with its source and
    preset; a few series while it runs), and the memory declared against max_memory."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        service = self.metrics.service
        index, measured, cfg = service.index, dict(service.measured), service.cfg
        labels = ["task", "source", "agent"]
        families = {
            "memory": GaugeMetricFamily("kugetsu_task_memory_bytes", "A running task's processes' total RSS now",
                                        labels=labels),
            "peak": GaugeMetricFamily("kugetsu_task_memory_peak_bytes", "A running task's largest total RSS measured",
                                      labels=labels),
            "cpu": GaugeMetricFamily("kugetsu_task_cpu_seconds", "CPU seconds a running task's processes used",
                                     labels=labels),
            "procs": GaugeMetricFamily("kugetsu_task_processes", "A running task's processes now", labels=labels),
        }
        for task in index.active:
            m = measured.get(task.id)
            if m is None:
                continue
            key = [str(task.id), task.source, task.agent or ""]
            families["memory"].add_metric(key, m.memory)
            families["peak"].add_metric(key, max(m.peak, task.peak_memory or 0))
            families["cpu"].add_metric(key, m.cpu)
            families["procs"].add_metric(key, m.procs)
        yield from families.values()
        declared = GaugeMetricFamily("kugetsu_memory_declared_bytes", "Memory the running tasks declared")
        declared.add_metric([], sum(policy.memory_of(cfg, t) for t in index.active))
        yield declared
        budget = GaugeMetricFamily("kugetsu_max_memory_bytes", "This machine's max_memory: what its tasks may declare")
        budget.add_metric([], cfg.memory_budget)
        yield budget


class Metrics:
    def __init__(self, service: Service):
        self.service = service
        self.registry = r = CollectorRegistry()
        self.running = Gauge("kugetsu_tasks_running", "Tasks holding a slot", registry=r)
        self.queued = Gauge("kugetsu_tasks_queued", "Tasks waiting in the queue", registry=r)
        self.free = Gauge("kugetsu_slots_free", "Slots free now", registry=r)
        self.max_agents = Gauge("kugetsu_max_agents", "Configured max_agents", registry=r)
        self.group_max = Gauge("kugetsu_group_max_agents", "A group's configured max_agents", ["group"], registry=r)
        self.group_running = Gauge("kugetsu_group_tasks_running", "A group's running tasks", ["group"], registry=r)
        self.group_queued = Gauge("kugetsu_group_tasks_queued", "A group's queued tasks", ["group"], registry=r)
        self.admitted = Counter("kugetsu_tasks_admitted", "Tasks admitted", registry=r)
        self.started = Counter("kugetsu_tasks_started", "Tasks started", registry=r)
        self.finished = Counter("kugetsu_tasks_finished", "Tasks that reached a final state", ["state"], registry=r)
        self.wait = Histogram("kugetsu_task_wait_seconds", "From admission to start", buckets=WAIT_BUCKETS,
                              registry=r)
        self.run = Histogram("kugetsu_task_run_seconds", "From start to the final state, for tasks that ran",
                             buckets=RUN_BUCKETS, registry=r)
        self.promotion = Histogram("kugetsu_promotion_latency_seconds",
                                   "From an agent's exit to the start of the queued task that took its slot",
                                   buckets=PROMOTION_BUCKETS, registry=r)
        self.start_time = Gauge("kugetsu_service_start_time_seconds", "When the service started (Unix time)",
                                registry=r)
        # Usage (issue 30), as the agents reported it: counted from the index's spending of the
        # day (budgets.book), mid-run too where an agent streams it.
        self.tokens = {kind: Counter(f"kugetsu_{kind}_tokens", f"Tokens used, by {kind} and direction (in, out)",
                                     [kind, "direction"], registry=r) for kind in ("source", "agent")}
        self.cost = {kind: Counter(f"kugetsu_{kind}_cost_usd", f"Cost in US dollars the agents reported, by {kind}",
                                   [kind], registry=r) for kind in ("source", "agent")}
        self.fallbacks = Counter("kugetsu_tasks_fallback_started", "Tasks started on a fallback preset (failover)",
                                 ["agent", "fallback_from"], registry=r)
        self._spent: tuple[str, dict[str, dict[str, Usage]]] | None = None  # the day's spending at the last look
        r.register(_Telegram(self))
        r.register(_Usage(self))
        for state in ("succeeded", "failed", "cancelled", "expired", "lost"):
            self.finished.labels(state=state)  # every state shows, at 0 until it happens
        self.last_seq = 0
        self._groups: set[str] = set()
        # The live tasks at the last look, id -> started. Not the Task objects: the service
        # changes its index in place in the next transaction. None: no look yet.
        self._live: dict[int, bool] | None = None
        self._final: set[int] = set()  # ids of final tasks already counted (pruned to the index's)
        self._top_id = 0  # the highest task id seen: above it, a task is new
        self.server: WSGIServer | None = None
        self.port: int | None = None
        self._failed = False  # logged once

    # ---- the endpoint ------------------------------------------------------------------

    def start(self, host: str, port: int) -> int:
        """Serve in prometheus-client's own thread; returns the port (0 asks for any free one)."""
        self.start_time.set(time.time())
        self.server = make_server(host, port, make_wsgi_app(self.registry), _Server, _Handler)
        threading.Thread(target=self.server.serve_forever, name="kugetsu-metrics", daemon=True).start()
        self.port = self.server.server_port
        return self.port

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # ---- what the service tells us, on its loop after each commit ------------------------

    def observe(self, index: Index, cfg: Config) -> None:
        """Never raises: a bug here must not fail the service's transaction after its commit."""
        try:
            self._observe(index, cfg)
        except Exception:
            if not self._failed:
                log.exception("metrics: could not take in a transaction; the figures may lag")
            self._failed = True

    def _observe(self, index: Index, cfg: Config) -> None:
        self.last_seq = index.next_seq - 1
        self.running.set(len(index.active))
        self.queued.set(len(index.queued))
        self.free.set(selection.free_slots(index, cfg))
        self.max_agents.set(cfg.max_agents)
        usage = selection.group_usage(index, cfg)
        for gone in self._groups - set(usage):  # a group removed from the config leaves the page
            for gauge in (self.group_max, self.group_running, self.group_queued):
                gauge.remove(gone)
        self._groups = set(usage)
        for name, u in usage.items():
            self.group_max.labels(name).set(u["max_agents"])
            self.group_running.labels(name).set(u["active"])
            self.group_queued.labels(name).set(u["queued"])
        self._count_usage(index)
        live = {t.id: t.started_at is not None for t in index.live()}
        if self._live is None:  # the first look: what is already there was not seen happen
            self._live = live
            self._final = {t.id for t in index.finished}
            self._top_id = max([t.id for t in index.all_tasks()], default=0)
            return
        before, self._live = self._live, live
        ended = self._new_finals(index, before, live)
        started = [t for t in (*index.active, *ended) if t.started_at is not None and not before.get(t.id)]
        self.admitted.inc(sum(1 for i in (*live, *(t.id for t in ended)) if i > self._top_id))
        self._top_id = max([self._top_id, *live, *(t.id for t in ended)])
        for t in started:
            self.started.inc()
            if t.fallback_from is not None:
                self.fallbacks.labels(t.agent or "-", t.fallback_from).inc()
            if t.started_at is not None:
                self.wait.observe(max(0.0, (t.started_at - t.created_at).total_seconds()))
        for t in ended:
            self.finished.labels(state=t.state.value).inc()
            if t.started_at is not None and t.finished_at is not None:
                self.run.observe(max(0.0, (t.finished_at - t.started_at).total_seconds()))
        # Promoted: queued at the last look. Freed: held a slot, also one taken since the last
        # look (a short task started and ended inside one held commit frees the slot it took).
        self._promotions([t for t in started if before.get(t.id) is False],
                         [t for t in ended if before.get(t.id) or (t.id in before and t.started_at is not None)])

    def _count_usage(self, index: Index) -> None:
        """What today's spending grew by since the last look (a new day starts from nothing).
        The first look only takes note: what was spent before this service is not counted."""
        spend = index.spend
        now = {"source": dict(spend.sources), "agent": dict(spend.agents)} if spend is not None else {}
        day = spend.day if spend is not None else ""
        last, self._spent = self._spent, (day, now)
        if last is None:
            return
        before = last[1] if last[0] == day else {}
        for kind, ledger in now.items():
            for key, used in ledger.items():
                old = before.get(kind, {}).get(key)
                delta = used - old if old is not None else used
                if delta.input_tokens > 0:
                    self.tokens[kind].labels(key, "in").inc(delta.input_tokens)
                if delta.output_tokens > 0:
                    self.tokens[kind].labels(key, "out").inc(delta.output_tokens)
                if delta.cost_usd:
                    self.cost[kind].labels(key).inc(max(0.0, delta.cost_usd))

    def _new_finals(self, index: Index, before: dict[int, bool], live: dict[int, bool]) -> list[Task]:
        """Tasks final since the last look. New ones are at the end of `finished`; a task
        archived in the very transaction that ended it (history_limit 0) is looked for at the
        end of history.jsonl. (One that a `clean` dropped before the look is not counted:
        clean keeps no trace of it.)"""
        ended = []
        for t in reversed(index.finished):
            if t.id in self._final:
                break
            ended.append(t)
        ended.reverse()
        self._final.update(t.id for t in ended)
        if len(self._final) > 2 * len(index.finished) + 100:  # bounded, whatever the service's age
            self._final = {t.id for t in index.finished}
        missing = set(before) - set(live) - {t.id for t in ended}
        if missing:
            ended += self._archived(missing)
        return ended

    def _archived(self, ids: set[int]) -> list[Task]:
        import msgspec

        found: dict[int, Task] = {}
        for line in read_tail(self.service.home.history, 4096 * len(ids)).splitlines():
            try:
                task = decode_task(line)
            except (msgspec.DecodeError, RecursionError):
                continue
            if task.id in ids and task.state.final:
                found[task.id] = task  # the last line of an id wins, as for every reader
        return list(found.values())

    def _promotions(self, promoted: list[Task], freed: list[Task]) -> None:
        """Pair the tasks that left the queue with the runs that ended in the same look, in
        order: each start's latency is from the agent's exit (when its wrapper wrote the exit
        status) to the start. A start with no end to pair (a slot added, a queue that was
        held) is no promotion."""
        if not promoted or not freed:
            return
        ends = sorted(runner.exit_time(self.service.home, t.id) or t.finished_at for t in freed)  # type: ignore[misc]
        starts = sorted(t.started_at for t in promoted)  # type: ignore[misc]
        for end, start in zip(ends, starts):
            self.promotion.observe(max(0.0, (start - end).total_seconds()))


def start(service: Service) -> Metrics | None:
    """The endpoint for a service whose config asks for one; None (logged) if it cannot bind:
    the service runs on without it, as without the Telegram bot."""
    address = service.cfg.metrics.address
    assert address is not None
    host, port = address
    metrics = Metrics(service)
    try:
        port = metrics.start(host, port)
    except OSError as err:
        log.error("metrics endpoint could not start on %s: %s; the service runs without it", service.cfg.metrics.listen,
                  err.strerror or err)
        return None
    metrics.observe(service.index, service.cfg)
    shown = f"[{host}]" if ":" in host else host
    log.info("metrics on http://%s:%d/metrics%s", shown, port,
             "" if is_loopback(host) else " (reachable from other machines)")
    return metrics
