"""The file store against a long queue (issue 31): `capacity` without decoding the queue,
prompts of a long listing; through the real CLI."""

from __future__ import annotations

import json
import os

from kugetsu.core.models import Index, Run, Task, TaskState
from kugetsu.store.protocol import encode_index

from conftest import T0


def _queue(home, n: int, **task_fields: object) -> None:
    """An index of n queued tasks, one running (this test's own process: alive), written as
    kugetsu writes it."""
    tasks = [Task(id=i, name=f"t{i}", command=["true"], cwd="/", created_at=T0, **task_fields) for i in range(1, n + 1)]
    run = Task(id=n + 1, name="run", command=["true"], cwd="/", created_at=T0, state=TaskState.RUNNING,
               started_at=T0, run=Run(slot=1, pid=os.getpid()))
    home.ensure()
    home.index.write_bytes(encode_index(Index(next_id=n + 2, queued=tasks, active=[run])))


def test_capacity_of_a_long_queue_counts_what_it_does_not_decode(kg):
    """capacity reads the queued tasks' number, a held preset's count and their memory from
    the head of index.json; the figures are those of the whole index."""
    kg.config(max_agents=2, max_queue=5000, autostart=False)
    _queue(kg.home, 3000, agent="codex")
    cap = kg.json("capacity")
    assert (cap["active"], cap["queued"], cap["free"], cap["holds"]) == (1, 3000, 1, {})
    kg.ok("hold", "codex", "--until", "1h")
    cap = kg.json("capacity")
    assert cap["queued"] == 3000 and cap["holds"]["codex"]["queued"] == 3000
    _queue(kg.home, 3000, agent="codex", memory=1 << 30)
    cap = kg.json("capacity")
    assert cap["queued"] == 3000 and "max_memory" in cap and cap["memory_used"] == 0


def test_prompts_of_a_long_listing_are_each_read_once_and_a_planted_link_is_its_own(kg):
    kg.config(max_agents=1, max_queue=500, autostart=False)
    _queue(kg.home, 300)
    kg.home.logs.mkdir(mode=0o700, exist_ok=True)
    for i in (3, 150, 299):
        path = kg.home.prompt_file(i)
        path.write_text(f"prompt {i}")
        path.chmod(0o600)
    os.symlink("/etc/passwd", kg.home.prompt_file(200))
    out = kg.run("queue", "--json")
    assert out.returncode == 0, out.stderr
    prompts = {t["id"]: t["prompt"] for t in json.loads(out.stdout)["queued"] if t["prompt"] is not None}
    assert prompts == {3: "prompt 3", 150: "prompt 150", 299: "prompt 299"}
    assert "the prompt of task #200 cannot be read" in out.stderr
