"""`kugetsu delegate`, `kugetsu capacity` and `kugetsu queue --limit N` through the running
service (issue 31): the thin path.

The CLI's entry (`run`: the console script and `python -m kugetsu`). For `delegate`, before
the CLI is imported (argparse, msgspec, the app layer: ~70 ms before it touches the index), it
hands the command line to this home's service over its delegate socket
(`service/handoff.py`): the argv, the working directory and the environment the command
reads (the task it runs in, PATH). The service runs the very same `cmd_delegate` (app/delegation's
checks and admission, in the service's own warm transaction in its loop: it neither decodes
nor writes the whole index again from scratch) and sends back what the command prints; this
process writes it and exits with its code. `capacity` is answered the same way, from the
index the service keeps (views.show_capacity: the CLI's very output), in a transaction that
writes nothing: at 50,000 queued the CLI's own read of index.json cost 110 ms. So is `queue`
with --limit (at most QUEUE_MOST) and no filter (views.show_queue): what it prints is bounded;
the whole queue's view is the CLI's to build, never the loop's (_bounded).

--prompt-file is read here (stdin too), once a service listens, and its bytes go with the
request, at most PROMPT_MAX: a longer one, a file that cannot be read, and stdin when the
service declines, are the CLI's as before (stdin replayed from the bytes read).

The command runs here instead, as before, when KUGETSU_THIN=0, or: no service listens (no
socket, a stale one), the home's store is a cluster (KUGETSU_STORE or config `store`), the
home is too deep for a socket path, --prompt-file cannot be read or is over PROMPT_MAX, or
the service declines the request: it blocks (--wait); it reads this environment by name
(--env NAME); it runs git (a worktree task); argparse would answer it (an error, --help);
the CLI's clock is off the service's by more than skew.CLOCK_TOLERANCE (a command with a
wrong clock stays one, corrected and said by the service); the service is stopping.
The service declines before it runs anything, so running here is never a second admission.

A service that ends (kill -9) after it said it runs the request may or may not have committed
it. The request carries the token the task gets (chosen here, 16 random bytes), and the CLI
then looks for it under the index lock, which the kernel took from the dead service (one
still alive has committed by then): found, it prints what `delegate` prints of that task;
not, the command runs here, as if no service had listened. Once either way, never twice
(docs/architecture.md, request walks). `capacity` and `queue` only read: asked again here.
"""

from __future__ import annotations

import os
import sys

from kugetsu import HANDED

TYPE_CHECKING = False  # not typing's: its import is 2 ms of the client's start
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable
    from contextlib import AbstractContextManager
    from typing import NoReturn, TextIO

    from kugetsu.config.model import Config
    from kugetsu.core.look import Chain
    from kugetsu.store.protocol import Txn

    # The service's transaction, as a context manager that gives the txn and the config.
    Transaction = Callable[[], AbstractContextManager[tuple[Txn, Config]]]

    from kugetsu.paths import Home

MAGIC = b"kugetsu-delegate/2"  # /2: the task's token in the request
# The environment `delegate` reads (delegation.caller_task: the task it runs in; the PATH an
# error names), and nothing else: no other variable (a token) leaves this process.
_PASSED = ("KUGETSU_TASK_ID", "KUGETSU_TASK_NAME", "PATH")
FAILURE = 1  # errors.FAILURE, without importing it


# HANDED, the commands the service runs for a CLI (kept in kugetsu/__init__.py, which skips
# msgspec's import for them): a PM agent's hot path, which at a long queue the CLI paid for by
# reading index.json (capacity: 110 ms at 50,000 queued, 4.9x a bare python).


def run() -> NoReturn:
    argv = sys.argv[1:]
    if argv[:1] and argv[0] in HANDED:
        code = _handed_over(argv)
        if code is not None:
            os._exit(code)
    from kugetsu.frontends.cli import main  # (which imports msgspec as kugetsu/__init__.py does)

    main.run()


# ---- the client: this process ------------------------------------------------------------


def _handed_over(argv: list[str]) -> int | None:
    """Run `delegate`, `capacity` or `queue` in the service; its exit code, or None: run it here."""
    if os.environ.get("KUGETSU_STORE") or os.environ.get("KUGETSU_THIN") == "0":
        return None  # a cluster (its services take no home's socket); or asked to run here
    from kugetsu.paths import default_home

    home = default_home()
    path = home.handoff
    if path is None or not os.path.exists(path):
        return None  # no service (a stat, not the socket module's import: what a command without one pays)
    try:
        cwd = os.getcwd()
    except OSError:
        return None  # gone: the CLI says what it says of that
    env = [f"{k}={os.environ[k]}" for k in _PASSED if k in os.environ]
    prompt_file = _prompt_file(argv) if argv[0] == "delegate" else None
    import time

    token = os.urandom(16).hex()  # the task's, should the service end before it answers
    head = (str(home.root), cwd, str(len(argv)), str(len(env)), prompt_file or "", repr(time.time()), token, *argv, *env)
    request = b"".join(f + b"\0" for f in (MAGIC, *(os.fsencode(s) for s in head)))
    import _socket

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    data: bytes | None = None
    try:
        try:
            sock.connect(str(path))
        except OSError:
            return None  # no service (no socket, a stale one): nothing read, nothing sent
        if prompt_file:  # read here, where the command would read it, once a service listens
            data = _read_bounded(prompt_file)
            if data is None or len(data) > PROMPT_MAX:
                _replay(prompt_file, data)
                return None
        try:
            sock.sendall(request + (data or b""))
            sock.shutdown(_socket.SHUT_WR)
            first = sock.recv(1)
        except OSError:
            first = b""
        if first != b"A":  # declined, or closed before it ran anything (it says A first)
            _replay(prompt_file, data)
            return None
        chunks = []
        try:
            while data := sock.recv(1 << 16):
                chunks.append(data)
        except OSError:
            chunks = []
    finally:
        sock.close()
    answer = _answer(b"".join(chunks))
    if answer is None:  # it ended after it took the request: admitted or not, by the token
        found = _admitted_by(home, argv, token) if argv[0] == "delegate" else None
        if found is None:
            _replay(prompt_file, data)
        return found
    code, err, out = answer
    return _print(code, err, out)


def _admitted_by(home: Home, argv: list[str], token: str) -> int | None:
    """`delegate`'s output and code for the task the service admitted with `token` before it
    ended without answering; None: it admitted none, and the command runs here."""
    from kugetsu.errors import KugetsuError
    from kugetsu.frontends.cli import main
    from kugetsu.frontends.cli.output import _say
    from kugetsu.frontends.cli.tasks import delegate_found

    try:
        return delegate_found(home, main.parse(argv), token)
    except (KugetsuError, OSError) as error:  # the index cannot be read: the command here would say the same
        line, code = main.failure(home, error)
        _say(line, file=sys.stderr)
        return code


PROMPT_MAX = 1 << 20  # bytes of --prompt-file sent; a longer one is read (and refused) in the CLI, as before


def _prompt_file(argv: list[str]) -> str | None:
    """--prompt-file's value, as the parser will take it (no option is abbreviated; the last
    one given wins; the command after `--` is not options); the service checks it."""
    found = None
    options = argv[: argv.index("--")] if "--" in argv else argv
    for i, word in enumerate(options):
        if word == "--prompt-file" and i + 1 < len(options):
            found = options[i + 1]
        elif word.startswith("--prompt-file="):
            found = word.partition("=")[2]
    return found or None


def _read_bounded(name: str) -> bytes | None:
    """At most PROMPT_MAX + 1 bytes of the prompt file (- : stdin); None: it could not be read
    (the CLI says so, in its words, reading it again)."""
    try:
        if name == "-":
            stream = sys.stdin.buffer
            return stream.read(PROMPT_MAX + 1)
        with open(name, "rb") as f:
            return f.read(PROMPT_MAX + 1)
    except (OSError, AttributeError, ValueError):
        return None


def _replay(name: str | None, data: bytes | None) -> None:
    """The command runs here after all: stdin as it was, the bytes read from it first."""
    if name == "-" and data:
        import io

        rest = sys.stdin.buffer.read()
        sys.stdin = io.TextIOWrapper(io.BytesIO(data + rest))


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


def _write(stream: TextIO | None, text: str) -> None:
    if text and stream is not None:  # None: the descriptor was closed (`>&-`); print() writes nothing there
        stream.write(text)
        stream.flush()


# ---- the service's half -------------------------------------------------------------------


class _Declined(Exception):
    """The command line is not one the service runs (argparse would print, or exit)."""


def answerer(home: Home, locked: Transaction, woken: Callable[[], object], read: Transaction,
             looks: Chain | None = None) -> Callable[[bytes], tuple[Callable[[], bytes], str] | None]:
    """The service's handler for its delegate socket (service/handoff.py): a request, read
    and checked, becomes what runs it (None: the CLI runs it itself). `locked`: the service's
    transaction (a context manager giving the txn and the config under its lock); `woken`:
    its tick, asked for as a local delegate's datagram would; `read`: the transaction of a
    command that only reads (`capacity`); `looks`: the service's Looks of the queue it keeps
    (core/look.py), which an admission follows instead of asking the whole queue afresh."""

    def handle(request: bytes) -> tuple[Callable[[], bytes], str] | None:
        parsed = _parse_request(home, request)
        if parsed is None:
            return None
        args, cwd, environ, prompt, token = parsed
        return lambda: _run(home, args, cwd, environ, prompt, token, locked, woken, read, looks), args.command

    return handle


def _parse_request(home: Home, request: bytes
                   ) -> tuple[argparse.Namespace, str, dict[str, str], bytes | None, str] | None:
    from kugetsu.app import delegation
    from kugetsu.config.load import load_config
    from kugetsu.errors import KugetsuError
    from kugetsu.frontends.cli import main
    from kugetsu.frontends.cli.output import _undo_dashdash
    from kugetsu.frontends.cli.tasks import _request
    from kugetsu.paths import Home

    head = request.split(b"\0", 8)  # MAGIC, home, cwd, argv's count, env's, --prompt-file, clock, token, the rest
    if len(head) != 9 or head[0] != MAGIC or not all(n.isdigit() and len(n) <= 7 for n in head[3:5]):
        return None
    token = head[7].decode("ascii", "replace")
    if len(token) != 32 or not all(c in "0123456789abcdef" for c in token):
        return None
    root, cwd, claimed = (os.fsdecode(f) for f in (head[1], head[2], head[5]))
    n_argv, n_env = int(head[3]), int(head[4])
    if not _same_clock(head[6]):
        return None
    fields = head[8].split(b"\0", n_argv + n_env)  # then --prompt-file's bytes, which may hold NULs
    if len(fields) != n_argv + n_env + 1:
        return None
    argv, env = [os.fsdecode(f) for f in fields[:n_argv]], [os.fsdecode(f) for f in fields[n_argv:-1]]
    if not argv or argv[0] not in HANDED or str(Home(root).root) != str(home.root) or not os.path.isabs(cwd):
        return None
    environ = dict(e.partition("=")[::2] for e in env)
    if any(k not in _PASSED for k in environ):
        return None
    try:
        args = main.parse(argv, _quiet_parser())
        _undo_dashdash(args)
    except (_Declined, KugetsuError):
        return None
    delegating = args.command == "delegate"
    if delegating and (args.wait or (args.prompt_file or "") != claimed
                       or any("=" not in v for v in args.env if isinstance(v, str))):
        return None  # blocks; not the file the CLI read; reads the CLI's environment by name
    prompt = fields[-1] if claimed else None
    if prompt is None and fields[-1]:
        return None
    try:
        cfg = load_config(home)
    except (KugetsuError, OSError):
        return None  # said by the CLI, in its words
    if cfg.clustered:
        return None
    if args.command == "queue" and not _bounded(args):
        return None  # the whole queue, or a filter over it: not in the loop every agent's start waits for
    if not delegating:  # capacity, queue: nothing more to check, and no prompt comes with it
        return (args, cwd, environ, None, token) if prompt is None else None
    try:
        if delegation.wants_worktree(cfg, _request(args, cwd, environ, prompt)):
            return None  # git, which the service's loop never waits for
    except KugetsuError:
        pass  # bad input: said by the command itself, as here
    return args, cwd, environ, prompt, token


QUEUE_MOST = 1000  # `queue --limit N` the service answers: what it prints is that long at most


def _bounded(args: argparse.Namespace) -> bool:
    """Whether a `queue` costs the service what it prints, not the whole queue: --limit (at
    most QUEUE_MOST) and no filter (a filtered view is the whole queue's, then filtered: half a
    second at 50,000 queued, in the loop that lets every agent go)."""
    return (args.limit is not None and args.limit <= QUEUE_MOST
            and args.group is None and args.state is None and args.source is None)


def _same_clock(sent: bytes) -> bool:
    """Whether the CLI's clock is the service's, as far as the service's rules tell (within
    skew.CLOCK_TOLERANCE): one that is not (faketime, a time namespace) runs the command
    itself, writing its own times, which the service then corrects and says, as before."""
    import time

    from kugetsu.core.skew import CLOCK_TOLERANCE

    try:
        return abs(time.time() - float(sent)) <= CLOCK_TOLERANCE.total_seconds()
    except ValueError:
        return False


def _run(home: Home, args: argparse.Namespace, cwd: str, environ: dict[str, str], prompt: bytes | None, token: str,
         locked: Transaction, woken: Callable[[], object], read: Transaction, looks: Chain | None = None) -> bytes:
    """cmd_delegate (or capacity's output) for the client, its output and exit code as the
    answer's bytes."""
    import io

    from kugetsu.app import delegation
    from kugetsu.errors import KugetsuError
    from kugetsu.frontends.cli import main
    from kugetsu.frontends.cli.output import _say
    from kugetsu.frontends.cli.tasks import Via, cmd_delegate

    out, err = io.StringIO(), io.StringIO()
    via = Via(out, err, cwd, environ, delegation.Caller(environ, locked, woken, token, looks), prompt)
    try:
        if args.command == "capacity":
            code = _capacity(args, read, out)
        elif args.command == "queue":
            code = _queue(home, args, read, out)
        else:
            code = cmd_delegate(home, args, via)
    except (KugetsuError, OSError) as error:
        line, code = main.failure(home, error)
        _say(line, file=err)
    e, o = err.getvalue().encode("utf-8", "surrogatepass"), out.getvalue().encode("utf-8", "surrogatepass")
    return b"%d %d %d\n" % (code, len(e), len(o)) + e + o


def _capacity(args: argparse.Namespace, read: Transaction, out: TextIO) -> int:
    """`capacity` from the index the service keeps, read in its transaction (which writes
    nothing): what the CLI prints from index.json (views.show_capacity, the queued tasks
    counted by selection.capacity from the index: the numbers read_head counts, found by a
    Look's passes in C, where QueueCounts.of took a Python step a task in the service's loop)."""
    from kugetsu.frontends.cli.views import show_capacity

    with read() as (txn, cfg):
        return show_capacity(cfg, txn.index, None, args.json, out)


def _queue(home: Home, args: argparse.Namespace, read: Transaction, out: TextIO) -> int:
    """`queue` from the index the service keeps, read in its transaction (which writes
    nothing): what the CLI prints from index.json (views.show_queue), its first --limit tasks
    found without sorting the rest (at 50,000 queued the CLI's own read of index.json cost
    ~180 ms)."""
    from kugetsu.frontends.cli.views import show_queue

    with read() as (txn, cfg):
        return show_queue(home, cfg, txn.index, args, True, out)


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
