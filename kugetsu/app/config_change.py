"""`config set` and `config unset`: the new config validated under the index lock and written with
the transaction (in a cluster, the shared part with the queue).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from kugetsu.app.control import check_wakeable, wake
from kugetsu.app.transaction import settle
from kugetsu.config.keys import has_value, mask_secrets, with_value
from kugetsu.config.load import cluster_config, read_raw, save_raw, validate
from kugetsu.config.model import Config, LOCAL_KEYS
from kugetsu.core.models import Event, Index
from kugetsu.errors import UsageError
from kugetsu.paths import Home
from kugetsu.store.files import open_store


# ---- config ------------------------------------------------------------------------------


def set_config(home: Home, key: str, value: Any, *, remove: bool = False,
               guard: Callable[[Index], None] | None = None) -> Config:
    """Validate, write atomically and apply at once (raising max_agents starts queued tasks).
    `guard`: a check of the index in the same transaction (`group remove`: no live task in it)."""
    check_wakeable(home)
    local = read_raw(home)
    if key == "store" and local.get("store"):
        # Leaving a cluster, or moving to another database: never through the database being
        # left, which may be the very reason (unreachable, a role without privileges). Its
        # queue does not record this machine's change of mind; config.json is the record.
        raw = with_value(local, key, value, remove=remove)
        cfg = validate(raw, home.config, hint="\nNothing was changed.", setting=key)
        save_raw(home, raw)
        return cfg
    store = open_store(home)
    with store.transaction() as txn:  # the index lock also orders config writes
        if guard is not None:
            guard(txn.index)
        local = read_raw(home)
        if key == "store" and not remove and not txn.shared_config:
            _check_joinable(home, local, txn.index)
        if txn.shared_config and key.split(".")[0] not in LOCAL_KEYS:
            # A cluster: the shared config is in the queue row, written in this transaction.
            before = msgspec.json.decode(txn.shared_config)
            shared = with_value(before, key, value, remove=remove)
            cfg = cluster_config(home, local, shared, setting=key)
            _check_unset(cfg, key, remove and shared == before)
            txn.new_config = msgspec.json.encode(shared)
        else:
            raw = with_value(local, key, value, remove=remove)
            if txn.shared_config:
                cfg = cluster_config(home, raw, msgspec.json.decode(txn.shared_config), setting=key)
            else:
                cfg = validate(raw, home.config, hint="\nNothing was changed.", setting=key)
            _check_unset(cfg, key, remove and raw == local)
            save_raw(home, raw)
        txn.emit([Event(type="config", at=txn.now, key=key, value=None if remove else mask_secrets(value, key))])
        settle(txn, cfg)
    wake(home, cfg, txn.index)
    return cfg


def _check_unset(cfg: Config, key: str, removed_nothing: bool) -> None:
    """`config unset` of a key that was not there and has no default (`agents.typo`) is an
    error before anything is written; one that removed an entry (`agents.x`) succeeds."""
    if removed_nothing and not has_value(cfg, key):
        raise UsageError(f"config key {key!r} is not set; nothing was changed")


def _check_joinable(home: Home, local: dict[str, Any], index: Index) -> None:
    """`config set store URL` joins this machine to a cluster as it is: a home with its own
    queue or config would silently lose them from view; `store migrate` moves them."""
    own = [k for k in local if k not in LOCAL_KEYS]
    if index.live() or own:
        what = f"{len(index.live())} queued or running task(s)" if index.live() else f"config keys {', '.join(own)}"
        raise UsageError(f"this home has {what}, which a cluster would not see: `kugetsu store migrate URL`"
                         f" moves them into an empty database; to join an existing cluster, remove them from"
                         f" {home.config} (or let the tasks finish) first")
