"""Loading config.json: read, validate (with the built-in presets), the cluster's shared config
merged with this machine's, the store's URL, and saving.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import msgspec
import msgspec.inspect

from kugetsu.config.explain import _explain_invalid, describe_decode_error, InvalidConfig
from kugetsu.config.model import Config, DEFAULT_AGENTS, LOCAL_KEYS, STORE_ENV
from kugetsu.errors import FileError
from kugetsu.paths import DISK_FULL, Home, atomic_write, disk_full, read_file


_FIX = "\nNothing was changed. Fix the file (`kugetsu config check` re-checks it) or move it away to use the defaults."


def read_raw(home: Home) -> dict[str, Any]:
    """The file's own content ({} when there is none): what `config set` edits."""
    try:
        data = read_file(home.config)
    except FileNotFoundError:
        return {}
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW: kugetsu never follows a link in its home
            raise FileError(f"{home.config} is a symbolic link; kugetsu never follows a link inside its home"
                            " (another user may have planted it): put the file itself there"
                            " (or remove it to use the defaults)") from None
        raise
    try:
        raw = msgspec.json.decode(data)
    # RecursionError: absurdly deep nesting; UnicodeDecodeError: bytes that are not UTF-8 in a
    # string or a key (msgspec raises it, not DecodeError, there).
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as err:
        raise FileError(describe_decode_error(home.config, data, err) + _FIX) from None
    if not isinstance(raw, dict):
        raise FileError(f"{home.config}: must hold a JSON object {{...}}{_FIX}")
    return raw


def with_builtin_presets(raw: dict[str, Any]) -> dict[str, Any]:
    """A built-in preset named in config.json keeps the built-in keys it does not set (so
    `config set agents.claude.max_agents 2` is all it takes), inside `limit` and `env` too
    (an API key added to its env keeps the variables the built-in one needs)."""
    agents = raw.get("agents")
    if not isinstance(agents, dict) or not any(n in DEFAULT_AGENTS and isinstance(p, dict) for n, p in agents.items()):
        return raw
    merged = dict(agents)
    for name, preset in agents.items():
        base = DEFAULT_AGENTS.get(name)
        if base is None or not isinstance(preset, dict):
            continue
        merged[name] = {**base, **preset}
        for key in ("limit", "env"):
            value = preset.get(key, {})
            if isinstance(value, dict):
                merged[name][key] = {**base.get(key, {}), **value}
    return {**raw, "agents": merged}


def validate(raw: dict[str, Any], where: object = "config.json", hint: str = _FIX, setting: str | None = None) -> Config:
    """The config `raw` holds, or an InvalidConfig naming the key (its real path, not msgspec's
    `agents[...]`), what it takes and how to write it. `setting`: the key `config set` is
    changing; an error at that key needs no file name (the file is not what was wrong)."""
    try:
        return msgspec.convert(with_builtin_presets(raw), Config)
    except msgspec.ValidationError as err:
        key, problem, suggestion = _explain_invalid(raw, str(err))
        if key and setting and (key == setting or key.startswith(setting + ".")):
            where = f"cannot set {setting}"
        elif setting:
            where = f"cannot set {setting}: {where}"
        at = f"key {key!r}: " if key and key != setting and not problem.startswith("unknown key") else ""
        raise InvalidConfig(f"{where}: {at}{problem}{hint}", key, suggestion, setting) from None


def load_config(home: Home) -> Config:
    raw = read_raw(home)
    url = _store_in(raw)
    if url is None:
        key = (str(home.config), msgspec.json.encode(raw))
        global _last_loaded
        if _last_loaded is not None and _last_loaded[0] == key:
            return _last_loaded[1]  # the same file again (delegate reads it twice: before and under the lock)
        cfg = validate(raw, home.config)
        _last_loaded = (key, cfg)
        return cfg
    from kugetsu.store.postgres import store_for  # cluster mode only: psycopg is not light

    return cluster_config(home, raw, store_for(url).read_config())


# The last file config validated, by its path and content: a Config is never changed in place.
_last_loaded: tuple[tuple[str, bytes], Config] | None = None


def _store_in(local: dict[str, Any]) -> str | None:
    """The cluster's database URL: env KUGETSU_STORE wins over this machine's config `store`."""
    url = os.environ.get(STORE_ENV) or local.get("store")
    return str(url) if url else None


def host_name(cfg: Config) -> str:
    """This machine's name in a cluster: config `host`, else its hostname."""
    import socket

    return cfg.host or socket.gethostname()


def cluster_host(cfg: Config) -> str | None:
    """This machine's name when it is in a cluster (tasks there carry the machine they run
    on: placement.ours), None on a machine of its own."""
    return host_name(cfg) if cfg.store else None


def store_url(home: Home) -> str | None:
    """The cluster's database, when this machine is in one (env KUGETSU_STORE, config `store`).
    A config.json that does not parse names no store here: every command that goes on to read
    the config stops on it (with its message), and `doctor` reports it and checks the rest."""
    try:
        return _store_in(read_raw(home))
    except FileError:
        return _store_in({})


def cluster_config(home: Home, local: dict[str, Any], shared: dict[str, Any], setting: str | None = None) -> Config:
    """The effective config of a machine in a cluster: the database's, and its own keys."""
    misplaced = [k for k in local if k not in LOCAL_KEYS]
    if misplaced:
        raise FileError(
            f"{home.config}: holds {', '.join(misplaced)}, which in cluster mode live in the database"
            f" (only {', '.join(LOCAL_KEYS)} stay in this file). Move them with `kugetsu store migrate URL`"
            " or `kugetsu config set KEY VALUE` (it applies to every machine), then remove them here.")
    raw = {**{k: v for k, v in shared.items() if k not in LOCAL_KEYS}, **local, "store": _store_in(local)}
    return validate(raw, f"{home.config} and the cluster's config", hint="\nNothing was changed.", setting=setting)


def save_raw(home: Home, raw: dict[str, Any]) -> None:
    home.ensure()
    try:
        import json  # only `config set`: not on every command's path

        atomic_write(home.config, json.dumps(raw, indent=2, ensure_ascii=False).encode() + b"\n")
    except OSError as err:
        if err.errno in DISK_FULL:  # atomic_write removed its temp file: config.json is as it was
            raise disk_full(home, f"writing {home.config}") from None
        raise
