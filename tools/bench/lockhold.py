#!/usr/bin/env python3
"""How long the service holds the index lock per transaction, during a drain of worktree tasks.

    python tools/bench/lockhold.py [--json] [--quick]

Every CLI command waits for that lock, so the longest hold is the longest a `kugetsu
delegate` or `cancel` can be kept waiting by the service. 40 tasks (12 with --quick), each in
its own git worktree, run at two slots; half commit a file (their worktree is kept), half
change nothing (worktree and branch removed). The service runs with a bench-only hook
(`install`, loaded through `python -c` before kugetsu starts) that wraps Store._lock and
Store._unlock and appends each hold to a file after the lock is let go: kugetsu itself
carries no instrumentation, and nothing is measured when the hook is not loaded.

By design a hold lasts up to service.COMMIT_DELAY (20 ms) after an agent's exit, so that
the exits that follow share one commit; what this shows is whether anything else (git,
before worktrees were closed by the git worker) is done with the lock held.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = "KUGETSU_BENCH_LOCKHOLD"  # where the hooked service appends its holds (seconds, one a line)


def install() -> None:
    """In the service's process: record every hold of the index lock."""
    from kugetsu.store.files import Store

    if not (hasattr(Store, "_lock") and hasattr(Store, "_unlock")):
        raise SystemExit("tools/bench/lockhold.py: Store has no _lock/_unlock any more; update the hook")
    out = os.open(os.environ[ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    lock, unlock = Store._lock, Store._unlock

    def _lock(self: Store) -> None:
        lock(self)
        self._bench_locked_at = time.perf_counter()  # type: ignore[attr-defined]

    def _unlock(self: Store) -> None:
        since = getattr(self, "_bench_locked_at", None)
        self._bench_locked_at = None  # type: ignore[attr-defined]
        unlock(self)
        if since is not None:  # written after the lock is let go: the hold is not lengthened
            os.write(out, f"{time.perf_counter() - since:.6f}\n".encode())

    Store._lock, Store._unlock = _lock, _unlock  # type: ignore[method-assign]


BOOT = f"import sys; sys.path.insert(0, {str(HERE)!r}); import lockhold; lockhold.install(); " \
       "from kugetsu.frontends.cli.main import main; sys.exit(main(sys.argv[1:]))"


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def measure(n: int = 40) -> dict:
    sys.path.insert(0, str(HERE))
    from common import PY, Kg, wait_until

    with tempfile.TemporaryDirectory(prefix="kgbench-") as tmp:
        root = Path(tmp)
        repo = root / "repo"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        for i in range(200):  # something for `git status` and the checkout to look at
            (repo / f"f{i}.txt").write_text(f"{i}\n" * 50)
        git(repo, "add", ".")
        git(repo, "-c", "user.name=b", "-c", "user.email=b@example.com", "commit", "-qm", "init")
        kg = Kg(root, max_agents=2, max_queue=n + 10, autostart=False)
        holds = root / "holds"
        env = {**kg.env, ENV: str(holds), "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.com",
               "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.com"}
        service = subprocess.Popen([PY, "-c", BOOT, "serve"], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_until(kg.home.service_pid.exists, 20, "the hooked service to be up")
            t0 = time.monotonic()
            for i in range(n):
                work = f"echo {i} > new{i}.txt; git add new{i}.txt; git commit -qm t{i}" if i % 2 else "true"
                kg.run("delegate", f"t{i}", "--worktree", "--cwd", str(repo), "--", "sh", "-c", work)

            def settled() -> bool:
                tasks = kg.index()["finished"]
                return len(tasks) == n and all(t.get("worktree_state") not in ("active", None) for t in tasks)

            wait_until(settled, 60 + n * 5, "every task to end with its worktree closed")
            wall = time.monotonic() - t0
            kept = sum(1 for t in kg.index()["finished"] if t["worktree_state"] == "kept")
        finally:
            kg.run("shutdown", check=False)
            try:
                service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait()
        held = [float(x) * 1000 for x in holds.read_text().split()]
    return {"tasks": n, "kept": kept, "drain_s": wall, "holds_ms": held}


def rows(res: dict) -> list[tuple[str, float]]:
    from common import pct

    held = res["holds_ms"]
    what = f"{res['tasks']} worktree tasks, {len(held)} transactions"
    return [(f"index lock held by the service p50 ({what})", statistics.median(held)),
            ("index lock held p99", pct(held, 99)), ("index lock held max", max(held))]


def main() -> int:
    sys.path.insert(0, str(HERE))
    from common import part_main

    return part_main(__doc__, "12 tasks instead of 40", lambda quick: measure(12 if quick else 40), rows,
                     lambda res: f"({res['tasks']} tasks, {res['kept']} worktrees kept, drained in {res['drain_s']:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
