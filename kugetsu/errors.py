"""Errors every layer may raise; each carries the exit code of docs/architecture.md §5. And
`warn`, what a layer says when it goes on."""

OK, FAILURE, USAGE, REJECTED, TIMED_OUT = 0, 1, 2, 3, 124


def warn(logger: str, message: str, *args: object) -> None:
    """A warning to `logger`, from a layer every command passes through (the core, the store):
    logging is imported only when there is something to say (7 ms of a 70 ms `delegate`)."""
    import logging

    logging.getLogger(logger).warning(message, *args)


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


# Errors that carry what was wrong as fields: pm raises them worded for nobody in particular,
# and each front end adds how to fix it in its own terms (a CLI flag, a bot command, a field
# of the dashboard's form): pm never names a CLI flag.


class NeedsPrompt(UsageError):
    def __init__(self, agent: str):
        super().__init__(f"agent {agent!r} needs a prompt")
        self.agent = agent


class EmptyPrompt(UsageError):
    """A prompt of nothing but whitespace: every front end (CLI, MCP, bot, dashboard) gets it
    from pm, the one place that checks it."""

    def __init__(self) -> None:
        super().__init__("the prompt is empty: an agent given nothing to do would start for nothing")


class Nested(UsageError):
    """A task's own agent delegating where its preset allows no (more) nesting."""


class NoSuchTask(NotFound):
    def __init__(self, ref: str):
        super().__init__(f"no task {ref!r}")
        self.ref = ref


class UnknownGroup(UsageError):
    def __init__(self, group: str, known: list[str]):
        super().__init__(f"unknown group {group!r} (groups: {', '.join(known) or 'none defined'})")
        self.group, self.known = group, known


class QueueFull(Rejected):
    def __init__(self, queued: int, max_queue: int, active: int, max_agents: int):
        super().__init__(f"queue full: {queued}/{max_queue} waiting, {active}/{max_agents} running;"
                         " try again when a task finishes")
        self.queued, self.max_queue, self.active, self.max_agents = queued, max_queue, active, max_agents


class InvalidHost(UsageError):
    """A machine's name that cannot be one (a task pinned to a host)."""

    def __init__(self, host: str):
        super().__init__(f"invalid host {host!r}: a machine's name is 1-64 letters, digits, '.', '_' or '-'")
        self.host = host


class NotClustered(UsageError):
    """Something only a cluster has (a host to pin to, the list of hosts), asked of one machine."""

    def __init__(self, what: str):
        super().__init__(f"{what} needs cluster mode (a shared PostgreSQL store)")
        self.what = what


class CommandNotFound(UsageError):
    """The agent's command is not where it would run. `looked`: which PATH was searched;
    `elsewhere`: where the caller's own PATH finds it (the service's lacks it), if it does."""

    def __init__(self, exe: str, preset: str | None, looked: str, elsewhere: str | None = None):
        what = f"{exe!r}" + (f" (agent preset {preset!r})" if preset else "")
        super().__init__(f"command not found: {what} (looked on {looked})"
                         + (f"; the caller's PATH finds it at {elsewhere}" if elsewhere else ""))
        self.exe, self.preset, self.looked, self.elsewhere = exe, preset, looked, elsewhere


class Unreachable(KugetsuError):
    """Cluster mode: the database cannot be reached (exit 1). The URL is shown without its password."""

    def __init__(self, url: str, why: str):
        super().__init__(f"database unreachable: {redact_url(url)}: {why}. Running agents are not affected;"
                         " check that PostgreSQL runs and the store URL (`kugetsu config get store`) is right.")
        self.url = url


def redact_url(text: str, mask: str | None = "***") -> str:
    """`text` with the password of every URL in it hidden (scheme://user:***@host, and a
    `password=` query parameter): the one mask for a password that is not under a secret
    key (the store URL, a DATABASE_URL in a preset's env), wherever it is shown or recorded.
    mask=None takes the password out altogether (scheme://user@host): a URL still usable
    with a password from elsewhere (~/.pgpass)."""
    if "://" not in text:
        return text  # the common case, without the regex module's import
    import re

    userinfo = r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s?#]*):[^/\s]*@"  # scheme://user:PASSWORD@
    query = r"([?&])password=[^&#\s]*"  # ?password=PASSWORD
    if mask is None:
        text = re.sub(userinfo, r"\1@", text)
        return re.sub(query + "&?", r"\1", text, flags=re.IGNORECASE).rstrip("?&")
    text = re.sub(userinfo, rf"\1:{mask}@", text)
    return re.sub(query, rf"\1password={mask}", text, flags=re.IGNORECASE)


class AmbiguousName(UsageError):
    """A name that no live task bears and several finished ones do: which one a wait means
    is a guess (selection.find_to_wait)."""

    def __init__(self, name: str, ids: list[int]):
        listed = ", ".join(f"#{i}" for i in ids)
        super().__init__(f"name {name!r} is ambiguous: no queued or running task has it, and finished tasks"
                         f" {listed} do; the latest, #{ids[-1]}, ended before this call")
        self.name, self.ids = name, ids


class UnknownDependency(UsageError):
    """A task to run after that kugetsu does not know (admission.admit)."""

    def __init__(self, ref: str):
        super().__init__(f"unknown dependency {ref!r}: no task has that id or name")
        self.ref = ref
