"""A cancel's SIGTERM has one sender: the service (issue 26). The command that cancels (the
CLI, the dashboard, the bot) only marks the task stopping and wakes it; on one machine as in a
cluster, the agent gets exactly one SIGTERM, and it comes from the service's process.

The agent records who signalled it: it blocks SIGTERM and takes each one with sigtimedwait,
whose siginfo names the sender's pid."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import wait_for

# Records each SIGTERM's sender, one pid a line, for 1.5 s after the first, then exits.
RECORDER = r"""
import signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
rec = sys.argv[1]
open(rec + ".ready", "w").close()
until = None
while until is None or time.monotonic() < until:
    info = signal.sigtimedwait({signal.SIGTERM}, 60 if until is None else until - time.monotonic())
    if info is None:
        break
    with open(rec, "a") as f:
        f.write(f"{info.si_pid}\n")
    until = until or time.monotonic() + 1.5
"""


def _senders(rec: Path) -> list[int]:
    return [int(line) for line in rec.read_text().split()] if rec.exists() else []


def _recording(kg) -> tuple[Path, int]:
    """A running agent that records its SIGTERMs (rec), and the service's pid."""
    kg.config(max_agents=1, kill_grace="30s")
    rec = kg.rec / "term"
    kg.ok("delegate", "held", "--", sys.executable, "-c", RECORDER, str(rec))
    wait_for(lambda: Path(f"{rec}.ready").exists(), what="the agent to block SIGTERM")
    service = kg.service_pid()
    assert service
    return rec, service


def test_a_cancel_from_the_cli_is_signalled_once_by_the_service(kg):
    rec, service = _recording(kg)
    out = kg.ok("cancel", "held")  # returns once the task is final
    assert "cancelled held (#1)" in out
    assert kg.task("held")["state"] == "cancelled"
    assert _senders(rec) == [service], "one SIGTERM, sent by the service, not by the cancelling command"


def test_a_cancel_from_a_process_in_the_callers_place_leaves_the_signal_to_the_service(kg):
    """The dashboard and the bot call verbs.cancel in their own process: no signal from there."""
    from kugetsu.app import verbs

    rec, service = _recording(kg)
    (task,) = verbs.cancel(kg.home, ["held"], reason="cancelled by a test")  # returns at once
    assert task.run is not None and task.run.stop is not None
    wait_for(lambda: kg.task("held")["state"] == "cancelled", timeout=10, what="the cancel to be final")
    assert _senders(rec) == [service]
