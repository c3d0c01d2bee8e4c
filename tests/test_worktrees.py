"""Worktree isolation through the real CLI, the real service, real git repositories and
real agent processes (docs/worktrees.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import agent_wrappers, wait_for


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    git(r, "config", "user.name", "Test")
    git(r, "config", "user.email", "test@example.com")
    (r / "f.txt").write_text("original\n")
    (r / "sub").mkdir()
    (r / "sub" / "keep.txt").write_text("x\n")
    git(r, "add", ".")
    git(r, "commit", "-qm", "init")
    return r


def gated(go: Path, after: str = "") -> list[str]:
    """An agent that says it runs (touches `<go>.ready`), waits for the file `go`, then runs `after`."""
    return ["sh", "-c", f'touch "$0.ready"; while [ ! -e "$0" ]; do sleep 0.05; done; {after}', str(go)]


def delegate(kg, repo: Path, name: str, argv: list[str], *extra: str, cwd: Path | None = None):
    return kg.run("delegate", name, "--worktree", "--cwd", str(cwd or repo), *extra, "--", *argv)


def branches(repo: Path) -> list[str]:
    return git(repo, "branch", "--format=%(refname:short)").splitlines()


def ended(kg, ref: str, *states: str, timeout: float = 15) -> dict:
    """The task final in one of `states`, and its worktree kept or removed: the service closes
    it in its git worker just after the task ends, and books the outcome a moment later."""
    return wait_for(lambda: (t := kg.task(ref))["state"] in states and t["worktree_state"] != "active" and t,
                    timeout, f"{ref} to be {states} with its worktree closed")  # type: ignore[return-value]


def registered(repo: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in git(repo, "worktree", "list", "--porcelain").splitlines()
            if line.startswith("worktree ")]


def test_parallel_tasks_each_see_only_their_own_change(kg, repo, tmp_path):
    go = tmp_path / "go"
    for name in ("a", "b"):
        # Each agent writes its own name into the same file, then (once both are running)
        # reports what it sees, where it runs and its branch.
        report = (f'echo {name} > f.txt; touch "$0.{name}"; while [ ! -e "$0" ]; do sleep 0.05; done; '
                  f'{{ cat f.txt; pwd; echo "$KUGETSU_BRANCH"; echo "$KUGETSU_WORKTREE"; }} > "{kg.rec / name}"')
        r = delegate(kg, repo, name, ["sh", "-c", report, str(go)])
        assert r.returncode == 0, r.stderr
        assert "worktree on branch kugetsu/" + name in r.stdout
    wait_for(lambda: Path(f"{go}.a").exists() and Path(f"{go}.b").exists(), 15, "both agents running at once")
    go.touch()
    for name in ("a", "b"):
        t = ended(kg, name, "succeeded")
        seen, cwd, branch, wt = (kg.rec / name).read_text().splitlines()
        assert seen == name, f"{name} saw the other agent's change"
        assert branch == f"kugetsu/{name}" and t["branch"] == branch
        assert cwd == wt == t["worktree"] != str(repo)
        assert t["worktree_state"] == "kept" and "work kept on branch kugetsu/" + name in t["reason"]
        assert (Path(wt) / "f.txt").read_text() == f"{name}\n"
    assert (repo / "f.txt").read_text() == "original\n"
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    listed = kg.json("worktrees")
    assert sorted(w["name"] for w in listed) == ["a", "b"]
    assert all(w["size"] > 0 and w["state"] == "succeeded" for w in listed)


def test_clean_task_leaves_nothing_behind(kg, repo):
    r = delegate(kg, repo, "clean", ["sh", "-c", 'cat f.txt > /dev/null; echo "$PWD" > "$0"', str(kg.rec / "clean")],
                 cwd=repo / "sub")
    assert r.returncode == 0, r.stderr
    t = ended(kg, "clean", "succeeded")
    assert (kg.rec / "clean").read_text().strip() == t["worktree"] + "/sub"  # same subdirectory as delegated from
    assert t["worktree_state"] == "removed" and t["reason"] is None
    assert branches(repo) == ["main"]
    assert registered(repo) == [str(repo)]
    assert not any((kg.home.root / "worktrees").glob("*/*"))
    assert kg.json("worktrees") == []


def test_task_with_a_commit_keeps_its_branch(kg, repo):
    work = 'echo more >> f.txt; echo new > g.txt; git add -A; git commit -qm "agent work"'
    assert delegate(kg, repo, "issue-16", ["sh", "-c", work]).returncode == 0
    t = ended(kg, "issue-16", "succeeded")
    assert t["reason"] == "work kept on branch kugetsu/issue-16 (1 commit, 2 files changed)"
    assert git(repo, "log", "-1", "--format=%s", "kugetsu/issue-16") == "agent work"
    assert git(repo, "rev-parse", "kugetsu/issue-16~1") == t["base"] == git(repo, "rev-parse", "main")
    final = kg.events("succeeded")[-1]
    assert final["branch"] == "kugetsu/issue-16" and final["worktree"] == t["worktree"]
    [closed] = kg.events("worktree")  # what became of the worktree, once git is done with it
    assert (closed["task"], closed["state"], closed["worktree_state"]) == (t["id"], "succeeded", "kept")
    assert closed["reason"] == t["reason"] and closed["branch"] == "kugetsu/issue-16"
    assert "kugetsu/issue-16" in kg.ok("queue", "--all")
    # The next task of that name would collide with the kept branch: refused up front.
    r = delegate(kg, repo, "issue-16", ["true"])
    assert r.returncode == 2 and "already exists" in r.stderr


def test_creation_failure_fails_the_task_and_frees_the_slot(kg, repo, tmp_path):
    kg.config(max_agents=1)
    git(repo, "branch", "feature")
    go = tmp_path / "go"
    assert delegate(kg, repo, "blocker", gated(go)).returncode == 0
    assert delegate(kg, repo, "bad", ["true"], "--base", "feature").returncode == 0
    assert delegate(kg, repo, "next", ["true"]).returncode == 0
    git(repo, "branch", "-D", "feature")  # the base vanishes while the task waits
    go.touch()
    bad = ended(kg, "bad", "failed")
    assert "could not create its worktree" in bad["reason"] and "feature" in bad["reason"]
    assert bad["worktree"] is None and bad["pid"] is None
    ended(kg, "next", "succeeded")
    assert "kugetsu/bad" not in branches(repo)
    assert not list((kg.home.root / "worktrees").glob("*/bad"))


def test_admission_refuses_what_could_never_get_a_worktree(kg, repo, tmp_path):
    outside = tmp_path / "plain"
    outside.mkdir()
    r = kg.run("delegate", "x", "--worktree", "--cwd", str(outside), "--", "true")
    assert r.returncode == 2 and "not inside" in r.stderr
    assert not kg.home.index.exists()
    r = delegate(kg, repo, "y", ["true"], "--base", "no-such-ref")
    assert r.returncode == 2 and "no-such-ref" in r.stderr
    r = delegate(kg, repo, "bad..name", ["true"])
    assert r.returncode == 2
    r = kg.run("delegate", "z", "--base", "main", "--cwd", str(repo), "--", "true")
    assert r.returncode == 2 and "--worktree" in r.stderr
    assert not kg.home.index.exists()


def test_kill_9_of_the_service_mid_run_leaves_nothing_stale(kg, repo, tmp_path):
    go = tmp_path / "go"
    assert delegate(kg, repo, "long", gated(go, 'echo w > w.txt; git add w.txt; git commit -qm w')).returncode == 0
    wait_for(lambda: Path(f"{go}.ready").exists(), 15, "the agent to run")
    old = wait_for(kg.service_pid, what="the service pid")
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{old}").exists() or b") Z" in Path(f"/proc/{old}/stat").read_bytes(), 5)
    # The next delegation brings the service back (autostart); it re-adopts `long` and starts `after`.
    assert delegate(kg, repo, "after", ["sh", "-c", "echo after > f.txt"]).returncode == 0
    assert "work kept on branch kugetsu/after" in ended(kg, "after", "succeeded")["reason"]
    assert kg.service_pid() != old
    go.touch()
    t = ended(kg, "long", "succeeded")
    assert "work kept on branch kugetsu/long (1 commit" in t["reason"]
    # A crash of the agent too: its worktree stays registered, and the next start must not trip on it.
    assert delegate(kg, repo, "crash", gated(go.with_name("go2"))).returncode == 0
    wait_for(lambda: Path(f"{go.with_name('go2')}.ready").exists(), 15, "the second agent to run")
    wait_for(lambda: kg.index()["active"][0]["pid"], what="the service to commit its pid")
    pid = kg.service_pid()
    os.kill(pid, signal.SIGKILL)
    for wrapper in agent_wrappers(kg.home):
        os.killpg(wrapper, signal.SIGKILL)
    wait_for(lambda: not agent_wrappers(kg.home), 5, "the agents to die")
    assert delegate(kg, repo, "next", ["true"]).returncode == 0  # brings the service back
    ended(kg, "next", "succeeded")
    lost = ended(kg, "crash", "lost", "failed")
    assert lost["worktree_state"] == "removed"
    assert "kugetsu/crash" not in branches(repo) and len(registered(repo)) == 3  # main + two kept ones
    assert delegate(kg, repo, "crash", ["sh", "-c", "echo again > f.txt"]).returncode == 0
    ended(kg, "crash", "succeeded")


def test_prune_spares_live_tasks_and_unmerged_work(kg, repo, tmp_path):
    go = tmp_path / "go"
    commit = 'echo "$KUGETSU_TASK_NAME" > f.txt; git commit -qam work'
    assert delegate(kg, repo, "merged", ["sh", "-c", commit]).returncode == 0
    assert delegate(kg, repo, "unmerged", ["sh", "-c", commit]).returncode == 0
    assert delegate(kg, repo, "live", gated(go, "echo live > f.txt")).returncode == 0
    ended(kg, "merged", "succeeded")
    ended(kg, "unmerged", "succeeded")
    wait_for(lambda: Path(f"{go}.ready").exists(), 15, "the live agent to run")
    git(repo, "merge", "-q", "--ff-only", "kugetsu/merged")
    live = kg.task("live")["worktree"]

    out = kg.ok("worktrees", "prune")
    assert "removed merged" in out and "kept unmerged" in out and "live (#" not in out
    assert "kugetsu/merged" not in branches(repo) and "kugetsu/unmerged" in branches(repo)
    assert kg.task("merged")["worktree_state"] == "pruned"
    assert kg.ok("worktrees", "prune", "--older-than", "1h").strip() == "no worktrees of finished tasks to prune"

    kg.ok("worktrees", "prune", "--force")
    assert "kugetsu/unmerged" not in branches(repo)
    assert os.path.isdir(live) and (Path(live) / ".git").exists()
    assert [w["name"] for w in kg.json("worktrees")] == ["live"]
    go.touch()
    t = ended(kg, "live", "succeeded")
    assert t["worktree_state"] == "kept" and "1 file changed, uncommitted" in t["reason"]
    assert [e["name"] for e in kg.events("worktree") if "worktree_state" not in e] == ["merged", "unmerged"]  # prunes


def test_config_preset_keep_and_max_disk(kg, repo):
    kg.config(
        agents={"coder": {"command": ["sh", "-c", 'echo "$KUGETSU_BRANCH" > out.txt; git add -A; git commit -qm x'],
                          "worktree": True}},
        worktrees={"keep": "changed", "max_disk": "1K"},
    )
    r = kg.run("delegate", "p1", "--agent", "coder", "--cwd", str(repo))
    assert r.returncode == 0 and "kugetsu/p1" in r.stdout, r.stderr
    t = ended(kg, "p1", "succeeded")
    assert "work kept on branch kugetsu/p1" in t["reason"]
    # Over max_disk: the finished task's worktree goes, its branch (the work) stays.
    wait_for(lambda: [e for e in kg.events("worktree") if "max_disk" in e.get("reason", "")], 10, "the max_disk prune")
    assert kg.task("p1")["worktree_state"] == "pruned" and not os.path.exists(t["worktree"])
    assert git(repo, "show", "kugetsu/p1:out.txt") == "kugetsu/p1"
    r = kg.run("delegate", "p2", "--agent", "coder", "--no-worktree", "--cwd", str(repo))
    assert r.returncode == 0 and "worktree" not in r.stdout
    ended(kg, "p2", "succeeded")
    assert (repo / "out.txt").read_text() == "\n"  # it ran in the checkout itself, without a branch
    r = kg.run("config", "set", "worktrees.keep", "sometimes")
    assert r.returncode == 2
    kg.ok("config", "set", "worktrees.keep", "always")
    assert kg.ok("config", "get", "worktrees.keep").strip() == "always"


def test_cancel_and_timeout_leave_no_worktree(kg, repo, tmp_path):
    kg.config(max_agents=1)
    go = tmp_path / "go"
    assert delegate(kg, repo, "running", gated(go)).returncode == 0
    assert delegate(kg, repo, "waiting", ["true"]).returncode == 0
    kg.ok("cancel", "waiting")  # queued: it never had a worktree
    assert kg.task("waiting")["worktree"] is None
    wait_for(lambda: Path(f"{go}.ready").exists(), 15, "the agent to run")
    assert kg.task("running")["worktree_state"] == "active"
    kg.ok("cancel", "running")
    assert ended(kg, "running", "cancelled")["worktree_state"] == "removed"
    assert delegate(kg, repo, "slow", ["sleep", "30"], "--timeout", "1s").returncode == 0
    t = ended(kg, "slow", "failed")
    assert "timed out" in t["reason"] and t["worktree_state"] == "removed"
    assert branches(repo) == ["main"] and registered(repo) == [str(repo)]
    assert not any((kg.home.root / "worktrees").glob("*/*"))


def test_a_worktree_created_before_a_crash_is_reused_not_recreated(kg, repo):
    # autostart off: the task is `running` in the index with no process and no worktree
    # recorded, as if the service died between `git worktree add` and its commit.
    kg.config(autostart=False)
    r = delegate(kg, repo, "orphaned", ["sh", "-c", 'cat left.txt > "$0"', str(kg.rec / "orphaned")])
    assert r.returncode == 0, r.stderr
    task = kg.index()["active"][0]
    assert task["pid"] is None and task["worktree"] is None
    from kugetsu.service.worktree import group_dir

    path = group_dir(kg.home, str(repo)) / "orphaned"
    git(repo, "worktree", "add", "-q", "-b", "kugetsu/orphaned", str(path), task["base"])
    (path / "left.txt").write_text("from before the crash\n")
    kg.ok("serve", "--detach")
    t = ended(kg, "orphaned", "succeeded")
    assert (kg.rec / "orphaned").read_text() == "from before the crash\n"
    assert t["worktree"] == str(path) and t["worktree_state"] == "kept"


def test_a_slow_checkout_holds_no_other_command_and_a_cancel_during_it_leaves_nothing(kg, repo, tmp_path):
    """The worktree is made in a worker thread of the service: while git is busy (here a
    post-checkout hook that waits for a file), the index lock is free for everyone else."""
    started, go = tmp_path / "checkout.started", tmp_path / "checkout.go"
    hook = repo / ".git" / "hooks" / "post-checkout"
    hook.write_text(f'#!/bin/sh\ntouch "{started}"\nwhile [ ! -e "{go}" ]; do sleep 0.05; done\n')
    hook.chmod(0o755)
    assert delegate(kg, repo, "slow", ["true"]).returncode == 0
    wait_for(started.exists, 15, "git to be inside the checkout")
    r = kg.run("delegate", "other", "--", "true", timeout=10)  # would wait for the checkout under the lock
    assert r.returncode == 0, r.stderr
    assert ended(kg, "other", "succeeded")
    slow = kg.task("slow")
    assert slow["state"] == "running" and slow["pid"] is None and slow["worktree_state"] is None
    assert "cancelled slow" in kg.ok("cancel", "slow")
    go.touch()  # git finishes the worktree nobody wants any more
    wait_for(lambda: "kugetsu/slow" not in branches(repo) and len(registered(repo)) == 1, 15,
             "the unwanted worktree and its branch to be removed")
    assert kg.task("slow")["state"] == "cancelled"
    assert not list((kg.home.root / "worktrees").glob("*/slow"))
    assert delegate(kg, repo, "after", ["sh", "-c", "echo after > f.txt"]).returncode == 0
    assert "work kept on branch kugetsu/after" in ended(kg, "after", "succeeded")["reason"]


def slow_branch_deletion(repo: Path, started: Path, go: Path) -> None:
    """A reference-transaction hook that, once git has deleted a kugetsu/ branch (what closing a
    clean worktree ends with), writes git's pid to `started` and waits for `go` (at most 10 s)."""
    hook = repo / ".git" / "hooks" / "reference-transaction"
    hook.write_text(f"""#!/bin/sh
[ "$1" = committed ] || exit 0
while read old new ref; do
  case "$new $ref" in
    0000000000000000000000000000000000000000\\ refs/heads/kugetsu/*)
      echo $PPID > "{started}"; i=0
      while [ ! -e "{go}" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done;;
  esac
done
""")
    hook.chmod(0o755)


def timed(kg, *args: str) -> float:
    t0 = time.monotonic()
    kg.ok(*args)
    return time.monotonic() - t0


def test_a_slow_close_holds_no_command_and_the_next_task_starts_at_once(kg, repo, tmp_path):
    """The worktree of a task that ended is closed (git status, worktree remove, branch -D
    and their hooks) by the service's git worker after the task is final: a slow git delays
    no command and no start, and the outcome is booked when git is done."""
    kg.config(max_agents=1)
    started, go = tmp_path / "close.started", tmp_path / "close.go"
    slow_branch_deletion(repo, started, go)
    first_go = tmp_path / "first.go"
    assert delegate(kg, repo, "first", kg.agent("first", gate=first_go)).returncode == 0
    kg.delegate("second", 0)  # no worktree: it waits for the slot only
    wait_for(lambda: "start" in kg.times("first"), 15, "first to run")
    first_go.touch()
    wait_for(started.exists, 15, "git to be inside the hook of first's close")
    # `kugetsu wait` waits for the worktree's fate too, so that the reason read after it says
    # where the work went.
    waiter = subprocess.Popen([sys.executable, "-m", "kugetsu", "wait", "first"], env=kg.env)
    # While the close hangs in git: the task has ended, its slot went on, commands answer.
    assert timed(kg, "delegate", "third", "--", *kg.agent("third")) < 2.0  # ~0.2 s; ~10 s when git held the lock
    assert timed(kg, "queue") < 2.0
    wait_for(lambda: "end" in kg.times("third"), 15, "third to run, after second")
    assert kg.times("second")["start"] - kg.times("first")["end"] < 0.5  # at once, by the agents' clocks
    first = kg.task("first")
    assert (first["state"], first["worktree_state"], first["reason"]) == ("succeeded", "active", None)
    assert waiter.poll() is None, "wait returned before the worktree was closed"
    go.touch()
    assert waiter.wait(timeout=15) == 0
    booked = next(t for t in kg.index()["finished"] if t["name"] == "first")
    assert booked["worktree_state"] == "removed"  # before wait returned
    first = ended(kg, "first", "succeeded")
    assert first["worktree_state"] == "removed" and first["reason"] is None
    [closed] = kg.events("worktree")
    assert (closed["name"], closed["state"], closed["worktree_state"]) == ("first", "succeeded", "removed")
    assert registered(repo) == [str(repo)] and not any((kg.home.root / "worktrees").glob("*/*"))


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or b") Z" in Path(f"/proc/{pid}/stat").read_bytes()


def test_a_close_cut_short_by_a_crash_is_finished_by_the_next_service(kg, repo, tmp_path):
    """The service dies while git closes one worktree, another waiting its turn: both tasks
    are final with their worktrees `active`. The next service books the first (git finished
    it) and closes the second."""
    kg.config(max_agents=2)
    started, go = tmp_path / "close.started", tmp_path / "close.go"
    slow_branch_deletion(repo, started, go)
    # One git worker makes and closes worktrees in turn: a ends once b has its worktree (else
    # b's would wait behind a's stuck close), and b commits once a's close is inside git, so
    # that b's own close waits behind it.
    b_runs = tmp_path / "b.runs"
    assert delegate(kg, repo, "a", ["sh", "-c", f'while [ ! -e "{b_runs}" ]; do sleep 0.05; done']).returncode == 0
    work = f'touch "{b_runs}"; while [ ! -e "{started}" ]; do sleep 0.05; done; echo b > f.txt; git commit -qam b'
    assert delegate(kg, repo, "b", ["sh", "-c", work]).returncode == 0
    wait_for(lambda: kg.task("b")["state"] == "succeeded", 15, "b to end while git is in a's close")
    assert kg.task("a")["worktree_state"] == kg.task("b")["worktree_state"] == "active"
    pid = kg.service_pid()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: gone(pid), 5, "the service to die")
    git_pid = int(started.read_text())
    go.touch()
    wait_for(lambda: gone(git_pid), 10, "the orphaned git to finish a's branch deletion")
    kg.ok("serve", "--detach")
    a, b = ended(kg, "a", "succeeded"), ended(kg, "b", "succeeded")
    assert a["worktree_state"] == "removed" and a["reason"] is None
    assert b["worktree_state"] == "kept" and b["reason"] == "work kept on branch kugetsu/b (1 commit, 1 file changed)"
    assert branches(repo) == ["kugetsu/b", "main"]
    assert registered(repo) == [str(repo), b["worktree"]]
    assert {e["name"]: e["worktree_state"] for e in kg.events("worktree")} == {"a": "removed", "b": "kept"}
