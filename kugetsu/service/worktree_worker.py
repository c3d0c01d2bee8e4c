"""The service's worktree worker: git runs in one worker thread, never on the loop and never
under the index lock. A worktree task's worktree is created when it starts (a long queue
costs no disk) and closed (kept or removed, worktrees.keep) after the commit that ended it;
what the worker did is booked by a later transaction. The git commands themselves are in
worktree.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kugetsu.service import worktree
from kugetsu.core.models import Event, Index, Task
from kugetsu.paths import Home
from kugetsu.store.protocol import Txn

if TYPE_CHECKING:  # only for the types: the worker imports it when it first needs it
    from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("kugetsu.service")


def workplace(task: Task) -> tuple[str, dict[str, str]]:
    """Where and with what environment the agent runs."""
    if not task.repo:
        return task.cwd, task.env
    assert task.worktree and task.branch
    env = {**task.env, "KUGETSU_WORKTREE": task.worktree, "KUGETSU_BRANCH": task.branch}
    return worktree.agent_cwd(task, Path(task.worktree)), env


class WorktreeWorker:
    def __init__(self, home: Home, request_tick: Callable[[], None]):
        self.home = home
        self.request_tick = request_tick  # each job done: a tick books it
        self.preparing: dict[int, asyncio.Future[Task]] = {}  # task id -> its worktree being created
        self.closing: dict[int, asyncio.Future[tuple[Task, str | None]]] = {}  # task id -> its worktree being closed
        self.close_due = True  # a final task may have an open worktree (at start: one a crash left)
        self._git: ThreadPoolExecutor | None = None  # one worker thread for git: creations never hold the lock or the loop

    def shutdown(self) -> None:
        if self._git is not None:  # a worktree half-made is recovered by the next service
            self._git.shutdown(wait=False, cancel_futures=True)

    def _worker(self) -> ThreadPoolExecutor:
        if self._git is None:
            from concurrent.futures import ThreadPoolExecutor

            self._git = ThreadPoolExecutor(1, thread_name_prefix="kugetsu-git")
        return self._git

    # ---- creating worktrees -------------------------------------------------------------

    def ready(self, task: Task) -> bool:
        """A worktree task's worktree is created when it starts (a long queue costs no disk),
        in a worker thread: a slow checkout must hold neither the index lock (every CLI
        command waits on it) nor the loop. True once it exists (its fields are then on the
        task); False while it is being made; raises what creating it raised."""
        if not task.repo or task.worktree_state is not None:
            return True
        future = self.preparing.get(task.id)
        if future is None:
            draft = msgspec.structs.replace(task)  # the thread fills in a copy, never the index

            def create() -> Task:
                worktree.create(self.home, draft)
                return draft

            future = asyncio.get_running_loop().run_in_executor(self._worker(), create)
            future.add_done_callback(lambda _: self.request_tick())
            self.preparing[task.id] = future
        if not future.done():
            return False
        del self.preparing[task.id]
        if future.cancelled():  # only when the service stops; the next one recovers or retries
            return False
        made = future.result()
        task.worktree, task.base_commit, task.worktree_state = made.worktree, made.base_commit, made.worktree_state
        return True

    def drop_unwanted(self, index: Index) -> None:
        """A task cancelled (or timed out) while its worktree was being made: remove it."""
        live = {t.id for t in index.active}
        for task_id, future in list(self.preparing.items()):
            if future.done() and task_id not in live:
                del self.preparing[task_id]
                if not future.cancelled() and future.exception() is None:
                    asyncio.get_running_loop().run_in_executor(self._worker(), self._remove_unwanted, future.result())

    def _remove_unwanted(self, made: Task) -> None:
        assert made.worktree
        try:
            worktree.remove(made.repo, Path(made.worktree), made.branch)
            log.info("removed the worktree made for %s (#%d): the task ended before it started", made.name, made.id)
        except Exception as err:
            log.warning("could not remove the worktree %s made for %s (#%d): %s", made.worktree, made.name, made.id, err)

    # ---- closing worktrees: git in the worker, the outcome in a later transaction ------

    def start_closes(self, index: Index, keep: str) -> None:
        """After a commit: the worktree of each final task still marked `active` goes to the
        git worker to be kept or removed (worktrees.keep). Inspecting and removing it runs git
        (`status`, `worktree remove`, `branch -D` and the repository's hooks), which can take
        seconds: never on the loop, never under the index lock, so the task has already ended
        and its slot gone to the next one. What became of the worktree is booked by the tick
        after the worker is done (record_closes). A close that a crash or a stop interrupted
        is found again here: the task is still `active` in the index."""
        self.close_due = False
        for task in index.finished:
            if task.worktree_state == "active" and task.id not in self.closing:
                draft = msgspec.structs.replace(task)  # the thread works on a copy, never the index
                future = asyncio.get_running_loop().run_in_executor(self._worker(), self._close_worktree, draft, keep)
                future.add_done_callback(lambda _: self.request_tick())
                self.closing[task.id] = future

    def _close_worktree(self, draft: Task, keep: str) -> tuple[Task, str | None]:
        """In the git worker: keep or remove the worktree; (the task as closed, what to say)."""
        try:
            note = worktree.close(self.home, draft, keep)
        except Exception as err:  # WorktreeError, or the disk: never lose work over it, keep it
            draft.worktree_state, note = "kept", f"worktree kept at {draft.worktree} ({err})"
        return draft, note

    def record_closes(self, txn: Txn) -> bool:
        """Book the worktrees the git worker has closed: the task's worktree_state, its reason
        (the note, e.g. `work kept on branch ...`), and a `worktree` event that says the same.
        Returns whether one was kept (worktrees.max_disk is then looked at again)."""
        kept = False
        for task_id, future in list(self.closing.items()):
            if not future.done():
                continue
            del self.closing[task_id]
            if future.cancelled():  # only when the service stops; the next one closes it again
                continue
            done, note = future.result()
            task = next((t for t in txn.index.finished if t.id == task_id), None)
            if task is not None:
                if task.worktree_state != "active":
                    continue  # `worktrees prune` got there first, and said so itself
                task.worktree_state = done.worktree_state
                if note:
                    task.reason = f"{task.reason}; {note}" if task.reason else note
            if done.worktree_state == "kept":
                kept = True
            txn.emit([Event(
                type="worktree", at=txn.now, task=task_id, name=done.name, source=done.source, state=done.state.value,
                reason=note, branch=done.branch, worktree=done.worktree, worktree_state=done.worktree_state,
            )])
        return kept
