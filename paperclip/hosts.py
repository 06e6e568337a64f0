"""The hosts this service calls because an API key named them (a work check's URL, a budget
alert's webhook): in `authenticated` mode only those the operator lists, since what each
call answers is shown to the key, which could otherwise probe the workers' network."""

from __future__ import annotations

from django.conf import settings


def unlisted_host_problem(host: str, *, setting: str, mode: str) -> str | None:
    """Why `host` may not be called, or None: in `authenticated` mode it must be one of the
    hosts listed in the setting named `setting`; in `local_trusted` mode any host may."""
    hosts = getattr(settings, setting)
    if mode == "local_trusted" or host.lower() in hosts:
        return None
    listed = ", ".join(sorted(hosts)) or "none are listed"
    return f"host {host!r} is not one of {setting} ({listed}); in authenticated mode the operator lists them"
