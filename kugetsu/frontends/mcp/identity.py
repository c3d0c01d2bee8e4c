"""What kugetsu's MCP server says of itself (its name, title and instructions), shared by the
early handshake (handshake.py, no SDK loaded) and the SDK's server (server.py), and the check
that the two answered `initialize` alike. Stdlib only: below both, so neither imports the other.
"""

from __future__ import annotations

import json
import sys
from typing import Any

NAME = "kugetsu"
TITLE = "kugetsu: capacity manager for parallel AI coding agents"

# The text a PM agent needs to use these tools well: sent as the server's instructions, and
# in README ("PM agent instructions") for clients that do not show them (a test keeps the two equal).
INSTRUCTIONS = """\
You delegate coding work to worker agents through kugetsu, which runs at most max_agents
of them at once and queues the rest.
1. Call `capacity` before delegating a batch: free > 0 means a task starts at once; a
   queue near max_queue means wait before sending more.
2. Delegate each issue with `delegate`: name = your issue id (e.g. issue-16), source = who
   you are (e.g. pm), prompt = the full instructions for the worker. The result says
   "started ... slot N" or "queued ... position N".
3. If `delegate` answers "rejected" (queue full, or your source's limit), nothing was queued:
   back off. Wait about a minute, or `wait` for one of your running tasks, then try again.
   Never retry in a tight loop.
4. Call `wait` with the names you delegated; it returns when they are final (give a timeout
   such as 10m if your client limits tool time, and call it again while done is false).
5. For each task that did not succeed, read `logs` (the end of its output) and `status`
   (its reason) before you retry it, fix the issue, or report it.
Use `queue` to see everything, `cancel` for work you no longer want, `priority` to move a
queued task ahead (under the priority or fair strategy)."""


def differs(early: dict[str, Any], sdk: dict[str, Any]) -> None:
    """Say on stderr where the SDK's own answer differs from the one sent early."""
    if early != sdk:
        print(f"kugetsu mcp: the SDK answers initialize otherwise than kugetsu did early: sent "
              f"{json.dumps(early['result'])[:2000]}, the SDK's {json.dumps(sdk.get('result'))[:2000]}",
              file=sys.stderr, flush=True)
