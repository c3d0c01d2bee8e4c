"""`kugetsu delegate` through the running service (frontends/cli/thin.py, service/handoff.py):
the real CLI, the real service, a temp home. The thin path is seen from the outside: the
service's log says it admitted a CLI's delegate, and the CLI's own process never imported
msgspec. Its output is the in-process command's (KUGETSU_THIN=0), byte for byte."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import Kugetsu, wait_for

from kugetsu.frontends.cli import thin

HANDED = "delegate socket: ran the delegate of a CLI"


def handed(kg: Kugetsu) -> int:
    try:
        return kg.home.service_log.read_text().count(HANDED)
    except FileNotFoundError:
        return 0


def served(kg: Kugetsu, **config: object) -> None:
    kg.config(max_agents=1, **config)
    kg.ok("serve", "--detach")
    wait_for(lambda: kg.home.handoff.exists(), 10, "the delegate socket")


def in_process(kg: Kugetsu, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kugetsu", *args], env={**kg.env, "KUGETSU_THIN": "0"}, input=input,
                          capture_output=True, text=True, timeout=60)


def test_the_thin_path_is_taken_and_imports_little(kg):
    served(kg)
    before = handed(kg)
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "kugetsu", "delegate", "a", "--", "sleep", "30"],
                       env=kg.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "started a (#1), slot 1/1\n", r
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "msgspec" not in imported and "argparse" not in imported and "kugetsu.frontends.cli.main" not in imported
    assert handed(kg) == before + 1
    kg.wait_state("a", "running")
    assert kg.wrappers().keys() == {1}  # the service spawned what its own transaction started
    r = kg.run("delegate", "b", "--", "true")  # queued behind a
    assert r.returncode == 0 and r.stdout == "queued b (#2), position 1 of 1\n", r
    assert handed(kg) == before + 2


def _same(thin: subprocess.CompletedProcess[str], here: subprocess.CompletedProcess[str]) -> None:
    assert (thin.returncode, thin.stdout, thin.stderr) == (here.returncode, here.stdout, here.stderr)


@pytest.mark.parametrize("args", [
    ("delegate", "x", "--prompt", "", "--", "true"),  # an empty prompt
    ("delegate", "x", "--agent", "nope", "--prompt", "hi"),  # an unknown preset
    ("delegate", "x", "--", "no-such-command-anywhere"),
    ("delegate", "x", "--after", "99", "--", "true"),
    ("delegate", "x", "--at", "whenever", "--", "true"),
    ("delegate", "x", "--cwd", "/no/such/dir", "--", "true"),
    ("delegate", "x", "--source", " ", "--", "true"),
    ("delegate", "x", "--env", "A", "--", "true"),  # declined: the CLI reads its own environment
    ("delegate", "x", "--bogus", "--", "true"),  # declined: argparse's error is the CLI's
    ("delegate", "--json", "x", "--group", "nope", "--", "true"),
    ("delegate",),
])
def test_refusals_are_the_in_process_commands(kg, args):
    served(kg, agents={"echo": {"command": ["echo", "{prompt}"]}})
    before = handed(kg)
    thin, here = kg.run(*args), in_process(kg, *args)
    _same(thin, here)
    declined = any(a in args for a in ("--env", "--bogus"))
    assert handed(kg) == before + (0 if declined else 1)
    assert thin.returncode == 2 and thin.stderr.startswith("kugetsu: ") and "Traceback" not in thin.stderr
    assert not kg.index().get("queued") and not kg.index().get("active")  # nothing written


def test_admissions_print_what_the_in_process_command_prints(kg):
    """Successes, warnings and --json: the same bytes but for the id, name and times."""
    served(kg, strategy="fifo", agents={"echo": {"command": ["echo", "{prompt}"]}})
    kg.ok("delegate", "first", "--", "sleep", "30")
    sub = Path(kg.home.root.parent / "sub")
    sub.mkdir()
    cases = [
        ("--", "true"),
        ("--priority", "high", "--prompt", "unused", "--", "echo", "x"),  # two warnings
        ("--json", "--prompt", "héllo \x1b]0;t\x07", "--agent", "echo", "--env", "K=V", "--cwd", "sub"),
        ("--json", "--after", "first", "--expire-after", "1h", "--", "true"),
        ("--delay", "1h", "--", "true"),
    ]
    for n, extra in enumerate(cases):
        before = handed(kg)
        thin = subprocess.run([sys.executable, "-m", "kugetsu", "delegate", f"t{n}", *extra], env=kg.env,
                              cwd=kg.home.root.parent, capture_output=True, text=True, timeout=60)
        assert handed(kg) == before + 1, thin
        here = subprocess.run([sys.executable, "-m", "kugetsu", "delegate", f"h{n}", *extra],
                              env={**kg.env, "KUGETSU_THIN": "0"}, cwd=kg.home.root.parent, capture_output=True,
                              text=True, timeout=60)
        assert handed(kg) == before + 1
        assert thin.returncode == here.returncode == 0, (thin, here)
        assert thin.stderr == here.stderr
        if "--json" in extra:
            a, b = json.loads(thin.stdout), json.loads(here.stdout)
            assert b["id"] == a["id"] + 1
            for key in ("id", "name", "created_at", "started_at", "expires_at", "not_before", "position"):
                a.pop(key), b.pop(key)
            assert a == b
            assert a["cwd"] == str(sub) if "sub" in extra else a["cwd"] == str(kg.home.root.parent)
        else:
            assert re.sub(r"\d+", "N", thin.stdout.replace(f"t{n}", "X")) == \
                re.sub(r"\d+", "N", here.stdout.replace(f"h{n}", "X")), (thin, here)


def test_a_caller_task_and_its_path_come_with_the_request(kg):
    """What delegate reads from its environment is the CLI's, not the service's."""
    served(kg)
    kg.ok("delegate", "parent", "--", "sleep", "30")
    kg.wait_state("parent", "running")
    env = {**kg.env, "KUGETSU_TASK_ID": "1", "KUGETSU_TASK_NAME": "parent"}
    before = handed(kg)
    args = [sys.executable, "-m", "kugetsu", "delegate", "child", "--json", "--", "true"]
    thin = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert handed(kg) == before + 1
    # A task of a command preset may not delegate: the service saw the caller's task.
    assert thin.returncode == 2 and "allows no nesting" in thin.stderr, thin
    _same(thin, subprocess.run(args, env={**env, "KUGETSU_THIN": "0"}, capture_output=True, text=True, timeout=60))
    # The PATH an error names is the caller's.
    bin_dir = kg.home.root.parent / "bin"
    bin_dir.mkdir()
    (bin_dir / "only-here").write_text("#!/bin/sh\n")
    (bin_dir / "only-here").chmod(0o755)
    env = {**kg.env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    args = [sys.executable, "-m", "kugetsu", "delegate", "x", "--", "only-here"]
    thin = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert thin.returncode == 2 and str(bin_dir / "only-here") in thin.stderr, thin
    _same(thin, subprocess.run(args, env={**env, "KUGETSU_THIN": "0"}, capture_output=True, text=True, timeout=60))


def test_hostile_clients_do_not_stop_or_stall_the_service(kg):
    served(kg)
    path = str(kg.home.handoff)
    idle = socket.socket(socket.AF_UNIX)
    idle.connect(path)  # says nothing, keeps its connection
    garbage = socket.socket(socket.AF_UNIX)
    garbage.connect(path)
    garbage.sendall(b"\xff\x00garbage\x00" * 100)
    garbage.shutdown(socket.SHUT_WR)
    assert garbage.recv(10) == b"F"  # declined: nothing run
    for junk in (b"kugetsu-delegate/2\x00/\x00/\x00" + b"9" * 5000, b"kugetsu-delegate/2\x00/\x00/\x00\xd9\xa3",
                 b"kugetsu-delegate/2\x00/\x00/\x001\x000\x00\x00nan\x00delegate\x00"):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            assert s.recv(10) == b"F"
    huge = socket.socket(socket.AF_UNIX)
    huge.connect(path)
    with pytest.raises(OSError):  # dropped past the bound, while it still writes
        huge.sendall(b"kugetsu-delegate/2\x00" + b"x" * (8 << 20))
        huge.shutdown(socket.SHUT_WR)
        if huge.recv(10) == b"":
            raise BrokenPipeError
    many = [socket.socket(socket.AF_UNIX) for _ in range(80)]  # past MAX_CLIENTS
    for s in many:
        s.connect(path)
    start = time.monotonic()
    r = kg.run("delegate", "ok", "--", "true")  # the service answers still; or the CLI runs it itself
    assert r.returncode == 0 and r.stdout.startswith(("started ok (#1)", "queued ok (#1)")), r
    for s in many:
        s.close()  # an empty request each: declined
    before = handed(kg)
    r = kg.run("delegate", "ok2", "--", "true")
    assert r.returncode == 0 and handed(kg) == before + 1, r
    assert time.monotonic() - start < 10
    # The idle one is dropped after the request deadline (5 s), the service still up.
    idle.settimeout(15)
    assert idle.recv(10) == b""
    assert "did not end within" in kg.home.service_log.read_text()
    assert kg.service_pid() is not None and os.kill(kg.service_pid(), 0) is None
    assert "Traceback" not in kg.home.service_log.read_text()


def test_without_a_service_or_with_a_stale_socket_the_cli_runs_it_itself(kg):
    kg.config(autostart=False)
    r = kg.run("delegate", "a", "--", "true")
    assert r.returncode == 0 and r.stdout == "started a (#1), slot 1/3\n", r
    served(kg, autostart=False)
    pid = kg.service_pid()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z",
             10, "the service gone")
    assert kg.home.handoff.exists()  # stale: nobody listens
    r = kg.run("delegate", "b", "--json", "--", "true")
    assert r.returncode == 0 and json.loads(r.stdout)["name"] == "b", r
    assert handed(kg) == 0


def test_a_cluster_store_is_never_handed_over(kg):
    served(kg)
    r = subprocess.run([sys.executable, "-m", "kugetsu", "delegate", "a", "--", "true"],
                       env={**kg.env, "KUGETSU_STORE": "postgresql://127.0.0.1:1/none"}, capture_output=True,
                       text=True, timeout=60)
    assert handed(kg) == 0 and r.returncode != 0, r  # the CLI's own (unreachable database) error


def _token_of(request: bytes) -> str:
    """The task's token in a handed request (thin.py: MAGIC, home, cwd, counts, --prompt-file,
    clock, token, ...)."""
    return request.split(b"\0")[7].decode()


def test_a_service_that_ends_after_it_took_the_request_admits_it_once(kg, tmp_path):
    """The service said it runs the request, then its connection dropped (kill -9 in the
    commit): it may have committed or not. The CLI looks for the task by the token its request
    gave it: not there, it admits the task itself; there, it prints what delegate prints of it
    and admits nothing more. Once either way."""
    from kugetsu.app.transaction import _locked
    from kugetsu.core import admission

    kg.config(autostart=False)
    kg.home.ensure()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(kg.home.handoff))
    listener.listen(1)

    def took_then_died(name: str, admit: bool) -> tuple[subprocess.CompletedProcess, str]:
        cli = subprocess.Popen([sys.executable, "-m", "kugetsu", "delegate", name, "--json", "--", "true"], env=kg.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        conn, _ = listener.accept()
        conn.settimeout(10)
        request = b""
        while data := conn.recv(65536):
            request += data
        conn.sendall(b"A")  # taken: then the service "dies", with or without its commit
        token = _token_of(request)
        if admit:
            with _locked(kg.home) as (txn, cfg):
                admission.admit(txn.index, cfg, txn.now, admission.Request(cwd="/", name=name, command=["true"],
                                                                           token=token))
        conn.close()
        out, err = cli.communicate(timeout=60)
        return subprocess.CompletedProcess(cli.args, cli.returncode, out, err), token

    r, token = took_then_died("a", admit=False)
    assert r.returncode == 0 and json.loads(r.stdout)["name"] == "a", r
    r, token_b = took_then_died("b", admit=True)
    assert r.returncode == 0 and json.loads(r.stdout)["name"] == "b", r
    tasks = [t for part in ("active", "queued", "finished") for t in kg.index()[part]]
    assert sorted(t["name"] for t in tasks) == ["a", "b"]  # each once
    assert next(t for t in tasks if t["name"] == "b")["token"] == token_b and token != token_b
    # A connection that drops before that byte: nothing was run, so the CLI runs it itself.
    cli = subprocess.Popen([sys.executable, "-m", "kugetsu", "delegate", "c", "--", "true"], env=kg.env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    conn, _ = listener.accept()
    conn.close()
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0 and " c (#3)" in out, (out, err)
    listener.close()


def test_the_service_gives_the_task_the_token_its_request_chose(kg):
    """What the CLI finds the task by, should the service end before it answers: a request of
    its own (the CLI's format) with a chosen token; the task admitted carries it."""
    served(kg)

    def ask(token: str, name: str) -> bytes:
        argv = ["delegate", name, "--", "true"]
        head = [str(kg.home.root), "/", str(len(argv)), "0", "", repr(time.time()), token, *argv]
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(kg.home.handoff))
            s.sendall(b"".join(f + b"\0" for f in (thin.MAGIC, *(f.encode() for f in head))))
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while data := s.recv(65536):
                answer += data
        return answer

    token = os.urandom(16).hex()
    assert ask(token, "t")[:1] == b"A"
    assert [t["token"] for part in ("active", "queued", "finished") for t in kg.index()[part] if t["name"] == "t"] == [token]
    for bad in ("", "0" * 31, "0" * 33, "Z" * 32, "../" + "0" * 29):  # not 32 hex digits: declined, nothing run
        assert ask(bad, "u") == b"F", bad
    assert not [t for part in ("active", "queued", "finished") for t in kg.index()[part] if t["name"] == "u"]


def test_a_service_killed_while_it_admits_a_handed_request_leaves_it_to_the_cli(kg):
    """The real service, killed (-9) after it took a request and before its transaction: the
    test holds the index lock, so the service waits for it with the request taken. The CLI
    finds no task with its token once the lock is free, and admits it itself: exit 0, one
    task. (The torture test's kills hit that window once in a full run.)"""
    import fcntl

    served(kg, autostart=False)
    pid = kg.service_pid()
    lock = os.open(kg.home.lock, os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        cli = subprocess.Popen([sys.executable, "-m", "kugetsu", "delegate", "a", "--json", "--", "true"],
                               env=kg.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Taken, and waiting for the lock: /proc/locks lists its blocked flock ("->").
        wait_for(lambda: any("->" in line and f" {pid} " in line for line in Path("/proc/locks").read_text().splitlines()),
                 30, "the service to take the request and wait for the index lock")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z",
                 10, "the service gone")
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0 and json.loads(out)["name"] == "a", (out, err)
    assert [t["name"] for part in ("active", "queued", "finished") for t in kg.index()[part]] == ["a"]


def test_another_user_is_refused(tmp_path):
    """The socket is 0600 in a 0700 home; should both be opened up by mistake, the service
    still refuses another uid (SO_PEERCRED) and runs nothing for it."""
    if os.geteuid() != 0 or not shutil.which("runuser") or not shutil.which("useradd"):
        pytest.skip("needs root (to add a user and run a client as it)")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the other user")
    user = "kugetsu-intruder"
    if subprocess.run(["id", user], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", user], check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as where:
        os.chmod(where, 0o755)
        kg = Kugetsu(Path(where) / "home")
        try:
            served(kg)
            sock = kg.home.handoff
            assert sock.stat().st_mode & 0o777 == 0o600 and kg.home.root.stat().st_mode & 0o777 == 0o700
            client = (
                "import socket, sys, time\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "try:\n"
                "    s.connect(sys.argv[1])\n"
                "except OSError as e:\n"
                "    print('connect', e.errno); sys.exit()\n"
                "try:\n"
                "    s.sendall(b'kugetsu-delegate/2\\0' + sys.argv[2].encode() + b'\\0/\\x002\\x000\\0\\0' + str(time.time()).encode() + b'\\0' + b'0' * 32 + b'\\0delegate\\0x\\0')\n"
                "    s.shutdown(socket.SHUT_WR)\n"
                "    print('got', repr(s.recv(10)))\n"
                "except OSError:  # closed before it wrote, or reset: the same refusal\n"
                "    print('got', repr(b''))\n"
            )
            run = ["runuser", "-u", user, "--", python, "-I", "-c", client, str(sock), str(kg.home.root)]
            r = subprocess.run(run, capture_output=True, text=True, timeout=60)
            assert r.stdout.strip() == "connect 13", r  # EACCES: the home and the socket are ours
            os.chmod(kg.home.root, 0o711)
            os.chmod(sock, 0o666)
            r = subprocess.run(run, capture_output=True, text=True, timeout=60)
            assert r.stdout.strip() == "got b''", r  # closed: neither taken nor declined
            wait_for(lambda: "refused a connection from uid" in kg.home.service_log.read_text(), 10, "the refusal")
            assert handed(kg) == 0 and not kg.index().get("queued")
        finally:
            os.chmod(kg.home.root, 0o700)
            kg.cleanup()


def test_a_service_killed_with_the_request_unread_leaves_it_to_the_cli(kg):
    """kill -9 of the real service while a CLI waits on it, its request not yet taken: the
    connection drops before the service said it runs it, so the CLI runs it itself, once."""
    served(kg, autostart=False)
    pid = kg.service_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        cli = subprocess.Popen([sys.executable, "-m", "kugetsu", "delegate", "once", "--json", "--", "true"], env=kg.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wchan = Path(f"/proc/{cli.pid}/wchan")
        wait_for(lambda: wchan.read_text() == "unix_stream_read_generic", 30, "the CLI waiting for the service's answer")
    finally:
        os.kill(pid, signal.SIGKILL)
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0 and json.loads(out)["name"] == "once", (out, err)
    tasks = [t["name"] for part in ("active", "queued", "finished") for t in kg.index()[part]]
    assert tasks.count("once") == 1
    assert handed(kg) == 0


def test_a_prompt_file_and_stdin_go_with_the_request(kg, tmp_path):
    """--prompt-file F and - (stdin): read by the CLI, sent with the request, refused or
    admitted as in the CLI's process; stdin is replayed when the CLI runs it after all."""
    served(kg, agents={"echo": {"command": ["echo", "{prompt}"]}}, default_agent="echo")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n")
    for args, stdin, declined in [
        (("--prompt-file", "-"), "", False),  # empty stdin
        (("--prompt-file", str(bad)), None, False),
        (("--prompt-file", str(blank)), None, False),
        (("--prompt-file", str(tmp_path / "missing")), None, True),  # read again by the CLI: its words
        (("--prompt-file=-", "--prompt", "x"), "text", True),  # argparse's error, with stdin read first
        (("--prompt-file", "-"), "p" * (200 << 10), False),  # over prompt_max_size (128 KiB)
        (("--prompt-file", "-"), "p" * (1100 << 10), True),  # over PROMPT_MAX: the CLI reads the rest itself
    ]:
        before = handed(kg)
        thin = kg.run("delegate", "x", *args, input=stdin)
        expected = before if declined else before + 1
        here = in_process(kg, "delegate", "x", *args, input=stdin)
        _same(thin, here)
        assert thin.returncode == 2 and "Traceback" not in thin.stderr, thin
        assert handed(kg) == expected, (args, thin)
    assert not kg.index().get("queued") and not kg.index().get("active")
    before = handed(kg)
    thin = kg.run("delegate", "a", "--json", "--prompt-file", "-", input="línea 1\r\nline 2\n")
    assert thin.returncode == 0 and json.loads(thin.stdout)["prompt"] == "línea 1\r\nline 2\n", thin
    assert handed(kg) == before + 1
    # Declined (--wait blocks), after the CLI read stdin: it runs here with the same prompt.
    thin = kg.run("delegate", "b", "--json", "--wait", "--prompt-file", "-", input="from stdin")
    assert thin.returncode == 0 and json.loads(thin.stdout)["prompt"] == "from stdin", thin
    assert handed(kg) == before + 1


def test_queue_is_answered_by_the_service_as_the_cli_prints_it(kg):
    """`queue --limit N` (text, --json, --all) through the service: the CLI's own process
    imports neither msgspec nor the CLI (at 50,000 queued its read of index.json was most of
    180 ms), and prints what the in-process command prints, byte for byte (the text's
    durations aside, which move with the clock between the two). Without --limit, over
    QUEUE_MOST, or with a filter (the whole queue's view, which the service's loop must not
    wait for), and for bad input, the CLI answers as before, the same words and codes."""
    served(kg)
    kg.ok("delegate", "done", "--", "true")  # one in the finished list, for --all
    kg.wait_state("done", "succeeded")
    kg.ok("pause")  # nothing running: a running task's measured use moves between the two commands
    kg.ok("delegate", "a", "--", "true")
    kg.ok("delegate", "b", "--source", "pm", "--memory", "1G", "--", "true")
    kg.ok("delegate", "c", "--prompt-file", "-", "--", "cat", input="a prompt, kept apart\n")
    kg.ok("hold", "claude")
    ages = re.compile(r"\b(?:\d+[smhd])+\b")

    def norm(text: str) -> str:
        """Durations as T, and the columns' padding with them (`1d` one moment, `23h59m` the next)."""
        return re.sub(r" +", " ", ages.sub("T", text))

    served_args = (["queue", "--limit", "5"], ["queue", "--json", "--limit", "1"], ["queue", "--all", "--limit", "9"],
                   ["queue", "--json", "--all", "--limit", str(thin.QUEUE_MOST)])
    its_own = (["queue"], ["queue", "--json"], ["queue", "--limit", "2", "--source", "pm"],
               ["queue", "--json", "--limit", str(thin.QUEUE_MOST + 1)], ["queue", "--state", "bogus", "--limit", "1"],
               ["queue", "--limit", "0"])
    for args in (*served_args, *its_own):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "kugetsu", *args], env=kg.env,
                           capture_output=True, text=True, timeout=60)
        imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
        here = in_process(kg, *args)
        assert ("kugetsu.frontends.cli.main" not in imported) == (args in served_args), args
        if args in served_args:
            assert "msgspec" not in imported, args
        err = "\n".join(line for line in r.stderr.splitlines() if not line.startswith("import time:"))
        assert (r.returncode, norm(r.stdout), err) == (here.returncode, norm(here.stdout), here.stderr.rstrip("\n")), args
    shown = json.loads(kg.run("queue", "--json", "--limit", "1").stdout)
    assert [t["name"] for t in shown["queued"]] == ["a"] and shown["more_queued"] == 2
    assert kg.run("queue", "--state", "bogus", "--limit", "1").returncode == 2
    kg.ok("resume")
    kg.wait_state("b", "succeeded")


def test_capacity_is_answered_by_the_service_as_the_cli_prints_it(kg):
    """`capacity` (text and --json) through the service: the CLI's own process imports neither
    msgspec nor the CLI, and prints what the in-process command prints, holds and tasks that
    declare memory or slots counted alike; the service's fast path is untouched (the next
    task is still let go at once when the running one ends)."""
    served(kg)
    kg.ok("delegate", "blocker", "--", "sleep", "30")
    kg.ok("delegate", "a", "--", "true")
    kg.ok("delegate", "big", "--slots", "1", "--memory", "1G", "--", "true")
    kg.ok("hold", "claude")
    for args in (["capacity"], ["capacity", "--json"]):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "kugetsu", *args], env=kg.env,
                           capture_output=True, text=True, timeout=60)
        imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
        assert "msgspec" not in imported and "kugetsu.frontends.cli.main" not in imported, args
        here = in_process(kg, *args)
        assert r.returncode == here.returncode == 0 and r.stdout == here.stdout, (r, here)
    assert json.loads(r.stdout)["queued"] == 2
    kg.ok("cancel", "blocker")
    kg.wait_state("big", "succeeded")
