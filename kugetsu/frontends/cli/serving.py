"""`kugetsu serve` and `kugetsu shutdown`: the service started and stopped. They read no
queue: imported apart from the other commands, `serve --detach` starts the service before the
reading of the queue, the rules and the views would have loaded (~25 ms of every detached start,
issue 31)."""

from __future__ import annotations

import argparse
import os
import time

from kugetsu.app import control
from kugetsu.errors import OK, KugetsuError
from kugetsu.frontends.cli.output import _say
from kugetsu.paths import Home, read_tail
from kugetsu.service import runner


def cmd_serve(home: Home, args: argparse.Namespace) -> int:
    control.check_wakeable(home)  # the service binds its socket there: say so now, not in its log
    if args.detach:
        child = control.start_service(home)
        if child is None:
            pid = control.service_pid(home)
            _say(f"kugetsu service already running{f' (pid {pid})' if pid else ''}")
            return OK
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pid = control.service_pid(home)
            if pid:
                _say(f"kugetsu service started (pid {pid}), log: {home.service_log}")
                return OK
            if runner.process_start(child) is None:  # it exited: say why now, not in 10 s
                raise KugetsuError(f"the service stopped at once; the end of {home.service_log}:\n"
                                   + _last_lines(home.service_log))
            time.sleep(0.01)  # a look is ~0.1 ms; every 50 ms was up to 50 ms more of each start
        raise KugetsuError(f"the service did not come up within 10s; see {home.service_log}")
    from kugetsu.service.daemon import serve

    return serve(home)


def _last_lines(path: os.PathLike[str], count: int = 4) -> str:
    lines = read_tail(path, 4096).decode(errors="replace").splitlines()[-count:]
    return "\n".join(f"  {line}" for line in lines) or "  (no log)"


def cmd_shutdown(home: Home, args: argparse.Namespace) -> int:
    control.check_wakeable(home)  # else "no service is running" would hide why it cannot be told
    if not control.service_holds_lock(home):
        _say("no kugetsu service is running")
        return OK
    # The lock is held: a service is up, or still coming up (autostarted by the command just
    # before, its socket not bound yet): it is told as soon as it listens, never missed.
    pid, told = None, False
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        pid = control.service_pid(home) or pid
        if not control.service_holds_lock(home):  # not just its pid file gone: wholly stopped
            _say(f"kugetsu service stopped{f' (pid {pid})' if pid else ''}; running agents keep running")
            return OK
        told = told or control.send(home, b"shutdown", warn=False)  # tried again until it listens
        time.sleep(0.02)
    raise KugetsuError(f"the service{f' (pid {pid})' if pid else ''} did not stop within 15s")
