"""Keyset pagination: `limit` and an opaque `next` cursor.

A page is `ORDER BY a, id LIMIT n+1` from where the last one stopped, never an OFFSET, so
page 200 of 10,000 sessions costs what page 1 does and walks the same index. The cursor is
the last row's ordering values, base64url-encoded; clients must treat it as opaque.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import UTC, datetime

from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet

from sessions_app.api.exceptions import BadRequest
from sessions_app.text import is_storable

DEFAULT_LIMIT = 50
MAX_LIMIT = 200


def parse_limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return DEFAULT_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise BadRequest(
            f"limit must be a whole number from 1 to {MAX_LIMIT}.", code="invalid_limit", fields={"limit": raw}
        )
    return limit


@dataclass(frozen=True)
class Keyset:
    """An ordering on one field plus the primary key, both in the same direction."""

    field: str
    descending: bool

    @property
    def order_by(self) -> tuple[str, str]:
        sign = "-" if self.descending else ""
        return (f"{sign}{self.field}", f"{sign}pk")

    def encode(self, row) -> str:
        """The cursor after `row`: a model instance, or a dict of values with its `id`."""
        value, pk = (row[self.field], row["id"]) if isinstance(row, dict) else (getattr(row, self.field), row.pk)
        payload = json.dumps([value.isoformat() if hasattr(value, "isoformat") else value, str(pk)])
        return base64.urlsafe_b64encode(payload.encode()).decode().rstrip("=")

    def decode(self, cursor: str, model) -> tuple:
        """The ordering value and primary key a cursor names, typed as `model`'s fields; 400 if bad."""
        try:
            padded = cursor + "=" * (-len(cursor) % 4)
            value, pk = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
            value = model._meta.get_field(self.field).to_python(value)
            if isinstance(value, datetime):
                # PostgreSQL refuses offsets beyond +-15:59; the cursors we write are UTC anyway.
                value = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
            pk = model._meta.pk.to_python(pk)
        except (ValueError, TypeError, OverflowError, UnicodeError, binascii.Error, ValidationError):
            raise BadRequest("The cursor is not valid.", code="invalid_cursor", fields={"next": "invalid"}) from None
        # The query string's check saw only the base64: what it decodes to may hold what no
        # database takes as a parameter (PostgreSQL refuses NUL; a lone surrogate is no UTF-8).
        if value is None or pk is None or (isinstance(value, str) and not is_storable(value)):
            raise BadRequest("The cursor is not valid.", code="invalid_cursor", fields={"next": "invalid"})
        return value, pk

    def after(self, queryset: QuerySet, cursor: str) -> QuerySet:
        return self.after_key(queryset, *self.decode(cursor, queryset.model))

    def after_key(self, queryset: QuerySet, value, pk) -> QuerySet:
        """The rows that come after (value, pk) in this ordering."""
        op = "lt" if self.descending else "gt"
        return queryset.filter(Q(**{f"{self.field}__{op}": value}) | Q(**{self.field: value, f"pk__{op}": pk}))

    def page(self, queryset: QuerySet, *, limit: int, cursor: str | None) -> tuple[list, str | None]:
        """One page of rows (one query) and the cursor of the next page, or None."""
        if cursor:
            queryset = self.after(queryset, cursor)
        rows = list(queryset.order_by(*self.order_by)[: limit + 1])
        if len(rows) <= limit:
            return rows, None
        rows = rows[:limit]
        return rows, self.encode(rows[-1])
