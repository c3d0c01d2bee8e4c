"""A fake OpenAI API on 127.0.0.1 for the real Codex CLI and opencode.

It speaks what those CLIs read: the Responses API as server-sent events (`POST
/v1/responses`, Codex), and chat completions as server-sent events (`POST
/v1/chat/completions`, opencode through an OpenAI-compatible provider). A test scripts it with
a queue of replies (`push`): text, tool calls, usage blocks, and the errors OpenAI sends (HTTP
429 with `usage_limit_reached` + `resets_at`, `insufficient_quota`, a rate limit with its
headers). Every request body is recorded (`requests`), so a test can see that a resumed run
sent the earlier conversation. A request that finds the queue empty (or no queued reply that
wants it) gets `default`: a short text answer.

Requests must carry `Authorization: Bearer <key>` (the CLIs send their API key): anything else
is answered 401, so a test also proves which key the agent used.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KEY = "test-key"


@dataclass
class Reply:
    """One scripted answer: an HTTP status, headers, and either a JSON body or SSE events.
    `when` (a request's parsed body -> bool) makes it wait for a request it fits (a title
    request of opencode is not the turn a test scripted); `path` the same for the endpoint."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None  # JSON (an error), sent as is
    events: list[dict[str, Any]] | None = None  # SSE `data:` lines (Responses: with `event:` too)
    when: Callable[[dict[str, Any]], bool] | None = None
    path: str | None = None  # "responses" | "chat" | None (either)
    delay: float = 0.0  # seconds before answering


_ids = iter(range(1, 1 << 30))


def _id(prefix: str) -> str:
    return f"{prefix}_{next(_ids):06d}"


# ---- Responses API (Codex) -----------------------------------------------------------------

def _usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def _response(items: list[dict[str, Any]], usage: dict[str, Any]) -> list[dict[str, Any]]:
    rid = _id("resp")
    out = [{"type": "response.created", "response": {"id": rid, "status": "in_progress", "output": []}}]
    for item in items:
        out.append({"type": "response.output_item.added", "item": item})
        if item["type"] == "message":
            out.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0,
                        "content_index": 0, "delta": item["content"][0]["text"]})
        out.append({"type": "response.output_item.done", "item": item})
    out.append({"type": "response.completed",
                "response": {"id": rid, "status": "completed", "output": items, "usage": usage}})
    return out


def responses_text(text: str, input_tokens: int = 100, output_tokens: int = 20, cached: int = 0,
                   **kw: Any) -> Reply:
    item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    return Reply(events=_response([item], _usage(input_tokens, output_tokens, cached)), path="responses", **kw)


def responses_call(name: str, arguments: dict[str, Any] | str, input_tokens: int = 100, output_tokens: int = 20,
                   cached: int = 0, **kw: Any) -> Reply:
    """A function call (Codex's `shell`/`exec_command`, `apply_patch`, ...)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    item = {"type": "function_call", "id": _id("fc"), "call_id": _id("call"), "name": name,
            "arguments": args, "status": "completed"}
    return Reply(events=_response([item], _usage(input_tokens, output_tokens, cached)), path="responses", **kw)


def responses_custom_call(name: str, text: str, input_tokens: int = 100, output_tokens: int = 20, **kw: Any) -> Reply:
    """A freeform tool call (Codex's `apply_patch` when the model uses the custom tool)."""
    item = {"type": "custom_tool_call", "id": _id("ctc"), "call_id": _id("call"), "name": name,
            "input": text, "status": "completed"}
    return Reply(events=_response([item], _usage(input_tokens, output_tokens)), path="responses", **kw)


# ---- chat completions (opencode) -----------------------------------------------------------

def _chunk(cid: str, delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": "fake",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        out["usage"] = usage
    return out


def _chat_usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_text(text: str, prompt_tokens: int = 100, completion_tokens: int = 20, cached: int = 0, **kw: Any) -> Reply:
    cid = _id("chatcmpl")
    events = [_chunk(cid, {"role": "assistant", "content": ""}), _chunk(cid, {"content": text}),
              _chunk(cid, {}, "stop"), {**_chunk(cid, {}), "choices": [], "usage": _chat_usage(prompt_tokens, completion_tokens, cached)}]
    return Reply(events=events, path="chat", **kw)


def chat_call(name: str, arguments: dict[str, Any], prompt_tokens: int = 100, completion_tokens: int = 20, **kw: Any) -> Reply:
    cid = _id("chatcmpl")
    call = {"index": 0, "id": _id("call"), "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    events = [_chunk(cid, {"role": "assistant", "content": None, "tool_calls": [call]}),
              _chunk(cid, {}, "tool_calls"),
              {**_chunk(cid, {}), "choices": [], "usage": _chat_usage(prompt_tokens, completion_tokens)}]
    return Reply(events=events, path="chat", **kw)


# ---- errors, as OpenAI sends them ----------------------------------------------------------

def usage_limit(resets_at: int, plan: str = "plus", **kw: Any) -> Reply:
    """ChatGPT-plan usage limit (what Codex shows as `You've hit your usage limit`)."""
    body = {"error": {"type": "usage_limit_reached", "message": "The usage limit has been reached",
                      "plan_type": plan, "resets_at": resets_at,
                      "resets_in_seconds": max(0, resets_at - int(time.time()))}}
    return Reply(status=429, body=body, **kw)


def insufficient_quota(**kw: Any) -> Reply:
    body = {"error": {"message": "You exceeded your current quota, please check your plan and billing details.",
                      "type": "insufficient_quota", "param": None, "code": "insufficient_quota"}}
    return Reply(status=429, body=body, **kw)


def rate_limit(retry_after: int = 20, **kw: Any) -> Reply:
    body = {"error": {"message": f"Rate limit reached for gpt-5 in organization org-test on tokens per min (TPM): "
                                 f"Limit 30000, Used 30000, Requested 100. Please try again in {retry_after}s.",
                      "type": "tokens", "param": None, "code": "rate_limit_exceeded"}}
    headers = {"retry-after": str(retry_after), "x-ratelimit-limit-tokens": "30000",
               "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": f"{retry_after}s"}
    return Reply(status=429, headers=headers, body=body, **kw)


def cwd_of(body: dict[str, Any]) -> str | None:
    """The agent's working directory, as it told the model (Codex: `<cwd>...</cwd>` in its
    environment context; opencode: `Working directory: ...` in its system prompt)."""
    import re

    m = re.search(r"<cwd>([^<]+)</cwd>|Working directory: *([^\n\\]+)", json.dumps(body))
    return (m.group(1) or m.group(2)).strip() if m else None


def side_request(body: dict[str, Any]) -> bool:
    """A request the agent makes beside its turns (opencode names its session with its small
    model): it never takes a scripted reply."""
    messages = body.get("messages") or []
    first = messages[0] if messages and isinstance(messages[0], dict) else {}
    return first.get("role") == "system" and "title generator" in str(first.get("content"))


class FakeOpenAI:
    """The server. `with FakeOpenAI() as api:` serves on api.base_url (`http://127.0.0.1:P/v1`)."""

    def __init__(self, default: Callable[[str, dict[str, Any]], Reply] | None = None):
        self.queue: list[Reply | Callable[[dict[str, Any]], Reply]] = []
        self.requests: list[dict[str, Any]] = []  # {"path", "body", "headers", "status"}
        self.default = default or (lambda path, body: chat_text("ok") if path == "chat" else responses_text("ok"))
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def push(self, *replies: Reply | Callable[[dict[str, Any]], Reply]) -> None:
        """Queue replies: a Reply, or a function of the request's body making one (a turn
        that depends on what the agent sent, e.g. its working directory)."""
        with self._lock:
            self.queue.extend(replies)

    def _take(self, path: str, body: dict[str, Any]) -> Reply:
        if side_request(body):
            return self.default(path, body)
        with self._lock:
            for i, r in enumerate(self.queue):
                if not isinstance(r, Reply):
                    self.queue.pop(i)
                    return r(body)
                if (r.path is None or r.path == path) and (r.when is None or r.when(body)):
                    return self.queue.pop(i)
        return self.default(path, body)

    def bodies(self, path: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [r["body"] for r in self.requests if path is None or r["path"] == path]

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> FakeOpenAI:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
                # The connection stays open for the next request, as OpenAI's does (and the
                # Anthropic fake's): closed after each answer, opencode's runtime (Bun) at times
                # sent its immediate retry of a 429 on the socket being closed and failed the
                # turn with "The socket connection was closed unexpectedly" (1 CI run in ~6).
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # model lists: one fake model
                if self.path.rstrip("/").endswith("/models"):
                    data = {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "test"}], "models": []}
                    self._send(200, json.dumps(data).encode(), "application/json")
                else:
                    self._send(404, b'{"error":{"message":"not found"}}', "application/json")

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"_raw": raw.decode("utf-8", "replace")}
                path = ("responses" if self.path.endswith("/responses") else
                        "chat" if self.path.endswith("/chat/completions") else self.path)
                record = {"path": path, "body": body, "headers": dict(self.headers.items())}
                with fake._lock:
                    fake.requests.append(record)
                if self.headers.get("authorization") != f"Bearer {KEY}":
                    record["status"] = 401
                    self._send(401, json.dumps({"error": {"message": "bad key", "type": "invalid_request_error",
                                                          "code": "invalid_api_key"}}).encode(), "application/json")
                    return
                reply = fake._take(path, body)
                record["status"] = reply.status
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.events is None:
                    self._send(reply.status, json.dumps(reply.body).encode(), "application/json", reply.headers)
                    return
                lines = []
                for ev in reply.events:
                    if path == "responses":
                        lines.append(f"event: {ev['type']}\n")
                    lines.append(f"data: {json.dumps(ev)}\n\n")
                if path == "chat":
                    lines.append("data: [DONE]\n\n")
                self._send(reply.status, "".join(lines).encode(), "text/event-stream", reply.headers)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
