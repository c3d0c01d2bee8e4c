"""A fake Anthropic Messages API on 127.0.0.1 for the real Claude Code CLI (tests of issue 25).

Scriptable: a test queues the replies of the model's turns (`text`, `tool_use`, `limit`,
`error`), each consumed by one `POST /v1/messages` of the main conversation (a request that
offers tools); every request is recorded (path, headers, JSON body) so a test can see what
the agent sent, e.g. the earlier conversation of a resumed session. Replies are what the API
documents and sends: server-sent events (message_start, content_block_*, message_delta with
usage, message_stop), and for a refusal the status, JSON error body and headers (429 with
`retry-after`, `anthropic-ratelimit-unified-status: rejected`, `-reset`,
`-representative-claim`).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclass
class Reply:
    status: int = 200
    blocks: list[dict[str, Any]] = field(default_factory=list)  # text / tool_use content blocks
    stop_reason: str = "end_turn"
    usage: dict[str, int] = field(default_factory=lambda: {"input_tokens": 100, "output_tokens": 20})
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None  # an error's JSON body


def text(s: str, **usage: int) -> Reply:
    return Reply(blocks=[{"type": "text", "text": s}], usage={"input_tokens": 100, "output_tokens": 20, **usage})


def tool_use(name: str, input: dict[str, Any], **usage: int) -> Reply:
    block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": name, "input": input}
    return Reply(blocks=[block], stop_reason="tool_use", usage={"input_tokens": 100, "output_tokens": 30, **usage})


def error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Reply:
    return Reply(status=status, headers=headers or {},
                 body={"type": "error", "error": {"type": kind, "message": message},
                       "request_id": "req_" + uuid.uuid4().hex[:24]})


def subscription_limit(reset: int, claim: str = "five_hour") -> Reply:
    """A Claude subscription's limit (claude.ai plans): 429 with the unified rate limit headers
    saying `rejected`, the Unix time it resets and which window (five_hour, seven_day,
    seven_day_opus, seven_day_sonnet) refused."""
    return error(429, "rate_limit_error", "This request would exceed your account's rate limit. Please try again later.",
                 {"anthropic-ratelimit-unified-status": "rejected", "anthropic-ratelimit-unified-reset": str(reset),
                  "anthropic-ratelimit-unified-representative-claim": claim,
                  f"anthropic-ratelimit-unified-{'5h' if claim == 'five_hour' else '7d'}-status": "rejected",
                  f"anthropic-ratelimit-unified-{'5h' if claim == 'five_hour' else '7d'}-reset": str(reset),
                  f"anthropic-ratelimit-unified-{'5h' if claim == 'five_hour' else '7d'}-utilization": "1.0",
                  "retry-after": "60"})


def api_rate_limit(retry_after: int = 30) -> Reply:
    """An API key's rate limit (requests or tokens per minute): 429 with `retry-after`."""
    return error(429, "rate_limit_error",
                 "Number of request tokens has exceeded your per-minute rate limit", {"retry-after": str(retry_after)})


def workdir(body: dict[str, Any]) -> str | None:
    """The agent's working directory, as its prompt (the environment block) tells the model."""
    text = json.dumps(body)
    m = re.search(r"Primary working directory: ([^\s\\]+)", text) or re.search(r"Working directory: ([^\s\\]+)", text)
    return m.group(1) if m else None


class Anthropic:
    """The server. `replies`: what the next main-loop turns get, in order (a Reply, or a
    function of the request's body returning one); when empty, `text("Done.")`."""

    def __init__(self) -> None:
        self.replies: deque[Reply | Callable[[dict[str, Any]], Reply]] = deque()
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                fake._record(self, None)
                self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": "not here"}})

            def do_HEAD(self) -> None:
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                size = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(size) if size else b""
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"raw": raw.decode(errors="replace")}
                fake._record(self, body)
                path = self.path.split("?")[0]
                if path.endswith("/count_tokens"):
                    return self._json(200, {"input_tokens": 100})
                if not path.endswith("/v1/messages"):
                    return self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": "not here"}})
                reply = fake._next(body)
                if reply.status != 200:
                    return self._json(reply.status, reply.body or {}, reply.headers)
                if body.get("stream"):
                    return self._sse(body, reply)
                return self._json(200, fake._message(body, reply))

            def _json(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("request-id", "req_" + uuid.uuid4().hex[:24])
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _sse(self, body: dict[str, Any], reply: Reply) -> None:
                msg = fake._message(body, reply)
                events: list[tuple[str, dict[str, Any]]] = []
                start = {**msg, "content": [], "stop_reason": None,
                         "usage": {**msg["usage"], "output_tokens": 1}}
                events.append(("message_start", {"type": "message_start", "message": start}))
                for i, block in enumerate(msg["content"]):
                    if block["type"] == "text":
                        events.append(("content_block_start", {"type": "content_block_start", "index": i,
                                                               "content_block": {"type": "text", "text": ""}}))
                        events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                                                               "delta": {"type": "text_delta", "text": block["text"]}}))
                    else:
                        events.append(("content_block_start", {"type": "content_block_start", "index": i,
                                                               "content_block": {**block, "input": {}}}))
                        events.append(("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                            "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
                    events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
                events.append(("message_delta", {"type": "message_delta",
                                                 "delta": {"stop_reason": reply.stop_reason, "stop_sequence": None},
                                                 "usage": {"output_tokens": msg["usage"]["output_tokens"]}}))
                events.append(("message_stop", {"type": "message_stop"}))
                data = b"".join(f"event: {k}\ndata: {json.dumps(v)}\n\n".encode() for k, v in events)
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("cache-control", "no-cache")
                self.send_header("request-id", "req_" + uuid.uuid4().hex[:24])
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _record(self, handler: BaseHTTPRequestHandler, body: Any) -> None:
        with self.lock:
            self.requests.append({"method": handler.command, "path": handler.path, "at": time.time(),
                                  "headers": {k.lower(): v for k, v in handler.headers.items()}, "body": body})

    def _next(self, body: dict[str, Any]) -> Reply:
        # The main conversation offers tools; a side request (a title, a quota probe) does not
        # and gets a plain answer without using up the script.
        if not body.get("tools"):
            return text("ok")
        with self.lock:
            reply = self.replies.popleft() if self.replies else text("Done.")
        return reply(body) if callable(reply) else reply

    @staticmethod
    def _message(body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        usage = {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                 **reply.usage}
        return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                "model": body.get("model", "claude-sonnet-4-5"), "content": reply.blocks,
                "stop_reason": reply.stop_reason, "stop_sequence": None, "usage": usage}

    def turns(self) -> list[dict[str, Any]]:
        """The main-loop requests (method, path, at, headers, body), in order."""
        with self.lock:
            return [r for r in self.requests if r["method"] == "POST" and isinstance(r["body"], dict)
                    and r["path"].split("?")[0].endswith("/v1/messages") and r["body"].get("tools")]

    def conversation(self) -> list[dict[str, Any]]:
        """The main-loop requests' bodies, in order."""
        return [r["body"] for r in self.turns()]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
