"""A small fake Telegram Bot API server for the tests: 127.0.0.1, a random port, a thread.

It answers what the bot uses (getMe, setMyCommands, deleteWebhook, getUpdates with long
polling, sendMessage, answerCallbackQuery, editMessageText), records every call, lets a
test queue incoming messages and button presses, and fails on demand (500s, 429 with
retry_after). The real python-telegram-bot talks to it over real HTTP.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl

TOKEN = "123456:TEST-secret-token-abcdefghij"
BOT_USER = {"id": 123456, "is_bot": True, "first_name": "Kugetsu", "username": "kugetsu_test_bot"}


@dataclass
class Call:
    method: str
    params: dict[str, Any]
    at: float
    status: int = 200
    result: Any = None


@dataclass
class Failure:
    status: int
    count: int  # how many calls still fail; -1: until cleared
    methods: set[str] | None
    retry_after: int | None = None
    description: str | None = None


@dataclass
class FakeBotAPI:
    token: str = TOKEN
    calls: list[Call] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cond = threading.Condition()
        self._next_update = 1
        self._next_message = 1000
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/bot"

    def start(self) -> FakeBotAPI:
        self.thread.start()
        return self

    def close(self) -> None:
        with self.cond:
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # ---- what a test does --------------------------------------------------------------

    def fail(self, status: int = 500, count: int = -1, methods: set[str] | None = None,
             retry_after: int | None = None, description: str | None = None) -> None:
        with self.cond:
            self.failures.append(Failure(status, count, methods, retry_after, description))

    def recover(self) -> None:
        with self.cond:
            self.failures.clear()

    def _user(self, user_id: int) -> dict[str, Any]:
        return {"id": user_id, "is_bot": False, "first_name": f"user{user_id}"}

    def _chat(self, chat_id: int) -> dict[str, Any]:
        if chat_id < 0:  # Telegram's group ids are negative
            return {"id": chat_id, "type": "group", "title": f"group{chat_id}"}
        return {"id": chat_id, "type": "private", "first_name": f"chat{chat_id}"}

    def _push(self, update: dict[str, Any]) -> None:
        with self.cond:
            update["update_id"] = self._next_update
            self._next_update += 1
            self.updates.append(update)
            self.cond.notify_all()

    def message(self, chat_id: int, text: str, user_id: int | None = None) -> None:
        """Someone writes `text` in `chat_id` (a command gets its bot_command entity)."""
        self._next_message += 1
        msg: dict[str, Any] = {
            "message_id": self._next_message, "date": int(time.time()), "chat": self._chat(chat_id),
            "from": self._user(user_id or chat_id), "text": text,
        }
        if text.startswith("/"):
            msg["entities"] = [{"type": "bot_command", "offset": 0, "length": len(text.split()[0])}]
        self._push({"message": msg})

    def press(self, chat_id: int, data: str, message_id: int, user_id: int | None = None) -> None:
        """Someone presses an inline button with callback `data` under message `message_id`."""
        self._push({"callback_query": {
            "id": f"cb{self._next_update}", "from": self._user(user_id or chat_id), "chat_instance": "ci",
            "data": data,
            "message": {"message_id": message_id, "date": int(time.time()), "chat": self._chat(chat_id),
                        "from": BOT_USER, "text": "queue"},
        }})

    # ---- what a test checks -------------------------------------------------------------

    def calls_to(self, method: str, ok_only: bool = True) -> list[Call]:
        with self.cond:
            return [c for c in self.calls if c.method == method and (c.status == 200 or not ok_only)]

    def sent(self, chat_id: int | None = None) -> list[Call]:
        """sendMessage calls that succeeded (to one chat)."""
        return [c for c in self.calls_to("sendMessage") if chat_id is None or c.params.get("chat_id") == chat_id]

    def texts(self, chat_id: int | None = None) -> list[str]:
        return [c.params["text"] for c in self.sent(chat_id)]

    def with_text(self, chat_id: int, needle: str) -> list[Call]:
        return [c for c in self.sent(chat_id) if needle in c.params["text"]]

    # ---- serving ---------------------------------------------------------------------------

    def _failure(self, method: str) -> Failure | None:
        with self.cond:
            for f in self.failures:
                if f.count != 0 and (f.methods is None or method in f.methods):
                    if f.count > 0:
                        f.count -= 1
                    return f
        return None

    def handle(self, token: str, method: str, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        call = Call(method, params, time.monotonic())
        with self.cond:
            self.calls.append(call)
        if token != self.token:
            call.status = 401
            return 401, {"ok": False, "error_code": 401, "description": "Unauthorized"}
        failure = self._failure(method)
        if failure is not None:
            call.status = failure.status
            body: dict[str, Any] = {"ok": False, "error_code": failure.status,
                                    "description": "Internal Server Error" if failure.status >= 500 else "Error"}
            if failure.retry_after is not None:
                body["description"] = f"Too Many Requests: retry after {failure.retry_after}"
                body["parameters"] = {"retry_after": failure.retry_after}
            if failure.description is not None:
                body["description"] = failure.description
            return failure.status, body
        result = getattr(self, f"api_{method}", None)
        if result is None:
            call.status = 404
            return 404, {"ok": False, "error_code": 404, "description": "Not Found: method not found"}
        call.result = result(params)
        return 200, {"ok": True, "result": call.result}

    def api_getMe(self, p: dict[str, Any]) -> Any:
        return {**BOT_USER, "can_join_groups": True, "can_read_all_group_messages": False,
                "supports_inline_queries": False}

    def api_setMyCommands(self, p: dict[str, Any]) -> Any:
        return True

    def api_deleteWebhook(self, p: dict[str, Any]) -> Any:
        return True

    def api_answerCallbackQuery(self, p: dict[str, Any]) -> Any:
        return True

    def api_getUpdates(self, p: dict[str, Any]) -> Any:
        offset = int(p.get("offset") or 0)
        deadline = time.monotonic() + float(p.get("timeout") or 0)
        with self.cond:
            while True:
                ready = [u for u in self.updates if u["update_id"] >= offset]
                left = deadline - time.monotonic()
                if ready or left <= 0:
                    return ready
                self.cond.wait(min(left, 0.5))

    def _sent_message(self, p: dict[str, Any], message_id: int | None = None) -> dict[str, Any]:
        if message_id is None:
            with self.cond:
                self._next_message += 1
                message_id = self._next_message
        return {"message_id": message_id, "date": int(time.time()), "chat": self._chat(int(p["chat_id"])),
                "from": BOT_USER, "text": p.get("text", "")}

    def api_sendMessage(self, p: dict[str, Any]) -> Any:
        return self._sent_message(p)

    def api_editMessageText(self, p: dict[str, Any]) -> Any:
        return self._sent_message(p, int(p["message_id"]))


def _decode(raw: bytes, content_type: str) -> dict[str, Any]:
    """python-telegram-bot posts form fields whose values are JSON (strings as they are)."""
    if "json" in content_type:
        return json.loads(raw or b"{}")
    params: dict[str, Any] = {}
    for key, value in parse_qsl(raw.decode(), keep_blank_values=True):
        if key in ("text", "callback_query_id"):
            params[key] = value
            continue
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    return params


def _handler(api: FakeBotAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            params = _decode(self.rfile.read(length), self.headers.get("Content-Type", ""))
            _, _, rest = self.path.partition("/bot")
            token, _, method = rest.partition("/")
            status, body = api.handle(token, method, params)
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the bot gave up on a long poll it no longer needs (it is stopping)

        do_GET = do_POST  # noqa: N815

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
