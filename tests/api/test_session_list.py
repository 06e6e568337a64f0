"""The sessions list's two paths (JSON written by PostgreSQL, or built in Python elsewhere)
give byte for byte what SessionSerializer and DRF's renderer give, edge cases included."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.renderers import JSONRenderer

from sessions_app.api.session_list import SESSION_ORDER, python_page, sql_page, value_sql
from sessions_app.models import AgentSession
from sessions_app.serializers import SessionSerializer
from tests.api.conftest import agent_url, make_session

pytestmark = pytest.mark.django_db

AWKWARD_TEXT = 'say "hi" \\ back\nslash\ttab\x01\x1f\x7f line\u2028para\u2029 é 漢 😀 </script>'


@pytest.fixture
def edge_sessions(persistent_agent):
    """Sessions covering every way a value can render: nulls, whole seconds, microseconds
    with leading zeros, the calendar's ends, a predecessor, long decimals, awkward text."""
    now = timezone.now().replace(microsecond=123456)
    base = make_session(persistent_agent, status="ended", last_used=now - timedelta(hours=1))
    rows = [
        # Nulls everywhere they are allowed.
        make_session(persistent_agent, status="ended", last_used=now - timedelta(hours=2)),
        # Whole seconds: isoformat prints no fraction at all.
        make_session(
            persistent_agent,
            status="ended",
            last_used=now.replace(microsecond=0) - timedelta(hours=3),
            ended_at=now.replace(microsecond=0),
            end_reason="expired",
            history_purged_at=now.replace(microsecond=0),
        ),
        # A fraction with leading zeros, a predecessor, every counter set, a long decimal.
        make_session(
            persistent_agent,
            status="expired",
            last_used=now.replace(microsecond=100) - timedelta(hours=4),
            ended_at=now.replace(microsecond=7),
            predecessor=base,
            last_input_tokens=2_000_000_000,
            total_input_tokens=9_007_199_254_740_993,
            total_output_tokens=555,
            total_cost_usd=Decimal("1234567890.1234567891"),
            turn_count=3,
            archived_message_count=40,
            compaction_count=2,
        ),
        make_session(
            persistent_agent,
            status="ended",
            last_used=now - timedelta(hours=5),
            total_cost_usd=Decimal("0.0000000001"),
            model=AWKWARD_TEXT,
            adapter_type="a\u2028b",
            end_reason='"',
        ),
        make_session(persistent_agent, status="active", last_used=now, total_cost_usd=Decimal("-0.5")),
    ]
    # The calendar's ends, and the same last_used twice (the keyset's tie on id).
    AgentSession.objects.filter(pk=rows[0].pk).update(created_at=datetime(1, 1, 1, tzinfo=UTC), expires_at=None)
    AgentSession.objects.filter(pk=rows[1].pk).update(
        created_at=datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), last_used=base.last_used
    )
    return [base, *rows]


def serializer_body(agent, *, limit: int = 50, next_cursor=None, **filters) -> bytes:
    sessions = AgentSession.objects.filter(agent=agent, **filters).defer("history").order_by("-last_used", "-id")
    data = {"sessions": SessionSerializer(sessions[:limit], many=True).data, "next": next_cursor}
    return JSONRenderer().render(data)


def page_args(agent, **kwargs) -> dict:
    args = {
        "company_id": agent.company_id,
        "agent_id": agent.id,
        "limit": 50,
        "status": None,
        "created_after": None,
        "created_before": None,
        "after": None,
    }
    return {**args, **kwargs}


def test_the_list_is_byte_for_byte_what_the_serializer_renders(api, persistent_agent, edge_sessions):
    response = api.get(agent_url(persistent_agent, "/sessions"))
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert response.content == serializer_body(persistent_agent)
    assert len(response.json()["sessions"]) == len(edge_sessions)


def test_every_page_and_cursor_is_byte_for_byte_the_serializers(api, persistent_agent, edge_sessions):
    ordered = list(AgentSession.objects.filter(agent=persistent_agent).order_by("-last_used", "-id"))
    cursor = None
    for index, session in enumerate(ordered):
        params = {"limit": 1, **({"next": cursor} if cursor else {})}
        response = api.get(agent_url(persistent_agent, "/sessions"), params)
        cursor = response.json()["next"]
        expected_cursor = SESSION_ORDER.encode(session) if index < len(ordered) - 1 else None
        assert cursor == expected_cursor
        expected = JSONRenderer().render(
            {"sessions": SessionSerializer([session], many=True).data, "next": expected_cursor}
        )
        assert response.content == expected


@pytest.mark.usefixtures("postgres_only")
@pytest.mark.parametrize("limit", [1, 2, 3, 50])
@pytest.mark.parametrize(
    "filters",
    [
        {},
        {"status": "ended"},
        {"status": "paused"},
        {"created_after": datetime(2000, 1, 1, tzinfo=UTC)},
        {"created_before": datetime(2000, 1, 1, tzinfo=UTC)},
        {"created_after": datetime(1, 1, 1, tzinfo=UTC), "created_before": datetime(9999, 1, 1, tzinfo=UTC)},
    ],
)
def test_postgresql_and_python_paths_agree_on_every_page(persistent_agent, edge_sessions, limit, filters):
    after = None
    pages = 0
    while True:
        args = page_args(persistent_agent, limit=limit, after=after, **filters)
        by_sql, by_python = sql_page(**args), python_page(**args)
        assert by_sql == by_python
        pages += 1
        cursor = json.loads(by_sql.body)["next"]
        if cursor is None:
            break
        after = SESSION_ORDER.decode(cursor, AgentSession)
    assert pages <= len(edge_sessions) + 1


@pytest.mark.usefixtures("postgres_only")
def test_postgresql_path_scopes_to_the_company_and_hides_deleted_agents(persistent_agent, other_company):
    make_session(persistent_agent)
    assert not sql_page(**page_args(persistent_agent)).empty
    assert sql_page(**page_args(persistent_agent, company_id=other_company.id)).empty
    persistent_agent.status = "deleted"
    persistent_agent.save()
    assert sql_page(**page_args(persistent_agent)).empty


def test_unknown_column_kinds_are_refused_not_guessed():
    with pytest.raises(TypeError):
        value_sql("manifest")


def test_list_queries_are_bounded_and_never_read_history(api, persistent_agent, edge_sessions):
    url = agent_url(persistent_agent, "/sessions")
    with CaptureQueriesContext(connection) as queries:
        first = api.get(url, {"limit": 2, "status": "ended", "created_after": "2000-01-01"}).json()
        api.get(url, {"limit": 2, "status": "ended", "created_after": "2000-01-01", "next": first["next"]})
    assert len(queries) == 2
    # A word match: history_purged_at is a column of its own, history is the turns.
    assert not any(re.search(r"\bhistory\b", query["sql"]) for query in queries)


def test_authenticated_list_is_the_key_lookup_and_the_page(key_api, persistent_agent, django_assert_max_num_queries):
    for _ in range(40):
        make_session(persistent_agent, status="ended")
    url = agent_url(persistent_agent, "/sessions")
    key_api.get(url)  # the key's first use also writes its last_used_at
    with django_assert_max_num_queries(2):
        body = key_api.get(url, {"limit": 200}).json()
    assert len(body["sessions"]) == 40 and body["next"] is None
