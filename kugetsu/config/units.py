"""Durations and sizes as config.json writes them (`90s`, `1.5h`, `200M`): parsing and wording.
"""

from __future__ import annotations

import re


# ---- durations ------------------------------------------------------------------------

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


MAX_DURATION = 3650 * 86400  # ten years: deadlines past year 9999 cannot be represented


def parse_duration(value: object, what: str = "duration", zero: bool = False) -> float:
    """`90s`, `15m`, `2h`, `1d` or plain seconds -> seconds (> 0; or 0 too with `zero`)."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a duration like 90s, 15m, 2h, 1d or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(str(value))
        if not m:
            raise ValueError(f"{what}: {value!r} is not a duration; use 90s, 15m, 2h, 1d or plain seconds")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not (seconds > 0 or zero and seconds == 0):
        raise ValueError(f"{what}: must be more than 0, got {value!r}")
    if not seconds <= MAX_DURATION:  # also NaN and inf: a deadline must be a real date
        raise ValueError(f"{what}: {value!r} is too long; at most {MAX_DURATION // 86400}d")
    return seconds


def format_duration(seconds: float) -> str:
    """Short human form: 45s, 1m30s, 12m, 24h, 3h05m, 2d, 2d04h."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s < 600 and s % 60 else f"{s // 60}m"
    if s < 2 * 86400:  # "24h" and "36h" read better than "1d00h"
        h, m = divmod(s // 60, 60)
        return f"{h}h{m:02d}m" if m else f"{h}h"
    d, h = divmod(s // 3600, 24)
    return f"{d}d{h:02d}h" if h else f"{d}d"


Duration = str | int | float

# ---- sizes -----------------------------------------------------------------------------

# KiB/MiB/GiB and bare K/M/G are powers of 1024 (what free(1) and psutil report); KB/MB/GB
# are powers of 1000, as their SI names say.
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
               "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


# The smallest log_max_size: a capped log keeps a quarter of it from its beginning and a
# quarter from its end (kugetsu/store/logtail.py).
LOG_MIN = 4 * 1024 * 1024


def parse_size(value: object, what: str = "size") -> int:
    """`2GiB`, `512MiB`, `1.5G`, `800MB` or plain bytes -> bytes (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size like 2GiB or 512MiB, got {value!r}")
    if isinstance(value, (int, float)):
        size = float(value)
    else:
        m = _SIZE_RE.match(str(value))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ValueError(f"{what}: {value!r} is not a size; use e.g. 2GiB, 512MiB, 800MB or plain bytes")
        size = float(m.group(1)) * _SIZE_UNITS[unit]
    if not size > 0:
        raise ValueError(f"{what}: must be more than 0, got {value!r}")
    return int(size)


def format_size(size: float) -> str:
    """Short binary form: 1.2 GiB, 512 MiB."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale:
            value = size / scale
            return f"{value:.1f} {unit}".replace(".0 ", " ")
    return f"{int(size)} B"
