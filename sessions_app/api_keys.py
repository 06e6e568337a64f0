"""API keys: created once, stored as a SHA-256 digest, looked up by that digest.

The plaintext exists only in the return value of `api_key_create`; the API, the admin and
`manage.py create_api_key` show it once and never again. Keys are high-entropy random
tokens, so one unsalted SHA-256 is enough (a salt or a slow hash protects guessable
passwords, not 256-bit secrets), and it lets authentication be a single indexed lookup.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime, timedelta

from django.db import connection

from sessions_app.models import ApiKey, Company

KEY_PREFIX = "pc_"
# Shown beside the key's name in the admin so an operator can tell keys apart.
DISPLAY_PREFIX_CHARS = 10
# last_used_at is a hint for operators, not an audit log: write it at most this often, so
# that a busy key does not turn every read request into a write.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def api_key_hash(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8", "surrogatepass")).hexdigest()


def api_key_create(*, company: Company, name: str = "") -> tuple[ApiKey, str]:
    """Create a key for `company`; returns the row and the plaintext (show it once)."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = ApiKey.objects.create(
        company=company,
        name=name,
        prefix=plaintext[:DISPLAY_PREFIX_CHARS],
        key_hash=api_key_hash(plaintext),
    )
    return api_key, plaintext


# Every authenticated request makes this lookup, and the ORM took longer to compile it than
# the database took to answer, so it is written out (the table is part of the contract).
# It reads the row on every call: revoking a key takes effect on the next request.
KEY_LOOKUP_SQL = (
    "SELECT id, company_id, key_hash, revoked_at IS NULL, last_used_at IS NULL OR last_used_at <= %s "
    "FROM api_keys WHERE key_hash = %s"
)


def api_key_authenticate(*, plaintext: str, now: datetime) -> ApiKey | None:
    """The active key with this plaintext, or None. Touches last_used_at (coarsely)."""
    digest = api_key_hash(plaintext)
    stale_before = connection.ops.adapt_datetimefield_value(now - LAST_USED_RESOLUTION)
    with connection.cursor() as cursor:
        cursor.execute(KEY_LOOKUP_SQL, [stale_before, digest])
        row = cursor.fetchone()
    if row is None:
        return None
    pk, company_id, key_hash, active, stale = row
    # The lookup is by digest, so timing reveals nothing about the stored value; the
    # constant-time comparison guards against a database collation that is not exact.
    if not hmac.compare_digest(key_hash, digest) or not active:
        return None
    meta = ApiKey._meta
    # The row as far as it was read; other fields load on first access, as with only().
    api_key = ApiKey.from_db(
        connection.alias,
        ["id", "company_id", "key_hash", "revoked_at"],
        [meta.pk.to_python(pk), meta.get_field("company").to_python(company_id), key_hash, None],
    )
    if stale:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
        api_key.last_used_at = now
    return api_key


def api_key_revoke(*, api_key: ApiKey, now: datetime) -> None:
    ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=now)
    api_key.refresh_from_db(fields=["revoked_at"])
