"""Shared pieces of the torture tests: sizes (quick by default, long with KUGETSU_TORTURE=long),
the invariants every test checks on a real home, and a figures record."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kugetsu.core.models import TaskState, check_index, task_record
from kugetsu.paths import Home
from kugetsu.store.files import Store
from kugetsu.store.protocol import encode_index

LONG = os.environ.get("KUGETSU_TORTURE", "").lower() == "long"
FIGURES = Path(__file__).resolve().parent.parent / ".torture-figures.json"


def size(quick: int, long: int) -> int:
    return long if LONG else quick


def record(test: str, **figures: object) -> None:
    """Print the figures (pytest -s shows them) and keep the last ones per test in
    .torture-figures.json, for docs/proof.md."""
    print(f"\n[torture] {test}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    try:
        data = json.loads(FIGURES.read_text())
    except (FileNotFoundError, ValueError):
        data = {}
    data[test] = {"mode": "long" if LONG else "quick", **figures}
    FIGURES.write_text(json.dumps(data, indent=2) + "\n")


def raw_index(home: Home) -> dict:
    """The committed index (index.json and the journal's records after it, as kugetsu's reader
    replays them) as plain JSON, every task with all its fields (the file leaves defaults out).
    FileNotFoundError when there is no index.json yet."""
    if not home.index.exists():
        raise FileNotFoundError(home.index)
    raw = json.loads(encode_index(Store(home).read()))
    for part in ("active", "queued", "finished"):
        raw[part] = [task_record(t) for t in raw.get(part, [])]
    return raw


def check_home(home: Home, max_agents: int | None = None) -> dict:
    """The invariants that must hold at every instant. Returns the decoded index as JSON.

    - index.json parses and validates (kugetsu's own reader) and is pretty-printed JSON;
    - every task is in exactly one of active/queued/finished, with a state that fits;
    - ids are unique and below next_id;
    - running tasks hold distinct slots;
    - queued positions are 1..n in id (FIFO) order.
    """
    index = Store(home).read()  # raises FileError on a torn or invalid file
    assert check_index(index) is None
    raw = raw_index(home) if home.index.exists() else {"active": [], "queued": [], "finished": []}
    ids = [t["id"] for part in ("active", "queued", "finished") for t in raw[part]]
    assert len(ids) == len(set(ids)), f"duplicate task ids: {sorted(ids)}"
    assert all(t.state is TaskState.RUNNING for t in index.active)
    assert all(t.state is TaskState.QUEUED for t in index.queued)
    assert all(t.state.final for t in index.finished)
    slots = [t.run.slot for t in index.active]
    assert len(slots) == len(set(slots)), f"two running tasks share a slot: {slots}"
    # (A slot number may exceed a lowered max_agents: lowering never kills the task in it.)
    assert all(s is not None and 1 <= s <= 64 for s in slots), slots
    from kugetsu.core import selection
    from kugetsu.config.load import load_config
    from kugetsu.app.transaction import now

    pos = selection.positions(index, load_config(home), now())
    assert sorted(pos.values()) == list(range(1, len(index.queued) + 1))
    assert [pos[t.id] for t in sorted(index.queued, key=lambda t: t.id)] == list(range(1, len(index.queued) + 1))
    return raw


def events(home: Home) -> list[dict]:
    """The events kept: events.jsonl.1 (after a rotation), then events.jsonl."""
    lines = []
    for path in (home.events_old, home.events):
        try:
            lines += path.read_text().splitlines()
        except FileNotFoundError:
            pass
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line torn by a kill: its event is re-appended from the outbox
    return out


def check_events(home: Home) -> list[dict]:
    """events.jsonl (and events.jsonl.1): sequence numbers strictly increasing, none repeated."""
    evs = events(home)
    seqs = [e["seq"] for e in evs]
    assert seqs == sorted(set(seqs)), "events.jsonl has repeated or out-of-order seq numbers"
    ats = [e["at"] for e in evs]
    assert ats == sorted(ats) or _same_offsets(ats), "an event's time goes back against its seq"
    return evs


def check_replay(evs: list[dict], max_agents: int) -> int:
    """Replaying the events never shows more than max_agents running (a start recorded after
    a crash comes after the exit that freed its slot). Returns the most seen at once."""
    running: set[int] = set()
    most = 0
    for e in evs:
        if e["type"] == "started":
            running.add(e["task"])
        elif e.get("task") in running and e["type"] in ("succeeded", "failed", "cancelled", "lost"):
            running.discard(e["task"])
        most = max(most, len(running))
        assert len(running) <= max_agents, f"events show {len(running)} running at seq {e['seq']} (max {max_agents})"
    return most


def _same_offsets(ats: list[str]) -> bool:
    from datetime import datetime

    times = [datetime.fromisoformat(a) for a in ats]
    return times == sorted(times)
