"""Git worktrees for agents: create at start, inspect and keep or remove at the end.

A process/IO module like runner.py: used by ops, the service and the CLI, never by pm.
Every git call is bounded by a timeout, because the service's one git worker thread runs
them one after the other; all worktree changes of one repository are serialized by a lock file in
KUGETSU_HOME, so that two tasks starting together never race on git's own lock files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kugetsu.errors import KugetsuError, UsageError
from kugetsu.core.models import Task
from kugetsu.paths import Home, open_file, private_dir

GIT_TIMEOUT = 30.0
ADD_TIMEOUT = 120.0  # a checkout of a big repository (and its post-checkout hook)
LOCK_TIMEOUT = 30.0
_ENV = {"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "GIT_OPTIONAL_LOCKS": "0"}


class WorktreeError(KugetsuError):
    pass


def git(cwd: str | os.PathLike[str], *args: str, timeout: float = GIT_TIMEOUT, check: bool = True) -> str:
    """Run git; its stdout, stripped. A contended git lock (another git process in the same
    repository, outside kugetsu's own lock) is retried a few times before it counts as a failure."""
    for attempt in range(4):
        try:
            proc = subprocess.run(
                ["git", *args], cwd=cwd, env={**os.environ, **_ENV}, stdin=subprocess.DEVNULL,
                capture_output=True, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise WorktreeError(f"git {args[0]} took longer than {timeout:.0f}s") from None
        except OSError as err:  # git missing, or cwd gone
            raise WorktreeError(f"cannot run git in {cwd}: {err.strerror or err}") from None
        if proc.returncode == 0 or not check:
            return proc.stdout.strip()
        message = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        text = message[-1] if message else f"git {args[0]} exited with {proc.returncode}"
        if ".lock" in text and "exists" in text and attempt < 3:
            time.sleep(0.1 * (attempt + 1))
            continue
        raise WorktreeError(text.removeprefix("fatal: ").removeprefix("error: "))
    raise AssertionError("unreachable")


# ---- admission ----------------------------------------------------------------------------


def admission(cwd: str, name: str | None, base: str | None) -> tuple[str, str]:
    """(repository top level, base) for a task delegated from `cwd`, or UsageError (exit 2).
    Without `base` the base is HEAD's commit now; a given REF is kept as given and resolved
    when the task starts, so that a queued task branches from the ref as it is then."""
    try:
        top = git(cwd, "rev-parse", "--show-toplevel")
    except WorktreeError:
        top = ""
    if not top:
        raise UsageError(
            f"--worktree needs a git repository, and {cwd} is not inside one;"
            " delegate from (or --cwd into) a checkout, or drop --worktree"
        )
    if base is None:
        try:
            base = git(top, "rev-parse", "--verify", "HEAD^{commit}")
        except WorktreeError:
            raise UsageError(f"the repository {top} has no commits yet; a worktree needs a commit to start from") from None
    elif not git(top, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}", check=False):
        raise UsageError(f"--base {base!r} is not a commit in {top}")
    if name is not None:
        branch = f"kugetsu/{name}"
        if subprocess.run(["git", "check-ref-format", f"refs/heads/{branch}"], capture_output=True).returncode:
            raise UsageError(f"task name {name!r} does not make a valid git branch name ({branch})")
        if git(top, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False):
            raise UsageError(
                f"branch {branch} already exists in {top} (work of an earlier task?);"
                f" merge or delete it (`git branch -D {branch}`), or pick another name"
            )
    return top, base


# ---- where -------------------------------------------------------------------------------


def group_dir(home: Home, repo: str) -> Path:
    """<home>/worktrees/<repo-name>-<hash>: the repository's name for people, a hash of its
    path so that two checkouts with the same name never share a directory."""
    digest = hashlib.sha256(repo.encode()).hexdigest()[:8]
    return home.root / "worktrees" / f"{Path(repo).name or 'repo'}-{digest}"


def path_for(home: Home, task: Task) -> Path:
    assert task.repo is not None
    return group_dir(home, task.repo) / task.name


def agent_cwd(task: Task, path: Path) -> str:
    """Delegated from a subdirectory of the repository: the agent starts in the same
    subdirectory of its worktree."""
    rel = os.path.relpath(task.cwd, task.repo) if task.repo else "."
    inside = path / rel if not rel.startswith("..") else path
    return str(inside if inside.is_dir() else path)


def repo_lock(home: Home, repo: str) -> contextlib.AbstractContextManager[None]:
    return group_lock(group_dir(home, repo))


@contextmanager
def group_lock(group: Path) -> Iterator[None]:
    """Serializes kugetsu's worktree changes of one repository (next to, not in, its directory)."""
    _private(group.parent)
    fd = open_file(group.parent / f".{group.name}.lock", os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise WorktreeError(f"another kugetsu process holds the worktree lock of {group.name}") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _private(path: Path) -> None:
    """worktrees/ and its per-repository directories: made 0700 by us, never a planted link."""
    try:
        private_dir(path, "a worktree directory", "remove it; kugetsu makes a new one")
    except UsageError as err:
        raise WorktreeError(str(err)) from None


# ---- start -------------------------------------------------------------------------------


def create(home: Home, task: Task) -> Path:
    """`git worktree add -b kugetsu/<name> <path> <base>`; sets the task's worktree fields.
    On any failure nothing is left behind (no directory, no registration, no new branch)."""
    assert task.repo and task.branch and task.base
    path = path_for(home, task)
    with repo_lock(home, task.repo):
        if not os.path.isdir(task.repo):
            raise WorktreeError(f"the repository {task.repo} is gone")
        git(task.repo, "worktree", "prune")  # registrations left by a crash would block `add`
        commit = git(task.repo, "rev-parse", "--verify", "--quiet", f"{task.base}^{{commit}}", check=False)
        if not commit:
            raise WorktreeError(f"base {task.base!r} is not a commit in {task.repo}")
        if git(task.repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{task.branch}", check=False):
            raise WorktreeError(f"branch {task.branch} already exists in {task.repo}")
        if path.exists():
            raise WorktreeError(f"{path} already exists")
        _private(path.parent)
        try:
            git(task.repo, "worktree", "add", "--quiet", "-b", task.branch, str(path), commit, timeout=ADD_TIMEOUT)
        except WorktreeError:
            _undo(task.repo, path, task.branch)
            raise
    task.worktree, task.base_commit, task.worktree_state = str(path), commit, "active"
    return path


def _undo(repo: str, path: Path, branch: str | None) -> None:
    """Take back a half-done `worktree add` (timeout, disk full)."""
    shutil.rmtree(path, ignore_errors=True)
    git(repo, "worktree", "prune", check=False)
    if branch:
        git(repo, "branch", "-D", branch, check=False)
    _rmdir_empty(path.parent)


def recover(home: Home, task: Task) -> bool:
    """After a crash between creating a worktree and committing the index: a live task with
    no recorded worktree whose worktree exists on its own branch gets it back."""
    if not task.repo or task.worktree_state is not None:
        return False
    path = path_for(home, task)
    if not (path / ".git").exists():
        return False
    head = git(path, "symbolic-ref", "--quiet", "HEAD", check=False)
    if head != f"refs/heads/{task.branch}":
        return False
    commit = git(task.repo, "rev-parse", "--verify", "--quiet", f"{task.base}^{{commit}}", check=False)
    task.worktree, task.base_commit, task.worktree_state = str(path), commit or None, "active"
    return True


# ---- end -----------------------------------------------------------------------------------


@dataclass
class Work:
    commits: int
    files: int
    dirty: bool

    @property
    def empty(self) -> bool:
        return not self.commits and not self.dirty

    def describe(self, branch: str) -> str:
        text = f"{self.commits} commit{'s' if self.commits != 1 else ''}, {self.files} file{'s' if self.files != 1 else ''} changed"
        return f"branch {branch} ({text}{', uncommitted' if self.dirty else ''})"


def inspect(task: Task) -> Work:
    """What the agent left: commits on its branch since the base, files that differ from the
    base (committed or not, untracked included), and whether anything is uncommitted."""
    assert task.worktree and task.branch
    wt = task.worktree
    base = task.base_commit or git(wt, "merge-base", "HEAD", task.base or "HEAD")
    commits = int(git(wt, "rev-list", "--count", f"{base}..refs/heads/{task.branch}") or 0)
    status = git(wt, "status", "--porcelain", "--untracked-files=all")
    files = set(git(wt, "diff", "--name-only", base).splitlines())
    files |= {line[3:] for line in status.splitlines() if line.startswith("??")}
    return Work(commits, len(files), bool(status))


def close(home: Home, task: Task, keep: str) -> str | None:
    """The task is final: keep or remove its worktree per `keep`. Returns what to tell the
    user (None: nothing worth saying). Work is never thrown away on a git error. The whole
    look-and-decide runs under the repository's lock: a `worktrees prune`, or a close of the
    same worktree by a service that restarted while a stopping one still ran, waits for it
    instead of removing the worktree between the look and the removal."""
    if task.worktree_state != "active" or not task.worktree or not task.repo:
        return None
    path, branch = Path(task.worktree), task.branch or ""
    try:
        with repo_lock(home, task.repo):
            return _close(task, path, branch, keep)
    except WorktreeError as err:  # the lock itself (another kugetsu holds it for too long)
        task.worktree_state = "kept"
        return f"worktree kept at {path} ({err})"


def _close(task: Task, path: Path, branch: str, keep: str) -> str | None:
    assert task.repo
    if not path.exists():
        task.worktree_state = "removed"
        return _gone(task, path, branch, keep)
    try:
        work = inspect(task)
    except WorktreeError as err:
        task.worktree_state = "kept"
        return f"worktree kept at {path} (could not inspect it: {err})"
    if keep == "always" or (keep == "changed" and not work.empty):
        task.worktree_state = "kept"
        return f"work kept on {work.describe(branch)}" if not work.empty else f"worktree kept at {path} (no changes)"
    try:
        remove(task.repo, path, branch if not work.commits else None)
    except WorktreeError as err:
        task.worktree_state = "kept"
        return f"worktree kept at {path} (could not remove it: {err})"
    task.worktree_state = "removed"
    if work.empty:
        return None
    kept = f"; {work.commits} commit(s) kept on branch {branch}" if work.commits else ""
    lost = "; uncommitted changes discarded" if work.dirty else ""
    return f"worktree removed (worktrees.keep=never){kept}{lost}"


def _gone(task: Task, path: Path, branch: str, keep: str) -> str | None:
    """The worktree's directory is gone: removed by hand, or by a close that a stop or a crash
    of the service cut short (the next service closes it again). A branch with no commits of
    its own goes as a clean worktree's would; one with commits stays, and the user is told."""
    said = f"worktree {path} had been removed; branch {branch} left as it was"
    assert task.repo
    if not os.path.isdir(task.repo):
        return said
    git(task.repo, "worktree", "prune", check=False)
    ref = f"refs/heads/{branch}"
    if not branch or not git(task.repo, "rev-parse", "--verify", "--quiet", ref, check=False):
        return None  # nothing is left, and it held no commits
    if keep == "always" or not task.base_commit:
        return said
    if git(task.repo, "rev-list", "--count", f"{task.base_commit}..{ref}", check=False) != "0":
        return said
    try:
        git(task.repo, "branch", "-D", branch)
    except WorktreeError:
        return said
    return None


def remove(repo: str | None, path: Path, branch: str | None) -> None:
    """Remove a worktree (and `branch`, if given). Call with the repository's lock held."""
    if repo and os.path.isdir(repo):
        if path.exists():
            git(repo, "worktree", "remove", "--force", "--force", str(path))
        git(repo, "worktree", "prune", check=False)
        if branch and git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False):
            git(repo, "branch", "-D", branch)
    shutil.rmtree(path, ignore_errors=True)  # the repository itself is gone: only files remain
    _rmdir_empty(path.parent)


def merged(repo: str, branch: str | None) -> bool:
    """Are the branch's commits on some other branch (or remote branch)? Then deleting the
    branch loses nothing. (A squash or rebase merge is not seen: that needs --force.)"""
    ref = f"refs/heads/{branch}"
    if not branch or not git(repo, "rev-parse", "--verify", "--quiet", ref, check=False):
        return True
    holders = git(repo, "for-each-ref", "--format=%(refname)", "--contains", ref, "refs/heads", "refs/remotes")
    return any(r != ref for r in holders.splitlines())


def dirty(path: str | os.PathLike[str]) -> bool:
    return bool(git(path, "status", "--porcelain", "--untracked-files=all"))


def _rmdir_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def disk_usage(path: str | os.PathLike[str]) -> int:
    """Bytes on disk under `path` (hard links and symlinks not followed twice)."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def on_disk(home: Home) -> list[Path]:
    """Every worktree directory under <home>/worktrees, known to the index or not."""
    top = home.root / "worktrees"
    if not top.is_dir():
        return []
    return sorted(p for g in top.iterdir() if g.is_dir() for p in g.iterdir() if p.is_dir())


# ---- listing -------------------------------------------------------------------------------


@dataclass
class Entry:
    """One worktree directory of this home, and the task it belongs to (None: an orphan, whose
    task left the index through `clean` or history_limit)."""

    path: Path
    task: Task | None
    repo: str | None  # where git runs for its repository
    branch: str | None

    @property
    def live(self) -> bool:
        return self.task is not None and not self.task.state.final


def entries(home: Home, tasks: list[Task]) -> list[Entry]:
    owner: dict[str, Task] = {}
    for task in sorted(tasks, key=lambda t: (not t.state.final, t.id)):  # live ones win
        if task.worktree:
            owner[task.worktree] = task
        if task.repo and not task.state.final:
            owner[str(path_for(home, task))] = task  # not created yet, or a crash hid it
    out = []
    for path in on_disk(home):
        task = owner.get(str(path))
        if task is not None:
            out.append(Entry(path, task, task.repo, task.branch))
            continue
        common = branch = ""
        if (path / ".git").is_file():  # else git would answer for whatever repository encloses the home
            common = git(path, "rev-parse", "--path-format=absolute", "--git-common-dir", check=False)
            branch = git(path, "symbolic-ref", "--quiet", "--short", "HEAD", check=False)
        out.append(Entry(path, None, common or None, branch or None))
    return out
