"""`paperclip.hosts.bounded_request` over TLS: a real local HTTPS server with a certificate
the client trusts through SSL_CERT_FILE (OpenSSL's own setting), no mocks."""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
import time
import urllib.request

import pytest

from paperclip.hosts import bounded_request
from tests.fake_anthropic import SHUTDOWN_POLL_SECONDS


class Answers(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/trickle":
            self.send_response(200)
            for index in range(20):  # a header line every 0.5 s: 10 s in all
                self.send_header(f"X-Line-{index}", "slow")
                self.wfile.flush()
                time.sleep(0.5)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def https_server(tmp_path, monkeypatch):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts this certificate, as a CA bundle
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    server.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_SECONDS}, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_https_answer_is_read_whole(https_server):
    assert bounded_request(urllib.request.Request(f"{https_server}/"), timeout=5, max_body=10) == (200, b"ok")


def test_an_https_server_trickling_its_headers_is_cut_off_at_the_deadline(https_server):
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        bounded_request(urllib.request.Request(f"{https_server}/trickle"), timeout=1)
    assert time.monotonic() - started < 2.5  # not the 10 s the server would take
