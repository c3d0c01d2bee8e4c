"""tools/parallel-capacity-test: small synthetic runs of the real tool, as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import REPO

TOOL = REPO / "tools" / "parallel-capacity-test" / "run.py"


def tool(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def tool_json(*args: str, **kw: object) -> dict:
    r = tool(*args, "--json", **kw)  # type: ignore[arg-type]
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout)


def test_synthetic_cpu_levels_table_and_recommendation():
    out = tool_json("--synthetic", "cpu", "--max", "3", "--repeat", "2", "--work", "0.3")
    levels = out["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2, 3]
    for lv in levels:
        assert lv["runs"] == lv["concurrency"] * 2
        assert len(lv["run_s"]) == lv["runs"]
        assert lv["failures"] == lv["timeouts"] == 0
        assert lv["throughput_per_min"] > 0
        assert lv["peak_mem_mb"] > 1  # the python runs were seen (runs last >= 0.3 s; sampled every 50 ms)
    # The recommendation follows the documented rule from the reported figures.
    rec = out["recommended_max_agents"]
    assert 1 <= rec <= 3
    for prev, lv in zip(levels, levels[1:rec]):
        assert lv["throughput_per_min"] >= prev["throughput_per_min"] * 1.10
    if rec < 3:
        assert any(f"level {rec + 1} not taken" in n for n in out["notes"])
    # Human output: the table and the recommendation line.
    r = tool("--synthetic", "cpu", "--max", "1", "--work", "0.05")
    assert r.returncode == 0 and "RUNS/MIN" in r.stdout and "recommended max_agents: 1" in r.stdout


def test_memory_limit_caps_the_recommendation():
    total_mb = psutil.virtual_memory().total / 2**20
    # 60 MB a run: level 1 fits under ~100 MB, level 2 (~120 MB + interpreters) does not.
    share = 100 / total_mb
    out = tool_json("--synthetic", "memory", "--mb", "60", "--hold", "0.6", "--max", "3", "--mem-share", f"{share:.8f}")
    lv1, lv2 = out["levels"][:2]
    assert 55 <= lv1["peak_mem_mb"] <= 100, lv1
    assert lv2["peak_mem_mb"] > 100, lv2
    assert out["recommended_max_agents"] == 1
    assert any("peak memory" in n for n in out["notes"])
    assert len(out["levels"]) == 2, "the test stops at the first level over the memory limit"


def test_failures_are_counted_and_do_not_block_when_level_1_fails_alike():
    out = tool_json("--command", "false", "--max", "2")
    assert [lv["failures"] for lv in out["levels"]] == [1, 2]
    assert any("every run failed at level 1" in n for n in out["notes"])


def test_timeouts_kill_the_whole_group_and_stop_the_test(tmp_path: Path):
    marker = "7.77123"
    # sh starts a grandchild sleep: the timeout must kill it too.
    out = tool_json("--command", f"sh -c 'sleep {marker} & sleep {marker}; wait'", "--timeout", "0.4", "--max", "3")
    assert len(out["levels"]) == 1 and out["levels"][0]["timeouts"] == 1
    assert out["recommended_max_agents"] == 1
    assert out["levels"][0]["run_s"][0] < 3
    left = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and marker in " ".join(p.info["cmdline"])]
    assert not left, f"processes of a timed-out run survived: {left}"


def test_command_is_split_with_shlex_and_never_run_by_a_shell(tmp_path: Path):
    # One argv element holding shell metacharacters arrives verbatim.
    weird = "a;b $(touch pwned) `touch pwned2` 'q' \"d\" | & > x"
    script = 'test "$1" = "$2" && test ! -e pwned && test ! -e pwned2 && test ! -e x'
    out = tool_json("--command", f"sh -c {shlex_quote(script)} _ {shlex_quote(weird)} {shlex_quote(weird)}",
                    "--max", "1", "--cwd", str(tmp_path))
    assert out["levels"][0]["failures"] == 0, out
    assert out["argv"][-1] == weird
    assert list(tmp_path.iterdir()) == []
    # A shell construct is not interpreted: `true;` is not a command.
    r = tool("--command", "true; false")
    assert r.returncode == 2 and "command not found: 'true;'" in r.stderr and "Traceback" not in r.stderr


def shlex_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


@pytest.mark.parametrize("args, message", [
    (["--synthetic", "cpu", "--max", "0"], "--max must be 1..64"),
    (["--synthetic", "cpu", "--timeout", "soon"], "not a duration"),
    (["--synthetic", "cpu", "--mem-share", "1.5"], "--mem-share"),
    (["--command", "sh -c 'unterminated"], "cannot split --command"),
    (["--command", "no-such-agent-xyz run"], "command not found"),
])
def test_bad_input_is_a_clear_error(args, message):
    r = tool(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_apply_writes_max_agents_through_config_set(kg):
    kg.config(autostart=False, max_agents=5)
    out = tool_json("--synthetic", "cpu", "--max", "1", "--work", "0.05", "--apply", env={"KUGETSU_HOME": str(kg.home.root)})
    assert out["recommended_max_agents"] == 1
    assert out["applied"] == {"config": str(kg.home.config), "max_agents": 1}
    assert json.loads(kg.home.config.read_text()) == {"autostart": False, "max_agents": 1}
    assert kg.ok("config", "get", "max_agents").strip() == "1"
    events = kg.events()
    assert events[-1]["type"] == "config" and events[-1]["key"] == "max_agents" and events[-1]["value"] == 1
