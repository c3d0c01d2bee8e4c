"""`kugetsu stats`: the pure computation on a history computed by hand, the bounded reader,
and the command against real homes (one written the way the store writes, one made by
real runs)."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone

import msgspec
import pytest

from kugetsu.app import stats
from kugetsu.config.model import Config
from kugetsu.core.models import Event, Index, Run, Task, TaskState
from kugetsu.paths import Home, atomic_write
from kugetsu.store import history
from kugetsu.store.protocol import encode_index

UTC = timezone.utc
NOW = datetime(2025, 3, 14, 12, 0, tzinfo=UTC)
HOUR = 3600.0


def at(hh: int, mm: int, ss: int = 0, base: datetime = NOW) -> datetime:
    """A time of the known history: 11:05 is 55 minutes before `base` (12:00)."""
    return base - timedelta(hours=12 - hh, minutes=-mm, seconds=-ss)


def task(id: int, state: str, created: datetime, started: datetime | None = None, finished: datetime | None = None,
         **kw: object) -> Task:
    return Task(id=id, name=f"t{id}", state=TaskState(state), command=["x"], cwd="/", created_at=created,
                started_at=started, finished_at=finished, **kw)  # type: ignore[arg-type]


def known_history(base: datetime = NOW) -> tuple[Index, list[Task], list[Event]]:
    """The history the expected figures below were computed from, by hand (window: 11:00-12:00).

    #1  pm     opencode      09:00 created+started, 10:00 succeeded        before the window
    #2  pm     opencode      10:30 created, 10:40 started, 11:10 succeeded  ran 30m, 10m of it inside
    #3  pm     claude        11:05, 11:06, 11:16 failed                     waited 1m, ran 10m
    #4  alice  opencode gpu  11:10, 11:30, 11:50 succeeded                  waited 20m, ran 20m
    #5  alice  -             11:20, expired 11:40
    #6  pm     -             11:25, cancelled while queued 11:26
    #7  pm     claude        11:30, 11:45, cancelled while running 11:55    waited 15m, ran 10m
    #8  pm     opencode gpu  11:50 created and started, running now         waited 0, 10m so far
    #9  alice  -             11:55, queued now                              waiting 5m, position 1
    #10 pm     codex         11:00, 11:01, lost 11:31                       waited 1m, ran 30m
    #11 bob    (cleaned away: only its events) 11:40, 11:41, succeeded 11:43  waited 1m, ran 2m
    max_agents: 2 (set at 10:00), 4 from 11:30.
    """
    t = lambda hh, mm: at(hh, mm, base=base)  # noqa: E731
    archived = [
        task(1, "succeeded", t(9, 0), t(9, 0), t(10, 0), source="pm", agent="opencode", exit_code=0),
        task(2, "succeeded", t(10, 30), t(10, 40), t(11, 10), source="pm", agent="opencode", exit_code=0),
    ]
    finished = [
        task(3, "failed", t(11, 5), t(11, 6), t(11, 16), source="pm", agent="claude", exit_code=1),
        task(6, "cancelled", t(11, 25), None, t(11, 26), source="pm"),
        task(10, "lost", t(11, 0), t(11, 1), t(11, 31), source="pm", agent="codex"),
        task(4, "succeeded", t(11, 10), t(11, 30), t(11, 50), source="alice", agent="opencode", group="gpu",
             exit_code=0),
        task(5, "expired", t(11, 20), None, t(11, 40), source="alice"),
        task(7, "cancelled", t(11, 30), t(11, 45), t(11, 55), source="pm", agent="claude", exit_code=143),
    ]
    active = [task(8, "running", t(11, 50), t(11, 50), source="pm", agent="opencode", group="gpu", run=Run(slot=1))]
    queued = [task(9, "queued", t(11, 55), source="alice", expires_at=base + timedelta(hours=23))]
    index = Index(next_id=12, active=active, queued=queued, finished=finished)
    ev = []

    def e(type: str, when: datetime, id: int | None = None, source: str | None = None, **kw: object) -> None:
        ev.append(Event(seq=len(ev) + 1, type=type, at=when, task=id, name=f"t{id}" if id else None, source=source,
                        **kw))  # type: ignore[arg-type]

    e("config", t(10, 0), key="max_agents", value=2)
    e("queued", t(10, 30), 2, "pm")
    e("started", t(10, 40), 2, "pm")
    e("queued", t(11, 0), 10, "pm")
    e("started", t(11, 1), 10, "pm")
    e("queued", t(11, 5), 3, "pm")
    e("started", t(11, 6), 3, "pm")
    e("queued", t(11, 10), 4, "alice")
    e("succeeded", t(11, 10), 2, "pm", exit_code=0)
    e("failed", t(11, 16), 3, "pm", exit_code=1)
    e("queued", t(11, 20), 5, "alice")
    e("queued", t(11, 25), 6, "pm")
    e("cancelled", t(11, 26), 6, "pm")
    e("config", t(11, 30), key="max_agents", value=4)
    e("queued", t(11, 30), 7, "pm")
    e("started", t(11, 30), 4, "alice")
    e("lost", t(11, 31), 10, "pm")
    e("queued", t(11, 40), 11, "bob")
    e("expired", t(11, 40), 5, "alice")
    e("started", t(11, 41), 11, "bob")
    e("succeeded", t(11, 43), 11, "bob", exit_code=0)
    e("started", t(11, 45), 7, "pm")
    e("succeeded", t(11, 50), 4, "alice", exit_code=0)
    e("queued", t(11, 50), 8, "pm")
    e("started", t(11, 50), 8, "pm")
    e("queued", t(11, 55), 9, "alice")
    e("cancelled", t(11, 55), 7, "pm", exit_code=143)
    return index, archived, ev


CFG = msgspec.convert({"max_agents": 4, "groups": {"gpu": {"max_agents": 1}}}, Config)


def window(base: datetime = NOW) -> stats.Window:
    index, archived, events = known_history(base)
    start = base - timedelta(hours=1)
    return stats.Window(start, base, CFG, index, [e for e in events if e.at >= start], archived, max_agents_at_start=2)


def test_totals_match_the_hand_computation():
    report = stats.summarise(window(), host="box")
    total = report["total"]
    assert {k: total[k] for k in ("admitted", "started", "succeeded", "failed", "cancelled", "expired", "lost")} == {
        "admitted": 9, "started": 6, "succeeded": 3, "failed": 1, "cancelled": 2, "expired": 1, "lost": 1}
    assert total["success_rate"] == 3 / 5
    # waits [0, 60, 60, 60, 900, 1200]; runs [120, 600, 600, 1200, 1800, 1800]; nearest rank
    assert total["wait_seconds"] == {"count": 6, "p50": 60, "p95": 1200, "max": 1200}
    assert total["run_seconds"] == {"count": 6, "p50": 600, "p95": 1800, "max": 1800}
    assert total["throughput_per_hour"] == 6  # #2 #3 #4 #7 #10 #11 ran and ended in the hour
    # busy: #2 600 + #3 600 + #4 1200 + #7 600 + #8 600 + #10 1800 + #11 120; slots: 2 for 30m, 4 for 30m
    assert total["busy_slot_seconds"] == 5520
    assert report["available_slot_seconds"] == 2 * 1800 + 4 * 1800
    assert total["utilisation"] == 5520 / 10800
    assert report["longest_waiting"] == [
        {"id": 9, "name": "t9", "source": "alice", "position": 1, "waiting_seconds": 300.0}]
    assert report["window_seconds"] == HOUR and report["max_agents"] == 4


def test_rows_by_source_group_agent_and_host():
    by_source = stats.summarise(window(), "source", host="box")["rows"]
    assert sorted(by_source) == ["alice", "bob", "pm"]
    pm = by_source["pm"]
    assert (pm["admitted"], pm["started"], pm["succeeded"], pm["failed"], pm["cancelled"], pm["lost"]) == (5, 4, 1, 1, 2, 1)
    assert pm["success_rate"] == 1 / 3
    assert pm["wait_seconds"] == {"count": 4, "p50": 60, "p95": 900, "max": 900}
    assert pm["run_seconds"] == {"count": 4, "p50": 600, "p95": 1800, "max": 1800}
    assert pm["busy_slot_seconds"] == 4200 and pm["throughput_per_hour"] == 4
    alice = by_source["alice"]
    assert (alice["admitted"], alice["started"], alice["succeeded"], alice["expired"], alice["busy_slot_seconds"]) == (
        3, 1, 1, 1, 1200)
    assert by_source["bob"]["busy_slot_seconds"] == 120
    # The rows share the slots out: they add up to the total.
    assert sum(r["busy_slot_seconds"] for r in by_source.values()) == 5520

    by_group = stats.summarise(window(), "group", host="box")["rows"]
    assert by_group["gpu"]["busy_slot_seconds"] == 1800  # #4 20m, #8 10m
    assert by_group["gpu"]["group_utilisation"] == 0.5  # of its one slot over the hour
    assert "group_utilisation" not in by_group["-"]

    by_agent = stats.summarise(window(), "agent", host="box")["rows"]
    assert sorted(by_agent) == ["-", "claude", "codex", "opencode"]  # #11 was cleaned: its agent is unknown
    assert by_agent["claude"]["run_seconds"]["count"] == 2 and by_agent["codex"]["lost"] == 1

    by_host = stats.summarise(window(), "host", host="box")["rows"]
    assert list(by_host) == ["box"] and by_host["box"] == stats.summarise(window(), host="box")["total"]


def test_timeline_of_queue_depth_and_starts():
    """The most waiting in each minute of the hour. #8, started at its admission (11:50), never
    waited; #7's arrival and #4's start at 11:30 sharp count arrival first (the peak)."""
    line = stats.timeline(window())
    depth = [0.0] * 60
    for first, last, value in ((0, 1, 1), (5, 6, 1), (10, 19, 1), (20, 24, 2), (25, 26, 3), (27, 29, 2), (30, 30, 3),
                               (31, 39, 2), (40, 40, 3), (41, 41, 2), (42, 45, 1), (55, 59, 1)):
        depth[first:last + 1] = [value] * (last - first + 1)
    assert line["queue_depth"] == depth
    starts = [0.0] * 60
    for minute in (1, 6, 30, 41, 45, 50):
        starts[minute] = 1
    assert line["starts"] == starts


def test_percentiles_by_nearest_rank():
    assert stats.percentiles([]) == {"count": 0, "p50": None, "p95": None, "max": None}
    assert stats.percentiles([5.0]) == {"count": 1, "p50": 5.0, "p95": 5.0, "max": 5.0}
    values = [float(v) for v in range(1, 21)]  # 1..20: p50 is the 10th, p95 the 19th
    assert stats.percentiles(values[::-1]) == {"count": 20, "p50": 10.0, "p95": 19.0, "max": 20.0}


def test_an_empty_home_has_no_rates():
    report = stats.summarise(stats.Window(NOW - timedelta(hours=1), NOW, Config(), Index(), [], []), host="box")
    total = report["total"]
    assert total["admitted"] == 0 and total["success_rate"] is None and total["utilisation"] == 0
    assert total["wait_seconds"]["p50"] is None and report["longest_waiting"] == []


# ---- the reader: from the end, bounded by the window --------------------------------------


def write_home(home: Home, base: datetime, rotate_at: int | None = None) -> None:
    """The known history on disk, written as the store writes it: index.json by atomic write,
    events one JSON object a line (rotated to events.jsonl.1 at seq `rotate_at`), the archived
    tasks in history.jsonl."""
    index, archived, events = known_history(base)
    home.ensure()
    index.next_seq = len(events) + 1
    atomic_write(home.index, encode_index(index))
    lines = [msgspec.json.encode(e) + b"\n" for e in events]
    if rotate_at is None:
        home.events.write_bytes(b"".join(lines))
    else:
        home.events_old.write_bytes(b"".join(lines[: rotate_at - 1]))
        home.events.write_bytes(b"".join(lines[rotate_at - 1 :]))
    home.history.write_bytes(b"".join(msgspec.json.encode(t) + b"\n" for t in archived))
    (home.root / "config.json").write_text(json.dumps({"max_agents": 4, "groups": {"gpu": {"max_agents": 1}},
                                                       "autostart": False}))


@pytest.mark.parametrize("rotate_at", [None, 12, 2])
def test_reader_returns_the_window_across_a_rotation(tmp_path, rotate_at):
    home = Home(tmp_path / "home")
    write_home(home, NOW, rotate_at)
    events, prior = history.events_since(home, NOW - timedelta(hours=1))
    assert [e.seq for e in events] == list(range(4, 28))  # from #10's queued at 11:00 on
    assert prior == 2  # the max_agents that the 11:30 change replaced, set at 10:00
    assert [t.id for t in history.history_since(home, NOW - timedelta(hours=1))] == [2]
    # A torn last line (a crash mid-append) is skipped, and the rest read.
    with open(home.events, "ab") as f:
        f.write(b'{"seq":28,"type":"sta')
    assert [e.seq for e in history.events_since(home, NOW - timedelta(hours=1))[0]][-1] == 27


def bytes_read() -> int:
    """What this process has read through read(2) so far (the kernel counts it)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_reader_never_reads_what_lies_before_the_window(tmp_path):
    """`--since 1h` on a home whose files begin with a GiB (a sparse hole, so it costs no
    disk): the reader reads the hour at the end, not the GiB before it."""
    home = Home(tmp_path / "home")
    write_home(home, NOW)
    for path in (home.events, home.history):
        data = path.read_bytes()
        with open(path, "wb") as f:
            f.truncate(1 << 30)
            f.seek(1 << 30)
            f.write(b"\n" + data)
    before = bytes_read()
    events, _ = history.events_since(home, NOW - timedelta(hours=1))
    archived = history.history_since(home, NOW - timedelta(hours=1))
    assert bytes_read() - before < 1 << 20
    assert len(events) == 24 and [t.id for t in archived] == [2]


def test_prior_max_agents_is_looked_for_only_a_bounded_way_back(tmp_path, monkeypatch):
    home = Home(tmp_path / "home")
    write_home(home, NOW)
    monkeypatch.setattr(history, "PRIOR_LOOKBACK", 50)  # less than the events between 10:00 and 11:00
    assert history.events_since(home, NOW - timedelta(hours=1))[1] is None


# ---- the command ---------------------------------------------------------------------------


def test_stats_command_on_a_known_home(kg):
    now = datetime.now(UTC)
    write_home(kg.home, now)
    r = kg.run("stats", "--since", "1h", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    total = report["total"]
    # The command's clock is a moment past the history's 12:00: #10, admitted at 11:00 sharp,
    # is just outside the hour (its start at 11:01 and its wait are inside).
    assert (total["admitted"], total["started"], total["succeeded"], total["failed"], total["cancelled"],
            total["expired"], total["lost"]) == (8, 6, 3, 1, 2, 1, 1)
    assert total["wait_seconds"] == {"count": 6, "p50": 60, "p95": 1200, "max": 1200}
    assert total["run_seconds"] == {"count": 6, "p50": 600, "p95": 1800, "max": 1800}
    # 2 slots, then 4 (the value before the change found on disk; without it: 4 x 1h = 14400);
    # the 2-slot half is as much shorter as the command started later
    assert report["available_slot_seconds"] == pytest.approx(10800, abs=120)
    # #8 still runs: its part grows with the seconds the command took to start.
    assert 5520 <= total["busy_slot_seconds"] < 5520 + 60
    assert report["longest_waiting"][0]["name"] == "t9"

    rows = json.loads(kg.ok("stats", "--since", "1h", "--by", "agent", "--json"))["rows"]
    assert rows["opencode"]["succeeded"] == 2 and rows["claude"]["failed"] == 1 and rows["codex"]["lost"] == 1
    host = json.loads(kg.ok("stats", "--since", "1h", "--by", "host", "--json"))
    assert list(host["rows"]) == [os.uname().nodename]

    text = kg.ok("stats", "--since", "1h", "--by", "source")
    assert text.startswith("last 1h: ")
    lines = text.splitlines()
    assert lines[2].split() == ["SOURCE", "ADMITTED", "STARTED", "SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED", "LOST",
                                "SUCCESS", "PER", "HOUR", "UTIL"]
    assert lines[3].split()[:9] == ["all", "8", "6", "3", "1", "2", "1", "1", "60%"]
    assert any(line.split()[:2] == ["pm", "4"] for line in lines)
    assert "longest waiting now:" in text and "t9" in text

    # A shorter window sees less: only what happened in the last 10 minutes.
    recent = json.loads(kg.ok("stats", "--since", "10m", "--json"))["total"]
    # (what happened at 11:50 sharp is just outside too)
    assert (recent["admitted"], recent["started"], recent["succeeded"], recent["cancelled"]) == (1, 0, 0, 1)


@pytest.mark.parametrize("args, message", [
    (["--since", "soon"], "'soon' is not a duration"),
    (["--since", "0"], "must be more than 0"),
    (["--since=--"], "--since"),
    (["--by", "colour"], "invalid choice: 'colour'"),
])
def test_bad_arguments_are_refused_plainly_and_write_nothing(kg, args, message):
    r = kg.run("stats", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not kg.home.root.exists()  # not even the home was made


def test_stats_after_real_runs(kg):
    """Through the real store and service: one slot, a task that succeeds, one that fails,
    one cancelled while it waits; the agents record their own times."""
    kg.config(max_agents=1)
    gate = kg.rec / "go"
    kg.delegate("slow", 0.3, 0, "--source", "pm", gate=gate)
    kg.delegate("bad", 0, 3, "--source", "pm")
    kg.delegate("never", 0, 0, "--source", "bob")
    kg.ok("cancel", "never")
    gate.touch()
    kg.ok("wait", "slow")
    kg.wait_state("bad", "failed")
    report = json.loads(kg.ok("stats", "--since", "1h", "--by", "source", "--json"))
    total = report["total"]
    assert (total["admitted"], total["started"], total["succeeded"], total["failed"], total["cancelled"]) == (3, 2, 1, 1, 1)
    assert total["success_rate"] == 0.5 and report["rows"]["bob"]["cancelled"] == 1
    # The figures are the tasks' own times...
    tasks = {n: kg.task(n) for n in ("slow", "bad")}
    t = {n: {k: datetime.fromisoformat(v[k]) for k in ("created_at", "started_at", "finished_at")} for n, v in tasks.items()}
    waits = [(x["started_at"] - x["created_at"]).total_seconds() for x in t.values()]
    runs = [(x["finished_at"] - x["started_at"]).total_seconds() for x in t.values()]
    assert total["wait_seconds"]["max"] == pytest.approx(max(waits), abs=1e-6)
    assert total["run_seconds"]["max"] == pytest.approx(max(runs), abs=1e-6)
    # ...and they hold what the agent recorded of its own run (at least its 0.3 s sleep)
    ran = kg.times("slow")
    assert total["run_seconds"]["max"] >= ran["end"] - ran["start"] >= 0.3
    # bad waited for slow's slot: it started only after slow's agent had ended
    assert t["bad"]["started_at"].timestamp() >= ran["end"]
    assert report["rows"]["pm"]["started"] == 2 and report["longest_waiting"] == []
