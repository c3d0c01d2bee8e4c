"""kugetsu: a capacity manager for parallel AI coding agents."""

import sys

__version__ = "0.1.0"


def _import_msgspec_lean() -> None:
    """Import msgspec without typing_extensions, which it tries first for `get_type_hints` and
    falls back from to `typing`'s, the same function on Python >= 3.11 for the types kugetsu
    decodes. typing_extensions pulls in inspect, dis and ast: about 10 ms of a 60 ms CLI call
    that agents make all day (README, "Performance"). Only msgspec's own import is steered;
    whatever imports typing_extensions later (pydantic for MCP, textual) gets the real module."""
    if "msgspec" in sys.modules or "typing_extensions" in sys.modules:
        return
    sys.modules["typing_extensions"] = None  # type: ignore[assignment]  # "import fails": msgspec's fallback
    try:
        import msgspec  # noqa: F401
    except ImportError:
        # A msgspec that needs typing_extensions after all: forget the half-imported one
        # and import it as it wants.
        for name in [m for m in sys.modules if m == "msgspec" or m.startswith("msgspec.")]:
            del sys.modules[name]
    finally:
        if sys.modules.get("typing_extensions", 0) is None:
            del sys.modules["typing_extensions"]


# The commands a running service runs for the CLI (frontends/cli/thin.py), needing no msgspec
# here: thin.run imports it (this way) only when the command runs in this process after all.
HANDED = ("delegate", "capacity", "queue")
if not (sys.argv[1:2] and sys.argv[1] in HANDED):
    _import_msgspec_lean()
