"""A task's command line: a preset's template rendered with the prompt, the prompt file, the
name and the id; which prompt a task runs with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kugetsu.core.models import Task


_PLACEHOLDER = re.compile(r"\{(prompt|prompt_file|name|id)\}")
_NEEDS_PROMPT = re.compile(r"\{prompt(?:_file)?\}")


def render_command(template: list[str], values: dict[str, str]) -> list[str]:
    """Substitute {prompt} {prompt_file} {name} {id} inside argv elements, in one pass: a
    prompt that itself contains `{name}` is passed verbatim."""
    return [_PLACEHOLDER.sub(lambda m: values[m.group(1)], arg) for arg in template]


PROMPT = "{prompt}"
_KEPT = re.compile(r"\{(prompt|prompt_file)\}")


def render_template(template: list[str], values: dict[str, str]) -> list[str]:
    """render_command with `{prompt}` and `{prompt_file}` left in place: the command a task
    keeps in the index. The prompt's text lives in the store beside it (StoreProtocol.prompts)
    and goes in when the agent starts (`argv`), so the index does not grow with prompts (a
    64 MB prompt made every command cost a second); the prompt file is made where the agent
    starts (in a cluster, the machine that runs it, not the one that admitted it)."""
    return render_command(template, {**values, "prompt": PROMPT, "prompt_file": "{prompt_file}"})


def argv(task: Task, prompt: str | None, prompt_file: str = "") -> list[str]:
    """The argv a task's agent runs with: its command, with the stored prompt in place of each
    `{prompt}` and `prompt_file` (where the caller wrote it) in place of `{prompt_file}`, when
    the command was made from a preset (`prompted`). One pass per element: a prompt that
    itself says `{prompt}` is passed verbatim. A command given at delegation (`-- CMD`) and a
    task from an older index (its prompt inside its command) run as kept."""
    if not task.prompted:
        return task.command
    if prompt is None:  # ValueError: the start fails with this reason (service._spawn)
        raise ValueError("its prompt is missing (not in the store beside the index)")
    values = {"prompt": prompt, "prompt_file": prompt_file}
    return [_KEPT.sub(lambda m: values[m.group(1)], a) for a in task.command]


def wants_file(task: Task) -> bool:
    """Does the task's agent read its prompt from a file ({prompt_file})?"""
    return task.prompted and any("{prompt_file}" in a for a in task.command)


def prompt_of(task: Task, stored: Mapping[int, str]) -> str | None:
    """A task's prompt: the store's copy, or (an index written by an older kugetsu) its own."""
    return stored.get(task.id, task.prompt)
