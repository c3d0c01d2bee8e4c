"""An index.json written at index version 1 (tests/index_v1, made by that kugetsu: the run's
fields were in the task itself) is read as it was meant, shown as it was, and written as
version 2 (the task's `run` record) by the next write; its archived tasks read too."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path

from kugetsu.store import history

FIXTURE = Path(__file__).parent / "index_v1"


def _v1_home(kg) -> None:
    kg.config(autostart=False)  # no service: the tasks' processes are made up
    for name in ("index.json", "history.jsonl", "events.jsonl"):
        shutil.copyfile(FIXTURE / name, kg.home.root / name)
        (kg.home.root / name).chmod(0o600)


def _tasks(queue: dict) -> dict[str, dict]:
    return {t["name"]: t for part in ("active", "queued", "finished") for t in queue[part]}


def test_a_version_1_index_reads_and_is_written_as_version_2(kg):
    _v1_home(kg)
    before = kg.json("queue", "--all")
    tasks = _tasks(before)
    run, wait, done, later = tasks["run"], tasks["wait"], tasks["done"], tasks["later"]
    assert (run["state"], run["pid"], run["slot"], run["paused_s"]) == ("running", 4242, 1, 1.5)
    assert run["paused_at"] is not None and run["run_usage"]["input_tokens"] == 10
    assert (wait["pid"], wait["slot"], wait["reason"]) == (4244, 2, "cancelled")
    assert (done["state"], done["pid"], done["slot"]) == ("succeeded", 40002, 2)
    assert (later["state"], later["pid"], later["slot"], later["paused_s"]) == ("queued", None, None, 0.0)
    assert json.loads(kg.home.index.read_text())["version"] == 1  # reading writes nothing

    kg.ok("pause")  # any write
    raw = json.loads(kg.home.index.read_text())
    assert raw["version"] == 2
    stored = {t["name"]: t for part in ("active", "queued", "finished") for t in raw[part]}
    assert stored["run"]["run"]["pid"] == 4242 and stored["run"]["run"]["slot"] == 1 and "pid" not in stored["run"]
    assert stored["wait"]["run"]["stop"] == "cancelled" and stored["wait"]["run"]["kill_at"]
    assert "run" not in stored["later"]
    after = kg.json("queue", "--all")
    assert after["paused"] and after["active"] == before["active"] and after["finished"] == before["finished"]
    assert [{**t, "waiting_for": None} for t in after["queued"]] == [{**t, "waiting_for": None} for t in before["queued"]]
    # A version-1 line of history.jsonl (never rewritten) keeps its run too.
    archived = history.history_since(kg.home, datetime(2000, 1, 1, tzinfo=timezone.utc))
    assert [(t.name, t.run and t.run.pid, t.run and t.run.slot) for t in archived] == [("archived", 40001, 1)]


def test_an_index_without_a_version_is_still_refused(kg):
    _v1_home(kg)
    raw = json.loads(kg.home.index.read_text())
    del raw["version"]
    kg.home.index.write_text(json.dumps(raw))
    r = kg.run("queue")
    assert r.returncode != 0 and "missing required field `version`" in r.stderr


def test_a_cluster_database_of_version_1_reads_its_runs_and_writes_version_2(request, pg_url):
    """The fixture's state as a kugetsu of version 1 kept it in the cluster's database (the
    state row's document without its tasks, a row per task holding its flat JSON, a history row):
    read with each run, and the first commit writes the document and the running tasks' rows as
    version 2."""
    from kugetsu.store.postgres import UPSERT_TASK, PgStore

    raw = json.loads((FIXTURE / "index.json").read_text())
    store = PgStore(pg_url)
    request.addfinalizer(store.close)
    doc = {**raw, "active": [], "queued": [], "finished": []}
    # Each row as kugetsu wrote it (msgspec: compact), so a row left as it was reads back unchanged.
    rows = [(t["id"], lst, place, 1, t.get("state", "queued"), t["name"], None, json.dumps(t, separators=(",", ":")).encode())
            for lst, part in enumerate(("active", "queued", "finished")) for place, t in enumerate(raw[part])]
    store.conn.execute("DELETE FROM kugetsu.tasks")
    for row in rows:
        store.conn.execute(UPSERT_TASK, row)
    store.conn.execute("UPDATE kugetsu.state SET doc = %s, rev = 1, next_ord = %s", (json.dumps(doc).encode(), len(rows)))
    archived = (FIXTURE / "history.jsonl").read_bytes().strip()
    store.conn.execute("INSERT INTO kugetsu.history (id, finished_at, body) VALUES (1, %s, %s)",
                       (json.loads(archived)["finished_at"], archived))

    def runs(index) -> dict[str, tuple[int | None, int | None, object]]:
        return {t.name: (t.run.pid, t.run.slot, t.run.stop) if t.run else (None, None, None) for t in index.all_tasks()}

    want = {"run": (4242, 1, None), "wait": (4244, 2, "cancelled"), "done": (40002, 2, None), "later": (None, None, None)}
    assert runs(store.read()) == want
    with store.transaction() as txn:
        assert runs(txn.index) == want
        txn.index.paused = True
    assert json.loads(bytes(store.conn.execute("SELECT doc FROM kugetsu.state").fetchone()[0]))["version"] == 2
    bodies = {name: json.loads(bytes(body)) for name, body in store.conn.execute("SELECT name, body FROM kugetsu.tasks")}
    assert bodies["run"]["run"]["pid"] == 4242 and "pid" not in bodies["run"] and "run" not in bodies["later"]
    fresh = PgStore(pg_url)
    request.addfinalizer(fresh.close)
    assert runs(fresh.read()) == want
    assert [(t.name, t.run.pid) for t in fresh.history_since(datetime(2000, 1, 1, tzinfo=timezone.utc)) if t.run] \
        == [("archived", 40001)]
