"""A small OpenAI-compatible chat-completions server for tests: ``http.server`` in a thread.

    with ChatServer.tiny() as server:          # binds 127.0.0.1 on an ephemeral port
        lm = HTTPChatLM(server.base_url, "tiny-random")
        lm.complete("hi", max_new_tokens=8)

It serves ``POST /v1/chat/completions`` and ``GET /v1/models`` with a local transformers model,
one request at a time. Requests are bounded (body size, ``max_tokens``, total count), an
optional API key is checked, and ``fail_first`` answers the first requests with 503 so a client's
retries can be tested. Leaving the ``with`` block shuts the server down and joins its thread.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from rlmix_lm import TransformersLM


class ChatServer:
    def __init__(self, lm: TransformersLM, model_name: str = "tiny-random",
                 api_key: str | None = None, max_body: int = 1 << 20, max_tokens: int = 64,
                 max_requests: int = 1000, fail_first: int = 0, delay_s: float = 0.0) -> None:
        self.lm, self.model_name, self.api_key = lm, model_name, api_key
        self.max_body, self.max_tokens, self.max_requests = max_body, max_tokens, max_requests
        self.fail_first, self.delay_s = fail_first, delay_s
        self.requests = 0  # POSTs received
        self.log: list[dict[str, Any]] = []  # bodies of the answered requests
        self._server: HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def tiny(cls, **kwargs: Any) -> ChatServer:
        from rlmix.policy import tiny_random

        model, tok = tiny_random()
        return cls(TransformersLM(model.eval(), tok), **kwargs)

    @property
    def base_url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> ChatServer:
        handler = _handler(self)
        self._server = HTTPServer(("127.0.0.1", 0), handler)
        self._server.timeout = 1.0
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # what one request gets back: (status, body)
    def answer(self, path: str, headers: Any, raw: bytes) -> tuple[int, dict[str, Any]]:
        if path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            return 404, {"error": {"message": f"no route {path}"}}
        self.requests += 1
        if self.requests > self.max_requests:
            return 429, {"error": {"message": "request limit of this test server reached"}}
        if self.api_key and headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {"error": {"message": "missing or wrong API key"}}
        if self.requests <= self.fail_first:
            return 503, {"error": {"message": "warming up (test server: fail_first)"}}
        try:
            body = json.loads(raw)
            messages = body["messages"]
            max_tokens = int(body.get("max_tokens") or 16)
            temperature = float(body.get("temperature") or 0.0)
        except (ValueError, KeyError, TypeError) as exc:
            return 400, {"error": {"message": f"bad request: {exc}"}}
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            text = self.lm.complete(messages, min(max_tokens, self.max_tokens), temperature)
        except (TypeError, ValueError) as exc:
            return 400, {"error": {"message": f"bad messages: {exc}"}}
        self.log.append(body)
        return 200, {"id": f"chatcmpl-{self.requests}", "object": "chat.completion",
                     "created": int(time.time()), "model": body.get("model") or self.model_name,
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": text}}]}


def _handler(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep test output clean
            pass

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": server.model_name,
                                                              "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            if length > server.max_body:
                # read what was sent (up to a bound) so the client sees the answer, not a reset
                left = min(length, 16 * server.max_body)
                while left > 0:
                    chunk = self.rfile.read(min(left, 1 << 16))
                    if not chunk:
                        break
                    left -= len(chunk)
                self.close_connection = True
                self._send(413, {"error": {"message": f"body over {server.max_body} bytes"}})
                return
            raw = self.rfile.read(length)
            status, payload = server.answer(self.path, self.headers, raw)
            self._send(status, payload)

    return Handler


class ScriptedLM:
    """A test double of ``rlmix_lm.LM``: answers with fixed replies, in order (the last one
    repeats), or with ``reply(prompt_text)`` when given a function. Records every prompt."""

    def __init__(self, replies: list[str] | None = None, reply: Any = None) -> None:
        if not replies and reply is None:
            raise ValueError("ScriptedLM needs replies or a reply function")
        self.replies, self.reply = list(replies or []), reply
        self.prompts: list[str] = []

    def complete(self, prompt: Any, max_new_tokens: int = 256, temperature: float = 0.0) -> str:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        self.prompts.append(text)
        if self.reply is not None:
            return str(self.reply(text))
        return self.replies[min(len(self.prompts), len(self.replies)) - 1]

    def complete_batch(self, prompts: list[Any], max_new_tokens: int = 256,
                       temperature: float = 0.0) -> list[str]:
        return [self.complete(p, max_new_tokens, temperature) for p in prompts]
