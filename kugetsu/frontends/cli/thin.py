"""`kugetsu delegate` through the running service (issue 31): the thin path.

The CLI's entry (`run`: the console script and `python -m kugetsu`). For `delegate`, before
the CLI is imported (argparse, msgspec, the app layer: ~70 ms before it touches the index), it
hands the command line to this home's service over its delegate socket
(`service/handoff.py`): the argv, the working directory and the environment the command
reads (the task it runs in, PATH). The service runs the very same `cmd_delegate` (app/delegation's
checks and admission, in the service's own warm transaction in its loop: it neither decodes
nor writes the whole index again from scratch) and sends back what the command prints; this
process writes it and exits with its code.

The command runs here instead, as before, when KUGETSU_THIN=0, or: no service listens (no socket, a stale one),
the home's store is a cluster (KUGETSU_STORE or config `store`), the home is too deep for a
socket path, or the service declines the request (it reads a file or stdin: --prompt-file;
it blocks: --wait; it reads the environment by name: --env NAME; it runs git: a worktree
task; it does not parse: argparse's error and --help are the CLI's; the service is stopping).
The service declines before it runs anything, so running here is never a second admission.

A service that ends (kill -9) after it said it runs the request may or may not have committed
it: the command then fails (exit 1) and says to look at `kugetsu queue` rather than delegate
again, since a task queued twice is worse than an error (docs/architecture.md, request walks).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's: its import is 2 ms of the client's start
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from typing import NoReturn

    from kugetsu.paths import Home

MAGIC = b"kugetsu-delegate/1"
# The environment `delegate` reads (delegation.caller_task: the task it runs in; the PATH an
# error names), and nothing else: no other variable (a token) leaves this process.
_PASSED = ("KUGETSU_TASK_ID", "KUGETSU_TASK_NAME", "PATH")
FAILURE = 1  # errors.FAILURE, without importing it


def run() -> NoReturn:
    argv = sys.argv[1:]
    if argv[:1] == ["delegate"]:
        code = _handed_over(argv)
        if code is not None:
            os._exit(code)
    from kugetsu.frontends.cli import main  # (which imports msgspec as kugetsu/__init__.py does)

    main.run()


# ---- the client: this process ------------------------------------------------------------


def _handed_over(argv: list[str]) -> int | None:
    """Run `delegate` in the service; its exit code, or None: run it here."""
    if os.environ.get("KUGETSU_STORE") or os.environ.get("KUGETSU_THIN") == "0":
        return None  # a cluster (its services take no home's socket); or asked to run here
    from kugetsu.paths import default_home

    home = default_home()
    path = home.handoff
    if path is None:
        return None
    try:
        cwd = os.getcwd()
    except OSError:
        return None  # gone: the CLI says what it says of that
    env = [f"{k}={os.environ[k]}" for k in _PASSED if k in os.environ]
    request = b"\0".join([MAGIC, *(os.fsencode(s) for s in (str(home.root), cwd, str(len(argv)), *argv, *env))])
    import _socket

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        try:
            sock.connect(str(path))
            sock.sendall(request)
            sock.shutdown(_socket.SHUT_WR)
            first = sock.recv(1)
        except OSError:
            return None  # no service, or it ran nothing (it runs a request only once it said so)
        if first != b"A":
            return None  # declined (or closed): nothing was run
        chunks = []
        try:
            while data := sock.recv(1 << 16):
                chunks.append(data)
        except OSError:
            chunks = []
    finally:
        sock.close()
    answer = _answer(b"".join(chunks))
    if answer is None:
        _write(sys.stderr, "kugetsu: the service stopped while it admitted this task, before it answered: the task may"
               " or may not have been admitted. Look with `kugetsu queue --all` before you delegate it again.\n")
        return FAILURE
    code, err, out = answer
    return _print(code, err, out)


def _answer(data: bytes) -> tuple[int, str, str] | None:
    """`<code> <stderr bytes> <stdout bytes>\\n`, then the two texts; None: cut short."""
    head, nl, rest = data.partition(b"\n")
    try:
        code, n_err, n_out = (int(x) for x in head.split())
    except ValueError:
        return None
    if not nl or len(rest) != n_err + n_out:
        return None
    return code, rest[:n_err].decode("utf-8", "surrogatepass"), rest[n_err:].decode("utf-8", "surrogatepass")


def _print(code: int, err: str, out: str) -> int:
    """What the command printed, as it would have here: stderr (said before), then stdout; a
    reader gone (`| head`) is no failure, a write that fails is one (cli.main's rules)."""
    try:
        _write(sys.stderr, err)
        _write(sys.stdout, out)
    except BrokenPipeError:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
        except OSError:
            pass
        return 0
    except OSError as error:
        _write(sys.stderr, f"kugetsu: could not write the output: {error.strerror or error}\n")
        return FAILURE
    return code


def _write(stream: object, text: str) -> None:
    if text:
        stream.write(text)  # type: ignore[attr-defined]
        stream.flush()  # type: ignore[attr-defined]


# ---- the service's half -------------------------------------------------------------------


class _Declined(Exception):
    """The command line is not one the service runs (argparse would print, or exit)."""


def answerer(home: Home, locked: Callable[[], object], woken: Callable[[], object]) -> Callable[[bytes], Callable[[], bytes] | None]:
    """The service's handler for its delegate socket (service/handoff.py): a request, read
    and checked, becomes what runs it (None: the CLI runs it itself). `locked`: the service's
    transaction (a context manager giving the txn and the config under its lock); `woken`:
    its tick, asked for as a local delegate's datagram would."""

    def handle(request: bytes) -> Callable[[], bytes] | None:
        parsed = _parse_request(home, request)
        if parsed is None:
            return None
        args, cwd, environ = parsed
        return lambda: _run(home, args, cwd, environ, locked, woken)

    return handle


def _parse_request(home: Home, request: bytes) -> tuple[argparse.Namespace, str, dict[str, str]] | None:
    from kugetsu.app import delegation
    from kugetsu.config.load import load_config
    from kugetsu.errors import KugetsuError
    from kugetsu.frontends.cli import main
    from kugetsu.frontends.cli.output import _undo_dashdash
    from kugetsu.frontends.cli.tasks import _request
    from kugetsu.paths import Home

    fields = [os.fsdecode(f) for f in request.split(b"\0")]
    if len(fields) < 4 or fields[0] != MAGIC.decode() or not (fields[3].isascii() and fields[3].isdigit()) \
            or len(fields[3]) > 7:
        return None
    root, cwd, count = fields[1], fields[2], int(fields[3])
    argv, env = fields[4 : 4 + count], fields[4 + count :]
    if len(argv) != count or argv[:1] != ["delegate"] or str(Home(root).root) != str(home.root) or not os.path.isabs(cwd):
        return None
    environ = dict(e.partition("=")[::2] for e in env)
    if any(k not in _PASSED for k in environ):
        return None
    try:
        args = main.parse(argv, _quiet_parser())
        _undo_dashdash(args)
    except (_Declined, KugetsuError):
        return None
    if args.wait or args.prompt_file or any("=" not in v for v in args.env if isinstance(v, str)):
        return None
    try:
        cfg = load_config(home)
    except (KugetsuError, OSError):
        return None  # said by the CLI, in its words
    if cfg.clustered:
        return None
    try:
        if delegation.wants_worktree(cfg, _request(args, cwd, environ)):
            return None  # git, which the service's loop never waits for
    except KugetsuError:
        pass  # bad input: said by the command itself, as here
    return args, cwd, environ


def _run(home: Home, args: argparse.Namespace, cwd: str, environ: dict[str, str],
         locked: Callable[[], object], woken: Callable[[], object]) -> bytes:
    """cmd_delegate for the client, its output and exit code as the answer's bytes."""
    import io

    from kugetsu.app import delegation
    from kugetsu.errors import KugetsuError
    from kugetsu.frontends.cli import main
    from kugetsu.frontends.cli.output import _say
    from kugetsu.frontends.cli.tasks import Via, cmd_delegate

    out, err = io.StringIO(), io.StringIO()
    via = Via(out, err, cwd, environ, delegation.Caller(environ, locked, woken))  # type: ignore[arg-type]
    try:
        code = cmd_delegate(home, args, via)
    except (KugetsuError, OSError) as error:
        line, code = main.failure(home, error)
        _say(line, file=err)
    e, o = err.getvalue().encode("utf-8", "surrogatepass"), out.getvalue().encode("utf-8", "surrogatepass")
    return b"%d %d %d\n" % (code, len(e), len(o)) + e + o


_quiet: list[type] = []


def _quiet_parser() -> type:
    if _quiet:
        return _quiet[0]
    from kugetsu.frontends.cli.parser import _Parser

    class Quiet(_Parser):
        """The CLI's parser, that prints nothing: what it would print (an error, --help,
        --version) the CLI prints itself."""

        def _print_message(self, message: str, file: object = None) -> None:
            raise _Declined

        def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
            raise _Declined

    _quiet.append(Quiet)  # built on first use: the client never imports the parser
    return Quiet
