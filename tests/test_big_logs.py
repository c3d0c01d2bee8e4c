"""Hostile output: an agent that writes hundreds of megabytes, or one 100 MB line. Every
reader of its log stays within a bounded window (memory under ~100 MB, quick), the
dashboard keeps answering, and the log itself is capped on disk (log_max_size)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_for
from dashboard_data import until

MB = 1024 * 1024


@pytest.fixture
def tmp_path(ram_path: Path) -> Path:
    """This file's tests write 200 MB logs: in RAM (conftest.ram_path), not on the shared disk."""
    return ram_path


def measured(kg, *args: str) -> tuple[subprocess.CompletedProcess[bytes], float, float]:
    """Run the real CLI; return its result, its peak RSS in MB and its wall time."""
    code = (
        "import resource, subprocess, sys, time; t = time.monotonic();"
        " r = subprocess.run(sys.argv[1:], capture_output=True);"
        " sys.stderr.buffer.write(r.stderr); sys.stdout.buffer.write(r.stdout);"
        " print(f'\\n@@ {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.1f}"
        " {time.monotonic() - t:.2f} {r.returncode}', file=sys.stderr)"
    )
    r = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "kugetsu", *args], env=kg.env,
                       capture_output=True, timeout=120)
    rss, secs, rc = r.stderr.rsplit(b"@@ ", 1)[1].split()
    r.returncode = int(rc)
    return r, float(rss), float(secs)


def written(log) -> int:
    """All an agent wrote to its log: what is there, plus what the cap dropped (its marker says);
    0 before the log exists (a task is `running` from its commit, its agent spawned just after)."""
    try:
        f = open(log, "rb")
    except FileNotFoundError:
        return 0
    with f:
        data = f.read(2 * MB)
        m = re.search(rb"\n?\[kugetsu: (\d+) bytes of output dropped here \(log_max_size [^)]*\)\]\n", data)
        return os.fstat(f.fileno()).st_size + (int(m.group(1)) - len(m.group(0)) if m else 0)


def big_agent(total: int, then: str = "") -> list[str]:
    """An agent that writes `total` bytes of numbered lines, then its last line."""
    return ["sh", "-c", f'yes "some output of the agent, line after line" | head -c {total}; echo; echo "the last line"; {then}']


def test_logs_of_a_200mb_log_reads_a_bounded_window(kg):
    kg.ok("delegate", "spam", "--", *big_agent(200 * MB))
    kg.wait_state("spam", "succeeded", timeout=60)
    r, rss, secs = measured(kg, "logs", "spam", "--lines", "1")
    assert r.returncode == 0 and r.stdout == b"the last line\n"
    assert rss < 100 and secs < 5, (rss, secs)
    r, rss, secs = measured(kg, "logs", "spam", "--lines", "5")
    assert r.stdout.startswith(b"some output") and r.stdout.endswith(b"\nthe last line\n") and r.stdout.count(b"\n") == 5
    assert rss < 100 and secs < 5, (rss, secs)
    r, rss, secs = measured(kg, "logs", "spam", "#1", "--lines", "2")
    assert r.stdout.endswith(b"spam | the last line\n") and rss < 100, rss
    # The whole log, on demand: streamed, never held.
    r, rss, _ = measured(kg, "logs", "spam")
    assert r.stdout.endswith(b"the last line\n") and rss < 100, rss


async def test_mcps_logs_of_a_200mb_log_reads_a_bounded_window(kg):
    """The MCP server's `logs` (what a PM agent reads when a worker failed) holds a window
    from the log's end too: its memory does not grow with the log."""
    import psutil
    import pytest

    pytest.importorskip("mcp")
    from test_mcp import connect, text

    kg.config(log_max_size=None)  # no cap on disk: the whole 200 MB is there to be misread
    kg.ok("delegate", "spam", "--", *big_agent(200 * MB))
    kg.wait_state("spam", "succeeded", timeout=60)
    async with connect(kg) as c:
        (server,) = [p for p in psutil.Process().children(recursive=True) if p.cmdline()[1:4] == ["-m", "kugetsu", "mcp"]]
        r = await c.call_tool("logs", {"task": "spam", "lines": 2})
        assert not r.is_error and text(r) == "so\nthe last line\n", text(r)[-200:]  # `head -c` cut a line
        r = await c.call_tool("logs", {"task": "spam", "max_bytes": 1024 * 1024})  # the most it allows
        assert not r.is_error and r.structured_content["truncated"] and r.structured_content["size"] > 200 * MB
        assert len(r.structured_content["text"]) <= 1024 * 1024
        peak = int(next(line for line in open(f"/proc/{server.pid}/status") if line.startswith("VmHWM")).split()[1]) * 1024
    assert peak < 100 * MB, peak / MB  # the server's own size (the SDK) included


def test_a_single_100mb_line_is_shown_cut_with_a_marker(kg):
    agent = [sys.executable, "-c", "import sys; sys.stdout.write('x' * 100_000_000 + 'END\\nafter\\n')"]
    kg.ok("delegate", "oneline", "--", *agent)
    kg.wait_state("oneline", "succeeded", timeout=60)
    r, rss, secs = measured(kg, "logs", "oneline", "--lines", "2")
    assert rss < 100 and secs < 5, (rss, secs)
    first, second, rest = r.stdout.split(b"\n")
    assert re.match(rb"^\[\xe2\x80\xa6 (more than )?\d+ bytes cut\] x+END$", first) and len(first) < 64 * 1024
    assert second == b"after" and rest == b""


async def test_the_dashboard_answers_while_its_selected_task_floods_its_log(kg):
    from kugetsu.frontends.tui.app import make_app
    from kugetsu.frontends.tui.screens import HelpScreen

    kg.config(max_agents=1)
    gate = kg.rec / "gate"
    # Floods its log for as long as the test looks (until the gate), a few hundred MB; and for
    # at most 3 minutes: a test process killed before its finally (and with it the service
    # that caps the log) once left this agent filling the disk (75 GB).
    flood = ["sh", "-c", 'end=$(($(date +%s) + 180)); while [ ! -e "$0" ] && [ "$(date +%s)" -lt "$end" ]; do'
             ' yes "flooding the log, line after line" | head -c 50000000; done', str(gate)]
    await asyncio.to_thread(kg.ok, "delegate", "flood", "--", *flood)
    app = make_app(kg.home, cwd=str(kg.home.root.parent))
    try:
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.running.keys == ["1"] and app.selected == 1, timeout=15, what="flood selected")
            await until(pilot, lambda: written(kg.home.log(1)) > 100 * MB, timeout=30, what="a big log")
            # The pane polls each second: a key is answered between polls, every time. (Before
            # the bound, one poll read the whole flood: no answer within minutes.) The deadline
            # is generous for a loaded 2-core machine; on a quiet one it takes ~0.2 s.
            for _ in range(3):
                t = time.monotonic()
                await pilot.press("question_mark")
                await until(pilot, lambda: isinstance(app.screen, HelpScreen), timeout=8, what="the help screen")
                await pilot.press("escape")
                await until(pilot, lambda: not isinstance(app.screen, HelpScreen), timeout=8, what="help closed")
                assert time.monotonic() - t < 10
                await pilot.pause(1.0)
            assert any("flooding the log" in line for line in app.output.lines)
    finally:
        gate.touch()


def test_a_log_over_log_max_size_keeps_its_beginning_and_end_and_says_what_was_dropped(kg):
    kg.config(log_max_size="4MiB")
    gate = kg.rec / "gate"
    body = 17 * 3_529_412  # whole lines of "a line of output\n", about 60 MB
    agent = ["sh", "-c", f'echo "the first line"; yes "a line of output" | head -c {body}; echo "still writing";'
             ' while [ ! -e "$0" ]; do sleep 0.05; done; echo "the very end"', str(gate)]
    kg.ok("delegate", "capped", "--", *agent)
    log = kg.home.log(1)
    kg.wait_state("capped", "running")
    wait_for(lambda: log.exists() and b"still writing" in log.read_bytes()[-100:] and os.path.getsize(log) <= 4 * MB, 30,
             "the log capped while the agent runs")
    gate.touch()
    kg.wait_state("capped", "succeeded")
    data = log.read_bytes()
    assert len(data) <= 4 * MB
    assert data.startswith(b"the first line\na line of output\n")
    m = re.search(rb"\n\[kugetsu: (\d+) bytes of output dropped here \(log_max_size 4 MiB\)\]\n", data)
    assert m and m.start() == 1024 * 1024, data[1024 * 1024 - 100 : 1024 * 1024 + 200]
    # What was dropped + what is left = all the agent wrote (the marker, with the newline that
    # ends the cut line before it, is kugetsu's).
    assert int(m.group(1)) + len(data) - len(m.group(0)) == len(b"the first line\n") + body + len(b"still writing\nthe very end\n")
    assert data.endswith(b"a line of output\nstill writing\nthe very end\n")
    # The tail begins with a whole line; only the head's last line is cut (at the marker).
    head, tail = data[: m.start()].split(b"\n"), data[m.end() :].split(b"\n")
    assert set(head[1:-1]) == {b"a line of output"} and b"a line of output".startswith(head[-1])
    assert set(tail[:-3]) == {b"a line of output"}


def test_a_bad_log_max_size_is_refused(kg):
    r = kg.run("config", "set", "log_max_size", "1KiB")
    assert r.returncode == 2 and "log_max_size" in r.stderr and "4 MiB" in r.stderr
    assert not kg.home.config.exists() or "log_max_size" not in kg.home.config.read_text()


def test_logs_follow_across_compactions_shows_every_line_once_in_order(kg):
    kg.config(log_max_size="4MiB")
    gate = kg.rec / "gate"
    # Numbered lines at a few MB/s: the cap is passed again and again while `logs -f` follows.
    agent = [sys.executable, "-c",
             "import os, sys, time\n"
             "i = 0\n"
             "while not os.path.exists(sys.argv[1]):\n"
             "    sys.stdout.write(''.join(f'line {n:09d} ' + 'p' * 80 + '\\n' for n in range(i, i + 2000)))\n"
             "    sys.stdout.flush(); i += 2000; time.sleep(0.02)\n"
             "print('done', i)\n", str(gate)]
    kg.ok("delegate", "stream", "--", *agent)
    kg.wait_state("stream", "running")
    follower = subprocess.Popen([sys.executable, "-m", "kugetsu", "logs", "stream", "-f"], env=kg.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: kg.home.log(1).exists() and written(kg.home.log(1)) > os.path.getsize(kg.home.log(1)) + 12 * MB,
                 60, "several compactions")
        gate.touch()
        out, err = follower.communicate(timeout=60)
    finally:
        gate.touch()
        follower.kill()
    assert follower.returncode == 0
    lines = out.split(b"\n")
    assert lines[-1] == b"" and lines[-2].startswith(b"done ")
    numbers = [int(x[5:14]) for x in lines if x.startswith(b"line ")]
    assert numbers == sorted(set(numbers)), "a line twice or out of order"
    marker = rb"\[kugetsu: \d+ bytes of output dropped here.*\]"
    # Every line whole, but the head's last one, cut where the marker begins.
    bad = [x for i, x in enumerate(lines[:-2]) if not re.fullmatch(rb"line \d{9} p{80}|" + marker, x)
           and not (re.fullmatch(marker, lines[i + 1]) and re.fullmatch(rb"[line 0-9p]*", x))]
    assert not bad, bad[:3]
    assert numbers[-1] + 1 == int(lines[-2].split()[1])  # it reached the end


def test_a_prompt_over_prompt_max_size_is_refused_and_nothing_is_written(kg, tmp_path):
    kg.config(default_agent="sim", agents={"sim": {"command": ["sh", "-c", 'cat "$0"', "{prompt_file}"]}})
    kg.ok("pause")  # it stays queued: edit needs that
    kg.ok("delegate", "small", "--prompt", "a prompt")
    before = kg.home.index.read_bytes()
    big = tmp_path / "big.txt"
    big.write_bytes(b"y" * (200 * 1024))
    r = kg.run("delegate", "huge", "--prompt-file", str(big))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "prompt_max_size" in r.stderr and "{prompt_file}" in r.stderr and "200 KiB" in r.stderr
    r = kg.run("edit", "small", "--prompt-file", str(big))
    assert r.returncode == 2 and "prompt_max_size" in r.stderr
    assert kg.home.index.read_bytes() == before
    kg.ok("config", "set", "prompt_max_size", "1MiB")
    kg.ok("edit", "small", "--prompt-file", str(big))
