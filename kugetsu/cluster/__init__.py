"""Cluster mode (docs/architecture.md §10): several machines share one queue through PostgreSQL.

Loaded only when the config names a `store` (or KUGETSU_STORE is set): the file store of a
single machine never imports psycopg.

- db.py: connecting (errors worded for people), the schema.
- store.py: PgStore, the StoreProtocol on the database (one row lock serializes writers).
- hosts.py: the machines, their heartbeats and leases, and fencing.
- logs.py: agents' output shipped to the database in bounded chunks.
- migrate.py: `kugetsu store migrate`, a file home into the database.
"""
