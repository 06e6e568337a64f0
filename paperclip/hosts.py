"""The hosts this service calls because an API key named them (a work check's URL, a budget
alert's webhook): in `authenticated` mode only those the operator lists, since what each
call answers is shown to the key, which could otherwise probe the workers' network.

A listed entry is a host (`hooks.slack.com`, `[fd00::7]`), which allows its URL scheme's
default port only (80 for http, 443 for https), or `host:port`, which allows that port only:
a listed host is not every service it runs (its database on 5432, say)."""

from __future__ import annotations

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
