"""What a provider says about its limits: refusals that name a reset, and what is left.

Pure functions of what the Messages API (or Claude Code) answered and `now`; no model and
no database (the engine's side is `sessions_app.quota`):

- `api_refusal`: a 429 rate limit with the reset it names (`retry-after`, or the
  `anthropic-ratelimit-*-reset` of a limit that is spent), or a 400 "credit balance is too
  low", which names none;
- `cli_refusal`: Claude Code's "usage limit reached ... resets at ..." in its result;
- `headroom_of`: the `anthropic-ratelimit-*-remaining` headers of an answer, as the share
  left of the tightest limit and when it resets (what paces claims before any refusal);
- `QuotaMiddleware`: the SDK middleware that ends its retry loop when the wait a 429 asks
  for lies beyond PAPERCLIP_QUOTA_RETRY_WINDOW_SECONDS: the worker does not sleep through a
  reset that every other agent on the key would also hit, the credential is held instead.

A credential is named by a fingerprint (`credential_fingerprint`), never by the key.
"""

from __future__ import annotations

import contextvars
import email.utils
import hashlib
import os
import re
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings

from sessions_app.adapters.base import QuotaRefused

RATE_LIMITED = "rate_limited"
CREDIT_EXHAUSTED = "credit_exhausted"
USAGE_LIMIT = "usage_limit"
CREDIT_REFUSAL = re.compile(r"credit balance is too low", re.IGNORECASE)
USAGE_LIMIT_TEXT = re.compile(r"usage limit reached", re.IGNORECASE)
# Claude Code says when a subscription limit resets as an epoch after a bar
# ("Claude AI usage limit reached|1767225600") or in words ("... resets at 5pm (UTC)").
EPOCH_AFTER_BAR = re.compile(r"usage limit reached\|(\d{9,11})", re.IGNORECASE)
RESETS_AT_TIME = re.compile(
    r"resets? (?:at )?(\d{1,2})(?::(\d{2}))?\s*(am|pm)?(?:\s*\(([A-Za-z_/+-]+)\))?", re.IGNORECASE
)
LIMIT_KINDS = ("requests", "tokens", "input-tokens", "output-tokens")
# A reset further away than this is not believed: a clock or header gone wrong must not
# hold a deployment for a year.
LONGEST_RESET = timedelta(days=8)


def credential_fingerprint(secret: str) -> str:
    """The name a credential is held under: a prefix of its SHA-256, never the key."""
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()[:16]


def api_credential() -> str:
    """The fingerprint of the deployment's Messages API credential, from the variables the
    SDK (and Claude Code) read; "anthropic:unset" when none is set."""
    secret = os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN") or ""
    return credential_fingerprint(secret) if secret else "anthropic:unset"


def _header(headers, name: str) -> str | None:
    value = headers.get(name) if headers is not None else None
    return value if isinstance(value, str) and value.strip() else None


def _time(value: str | None) -> datetime | None:
    """An RFC 3339 time (`anthropic-ratelimit-*-reset`), or None."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def retry_after(headers, *, now: datetime) -> timedelta | None:
    """How long `retry-after-ms` or `retry-after` (seconds, or an HTTP date) says to wait."""
    if (ms := _header(headers, "retry-after-ms")) is not None:
        try:
            return max(timedelta(milliseconds=float(ms)), timedelta(0))
        except (ValueError, OverflowError):
            pass
    value = _header(headers, "retry-after")
    if value is None:
        return None
    try:
        return max(timedelta(seconds=float(value)), timedelta(0))
    except (ValueError, OverflowError):
        pass
    parsed = email.utils.parsedate_tz(value)
    return max(datetime.fromtimestamp(email.utils.mktime_tz(parsed), UTC) - now, timedelta(0)) if parsed else None


def limits_reset(headers, *, spent_only: bool) -> datetime | None:
    """The latest `anthropic-ratelimit-*-reset` (of the limits with nothing remaining, when
    `spent_only`)."""
    found = []
    for kind in LIMIT_KINDS:
        reset = _time(_header(headers, f"anthropic-ratelimit-{kind}-reset"))
        remaining = _header(headers, f"anthropic-ratelimit-{kind}-remaining")
        if reset is not None and (not spent_only or remaining in (None, "0")):
            found.append(reset)
    return max(found, default=None)


def _bounded(reset: datetime | None, *, now: datetime) -> datetime | None:
    if reset is None:
        return None
    return min(max(reset, now), now + LONGEST_RESET)


def api_refusal(*, status: int, headers, message: str, now: datetime) -> QuotaRefused | None:
    """The quota refusal a Messages API error is, or None for any other error."""
    if status == 429:
        message = f"Messages API rate limit (429): {message}"[:500]
        if (wait := retry_after(headers, now=now)) is not None:
            return QuotaRefused(RATE_LIMITED, message, wait=min(wait, LONGEST_RESET))
        reset = limits_reset(headers, spent_only=True) or limits_reset(headers, spent_only=False)
        return QuotaRefused(RATE_LIMITED, message, reset_at=_bounded(reset, now=now))
    if status == 400 and CREDIT_REFUSAL.search(message or ""):
        return QuotaRefused(CREDIT_EXHAUSTED, f"Messages API refused: {message}"[:500], reset_at=None)
    return None


def cli_refusal(text: str, *, now: datetime) -> QuotaRefused | None:
    """The usage-limit refusal in what Claude Code reported, or None."""
    if not text or not USAGE_LIMIT_TEXT.search(text):
        return None
    return QuotaRefused(
        USAGE_LIMIT, f"Claude Code: {text.strip()}"[:500], reset_at=_bounded(cli_reset(text, now=now), now=now)
    )


def cli_reset(text: str, *, now: datetime) -> datetime | None:
    """When Claude Code says its usage limit resets: an epoch after a bar, or a clock time
    ("resets at 5pm (Europe/Berlin)", UTC when no zone is named) at its next occurrence."""
    if match := EPOCH_AFTER_BAR.search(text):
        return datetime.fromtimestamp(int(match.group(1)), UTC)
    match = RESETS_AT_TIME.search(text)
    if match is None:
        return None
    hour, minute, half, zone_name = int(match.group(1)), int(match.group(2) or 0), match.group(3), match.group(4)
    if half:
        hour = hour % 12 + (12 if half.lower() == "pm" else 0)
    if not (0 <= hour < 24 and 0 <= minute < 60):
        return None
    try:
        zone = zoneinfo.ZoneInfo(zone_name) if zone_name else UTC
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        zone = UTC
    local_now = now.astimezone(zone)
    moment = local_now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if moment <= local_now:
        moment = (local_now + timedelta(days=1)).replace(hour=hour, minute=minute, second=0, microsecond=0)
    return moment.astimezone(UTC)


@dataclass(frozen=True)
class Headroom:
    """The tightest of an answer's rate limits: the share of it left, and when it resets."""

    left: float  # 0.0 .. 1.0
    remaining: int
    limit: int
    kind: str
    reset_at: datetime | None


def headroom_of(headers) -> Headroom | None:
    """From `anthropic-ratelimit-{kind}-limit/-remaining/-reset`; None without them."""
    tightest = None
    for kind in LIMIT_KINDS:
        try:
            limit = int(_header(headers, f"anthropic-ratelimit-{kind}-limit") or "")
            remaining = int(_header(headers, f"anthropic-ratelimit-{kind}-remaining") or "")
        except ValueError:
            continue
        if limit <= 0:
            continue
        left = max(min(remaining / limit, 1.0), 0.0)
        if tightest is None or left < tightest.left:
            reset = _time(_header(headers, f"anthropic-ratelimit-{kind}-reset"))
            tightest = Headroom(left=left, remaining=max(remaining, 0), limit=limit, kind=kind, reset_at=reset)
    return tightest


# What the middleware saw of the last answer in this context (a heartbeat's thread): the
# adapter reads it back after its call, so that a process-wide client shares nothing.
LAST_HEADROOM: contextvars.ContextVar[Headroom | None] = contextvars.ContextVar("last_headroom", default=None)


class QuotaMiddleware:
    """`anthropic.Anthropic(middleware=[...])`: runs inside the SDK's retry loop, once per
    attempt. A 429 whose wait lies beyond the retry window ends the loop with
    `QuotaRefused` (the SDK would otherwise sleep for as long as `retry-after` asks, on
    every worker); shorter waits are the SDK's to retry. A successful answer leaves its
    headroom in `LAST_HEADROOM`."""

    def __call__(self, request, call_next):
        response = call_next(request)
        now = datetime.now(UTC)
        headers = response.headers
        if response.status_code == 429:
            wait = retry_after(headers, now=now)
            if wait is None and (reset := limits_reset(headers, spent_only=True)) is not None:
                wait = reset - now
            if wait is not None and wait > timedelta(seconds=settings.PAPERCLIP_QUOTA_RETRY_WINDOW_SECONDS):
                raise api_refusal(status=429, headers=headers, message=_error_message(response), now=now)
        elif response.status_code < 400:
            LAST_HEADROOM.set(headroom_of(headers))
        return response


def _error_message(response) -> str:
    try:
        body = response.json()
    except Exception:  # noqa: BLE001 - a body that is not JSON says nothing more
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message", ""))[:300] if isinstance(error, dict) else ""
