"""Errors every layer may raise; each carries the exit code of DESIGN section 5."""

OK, FAILURE, USAGE, REJECTED, TIMED_OUT = 0, 1, 2, 3, 124


class KugetsuError(Exception):
    """A failure the user can act on: the message says what was wrong and what to do."""

    code = FAILURE

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class UsageError(KugetsuError):
    """Bad usage or bad input (exit 2)."""

    code = USAGE


class FileError(KugetsuError):
    """config.json or index.json does not parse or validate (exit 2); it is never overwritten."""

    code = USAGE


class Rejected(KugetsuError):
    """Admission refused the task (exit 3): queue full or a per-source limit."""

    code = REJECTED


class NotFound(KugetsuError):
    """No such task (exit 1)."""

    code = FAILURE


class DiskFull(KugetsuError):
    """The disk (or the user's quota) is full: the change was not written (exit 1)."""

    code = FAILURE
