"""The hosts this service calls because an API key named them (a work check's URL, a budget
alert's webhook): in `authenticated` mode only those the operator lists, since what each
call answers is shown to the key, which could otherwise probe the workers' network.

A listed entry is a host (`hooks.slack.com`, `[fd00::7]`), which allows its URL scheme's
default port only (80 for http, 443 for https), or `host:port`, which allows that port only:
a listed host is not every service it runs (its database on 5432, say).

Such a call is bounded as a whole (`bounded_request`): connecting, the TLS handshake,
sending, the status and headers and the body all share one deadline. A socket timeout
alone bounds each read, which a server sending a byte every second never trips.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
import urllib.request
from urllib.parse import SplitResult, urlsplit

from django.conf import settings

DEFAULT_PORTS = {"http": 80, "https": 443}


def host_entry(entry: str) -> tuple[str, int | None]:
    """A listed entry as (host, port or None); ValueError when it is not `host` or
    `host:port` (a port in 1..65535; an IPv6 address in brackets)."""
    text = entry.strip().lower()
    parts = urlsplit(f"//{text}")
    port = parts.port  # ValueError when not a number in 0..65535
    if (
        not parts.hostname
        or any(char.isspace() for char in text)
        or parts.username is not None
        or parts.path
        or parts.query
        or parts.fragment
        or port == 0
        or (":" in text.rsplit("]", 1)[-1] and port is None)
    ):
        raise ValueError(f"{entry!r} is not a host or host:port")
    return parts.hostname, port


def unlisted_host_problem(url: SplitResult, *, setting: str, mode: str) -> str | None:
    """Why the host and port of `url` may not be called, or None: in `authenticated` mode
    they must be listed in the setting named `setting`; in `local_trusted` mode any may."""
    if mode == "local_trusted":
        return None
    host = (url.hostname or "").lower()
    port = url.port or DEFAULT_PORTS.get(url.scheme.lower())
    listed = getattr(settings, setting)
    for entry in listed:
        try:
            listed_host, listed_port = host_entry(entry)
        except ValueError:
            continue  # refused at start-up; a list set some other way is read as it can be
        if listed_host == host and (listed_port or DEFAULT_PORTS.get(url.scheme.lower())) == port:
            return None
    names = ", ".join(sorted(listed)) or "none are listed"
    return (
        f"host {host!r} on port {port} is not one of {setting} ({names}); in authenticated mode the operator "
        "lists them, a bare host for its scheme's default port (80, 443) or host:port for another"
    )


class _Deadline:
    """When the whole request must be over; each socket operation gets what is left."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.seconds = seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete answer within {self.seconds:g} s")
        return left


class _ArmedBeforeEachTransfer:
    """Gives each send and receive of a socket what is left of its deadline (`_deadline`)."""

    def _deadline(self) -> _Deadline:
        raise NotImplementedError

    def _arm(self) -> None:
        self.settimeout(self._deadline().left())

    def recv(self, *args, **kwargs):
        self._arm()
        return super().recv(*args, **kwargs)

    def recv_into(self, *args, **kwargs):
        self._arm()
        return super().recv_into(*args, **kwargs)

    def send(self, *args, **kwargs):
        self._arm()
        return super().send(*args, **kwargs)

    def sendall(self, *args, **kwargs):
        self._arm()
        return super().sendall(*args, **kwargs)


class _DeadlineSocket(_ArmedBeforeEachTransfer, socket.socket):
    """A plain connection whose every send and receive times out at the deadline."""

    deadline: _Deadline

    def _deadline(self) -> _Deadline:
        return self.deadline


class _DeadlineSSLSocket(_ArmedBeforeEachTransfer, ssl.SSLSocket):
    """A TLS connection whose handshake, sends and receives time out at the deadline (its
    context's `deadline`, set by `bounded_request`)."""

    def _deadline(self) -> _Deadline:
        return self.context.deadline

    def do_handshake(self, *args, **kwargs):
        self._arm()
        return super().do_handshake(*args, **kwargs)

    def read(self, *args, **kwargs):
        self._arm()
        return super().read(*args, **kwargs)


def _connect(deadline: _Deadline):
    """`socket.create_connection` within what is left of the deadline, as a _DeadlineSocket."""

    def create_connection(address, timeout=None, source_address=None, **kwargs):
        plain = socket.create_connection(address, deadline.left(), source_address, **kwargs)
        bounded = _DeadlineSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
        bounded.deadline = deadline
        return bounded

    return create_connection


class _HTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args, deadline: _Deadline, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = _connect(deadline)


class _HTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args, deadline: _Deadline, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = _connect(deadline)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def http_open(self, req):
        return self.do_open(_HTTPConnection, req, deadline=self._deadline)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        context = ssl.create_default_context()
        context.sslsocket_class = _DeadlineSSLSocket
        context.deadline = deadline
        super().__init__(context=context)
        self._deadline = deadline

    def https_open(self, req):
        return self.do_open(_HTTPSConnection, req, context=self._context, deadline=self._deadline)


class _EveryStatusIsAnAnswer(urllib.request.HTTPErrorProcessor):
    # No HTTPError for a status other than 2xx, and so no redirect followed: a redirect
    # could lead to a host the operator did not list.
    def http_response(self, request, response):
        return response

    https_response = http_response


def bounded_request(
    request: urllib.request.Request, *, timeout: float, max_body: int = 0, proxies: bool = False
) -> tuple[int, bytes]:
    """Send `request` and read its answer, all of it within `timeout` seconds: (status, the
    first `max_body` bytes of the body). Any status is an answer (redirects are not
    followed). `proxies`: through the proxy the environment names, if any.

    Raises TimeoutError past the deadline (also as the `reason` of a URLError), and OSError,
    http.client.HTTPException or ValueError when there is no answer to read. The name
    lookup is the one step not bounded by it (the resolver's own timeouts apply)."""
    deadline = _Deadline(timeout)
    handlers = [_EveryStatusIsAnAnswer, _HTTPHandler(deadline), _HTTPSHandler(deadline)]
    if not proxies:
        handlers.append(urllib.request.ProxyHandler({}))
    opener = urllib.request.build_opener(*handlers)
    with opener.open(request, timeout=timeout) as response:
        status = response.status
        body = response.read(max_body) if max_body > 0 else b""
    return status, body
