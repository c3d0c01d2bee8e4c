"""How index.json, history.jsonl and events.jsonl beside this file were made: by kugetsu as it was
at index version 1 (run with PYTHONPATH=<a checkout of that kugetsu>, the new home's path as its
argument; then the index's `clock.by` was made neutral by hand). Kept to show what they hold."""
import sys
from datetime import timedelta
from kugetsu.paths import Home
from kugetsu.store.files import Store
from kugetsu.config.model import Config
from kugetsu.core import admission, lifecycle
from kugetsu.core.models import INDEX_VERSION
from kugetsu.app import transaction
from kugetsu.agents.report import Usage
assert INDEX_VERSION == 1, "run it with the kugetsu of index version 1"
home = Home(__import__("pathlib").Path(sys.argv[1]))
store = Store(home)
cfg = Config(max_agents=2, history_limit=1)
with store.transaction(transaction.now()) as txn:
    for n in ("archived", "done", "run", "wait"):
        admission.admit(txn.index, cfg, txn.now, admission.Request(cwd="/", name=n, command=["true"]))
    transaction.settle(txn, cfg)  # archived and done start
    for t in list(txn.index.active):
        t.pid, t.pid_start = 40000 + t.id, 1  # start tick 1: no process of this machine is it
        lifecycle.finish(txn.index, t, txn.now, 0)
    transaction.settle(txn, cfg)  # run and wait start; done archives `archived`
    run = next(t for t in txn.index.active if t.name == "run")
    run.pid, run.pid_start, run.paused_at, run.paused_s = 4242, 1, txn.now, 1.5
    run.run_usage = Usage(input_tokens=10, output_tokens=2)
    wait = next(t for t in txn.index.active if t.name == "wait")
    lifecycle.cancel(txn.index, wait, txn.now, 5.0)  # being stopped: stop, kill_at
    wait.pid, wait.pid_start = 4244, 1
    admission.admit(txn.index, cfg, txn.now, admission.Request(cwd="/", name="later", command=["true"]))
    txn.index.clock = None  # not this script's path
# Then `expires_at` was taken out of every task (index.json, history.jsonl): the queued task
# would expire a day after it was made.
