"""A webhook receiver on 127.0.0.1: real HTTP, the requests it got, the answers it gives.

`WebhookReceiver().start()` listens on a free port; `answer(500, 500, 200)` queues status
codes for the next requests (200 once they run out); `requests` holds every request's
headers (lower-cased names) and body; `refused_url()` is a URL where nothing listens.
"""

from __future__ import annotations

import json
import socket
import threading
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict
    body: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.body)


class WebhookReceiver:
    def __init__(self) -> None:
        self.requests: list[Received] = []
        self._answers: deque[int] = deque()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.requests.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                status = receiver._answers.popleft() if receiver._answers else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/hook"

    def answer(self, *statuses: int) -> None:
        self._answers.extend(statuses)


def refused_url() -> str:
    """A local URL nobody listens on: the port was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"
