"""Times as people read them, shared by the rules' messages (policy, budgets) and the front ends.

Below policy and budgets: both word a reset or a hold with it, and policy imports budgets.
"""

from __future__ import annotations

from datetime import datetime


def clock(at: datetime, now: datetime) -> str:
    """A moment as people read it on this machine: 15:00, or 15:00:12 within the minute; one
    on another day than `now` with its date: Nov 27 15:00 (a hold until 10:00 set at 14:38
    ends tomorrow, and a weekly limit's reset must not read as today's)."""
    try:
        local = at.astimezone()
        today = now.astimezone().date()
    except (OverflowError, ValueError):  # a recorded time at the end of what this zone can hold
        return at.isoformat()
    text = local.strftime("%H:%M:%S" if local.second else "%H:%M")
    if local.date() != today:
        text = f"{local.strftime('%b')} {local.day} {text}"
    return text
