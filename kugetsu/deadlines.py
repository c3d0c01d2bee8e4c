"""One timer for everything that happens at a time: queue expiry, run timeouts, SIGKILL after
the grace, rate limits, resource-guard re-checks, the end of a hold on an agent preset (its
provider's limit resets). The service sets it after every tick at the
earliest of those moments (pm.next_deadline and the policies' wake-ups); when it fires, the
tick that follows asks pm what is due. A plain loop callback, set again by every tick, so it
can never be lost: APScheduler, used before, skipped its one job when the tick that job ran
set the next deadline already due (max_instances), and every later deadline then waited for
the 5 s reconcile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime


class DeadlineTimer:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_due: Callable[[], None]):
        self.loop, self.on_due = loop, on_due
        self.due: datetime | None = None  # when it is set to fire
        self._handle: asyncio.TimerHandle | None = None

    def set(self, due: datetime | None, now: datetime) -> None:
        if due == self.due:
            return  # already set for that moment (a promotion mostly leaves it so)
        self.cancel()
        self.due = due
        if due is not None:
            # The loop's clock is monotonic and deadlines are wall-clock: the delay is taken
            # now. A timer that fires a hair early (the wall clock slewed) finds nothing due,
            # and its tick sets it again for what is left.
            self._handle = self.loop.call_later(max(0.0, (due - now).total_seconds()), self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle, self.due = None, None

    def _fire(self) -> None:
        self._handle, self.due = None, None  # it has fired: the tick sets the next one
        self.on_due()
