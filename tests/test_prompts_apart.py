"""Prompts are kept beside the index, not in it (issue: hostile input, "smaller edges"): a
long prompt made every command read, decode and rewrite it twice (the prompt, and the
command it was put in). The index keeps `{prompt}` where the text goes; the store keeps the
text (the file store: logs/<id>.prompt, 0600; the cluster: a row each) and the agent gets it
verbatim when it starts. An index written by an older kugetsu (prompts inside) keeps working."""

from __future__ import annotations

import json
import stat
import sys

from conftest import Kugetsu, wait_for

# Writes the argv element it was given, byte for byte, to rec/<name>.prompt (whole: through a
# rename, so that a reader never sees the file half written).
RECORDER = ("import os, sys; open(sys.argv[2] + '.new', 'w', encoding='utf-8', newline='').write(sys.argv[1]);"
            " os.replace(sys.argv[2] + '.new', sys.argv[2])")


def recorder(kg: Kugetsu) -> dict:
    return {"command": [sys.executable, "-c", RECORDER, "{prompt}", str(kg.rec) + "/{name}.prompt"]}


def received(kg: Kugetsu, name: str) -> str:
    path = kg.rec / f"{name}.prompt"
    wait_for(path.exists, 20, f"{name}'s agent to record its prompt")
    return path.read_text(encoding="utf-8")


def hostile(n: int, size: int) -> str:
    """A prompt of about `size` characters with what a shell or a format string would mangle."""
    head = f"task {n}: $(rm -rf ~) `id` '{{name}}' \"{{prompt}}\" ; | & \\ \n\t ünïcødé ✓ {{id}}\n"
    return head + "x" * (size - len(head))


def test_long_prompts_stay_out_of_the_index_and_reach_the_agent_verbatim(kg: Kugetsu):
    kg.config(max_agents=1, agents={"rec": recorder(kg)}, default_agent="rec")
    kg.ok("pause")
    prompts = {f"p{n}": hostile(n, 100_000) for n in range(4)}
    for name, text in prompts.items():
        kg.ok("delegate", name, "--prompt", text)
    # 4 x 100 KB of prompts, and the index is a few KB: none of it is there, not even in argv.
    index = kg.home.index.read_bytes()
    assert len(index) < 10_000 and b"xxxxxxxx" not in index, len(index)
    assert all(t["command"][-2] == "{prompt}" for t in json.loads(index)["queued"])
    for path in kg.home.logs.glob("*.prompt"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # Every front end's task object still carries the prompt.
    assert kg.json("status", "p1")["prompt"] == prompts["p1"]
    assert [t["prompt"] for t in kg.json("queue")["queued"]] == list(prompts.values())
    # A queued task's prompt can change; the agent gets the new one.
    prompts["p2"] = "edited: {prompt} $HOME"
    kg.ok("edit", "p2", "--prompt", prompts["p2"])
    assert kg.json("status", "p2")["prompt"] == prompts["p2"]
    kg.ok("resume")
    for name, text in prompts.items():
        assert received(kg, name) == text
        kg.wait_state(name, "succeeded")
    # `retry` of a finished task runs it again with its prompt.
    (kg.rec / "p3.prompt").unlink()
    kg.ok("retry", "p3")
    assert received(kg, "p3") == prompts["p3"]
    assert len(kg.home.index.read_bytes()) < 10_000


def test_an_index_from_an_older_kugetsu_runs_the_prompt_it_kept(kg: Kugetsu):
    """Before, the prompt was in the task (`prompt`) and inside its command: such a task
    still starts with it, shows it, and can be edited and retried."""
    kg.config(max_agents=1, agents={"rec": recorder(kg)}, default_agent="rec", autostart=False)
    kg.ok("pause")
    kg.ok("delegate", "old", "--prompt", "placeholder")
    kg.ok("delegate", "older", "--prompt", "placeholder")
    doc = json.loads(kg.home.index.read_bytes())
    for task, text in zip(doc["queued"], ("kept in the index", "kept too")):
        task["prompt"] = text
        task["command"] = [text if a == "{prompt}" else a for a in task["command"]]
        del task["prompted"]
        kg.home.prompt_file(task["id"]).unlink()
    kg.home.index.write_text(json.dumps(doc))
    assert kg.json("status", "old")["prompt"] == "kept in the index"
    kg.ok("edit", "older", "--prompt", "edited after the upgrade")
    assert kg.json("status", "older")["command"][-2] == "{prompt}"  # kept apart from now on
    kg.ok("resume")
    kg.ok("serve", "--detach")
    assert received(kg, "old") == "kept in the index"
    assert received(kg, "older") == "edited after the upgrade"
    kg.wait_state("old", "succeeded")
    (kg.rec / "old.prompt").unlink()
    kg.ok("retry", "old")
    assert received(kg, "old") == "kept in the index"


def test_a_prompt_that_went_missing_fails_its_task_with_the_reason_and_nothing_else(kg: Kugetsu):
    kg.config(max_agents=2, agents={"rec": recorder(kg)}, default_agent="rec", autostart=False)
    kg.ok("pause")
    kg.ok("delegate", "lost", "--prompt", "gone")
    kg.ok("delegate", "fine", "--prompt", "here")
    kg.home.prompt_file(1).unlink()
    kg.ok("resume")
    kg.ok("serve", "--detach")
    lost = kg.wait_state("lost", "failed")
    assert "prompt is missing" in lost["reason"], lost
    assert received(kg, "fine") == "here"
    kg.wait_state("fine", "succeeded")
