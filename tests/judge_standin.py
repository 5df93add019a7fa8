"""A stand-in judge: a real HTTP server on 127.0.0.1 speaking OpenAI's /v1/chat/completions.

Its verdict depends on words in the solution (the text inside ``<solution>...</solution>`` of the
prompt, or the whole prompt when a template has no such tags):

    "symmetry" -> a reasoned reply ending in VERDICT: ELEGANT
    "case"     -> ... VERDICT: BASHY
    "garble"   -> text with no valid verdict line
    "slow"     -> sleeps ``slow_s`` before answering (past the client's timeout)
    "flaky"    -> HTTP 500 on the first request for that prompt, then answers as above
    "busy"     -> HTTP 429 with Retry-After: 0 on the first request, then answers
    "toolong"  -> HTTP 400 (what a server says to a prompt over its context length)
    "notjson"  -> HTTP 200 with a body that is not JSON

A wrong Authorization header gets a 401 whose message echoes the key it was sent (as some
hosted APIs do), so tests can check the client redacts it. Every request is recorded, and the
number in flight at once is tracked (each request is held ``hold_s``).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SOLUTION = re.compile(r"<solution>(.*)</solution>", re.DOTALL)


class StandinJudge:
    def __init__(self, key: str | None, hold_s: float = 0.0, slow_s: float = 2.0):
        self.key = key
        self.hold_s = hold_s
        self.slow_s = slow_s
        self.requests: list[dict] = []  # JSON bodies, in arrival order
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self.seen: set[str] = set()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                standin.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False  # a "slow" request still sleeping must not hold up shutdown
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> StandinJudge:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def contents(self) -> list[str]:
        return [body["messages"][-1]["content"] for body in self.requests]

    def handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length", 0))
        raw = handler.rfile.read(length)
        if handler.path != "/v1/chat/completions":
            return self.send(handler, 404, {"error": {"message": f"no route {handler.path}"}})
        sent = handler.headers.get("Authorization")
        with self.lock:
            self.headers.append(dict(handler.headers))
        if self.key is not None and sent != f"Bearer {self.key}":
            return self.send(handler, 401, {"error": {"message": f"Incorrect API key provided: {sent}"}})
        body = json.loads(raw)
        content = body["messages"][-1]["content"]
        match = SOLUTION.search(content)
        solution = match.group(1) if match else content
        with self.lock:
            self.requests.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            first = content not in self.seen
            self.seen.add(content)
        try:
            time.sleep(self.hold_s)
            reply = self.reply(body, solution, first)
        finally:  # the request is done once its reply is ready: counted out before the client can see it
            with self.lock:
                self.in_flight -= 1
        self.send(handler, *reply)

    def reply(self, body: dict, solution: str, first: bool) -> tuple:
        """(status, payload[, headers]) of the response to a request for ``solution``."""
        if "slow" in solution:
            time.sleep(self.slow_s)
        if "flaky" in solution and first:
            return 500, {"error": {"message": "internal error"}}
        if "busy" in solution and first:
            return 429, {"error": {"message": "rate limited"}}, {"Retry-After": "0"}
        if "toolong" in solution:
            return 400, {"error": {"message": "prompt is longer than the context"}}
        if "notjson" in solution:
            return 200, None
        if "garble" in solution:
            reply = "It is rather nice, I think.\nVERDICT: MAYBE"
        elif "symmetry" in solution:
            reply = "The key step is a symmetry argument.\nVERDICT: ELEGANT"
        elif "case" in solution:
            reply = "It checks every case.\nVERDICT: BASHY"
        else:
            reply = "No idea."
        return 200, {
            "id": "standin",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
        }

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, payload: dict | None, headers: dict | None = None) -> None:
        data = b"<html>bad gateway</html>" if payload is None else json.dumps(payload).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                handler.send_header(name, value)
            handler.end_headers()
            handler.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
            pass
