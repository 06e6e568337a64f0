from __future__ import annotations

import re
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from costs_app.money import usd
from sessions_app.models import AgentSession
from sessions_app.stores import STORES
from tests.api.conftest import agent_url, assert_error, make_session
from tests.fake_anthropic import Reply

pytestmark = pytest.mark.django_db


def test_sessions_list_has_the_contract_shape(api, persistent_agent):
    session = make_session(persistent_agent, messages=12)
    response = api.get(agent_url(persistent_agent, "/sessions"))
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"sessions", "next"}
    (row,) = body["sessions"]
    assert re.fullmatch(r"sess_[0-9a-f]{32}", row["id"])
    assert row["id"] == session.public_id
    assert row["message_count"] == 12
    for key in ("created_at", "last_used", "expires_at", "status", "agent_id", "last_input_tokens"):
        assert key in row
    assert "history" not in row
    assert row["total_cost_usd"] == "0.00"


def test_sessions_list_is_newest_use_first_and_pages_with_a_cursor(api, persistent_agent):
    now = timezone.now()
    for index in range(5):
        make_session(persistent_agent, status="ended", last_used=now - timedelta(minutes=index))
    seen = []
    cursor = None
    for _ in range(3):
        params = {"limit": 2, **({"next": cursor} if cursor else {})}
        body = api.get(agent_url(persistent_agent, "/sessions"), params).json()
        seen.extend(row["last_used"] for row in body["sessions"])
        cursor = body["next"]
    assert cursor is None
    assert len(seen) == 5
    assert seen == sorted(seen, reverse=True)


def test_sessions_with_the_same_last_used_are_all_listed_once(api, persistent_agent):
    now = timezone.now()
    ids = {make_session(persistent_agent, status="ended", last_used=now).public_id for _ in range(5)}
    seen = []
    cursor = None
    while True:
        params = {"limit": 2, **({"next": cursor} if cursor else {})}
        body = api.get(agent_url(persistent_agent, "/sessions"), params).json()
        seen.extend(row["id"] for row in body["sessions"])
        cursor = body["next"]
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids)


def test_sessions_list_filters_by_status_and_created_range(api, persistent_agent):
    old = make_session(persistent_agent, status="ended")
    AgentSession.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=10))
    live = make_session(persistent_agent, status="active")
    url = agent_url(persistent_agent, "/sessions")
    assert [s["id"] for s in api.get(url, {"status": "ended"}).json()["sessions"]] == [old.public_id]
    after = (timezone.now() - timedelta(days=1)).isoformat()
    assert [s["id"] for s in api.get(url, {"created_after": after}).json()["sessions"]] == [live.public_id]
    assert [s["id"] for s in api.get(url, {"created_before": after}).json()["sessions"]] == [old.public_id]
    day = (timezone.now() - timedelta(days=5)).date().isoformat()
    assert [s["id"] for s in api.get(url, {"created_before": day}).json()["sessions"]] == [old.public_id]


@pytest.mark.parametrize(
    "params",
    [
        {"status": "bogus"},
        {"created_after": "yesterday"},
        {"created_before": "2026-13-45"},
        {"limit": 0},
        {"limit": 201},
        {"limit": "ten"},
        {"next": "not-a-cursor"},
        {"next": "WyJub3QtYS1kYXRlIiwgIngiXQ"},
    ],
)
def test_bad_list_parameters_are_400(api, persistent_agent, params):
    assert_error(api.get(agent_url(persistent_agent, "/sessions"), params), 400)


def test_sessions_list_never_reads_history(api, persistent_agent):
    make_session(persistent_agent, messages=4)
    with CaptureQueriesContext(connection) as queries:
        response = api.get(agent_url(persistent_agent, "/sessions"))
    assert response.status_code == 200
    session_selects = [q["sql"] for q in queries if "agent_sessions" in q["sql"]]
    assert session_selects
    # A word match, whatever the quoting or alias: history_purged_at is a column of its
    # own, only "history" itself is the turns.
    assert not any(re.search(r"\bhistory\b", sql) for sql in session_selects)


def test_sessions_list_queries_do_not_grow_with_sessions(api, persistent_agent, django_assert_max_num_queries):
    for _ in range(40):
        make_session(persistent_agent, status="ended")
    with django_assert_max_num_queries(2):
        response = api.get(agent_url(persistent_agent, "/sessions"), {"limit": 200})
    assert len(response.json()["sessions"]) == 40


def test_session_detail_includes_its_history_by_either_id_form(api, persistent_agent):
    session = make_session(persistent_agent, messages=3)
    for session_id in (session.public_id, str(session.id)):
        response = api.get(agent_url(persistent_agent, f"/sessions/{session_id}"))
        assert response.status_code == 200
        body = response.json()
        assert body["id"] == session.public_id
        assert [m["content"] for m in body["history"]] == ["turn 0", "turn 1", "turn 2"]


def file_session(agent, messages):
    session = AgentSession.objects.create(
        agent=agent, company_id=agent.company_id, store="file", message_count=len(messages)
    )
    staged = STORES["file"].stage(session, messages)
    session.save(update_fields=staged.fields)
    staged.publish()
    return session


def test_session_detail_reads_a_file_store_history(api, persistent_agent):
    session = file_session(persistent_agent, [{"role": "user", "content": "hello"}])
    body = api.get(agent_url(persistent_agent, f"/sessions/{session.public_id}")).json()
    assert body["history"] == [{"role": "user", "content": "hello"}]
    assert body["store"] == "file"


def test_missing_history_file_is_409_with_its_code(api, persistent_agent):
    session = file_session(persistent_agent, [{"role": "user", "content": "hello"}])
    STORES["file"].path_for(session).unlink()
    assert_error(api.get(agent_url(persistent_agent, f"/sessions/{session.public_id}")), 409, "history_missing")


def test_corrupt_history_file_is_409_with_its_code(api, persistent_agent):
    session = file_session(persistent_agent, [{"role": "user", "content": "hello"}])
    STORES["file"].path_for(session).write_text("{not json")
    assert_error(api.get(agent_url(persistent_agent, f"/sessions/{session.public_id}")), 409, "history_corrupt")


def test_unreadable_history_file_is_503(api, persistent_agent):
    session = file_session(persistent_agent, [{"role": "user", "content": "hello"}])
    path = STORES["file"].path_for(session)
    path.unlink()
    path.mkdir()  # reading a directory is an OSError other than "missing"
    assert_error(api.get(agent_url(persistent_agent, f"/sessions/{session.public_id}")), 503, "history_unreadable")


def test_delete_session_removes_row_and_file(api, persistent_agent, django_capture_on_commit_callbacks):
    session = file_session(persistent_agent, [{"role": "user", "content": "hello"}])
    path = STORES["file"].path_for(session)
    with django_capture_on_commit_callbacks(execute=True):
        response = api.delete(agent_url(persistent_agent, f"/sessions/{session.public_id}"))
    assert response.status_code == 204
    assert not AgentSession.objects.filter(pk=session.pk).exists()
    assert not path.exists()
    assert_error(api.delete(agent_url(persistent_agent, f"/sessions/{session.public_id}")), 404)


@pytest.mark.parametrize("session_id", ["sess_nothex", "sess_" + "0" * 31, "12345", "sess_" + "a" * 40])
def test_malformed_session_ids_are_404(api, persistent_agent, session_id):
    assert_error(api.get(agent_url(persistent_agent, f"/sessions/{session_id}")), 404)
    assert_error(api.delete(agent_url(persistent_agent, f"/sessions/{session_id}")), 404)


def test_another_agents_session_is_404_through_this_agent(api, persistent_agent, stateless_agent):
    session = make_session(stateless_agent)
    assert_error(api.get(agent_url(persistent_agent, f"/sessions/{session.public_id}")), 404)
    assert_error(api.delete(agent_url(persistent_agent, f"/sessions/{session.public_id}")), 404)
    assert AgentSession.objects.filter(pk=session.pk).exists()


@pytest.mark.parametrize(
    "value",
    [
        "7779-05-19T22:24:31+23:05",  # PostgreSQL refuses offsets beyond +-15:59
        "9999-12-31T23:59:59-10:00",  # past the largest datetime once in UTC
        "0001-01-01T00:00:00+10:00",
    ],
)
def test_created_range_with_extreme_offsets_never_fails(api, persistent_agent, value):
    response = api.get(agent_url(persistent_agent, "/sessions"), {"created_before": value})
    assert response.status_code in (200, 400)
    if response.status_code == 400:
        assert_error(response, 400, "invalid_parameter")


def test_cursor_with_an_extreme_offset_is_400_or_a_page(api, persistent_agent):
    import base64
    import json

    make_session(persistent_agent)
    cursor = base64.urlsafe_b64encode(json.dumps(["7779-05-19T22:24:31+23:05", str(uuid.uuid4())]).encode()).decode()
    response = api.get(agent_url(persistent_agent, "/sessions"), {"next": cursor})
    assert response.status_code in (200, 400)


def test_fast_list_item_matches_the_session_serializer(persistent_agent):
    from decimal import Decimal

    from sessions_app.serializers import SESSION_LIST_COLUMNS, SessionSerializer, session_list_item

    predecessor = make_session(persistent_agent, status="ended", ended_at=timezone.now(), end_reason="expired")
    session = make_session(
        persistent_agent,
        predecessor=predecessor,
        last_input_tokens=1234,
        total_input_tokens=99999,
        total_output_tokens=555,
        total_cost_usd=Decimal("0.1234567891"),
        model="claude-opus-4-5",
        adapter_type="claude-code",
    )
    for one in (session, predecessor):
        row = AgentSession.objects.filter(pk=one.pk).values(*SESSION_LIST_COLUMNS).get()
        assert session_list_item(row) == SessionSerializer(AgentSession.objects.get(pk=one.pk)).data


def test_agent_without_sessions_lists_none(api, persistent_agent, django_assert_max_num_queries):
    with django_assert_max_num_queries(2):
        response = api.get(agent_url(persistent_agent, "/sessions"))
    assert response.json() == {"sessions": [], "next": None}


def test_a_session_whose_summary_did_not_shrink_it_says_so(api, persistent_agent):
    at = timezone.now()
    session = make_session(persistent_agent, compaction_error="compaction_not_shrinking", compaction_error_at=at)
    listed = api.get(agent_url(persistent_agent, "/sessions")).json()["sessions"][0]
    detail = api.get(agent_url(persistent_agent, f"/sessions/{session.public_id}")).json()
    for body in (listed, detail):
        assert body["compaction_error"] == "compaction_not_shrinking"
        assert body["compaction_error_at"].startswith(at.strftime("%Y-%m-%dT%H:%M"))
    healthy_session = make_session(persistent_agent, status="ended")
    healthy = api.get(agent_url(persistent_agent, f"/sessions/{healthy_session.public_id}")).json()
    assert (healthy["compaction_error"], healthy["compaction_error_at"]) == ("", None)


def test_a_turns_cost_in_the_history_is_money_by_the_one_rule(api, persistent_agent, fake_anthropic):
    # The ledger keeps 10 places; the turn once showed them all ("0.0001500000").
    fake_anthropic.push(Reply.message("Done.", usage={"input_tokens": 30, "output_tokens": 4}))
    run = api.post(agent_url(persistent_agent, "/heartbeat"), {"task": "hi", "wait": True}).json()
    body = api.get(agent_url(persistent_agent, f"/sessions/{run['session_id']}")).json()
    answer = body["history"][-1]
    assert answer["cost_usd"] == run["cost_usd"] == usd(Decimal(run["cost_usd"]))
    assert not answer["cost_usd"].endswith("0")
