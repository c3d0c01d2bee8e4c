"""Hostile neighbours (issue 24, items 3, 4 and a part of 9), through the real program and a
real PostgreSQL: two homes that claim one machine name, a password in the store URL, kugetsu's
secrets in the service's environment, a database role without privileges."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from conftest import Kugetsu, wait_for
from test_cluster import Machine, machines  # noqa: F401  (a fixture: homes sharing one database)

PASSWORD = "hunter2-Zq9"  # trust auth on the test server: a password in the URL is accepted, unused


def with_user(url: str, user: str, password: str | None = None) -> str:
    """`url` (postgresql://host:port/db) as `user` (with `password`)."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}{':' + password if password else ''}@{rest}"


def role_url(url: str, password: str = PASSWORD) -> str:
    import psycopg

    with psycopg.connect(url, autocommit=True) as db:
        me = db.execute("SELECT current_user").fetchone()[0]  # type: ignore[index]
    return with_user(url, me, password)


# ---- item 3: one machine name, two homes -------------------------------------------------------


def test_a_second_home_under_a_name_already_held_is_refused_and_the_first_loses_nothing(
        machines: Machine, tmp_path: Path):  # noqa: F811
    a = machines("box")
    a.ok("config", "set", "cluster.lease", "3s")
    a.ok("shutdown")
    a.ok("serve", "--detach")  # a real restart of the same home: its own name, at once
    a.delegate("work", 0.0, 0, gate=a.rec / "go")
    a.wait_state("work", "running")
    b = machines("other", serve=False)
    b.config(store=json.loads(a.home.config.read_text())["store"], host="box", host_max_agents=2)
    r = b.run("serve", "--detach")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "'box'" in r.stderr and str(a.home.root) in r.stderr and "config set host" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and b.service_pid() is None
    (a.rec / "go").touch()
    task = a.wait_state("work", "succeeded", "failed", "lost")
    assert task["state"] == "succeeded" and task["host"] == "box", task
    # Its lease run out (the machine died), the name may be taken over.
    pid = a.service_pid()
    assert pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: b.run("serve", "--detach").returncode == 0, 20, "the name to be free once its lease ran out")
    rows = {r["name"]: r for r in b.json("hosts")}  # type: ignore[union-attr]
    assert rows["box"]["state"] == "up" and rows["box"]["this"]
    r = a.run("serve", "--detach")  # the first home, back: now it is the one refused
    assert r.returncode == 1 and str(b.home.root) in r.stderr, r.stderr


# ---- item 4: secrets outside the secret keys ---------------------------------------------------


def test_a_password_in_the_store_url_is_masked_in_output_and_never_written_to_events(
        kg: Kugetsu, pg_url: str):
    url = role_url(pg_url)
    r = kg.run("config", "set", "store", "-", input=url + "\n")
    assert r.returncode == 0, r.stderr
    assert PASSWORD not in r.stdout + r.stderr and ":***@" in r.stdout, r.stdout
    for args in (["config", "get", "store"], ["config", "show"], ["config", "show", "--json"]):
        out = kg.ok(*args)
        assert PASSWORD not in out and ":***@" in out, (args, out)
    assert PASSWORD not in kg.home.events.read_text()
    # A preset's env holding a database URL is masked the same way, in output and events.
    kg.ok("config", "set", "agents.db", json.dumps({"command": ["true"], "env": {"DATABASE_URL": url}}))
    assert PASSWORD not in kg.ok("config", "get", "agents.db") + kg.ok("config", "show")
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as db:
        bodies = b"".join(bytes(r[0]) for r in db.execute("SELECT body FROM kugetsu.events").fetchall())
    assert bodies and PASSWORD.encode() not in bodies
    assert kg.json("config", "show")["store"] == with_user(pg_url, url.split("://")[1].split(":")[0], "***")  # type: ignore[index]


def test_an_agent_gets_no_kugetsu_secret_from_the_service_s_environment(tmp_path: Path, pg_url: str):
    k = Kugetsu(tmp_path / "m1")
    k.config(host="m1")
    secrets = {
        "KUGETSU_STORE": role_url(pg_url),
        "KUGETSU_MCP_TOKEN": "mcp-token-Xq81",
        "KUGETSU_TELEGRAM_TOKEN": "123456789:telegram-secret-Vb7",
        "KUGETSU_SOMETHING_NEW": "future-secret-Ky3",
        "PGPASSWORD": "pg-password-Lm5",
    }
    k.env.update(secrets)
    k.env["PROVIDER_API_KEY"] = "provider-key-passes"  # the agents' own keys are theirs
    try:
        k.ok("config", "set", "telegram.api_base_url", "http://127.0.0.1:1")
        k.ok("config", "set", "agents.dump", json.dumps({"command": ["sh", "-c", 'env > "$0"', "{prompt}"],
                                                         "env": {"FROM_PRESET": "yes"}}))
        k.ok("serve", "--detach")
        dump = k.rec / "env"
        k.ok("delegate", "dump", "--agent", "dump", "--prompt", str(dump))
        assert k.wait_state("dump", "succeeded", "failed")["state"] == "succeeded"
        env = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
        for name, value in secrets.items():
            assert value not in dump.read_text(), name
        assert PASSWORD not in dump.read_text()
        assert env["PROVIDER_API_KEY"] == "provider-key-passes" and env["FROM_PRESET"] == "yes"
        assert env["KUGETSU_TASK_NAME"] == "dump" and env["KUGETSU_HOME"] == str(k.home.root) and env["PATH"]
        assert "KUGETSU_MCP_TOKEN" not in env and "KUGETSU_TELEGRAM_TOKEN" not in env and "PGPASSWORD" not in env
        # A `kugetsu` the agent runs uses the same queue, with a password from elsewhere (~/.pgpass).
        assert env["KUGETSU_STORE"] == secrets["KUGETSU_STORE"].replace(f":{PASSWORD}@", "@")
    finally:
        k.cleanup()


# ---- item 9 (part): a role without privileges --------------------------------------------------


@pytest.fixture
def weak_role(pg_url: str):
    import psycopg

    name = f"kugetsu_weak_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as db:
        db.execute(f'CREATE ROLE "{name}" LOGIN')
    try:
        yield name
    finally:
        with psycopg.connect(pg_url, autocommit=True) as db:
            db.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'")
            db.execute(f'DROP OWNED BY "{name}"')
            db.execute(f'DROP ROLE "{name}"')


def test_a_role_without_privileges_is_one_line_and_config_unset_store_gets_out(
        tmp_path: Path, pg_url: str, weak_role: str):
    k = Kugetsu(tmp_path / "h")
    k.config(store=with_user(pg_url, weak_role, PASSWORD), host="h")

    def refused(*args: str) -> str:
        r = k.run(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert r.stderr.startswith("kugetsu: ") and weak_role in r.stderr and "GRANT" in r.stderr, r.stderr
        assert PASSWORD not in r.stderr
        return r.stderr

    first = refused("queue")  # a database without kugetsu's tables, which this role cannot create
    assert "CREATE" in first
    owner = Kugetsu(tmp_path / "owner")
    owner.config(store=pg_url, host="owner")
    owner.ok("queue")  # the owner makes the schema; the weak role has no right to it
    for args in (["queue"], ["delegate", "x", "--", "true"], ["config", "get", "store"], ["config", "show"],
                 ["hosts"], ["config", "set", "max_agents", "3"]):
        assert "USAGE" in refused(*args)
    assert k.ok("config", "unset", "store").strip() == "store = null"
    assert json.loads(k.home.config.read_text()) == {"host": "h"}
    assert k.json("queue")["active"] == []  # type: ignore[index]


def test_a_database_of_the_previous_schema_is_upgraded_by_the_first_command(tmp_path: Path, pg_url: str):
    import psycopg

    k = Kugetsu(tmp_path / "m1")
    k.config(store=pg_url, host="m1")
    k.ok("queue")
    with psycopg.connect(pg_url, autocommit=True) as db:  # as kugetsu 0.x left it: no machine ids
        db.execute("ALTER TABLE kugetsu.hosts DROP COLUMN machine, DROP COLUMN home")
        db.execute("DROP TABLE kugetsu.prompts")
        db.execute("UPDATE kugetsu.meta SET schema_version = 1")
    try:
        k.ok("serve", "--detach")
        k.delegate("after", 0.0, 0)
        assert k.wait_state("after", "succeeded")["host"] == "m1"
        with psycopg.connect(pg_url, autocommit=True) as db:
            assert db.execute("SELECT schema_version FROM kugetsu.meta").fetchone() == (5,)
            assert db.execute("SELECT count(*) FROM kugetsu.prompts").fetchone() == (0,)  # made by the upgrade
            assert db.execute("SELECT machine FROM kugetsu.hosts").fetchone() == (k.home.machine_id.read_text().strip(),)
        assert oct(k.home.machine_id.stat().st_mode & 0o777) == "0o600"
    finally:
        k.cleanup()


async def test_the_dashboard_masks_a_url_password_in_an_event_an_older_kugetsu_recorded(tmp_path: Path):
    import msgspec
    from dashboard_data import busy_home, clock, until
    from test_dashboard_layout import app_for

    from kugetsu.core.models import Event
    from kugetsu.frontends.tui.widgets import StateTable

    home = busy_home(tmp_path / "home")
    url = f"postgresql://kugetsu:{PASSWORD}@db/kugetsu"
    with home.events.open("ab") as f:  # written before masking covered URLs
        f.write(msgspec.json.encode(Event(type="config", at=clock(), key="store", value=url, seq=10)) + b"\n")
    app = app_for(home)
    async with app.run_test(size=(120, 30)) as pilot:
        events = app.query_one("#events", StateTable)
        await until(pilot, lambda: "10" in events.keys, what="the config event in the Events pane")
        shown = " ".join(str(cell) for cell in events.get_row("10"))
        assert PASSWORD not in shown and "kugetsu:***@db" in shown, shown

