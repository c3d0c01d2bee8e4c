"""A real PostgreSQL for the cluster tests: a database of its own per test, dropped after.

Where PostgreSQL is installed (or KUGETSU_TEST_PG names one), the tests must run: a
database that cannot be reached fails them, saying how to start it. A machine without
PostgreSQL skips them, saying why.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ADMIN_URL = os.environ.get("KUGETSU_TEST_PG", "postgresql://127.0.0.1:5432/postgres")
START = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"


def installed() -> bool:
    return bool(os.environ.get("KUGETSU_TEST_PG")) or Path("/etc/postgresql").is_dir() or bool(shutil.which("postgres"))


def admin():  # -> psycopg.Connection
    try:
        import psycopg
    except ImportError as err:
        if installed():
            pytest.fail(f"PostgreSQL is here but psycopg is not installed ({err}): pip install -e '.[test]'")
        pytest.skip(f"no PostgreSQL on this machine and no psycopg ({err})")
    try:
        return psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.Error as err:
        if installed():
            pytest.fail(f"PostgreSQL is installed here but {ADMIN_URL} cannot be reached: {err}\nStart it: {START}")
        pytest.skip(f"no PostgreSQL on this machine ({err})")


def database_url(name: str) -> str:
    return ADMIN_URL.rsplit("/", 1)[0] + "/" + name


@pytest.fixture
def pg_url() -> Iterator[str]:
    """The URL of a new, empty database, dropped after the test."""
    conn = admin()
    name = f"kugetsu_test_{uuid.uuid4().hex[:12]}"
    conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield database_url(name)
    finally:
        from kugetsu.store import postgres as cluster_store

        for s in list(cluster_store._stores.values()):  # this process's connections to it
            if name in s.url:
                s.close()
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        conn.close()
