"""The real agent CLIs (Claude Code, Codex, opencode) for the tests, from npm.

Each is installed once per pinned version (tests/agent_clis.json) into a cache outside the
clone (KUGETSU_AGENT_CACHE, else ~/.cache/kugetsu-agent-clis), under a file lock so two
pytest-xdist workers never install the same thing at once. Where node/npm are missing or the
registry cannot be reached, `agent_cli` skips the test saying why; the hook of the brief wants
them to run wherever npm is installed, so an install that fails with npm present is a failure.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

PINS: dict[str, dict[str, Any]] = {
    k: v for k, v in json.loads((Path(__file__).parent / "agent_clis.json").read_text()).items() if not k.startswith("_")
}


def cache_root() -> Path:
    return Path(os.environ.get("KUGETSU_AGENT_CACHE") or Path.home() / ".cache" / "kugetsu-agent-clis")


def agent_cli(name: str) -> Path:
    """The path of the pinned CLI `name` (claude, codex, opencode), installed if need be."""
    pin = PINS[name]
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip(f"{name}: node and npm are not installed, so the real {pin['package']} cannot be")
    prefix = cache_root() / f"{pin['package'].replace('/', '+')}@{pin['version']}"
    binary = prefix / "node_modules" / ".bin" / pin["bin"]
    if binary.exists():
        return binary
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix.parent / f".{prefix.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            done = subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(prefix),
                 f"{pin['package']}@{pin['version']}"],
                capture_output=True, text=True, timeout=900)
            if done.returncode != 0 or not binary.exists():
                pytest.fail(f"{name}: npm install {pin['package']}@{pin['version']} failed "
                            f"(exit {done.returncode}): {done.stderr[-2000:]}")
    return binary


def git_repo(tmp_path: Path) -> Path:
    """A git repository with one commit, for an agent's --worktree task."""
    r = tmp_path / "repo"
    r.mkdir()
    for args in (["init", "-q", "-b", "main"], ["config", "user.name", "T"], ["config", "user.email", "t@example.com"]):
        subprocess.run(["git", *args], cwd=r, check=True)
    (r / "README").write_text("hi\n")
    subprocess.run(["git", "add", "."], cwd=r, check=True)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=r, check=True)
    return r
