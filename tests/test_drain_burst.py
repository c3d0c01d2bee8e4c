"""A drain of quick agents through several slots: a burst of exits, each ticked at once. The
real service and real agents; a queue written into index.json while no service runs (1,200
delegations would take over a minute), a thread of the test that takes the index lock as a
CLI command does, and the agents' own exit codes. Then the exit files used again
(service/spares.py) on real files: what is used, what never is."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from datetime import datetime, timedelta, timezone

from conftest import wait_for

from kugetsu.core.models import Index, Task
from kugetsu.service import runner
from kugetsu.store.protocol import encode_index

TASKS = 1200


def _queue(kg, count: int) -> None:
    """`count` agents behind a gate: task i exits with code i % 3 once rec/go exists."""
    kg.home.root.mkdir(mode=0o700, exist_ok=True)
    now = datetime.now(timezone.utc)
    index = Index(next_id=count + 1)
    gate = kg.rec / "go"
    for i in range(1, count + 1):
        argv = ["sh", "-c", 'while [ ! -e "$0" ]; do sleep 0.01; done; exit "$1"', str(gate), str(i % 3)]
        index.queued.append(Task(id=i, name=f"t{i}", command=argv, cwd="/", created_at=now, token=runner.new_token(),
                                 expires_at=now + timedelta(hours=1)))
    kg.home.index.write_bytes(encode_index(index))


def test_a_burst_of_exits_neither_holds_the_index_lock_nor_mixes_up_exit_codes(kg):
    """The transaction an exit opens is held COMMIT_DELAY (20 ms) for the exits that follow.
    Its flush was a timer, looked at once a turn of the loop: with a burst of exits each ticked
    in the same turn it fired 0.2-1.2 s late, the index lock held all along, so a CLI command
    waited that long: 2.1-2.3 s here through 8 slots (fastpath.HeldCommit.overdue; 0.07-0.09 s
    now, 0.16 s beside two CPU hogs). And ended tasks' exit files are used again for the tasks
    that start (service/spares.py): each task still gets its own agent's code."""
    kg.config(max_agents=8, max_queue=TASKS + 10, history_limit=TASKS, autostart=False)
    _queue(kg, TASKS)
    kg.ok("serve", "--detach")
    wait_for(lambda: len(kg.wrappers()) >= 8, timeout=30, what="the first agents to run")
    waits: list[float] = []
    done = threading.Event()

    def take_the_lock_as_a_command_does() -> None:
        while not done.is_set():
            fd = os.open(kg.home.lock, os.O_RDWR)
            try:
                t0 = time.monotonic()
                fcntl.flock(fd, fcntl.LOCK_EX)
                waits.append(time.monotonic() - t0)
            finally:
                os.close(fd)
            time.sleep(0.005)

    prober = threading.Thread(target=take_the_lock_as_a_command_does)
    prober.start()
    try:
        (kg.rec / "go").touch()
        wait_for(lambda: len(kg.index()["finished"]) == TASKS, timeout=120, what="the queue to drain")
    finally:
        done.set()
        prober.join()
    assert max(waits) < 0.5, f"the index lock was held {max(waits):.3f}s at a time; waits: {sorted(waits)[-5:]}"
    finished = {t["id"]: t for t in kg.index()["finished"]}
    wrong = {i: t["exit_code"] for i, t in finished.items() if t["exit_code"] != i % 3}
    assert not wrong, f"tasks with another's exit code: {dict(list(wrong.items())[:10])}"
    exits = list(kg.home.logs.glob("*.exit"))
    assert len(exits) < TASKS // 2, f"{len(exits)} exit files for {TASKS} tasks: few or none used again"


def _ended(home, ids: list[int], status: bytes = b"0\n") -> None:
    """Exit files as a wrapper leaves them: blanks, a status written over their start."""
    for i in ids:
        path = home.exit_file(i)
        path.write_bytes(status + runner.EXIT_BLANK[len(status):])
        os.chmod(path, 0o600)


def test_exit_files_used_again_only_once_committed_and_never_a_running_tasks(tmp_path):
    from kugetsu.paths import Home
    from kugetsu.service.spares import SpareExits

    home = Home(tmp_path / "home")
    home.ensure()
    spare = SpareExits(home, keep=2)
    _ended(home, [1, 2, 3, 4, 5])
    for i in (1, 2, 3, 4, 5):
        spare.booked(i)
    assert not spare.take(10, home.exit_file(10)), "used before a commit recorded the ends"
    # Task 2 runs again (a retry) at the commit; 4 and 5 are the last `keep` ends.
    running = Index(active=[Task(id=2, name="t2", command=["true"], cwd="/", created_at=datetime.now(timezone.utc))])
    spare.committed(running)
    assert list(spare.free) == [1, 3]
    # 1's file is not one runner.spawn made (a longer one): left alone; 3's becomes 10's.
    home.exit_file(1).write_bytes(b"0\n" + b" " * 40)
    assert spare.take(10, home.exit_file(10))
    assert home.exit_file(10).read_bytes() == runner.EXIT_BLANK and runner.read_exit(home, 10) is None
    assert not home.exit_file(3).exists() and home.exit_file(1).read_bytes().startswith(b"0\n")
    assert home.exit_file(2).exists() and home.exit_file(4).exists() and home.exit_file(5).exists()
    assert not spare.take(11, home.exit_file(11)), "none left to use"


def test_a_task_that_starts_again_keeps_its_exit_file_and_a_link_is_never_used(tmp_path):
    from kugetsu.paths import Home
    from kugetsu.service.spares import SpareExits

    home = Home(tmp_path / "home")
    home.ensure()
    spare = SpareExits(home, keep=0)
    _ended(home, [1, 2, 3])
    target = tmp_path / "elsewhere"
    target.write_bytes(runner.EXIT_BLANK)
    home.exit_file(3).unlink()
    home.exit_file(3).symlink_to(target)
    for i in (1, 2, 3):
        spare.booked(i)
    spare.committed(Index())
    # 1 starts again (its own spawn): its file is off the list, 2's is used, never 1's later.
    assert spare.take(1, home.exit_file(1))
    assert home.exit_file(1).exists() and not home.exit_file(2).exists()
    assert runner.read_exit(home, 1) is None  # blanks: its new run's end is still to come
    # 3 is a link: never followed, never moved; nothing else is left.
    assert not spare.take(4, home.exit_file(4))
    assert home.exit_file(3).is_symlink() and target.read_bytes() == runner.EXIT_BLANK
    assert not home.exit_file(4).exists()
