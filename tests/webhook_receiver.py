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

from tests.fake_anthropic import SHUTDOWN_POLL_SECONDS


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
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_SECONDS}, daemon=True
        )

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


class TricklingServer:
    """Answers every request with a status line, then one header line every `every` seconds
    for `lines` lines (then an empty body): each read gets data well within a per-read
    timeout, so only a bound on the whole request stops a client early. `served` counts
    the header lines sent; a client that hangs up ends its connection's trickle."""

    def __init__(self, *, every: float = 0.5, lines: int = 120) -> None:
        self.every = every
        self.lines = lines
        self.served = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}/slow"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(client,), daemon=True).start()

    def _trickle(self, client: socket.socket) -> None:
        with client:
            try:
                client.recv(65536)  # the request (small: headers and a short body)
                client.sendall(b"HTTP/1.1 200 OK\r\n")
                for number in range(self.lines):
                    if self._stopped.wait(self.every):
                        return
                    client.sendall(f"X-Trickle-{number}: still here\r\n".encode())
                    self.served += 1
                client.sendall(b"Content-Length: 0\r\n\r\n")
            except OSError:
                return  # the client hung up

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
