"""One page of an agent's sessions list, as the JSON bytes of the response.

On PostgreSQL the database writes each row's JSON itself (`SESSION_ITEM_SQL`), byte for
byte what `SessionSerializer` and DRF's JSONRenderer would produce: turning ~250
timestamps a page into Python datetimes and back into ISO strings cost more than the query,
and compiling the query through the ORM cost as much again. Elsewhere (SQLite, the embedded
default) the page goes through the ORM and `session_list_item`. Tests hold both paths to
the serializer's output. Neither reads `history`, which may be megabytes a row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from django.db import connection, models
from rest_framework.renderers import JSONRenderer

from sessions_app.api.pagination import Keyset
from sessions_app.models import SESSION_ID_PREFIX, AgentSession, AgentStatus
from sessions_app.serializers import SESSION_LIST_COLUMNS, session_list_item

SESSION_ORDER = Keyset("last_used", descending=True)  # sessions_agent_last_used_idx


@dataclass(frozen=True)
class SessionPage:
    body: bytes
    empty: bool


def session_list_page(
    *,
    company_id: UUID,
    agent_id: UUID,
    limit: int,
    status: str | None = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    after: tuple[datetime, UUID] | None = None,
) -> SessionPage:
    """The agent's sessions, most recently used first, after the `after` (last_used, id) key."""
    page = sql_page if connection.vendor == "postgresql" else python_page
    return page(
        company_id=company_id,
        agent_id=agent_id,
        limit=limit,
        status=status,
        created_after=created_after,
        created_before=created_before,
        after=after,
    )


# The Python path (every database).


def python_page(*, company_id, agent_id, limit, status, created_after, created_before, after) -> SessionPage:
    sessions = (
        AgentSession.objects.filter(agent_id=agent_id, agent__company_id=company_id)
        .exclude(agent__status=AgentStatus.DELETED)
        .values(*SESSION_LIST_COLUMNS)
    )
    if status:
        sessions = sessions.filter(status=status)
    if created_after:
        sessions = sessions.filter(created_at__gte=created_after)
    if created_before:
        sessions = sessions.filter(created_at__lt=created_before)
    if after:
        sessions = SESSION_ORDER.after_key(sessions, *after)
    rows = list(sessions.order_by(*SESSION_ORDER.order_by)[: limit + 1])
    cursor = SESSION_ORDER.encode(rows[limit - 1]) if len(rows) > limit else None
    data = {"sessions": [session_list_item(row) for row in rows[:limit]], "next": cursor}
    return SessionPage(body=JSONRenderer().render(data), empty=not rows)


# The PostgreSQL path: the same page, its JSON written by the database.


def iso_time_sql(column: str, suffix: str) -> str:
    # Python's isoformat(): microseconds when there are any, none at all (not .000000)
    # when they are 0. to_char does not depend on DateStyle or the session's time zone.
    return f"replace(to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US'), '.000000', '') || '{suffix}'"


def value_sql(name: str) -> str:
    """The JSON text of one SESSION_LIST_COLUMNS entry, as SessionSerializer renders it."""
    field = AgentSession._meta.get_field(name)
    column = f"s.{field.column}"
    if name in ("id", "predecessor_id"):
        # uuid_send is the 16 bytes, so this is UUID.hex (and cheaper than editing the text form).
        value = f"'\"{SESSION_ID_PREFIX}' || encode(uuid_send({column}), 'hex') || '\"'"
    elif isinstance(field, models.UUIDField) or isinstance(getattr(field, "target_field", None), models.UUIDField):
        value = f"'\"' || {column}::text || '\"'"
    elif isinstance(field, models.DateTimeField):
        value = f"'\"' || {iso_time_sql(column, 'Z')} || '\"'"
    elif isinstance(field, models.DecimalField):
        # Money by costs_app.money's rule: numeric's text is never in exponent form;
        # trim_scale() drops the zeros after the last significant digit, and an amount with
        # fewer than two decimals left is printed with two (round() keeps trailing zeros).
        exact = f"round({column}, {int(field.decimal_places)})"
        money = f"CASE WHEN scale(trim_scale({exact})) < 2 THEN round({exact}, 2) ELSE trim_scale({exact}) END"
        value = f"'\"' || ({money})::text || '\"'"
    elif isinstance(field, (models.CharField, models.TextField)):
        # to_json escapes exactly the characters Python's json module does: quote,
        # backslash, control characters as \b \f \n \r \t or \u00XX (see json_body for the rest).
        value = f"to_json({column})::text"
    elif isinstance(field, models.IntegerField):  # BigIntegerField and PositiveIntegerField too
        value = f"{column}::text"
    else:
        raise TypeError(f"No SQL JSON rendering for {name} ({type(field).__name__}); add one and a test.")
    return f"coalesce({value}, 'null')" if field.null else value


def item_sql(columns=SESSION_LIST_COLUMNS) -> str:
    parts = []
    for index, name in enumerate(columns):
        parts.append("'" + ("{" if index == 0 else ",") + f'"{name}":' + "'")
        parts.append(value_sql(name))
    parts.append("'}'")
    return f"concat({', '.join(parts)})"


SESSION_ITEM_SQL = item_sql()
PAGE_SELECT = (
    f"SELECT {SESSION_ITEM_SQL} "  # noqa: S608 (built from model fields, no input)
    "FROM agent_sessions s JOIN agents a ON a.id = s.agent_id "
    "WHERE s.agent_id = %s AND a.company_id = %s AND a.status <> %s"
)
PAGE_ORDER = " ORDER BY s.last_used DESC, s.id DESC LIMIT %s"


def cursor_after(item: str) -> str:
    """The cursor Keyset.encode writes for the session whose JSON is `item`.

    Read back from the JSON rather than selected beside it: a second rendering of the
    keys on every row cost the database more than parsing one row here.
    """
    row = json.loads(item)
    last_used = row["last_used"].removesuffix("Z") + "+00:00"  # isoformat() of the aware UTC time
    pk = UUID(hex=row["id"].removeprefix(SESSION_ID_PREFIX))
    return SESSION_ORDER.encode({"last_used": last_used, "id": pk})


def json_body(items: list[str], cursor: str | None) -> bytes:
    body = f'{{"sessions":[{",".join(items)}],"next":{json.dumps(cursor)}}}'
    # As DRF's JSONRenderer does to its whole output: U+2028 and U+2029 are valid JSON but
    # were not valid in JavaScript string literals. They can only occur inside strings.
    return body.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").encode()


def sql_page(*, company_id, agent_id, limit, status, created_after, created_before, after) -> SessionPage:
    filters = []
    params: list = [agent_id, company_id, AgentStatus.DELETED.value]
    if status:
        filters.append(" AND s.status = %s")
        params.append(status)
    if created_after:
        filters.append(" AND s.created_at >= %s")
        params.append(created_after)
    if created_before:
        filters.append(" AND s.created_at < %s")
        params.append(created_before)
    if after:
        last_used, pk = after
        filters.append(" AND (s.last_used < %s OR (s.last_used = %s AND s.id < %s))")
        params.extend([last_used, last_used, pk])
    params.append(limit + 1)
    with connection.cursor() as cursor:
        cursor.execute(PAGE_SELECT + "".join(filters) + PAGE_ORDER, params)
        rows = cursor.fetchall()
    items = [row[0] for row in rows[:limit]]
    cursor_text = cursor_after(items[-1]) if len(rows) > limit else None
    return SessionPage(body=json_body(items, cursor_text), empty=not rows)
