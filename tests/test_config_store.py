"""config.py and store.py against real files in a temp home."""

from __future__ import annotations

import json
import os
import stat

import msgspec
import pytest

from kugetsu.app import config_change, transaction

from kugetsu.core import admission, lifecycle
from kugetsu.config.load import load_config, validate
from kugetsu.config.model import Config
from kugetsu.config.units import format_duration, parse_duration
from kugetsu.errors import FileError, UsageError
from kugetsu.core.models import Event, Index
from kugetsu.paths import Home
from kugetsu.store.files import Store
from kugetsu.store.protocol import encode_index

REPO_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "config.example.json")


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("15m", 900), ("2h", 7200), ("1d", 86400), ("45", 45),
                                          (30, 30), ("1.5h", 5400), (" 5m ", 300)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "5w", "-5s", "0", "0s", "1h30", True, "1e3"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_duration():
    assert [format_duration(s) for s in (5, 90, 900, 3600, 3660, 86400, 90000, 172800, 187200)] == [
        "5s", "1m30s", "15m", "1h", "1h01m", "24h", "25h", "2d", "2d04h"]


def test_example_config_is_valid_and_holds_every_default():
    from kugetsu.config.model import _OPENCODE_PLUGIN

    # The opencode preset loads kugetsu's plugin from where kugetsu is installed: the example
    # shows a typical install's path.
    text = open(REPO_EXAMPLE).read().replace("file:///usr/local/lib/python3.11/site-packages/kugetsu/agents/opencode_plugin.js",
                                             _OPENCODE_PLUGIN)
    raw = json.loads(text)
    assert msgspec.to_builtins(validate(raw)) == msgspec.to_builtins(Config())
    assert set(raw) == set(Config.__struct_fields__)


def test_unknown_key_is_an_error_with_a_suggestion(tmp_path):
    home = Home(tmp_path)
    home.config.write_text('{"max_agent": 4}')
    with pytest.raises(FileError, match=r"unknown key 'max_agent' \(did you mean 'max_agents'\?\)"):
        load_config(home)


def test_bad_value_names_the_key(tmp_path):
    home = Home(tmp_path)
    home.config.write_text('{"telegram": {"notify_chat_ids": ["x"]}}')
    with pytest.raises(FileError, match=r"key 'telegram.notify_chat_ids.0': expected a whole number, got \"x\""):
        load_config(home)
    home.config.write_text('{"max_agents": 65}')
    with pytest.raises(FileError, match=r"key 'max_agents': expected a whole number at most 64, got 65"):
        load_config(home)


def test_json_syntax_error_names_line_and_column(tmp_path):
    home = Home(tmp_path)
    home.config.write_text('{\n  "max_agents": 3,\n}\n')
    with pytest.raises(FileError, match=r"config.json: not valid JSON at line 3, column 1"):
        load_config(home)


def test_set_config_validates_and_keeps_the_file_on_error(tmp_path):
    home = Home(tmp_path / "h")
    config_change.set_config(home, "autostart", False)  # no service needed here
    config_change.set_config(home, "max_agents", 5)
    config_change.set_config(home, "telegram.allowed_chat_ids", [1, 2])
    before = home.config.read_bytes()
    with pytest.raises(FileError, match="expected a whole number at least 1, got 0"):
        config_change.set_config(home, "max_agents", 0)
    with pytest.raises(UsageError, match="unknown config key 'max_agnets'"):
        config_change.set_config(home, "max_agnets", 1)
    assert home.config.read_bytes() == before
    assert json.loads(before) == {"autostart": False, "max_agents": 5, "telegram": {"allowed_chat_ids": [1, 2]}}
    config_change.set_config(home, "max_agents", None, remove=True)
    assert load_config(home).max_agents == 3
    assert stat.S_IMODE(home.config.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.root.stat().st_mode) == 0o700


def test_token_is_masked_in_events(tmp_path):
    home = Home(tmp_path / "h")
    config_change.set_config(home, "autostart", False)
    config_change.set_config(home, "telegram.token", "123:SECRET")
    assert "SECRET" not in home.events.read_text()
    assert "SECRET" not in json.dumps(__import__("kugetsu.config.keys", fromlist=["masked"]).masked(load_config(home)))


# ---- store --------------------------------------------------------------------------------


def _admit(store, name):
    with store.transaction(transaction.now()) as txn:
        task, events = admission.admit(txn.index, Config(), txn.now, admission.Request(cwd="/", name=name, command=["true"]))
        txn.emit(events)
    return task


def test_transaction_writes_atomically_with_private_modes(tmp_path):
    home = Home(tmp_path / "h")
    store = Store(home)
    _admit(store, "a")
    index = store.read()
    assert [t.name for t in index.queued] == ["a"] and index.next_id == 2
    for path in (home.index, home.lock, home.events):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert not list(home.root.glob(".*.tmp"))
    assert [e.seq for e in store.read_events()] == [1]


def test_a_failed_transaction_writes_nothing(tmp_path):
    store = Store(Home(tmp_path / "h"))
    _admit(store, "a")
    before = store.home.index.read_bytes()
    with pytest.raises(RuntimeError):
        with store.transaction(transaction.now()) as txn:
            txn.index.queued.clear()
            raise RuntimeError("boom")
    assert store.home.index.read_bytes() == before


def test_corrupt_index_is_never_overwritten(tmp_path):
    home = Home(tmp_path / "h")
    store = Store(home)
    _admit(store, "a")
    home.index.write_text(home.index.read_text()[:-30])
    broken = home.index.read_bytes()
    with pytest.raises(FileError, match=r"index.json: not valid JSON: it ends early, at line \d+"):
        _admit(store, "b")
    assert home.index.read_bytes() == broken


def test_inconsistent_index_is_refused(tmp_path):
    home = Home(tmp_path / "h")
    store = Store(home)
    _admit(store, "a")
    data = json.loads(home.index.read_text())
    data["next_id"] = 1
    home.index.write_text(json.dumps(data))
    with pytest.raises(FileError, match="not below next_id"):
        store.read()


def test_outbox_recovers_events_lost_between_rename_and_append(tmp_path):
    home = Home(tmp_path / "h")
    store = Store(home)
    _admit(store, "a")
    _admit(store, "b")
    # Simulate a crash after the index rename, before the events append: drop the last line.
    lines = home.events.read_bytes().splitlines(keepends=True)
    home.events.write_bytes(b"".join(lines[:-1]) + b'{"seq":2,"ty')  # and a torn line
    _admit(Store(home), "c")  # the next process after the crash
    seqs = [e.seq for e in store.read_events()]
    assert seqs == [1, 2, 3]


def test_events_rotate_past_the_limit_and_readers_see_both_files(tmp_path):
    home = Home(tmp_path / "h")
    store = Store(home)
    for n in "abc":
        _admit(store, n)
    assert store.rotate_events(10**6) is None and not home.events_old.exists()  # under the limit
    size = home.events.stat().st_size
    assert store.rotate_events(100) == size
    assert not home.events.exists() and home.events_old.stat().st_size == size
    assert stat.S_IMODE(home.events_old.stat().st_mode) == 0o600
    _admit(store, "d")
    assert [e.seq for e in store.read_events()] == [1, 2, 3, 4]
    assert [e.seq for e in store.tail_events(3)] == [2, 3, 4]  # across the two files
    assert [e.seq for e in store.tail_events(1)] == [4]


def test_outbox_recovery_right_after_a_rotation_repeats_nothing(tmp_path):
    home = Home(tmp_path / "h")
    _admit(Store(home), "a")
    Store(home).rotate_events(1)  # events.jsonl is now events.jsonl.1, and there is no new one
    _admit(Store(home), "b")  # another process: it must find seq 1 in the rotated file
    assert [e.seq for e in Store(home).read_events()] == [1, 2]


def test_history_moves_out_beyond_the_limit(tmp_path):
    home = Home(tmp_path / "h")
    home.ensure()
    home.config.write_text('{"history_limit": 2, "max_agents": 5}')
    cfg = load_config(home)
    store = Store(home)
    with store.transaction(transaction.now()) as txn:
        for n in "abcd":
            admission.admit(txn.index, cfg, txn.now, admission.Request(cwd="/", name=n, command=["true"]))
        transaction.settle(txn, cfg)
        for task in list(txn.index.active):
            lifecycle.finish(txn.index, task, txn.now, 0)
        transaction.settle(txn, cfg)
    assert [t.name for t in store.read().finished] == ["c", "d"]
    assert [json.loads(line)["name"] for line in home.history.read_text().splitlines()] == ["a", "b"]


def test_index_is_pretty_and_round_trips():
    index = Index()
    data = encode_index(index)
    assert data.startswith(b'{\n  "version": 2,')
    assert msgspec.json.decode(data, type=Index) == index


def test_event_lines_omit_empty_fields(tmp_path):
    store = Store(Home(tmp_path / "h"))
    with store.transaction(transaction.now()) as txn:
        txn.emit([Event(type="config", at=txn.now, key="max_agents", value=4)])
    line = json.loads(store.home.events.read_text())
    assert set(line) == {"seq", "type", "at", "key", "value"}


def test_the_builtin_presets_patterns_are_regular_expressions():
    """Validation takes the built-in presets' patterns as known good (not compiled on every
    CLI call): this is where they are checked."""
    import re

    from kugetsu.config.model import _BUILTIN_PATTERNS, DEFAULT_AGENTS

    assert len(_BUILTIN_PATTERNS) >= len(DEFAULT_AGENTS)
    for pattern in _BUILTIN_PATTERNS:
        re.compile(pattern)


def test_a_config_read_twice_is_validated_once_and_a_change_is_seen(tmp_path):
    home = Home(tmp_path)
    home.config.write_text('{"max_agents": 3}')
    first = load_config(home)
    assert load_config(home) is first  # delegate reads it before and under the lock
    home.config.write_text('{"max_agents": 4}')
    assert load_config(home).max_agents == 4
    home.config.write_text('{"max_agents": 0}')
    with pytest.raises(FileError, match="max_agents"):
        load_config(home)


def test_open_store_is_one_store_per_home_in_the_main_thread(tmp_path):
    """A process that commits again reuses its Store (and skips decoding its own last
    write); another thread gets a fresh one each time (a server's pool must not keep a copy
    of the queue per thread), so two threads' transactions wait for each other instead of
    being taken for a nested one."""
    import threading

    from kugetsu.store.files import open_store

    home = Home(tmp_path / "h")
    store = open_store(home)
    assert open_store(home) is store and open_store(Home(tmp_path / "other")) is not store
    _admit(store, "a")
    with store.transaction(transaction.now()) as txn:
        assert txn.unchanged  # its own last commit, not decoded again
        other: list[object] = []
        t = threading.Thread(target=lambda: other.extend([open_store(home), open_store(home)]))
        t.start()
        t.join()
        assert other[0] is not store and other[1] is not other[0]

    done = threading.Event()

    def second() -> None:
        _admit(open_store(home), "b")  # waits for the lock the main thread holds
        done.set()

    with store.transaction(transaction.now()):
        t = threading.Thread(target=second)
        t.start()
        assert not done.wait(0.3)
    t.join(10)
    assert done.is_set() and [x.name for x in store.read().queued] == ["a", "b"]


def test_a_long_lived_store_makes_its_home_again_when_it_was_removed(tmp_path):
    """open_store's Store outlives one command (MCP, the bot): a home removed meanwhile is
    made again by the next transaction, as a new Store would."""
    import shutil

    from kugetsu.store.files import open_store

    home = Home(tmp_path / "h")
    _admit(open_store(home), "a")
    shutil.rmtree(home.root)
    _admit(open_store(home), "b")
    assert [t.name for t in open_store(home).read().queued] == ["b"]
    assert stat.S_IMODE(os.stat(home.root).st_mode) == 0o700
