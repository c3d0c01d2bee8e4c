"""A front end's transaction: the store's, with the config as it is under the index lock, settled
(expiry, starts, history) before it commits; the machine's readings for the resource guard.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

import msgspec

from kugetsu.app.control import check_wakeable
from kugetsu.config.load import cluster_config, load_config, read_raw
from kugetsu.config.model import Config
from kugetsu.core import policy, step
from kugetsu.paths import Home
from kugetsu.store.files import open_store
from kugetsu.store.protocol import StoreProtocol, Txn


def now() -> datetime:
    return datetime.now(timezone.utc)


@contextmanager
def _locked(home: Home, store: StoreProtocol | None = None) -> Iterator[tuple[Txn, Config]]:
    """A transaction, with the config as it is under the index lock: `config set` writes it
    under that lock, so a config read before taking it may already be stale (a lowered
    max_agents overshot by one start). `store`: a long-lived writer's own (the MCP server's
    admissions), else the home's as open_store gives it."""
    check_wakeable(home)  # every transaction here ends with a wake
    with (store or open_store(home)).transaction() as txn:
        yield txn, config_in(home, txn)


def config_in(home: Home, txn: Txn) -> Config:
    """The config as the transaction sees it: in a cluster, the shared part came with the
    queue row (under its lock), so both are of one moment."""
    if not txn.shared_config:
        return load_config(home)
    return cluster_config(home, read_raw(home), msgspec.json.decode(txn.shared_config))


def settle(txn: Txn, cfg: Config, look: policy.Look | None = None) -> None:
    """step.settle in a transaction: every transaction runs it (expiry, starts, history).
    `look`: of this queue or an earlier state of it (a Chain's, core/look.py)."""
    plan = step.settle(txn.index, cfg, txn.now, measure(cfg), look=look)
    txn.emit(plan.events)
    txn.archive.extend(plan.archive)


def measure(cfg: Config) -> policy.Resources | None:
    """The machine's readings for the resource guard; None (and no psutil import) when it is off."""
    if not cfg.resource_guard.enabled:
        return None
    import psutil

    return policy.Resources(
        available_memory=psutil.virtual_memory().available,
        load_per_cpu=os.getloadavg()[0] / (os.cpu_count() or 1),
    )
