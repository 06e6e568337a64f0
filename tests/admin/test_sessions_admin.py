"""The sessions admin: list, page, export, actions and deletes through the services."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from costs_app.models import CostEvent, CostKind
from sessions_app.admin import humane_expiry
from sessions_app.models import Agent, AgentSession, HeartbeatRun, HistoryStore, RunStatus, SessionStatus
from sessions_app.stores import STORES, store_for
from tests.admin.conftest import conversation, make_cost, make_run, make_session

CHANGELIST = "admin:sessions_app_agentsession_changelist"


def change_url(session) -> str:
    return reverse("admin:sessions_app_agentsession_change", args=[session.pk])


def history_file(session):
    return STORES[HistoryStore.FILE].path_for(session)


def test_expiry_reads_like_a_person_would_say_it():
    now = timezone.now()
    assert humane_expiry(now + timedelta(hours=3, minutes=5), now=now) == "in 3\xa0hours"
    assert humane_expiry(now - timedelta(days=2, hours=1), now=now) == "expired 2\xa0days ago"
    assert humane_expiry(None, now=now) == "never"


def test_changelist_shows_the_session_columns(admin_client, persistent_agent):
    now = timezone.now()
    live = make_session(
        persistent_agent, history=conversation(2), status=SessionStatus.ACTIVE, expires_at=now + timedelta(hours=3)
    )
    live.last_input_tokens = 4321
    live.total_cost_usd = "1.2345"
    live.save(update_fields=["last_input_tokens", "total_cost_usd"])
    old = make_session(persistent_agent, history=[], status=SessionStatus.EXPIRED, expires_at=now - timedelta(days=2))
    page = admin_client.get(reverse(CHANGELIST)).content.decode()
    assert live.public_id in page and old.public_id in page
    assert "in 2\xa0hours" in page or "in 3\xa0hours" in page
    assert "expired 2\xa0days ago" in page
    assert "last request 4321 in" in page and "1.2345" in page
    assert "Persistent" in page


@pytest.mark.parametrize("form", ["public", "uuid"])
def test_search_finds_a_session_by_either_id_form(admin_client, persistent_agent, form):
    wanted = make_session(persistent_agent, history=[])
    other = make_session(persistent_agent, history=[])
    term = wanted.public_id if form == "public" else str(wanted.pk)
    page = admin_client.get(reverse(CHANGELIST), {"q": term}).content.decode()
    assert wanted.public_id in page
    assert other.public_id not in page


def test_search_by_agent_name(admin_client, persistent_agent, other_agent):
    mine = make_session(persistent_agent, history=[])
    theirs = make_session(other_agent, history=[])
    page = admin_client.get(reverse(CHANGELIST), {"q": "foreign"}).content.decode()
    assert theirs.public_id in page and mine.public_id not in page


def sessions_for(agents, count):
    for i in range(count):
        make_session(agents[i % len(agents)], history=conversation(2), store=HistoryStore.DATABASE)


def count_queries(client, url, params=None) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url, params or {}).status_code == 200
    return len(queries)


def test_session_changelist_query_count_does_not_grow_with_rows(
    admin_client, company, persistent_agent, stateless_agent, django_assert_max_num_queries
):
    agents = [persistent_agent, stateless_agent]
    agents += [Agent.objects.create(company=company, name=f"a{i}", adapter_config={}) for i in range(3)]
    sessions_for(agents, 3)
    count_queries(admin_client, reverse(CHANGELIST))  # warm the per-process caches
    small = count_queries(admin_client, reverse(CHANGELIST))
    sessions_for(agents, 40)
    with django_assert_max_num_queries(small):
        admin_client.get(reverse(CHANGELIST))
    assert count_queries(admin_client, reverse(CHANGELIST), {"q": "a1"}) <= small + 1


def test_session_changelist_never_reads_history_or_counts_the_table(admin_client, persistent_agent):
    make_session(persistent_agent, history=conversation(2), store=HistoryStore.DATABASE)
    with CaptureQueriesContext(connection) as queries:
        admin_client.get(reverse(CHANGELIST))
    page_queries = [q["sql"] for q in queries if 'FROM "agent_sessions"' in q["sql"]]
    assert page_queries
    for sql in page_queries:
        assert '"agent_sessions"."history"' not in sql
        if "COUNT(" in sql.upper():
            assert "LIMIT" in sql.upper(), sql  # the capped count, never a full COUNT(*)


@pytest.mark.parametrize(
    "changelist",
    [CHANGELIST, "admin:sessions_app_heartbeatrun_changelist", "admin:memory_app_memoryfile_changelist"],
)
def test_the_agent_filter_reads_agents_names_not_their_prompts(admin_client, company, changelist):
    agents = [
        Agent.objects.create(company=company, name=f"agent {n}", system_prompt="You are thorough. " * 500)
        for n in range(3)
    ]
    make_run(agents[0])
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(reverse(changelist)).content.decode()
    assert all(agent.name in page for agent in agents)  # each one offered in the sidebar
    for query in queries:
        assert '"system_prompt"' not in query["sql"].split(" FROM ")[0], query["sql"]


def test_runs_and_ledger_changelists_query_count_does_not_grow(
    admin_client, persistent_agent, stateless_agent, django_assert_max_num_queries
):
    def add(count):
        for i in range(count):
            agent = (persistent_agent, stateless_agent)[i % 2]
            run = make_run(agent)
            make_cost(agent, run=run)

    add(2)
    runs_url = reverse("admin:sessions_app_heartbeatrun_changelist")
    costs_url = reverse("admin:costs_app_costevent_changelist")
    count_queries(admin_client, runs_url)  # warm the per-process caches
    runs_small = count_queries(admin_client, runs_url)
    costs_small = count_queries(admin_client, costs_url)
    add(40)
    with django_assert_max_num_queries(runs_small):
        admin_client.get(runs_url)
    with django_assert_max_num_queries(costs_small):
        admin_client.get(costs_url)


def test_session_page_renders_the_conversation(admin_client, persistent_agent):
    run = make_run(persistent_agent)
    history = conversation(2, run_id=str(run.pk))
    history[1]["content"].append({"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "docs"}})
    history.append({"role": "user", "content": "Earlier turns, summarised.", "kind": "summary"})
    session = make_session(persistent_agent, history=history)
    make_cost(persistent_agent, session=session, run=run, cost_usd="0.0123")
    response = admin_client.get(change_url(session))
    assert response.status_code == 200
    page = response.content.decode()
    assert "turn 0: what next?" in page
    assert "turn 1: the answer." in page
    assert "tool call: search" in page
    assert "output_tokens: 20" in page
    assert "cost: $0.0123<" in page  # from the ledger, by the turn's run
    assert 'class="pc-kind">summary<' in page
    assert "Raw history JSON" in page
    assert f"?session={session.pk}" in page  # runs and cost events of this session
    assert reverse("admin:sessions_app_agentsession_export", args=[session.pk]) in page
    assert 'name="_save"' not in page  # never editable


def test_session_page_cannot_be_edited(admin_client, file_session):
    response = admin_client.post(change_url(file_session), {"status": "active", "message_count": "0"})
    assert response.status_code == 403
    file_session.refresh_from_db()
    assert file_session.message_count == 4


def test_history_containing_script_is_rendered_as_text(admin_client, persistent_agent):
    persistent_agent.name = "<b>Agent</b>"
    persistent_agent.save()
    history = [
        {"role": "user", "content": "<script>alert(1)</script>"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "<img src=x onerror=alert(2)>"}],
            "kind": "<i>x</i>",
        },
    ]
    session = make_session(persistent_agent, history=history)
    make_cost(persistent_agent, session=session)
    pages = {
        "session": admin_client.get(change_url(session)).content.decode(),
        "list": admin_client.get(reverse(CHANGELIST)).content.decode(),
        "costs": admin_client.get(reverse("admin:costs_app_costevent_report")).content.decode(),
    }
    page = pages["session"]
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page
    assert "<i>x</i>" not in page
    for name, text in pages.items():
        assert "<b>Agent</b>" not in text, name
        assert "&lt;b&gt;Agent&lt;/b&gt;" in text, name


def test_unreadable_history_is_an_error_on_the_page_not_a_500(admin_client, file_session):
    history_file(file_session).unlink()
    response = admin_client.get(change_url(file_session))
    assert response.status_code == 200
    page = response.content.decode()
    assert "The history cannot be read" in page and "missing" in page
    history_file(file_session).write_text("{not json")
    assert "corrupt" in admin_client.get(change_url(file_session)).content.decode()
    export = admin_client.get(reverse("admin:sessions_app_agentsession_export", args=[file_session.pk]))
    assert export.status_code == 302


def test_a_history_holding_a_lone_surrogate_is_shown_and_exported_not_a_500(admin_client, file_session):
    # Read by the json fallback (msgspec refuses it); UTF-8 cannot carry it out.
    path = history_file(file_session)
    path.write_text(path.read_text().replace("turn 1: the answer.", "turn 1: \\ud800 answer."))

    response = admin_client.get(change_url(file_session))

    assert response.status_code == 200
    assert "turn 1: \ufffd answer." in response.content.decode()
    export = admin_client.get(reverse("admin:sessions_app_agentsession_export", args=[file_session.pk]))
    assert export.status_code == 200
    assert json.loads(export.content)["history"][1]["content"][0]["text"] == "turn 1: \ud800 answer."


def test_export_downloads_the_session_and_its_history(admin_client, file_session):
    response = admin_client.get(reverse("admin:sessions_app_agentsession_export", args=[file_session.pk]))
    assert response.status_code == 200
    assert response["Content-Disposition"] == f'attachment; filename="{file_session.public_id}.json"'
    document = json.loads(response.content)
    assert document["session"]["id"] == file_session.public_id
    assert document["history"] == store_for(file_session).read(file_session)
    assert len(document["history"]) == 4


def test_bulk_delete_removes_rows_and_history_files(
    admin_client, persistent_agent, other_agent, django_capture_on_commit_callbacks
):
    doomed = [make_session(persistent_agent, history=conversation(3)) for _ in range(2)]
    doomed.append(make_session(other_agent, history=conversation(2), store=HistoryStore.DATABASE))
    kept = make_session(persistent_agent, history=conversation(2))
    files = [history_file(s) for s in doomed[:2]]
    assert all(f.exists() for f in files)
    data = {"action": "delete_selected", "_selected_action": [str(s.pk) for s in doomed]}
    confirm = admin_client.post(reverse(CHANGELIST), data)
    assert confirm.status_code == 200 and b"Are you sure" in confirm.content
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(reverse(CHANGELIST), {**data, "post": "yes"})
    assert response.status_code == 302
    assert not AgentSession.objects.filter(pk__in=[s.pk for s in doomed]).exists()
    assert not any(f.exists() for f in files)
    assert history_file(kept).exists()


def test_single_delete_removes_the_history_file(admin_client, file_session, django_capture_on_commit_callbacks):
    path = history_file(file_session)
    url = reverse("admin:sessions_app_agentsession_delete", args=[file_session.pk])
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(url, {"post": "yes"})
    assert response.status_code == 302
    assert not AgentSession.objects.filter(pk=file_session.pk).exists()
    assert not path.exists()


def test_expire_now_action(admin_client, persistent_agent):
    session = make_session(persistent_agent, history=[], status=SessionStatus.ACTIVE, unbilled_active_seconds=90)
    data = {"action": "expire_now", "_selected_action": [str(session.pk)]}
    response = admin_client.post(reverse(CHANGELIST), data, follow=True)
    assert "Expired 1 session(s)." in response.content.decode()
    session.refresh_from_db()
    assert session.status == SessionStatus.EXPIRED
    assert session.end_reason == "expired_by_operator"
    # Its active time is billed once: by the action, not again by a second one.
    admin_client.post(reverse(CHANGELIST), data)
    assert CostEvent.objects.get(kind=CostKind.SESSION_HOURS, session_id=session.id).session_seconds == 90


def test_clear_history_action_keeps_the_row(admin_client, file_session):
    data = {"action": "clear_history", "_selected_action": [str(file_session.pk)]}
    admin_client.post(reverse(CHANGELIST), data)
    file_session.refresh_from_db()
    assert file_session.message_count == 0
    assert store_for(file_session).read(file_session) == []
    assert history_file(file_session).exists()


def test_expire_and_clear_buttons_on_the_session_page(admin_client, persistent_agent):
    session = make_session(persistent_agent, history=conversation(2), status=SessionStatus.ACTIVE)
    page = admin_client.get(change_url(session)).content.decode()
    assert "Expire now" in page and "Clear history" in page
    expire = reverse("admin:sessions_app_agentsession_expire", args=[session.pk])
    assert admin_client.get(expire).status_code == 405  # POST only
    assert (
        admin_client.get(reverse("admin:sessions_app_agentsession_clear_history", args=[session.pk])).status_code == 405
    )
    AgentSession.objects.filter(pk=session.pk).update(unbilled_active_seconds=60)
    response = admin_client.post(expire, follow=True)
    assert f"Session {session.public_id} expired." in response.content.decode()
    assert CostEvent.objects.get(kind=CostKind.SESSION_HOURS, session_id=session.id).session_seconds == 60
    admin_client.post(reverse("admin:sessions_app_agentsession_clear_history", args=[session.pk]))
    session.refresh_from_db()
    assert (session.status, session.message_count) == (SessionStatus.EXPIRED, 0)


def test_purged_history_is_said_not_shown_as_empty(admin_client, persistent_agent):
    session = make_session(persistent_agent, history=conversation(2), store=HistoryStore.DATABASE)
    AgentSession.objects.filter(pk=session.pk).update(history=[], history_purged_at=timezone.now())
    page = admin_client.get(change_url(session)).content.decode()
    assert "removed by retention" in page


def test_images_are_described_not_dumped(admin_client, persistent_agent):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A" * 5000}}
    session = make_session(
        persistent_agent, history=[{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    )
    page = admin_client.get(change_url(session)).content.decode()
    assert "[image: image/png, 5000 base64 characters]" in page
    conversation_html = page.split('id="conversation"')[1].split("Raw history JSON")[0]
    assert "AAAAAAAAAA" not in conversation_html


def test_bad_filter_values_are_not_a_500(admin_client):
    for name in ("sessions_app_agentsession", "sessions_app_heartbeatrun", "costs_app_costevent"):
        response = admin_client.get(reverse(f"admin:{name}_changelist"), {"session": "not-a-uuid"})
        assert response.status_code in (200, 302), name


def test_session_page_query_count_does_not_grow_with_turns(admin_client, persistent_agent):
    run = make_run(persistent_agent)

    def queries(turns: int) -> int:
        session = make_session(persistent_agent, history=conversation(turns, run_id=str(run.pk)))
        with CaptureQueriesContext(connection) as captured:
            assert admin_client.get(change_url(session)).status_code == 200
        return len(captured)

    queries(1)  # warm the per-process caches (content types)
    assert queries(2) == queries(60)


def test_session_page_fetches_the_session_once(admin_client, persistent_agent, django_assert_max_num_queries):
    run = make_run(persistent_agent)
    session = make_session(persistent_agent, history=conversation(2, run_id=str(run.pk)), store=HistoryStore.DATABASE)
    make_cost(persistent_agent, session=session, run=run)
    admin_client.get(change_url(session))  # warm the per-process caches (content types)
    # The login's session and user, the session row, its history (deferred by the admin's
    # queryset), the ledger's cost per run, the compactions.
    with django_assert_max_num_queries(6) as captured:
        assert admin_client.get(change_url(session)).status_code == 200
    assert sum('"agent_sessions"."status"' in query["sql"] for query in captured.captured_queries) == 1


def test_compacted_turns_are_shown_archived_and_escaped(
    admin_client, persistent_agent, django_capture_on_commit_callbacks
):
    from sessions_app.models import SessionCompaction

    summary_pair = [
        {"role": "user", "content": "Summary of earlier conversation: the plan.", "kind": "summary", "seq": 4},
        {"role": "assistant", "content": "Understood. I will continue from here.", "kind": "summary", "seq": 5},
    ]
    session = make_session(persistent_agent, history=summary_pair + conversation(2))
    archived = [
        {"role": "user", "content": "<script>alert('archived')</script> first question", "seq": 0},
        {"role": "assistant", "content": [{"type": "text", "text": "first answer"}], "seq": 1},
    ]
    SessionCompaction.objects.create(
        session=session,
        kind="summarize",
        archived_messages=archived,
        messages_before=6,
        messages_after=4,
        tokens_before=90_000,
        tokens_after=12_000,
        summary="The plan, in short.",
        cost_usd="0.02",
    )
    page = admin_client.get(change_url(session)).content.decode()
    assert "Compactions (1)" in page
    assert "2 archived turns" in page and "first answer" in page
    assert 'pc-kind pc-archived">archived<' in page
    assert "90000 → 12000 tokens" in page
    assert "The plan, in short." in page
    assert "seq 4" in page and 'class="pc-kind">summary<' in page
    assert "<script>alert('archived')</script>" not in page
    assert "&lt;script&gt;alert(&#x27;archived&#x27;)&lt;/script&gt;" in page
    confirm = admin_client.get(reverse("admin:sessions_app_agentsession_delete", args=[session.pk])).content.decode()
    assert "1 session compaction" in confirm
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(reverse("admin:sessions_app_agentsession_delete", args=[session.pk]), {"post": "yes"})
    assert not SessionCompaction.objects.exists()


def test_session_page_says_when_its_last_summary_did_not_shrink_it(admin_client, persistent_agent):
    session = make_session(
        persistent_agent,
        history=conversation(1),
        compaction_error="compaction_not_shrinking",
        compaction_error_at=timezone.now(),
    )
    page = admin_client.get(change_url(session)).content.decode()
    assert "compaction_not_shrinking" in page


def test_compact_now_action_compacts_each_session_and_names_the_refused(admin_client, company, fake_anthropic):
    from tests.conftest import beat, context_agent

    talkative = context_agent(company, keep_recent_turns=1)
    for i in range(3):
        beat(talkative, f"step {i}: " + "x" * 400)
    quiet = context_agent(company, keep_recent_turns=1)
    beat(quiet, "only one turn")
    sessions = [AgentSession.objects.get(agent=agent) for agent in (talkative, quiet)]
    data = {"action": "compact_now", "_selected_action": [str(s.pk) for s in sessions]}

    page = admin_client.post(reverse(CHANGELIST), data, follow=True).content.decode()

    assert "Compacted 1 session(s)." in page
    assert f"Session {sessions[1].public_id}: nothing_to_compact" in page
    assert [AgentSession.objects.get(pk=s.pk).compaction_count for s in sessions] == [1, 0]
    assert CostEvent.objects.filter(kind=CostKind.COMPACTION, session_id=sessions[0].pk).count() == 1


def test_a_compaction_shows_each_fact_it_checked_with_pass_or_fail(admin_client, persistent_agent):
    from sessions_app.models import SessionCompaction

    session = make_session(persistent_agent, history=conversation(1))
    SessionCompaction.objects.create(
        session=session,
        kind="summarize",
        summary="Short.\n\nKept facts (pinned; carried verbatim because the summary left them out):\n- ACME-42",
        summary_attempts=2,
        facts=[
            {"text": "ACME-42", "source": "pin", "passed": False, "via": "kept_facts"},
            {"text": "https://ci.example.com/<b>", "source": "candidate", "passed": True, "via": "retry"},
            {"text": "/srv/app.py", "source": "candidate", "passed": False, "via": ""},
        ],
    )
    page = admin_client.get(change_url(session)).content.decode()
    assert "<summary>facts checked: 1 of 3 in the model's summary</summary>" in page
    assert "asked for again: a pinned fact was missing" in page
    assert page.count("<strong>fail</strong>") == 2
    assert "kept-facts block (verbatim)" in page and "dropped" in page
    assert "https://ci.example.com/&lt;b&gt;" in page


def test_a_session_page_shows_its_newest_compactions_however_many_it_has(admin_client, persistent_agent):
    from datetime import timedelta

    from sessions_app.models import SessionCompaction

    session = make_session(persistent_agent, history=conversation(1))
    start = timezone.now() - timedelta(days=1)
    shown = 20  # docs/operations.md
    SessionCompaction.objects.bulk_create(
        SessionCompaction(
            session=session,
            kind="summarize",
            created_at=start + timedelta(minutes=n),
            summary=f"Summary number {n}.",
            archived_messages=conversation(2, text=f"archived {n}"),
        )
        for n in range(shown + 5)
    )
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(change_url(session)).content.decode()
    assert f"the newest {shown} of {shown + 5}" in page
    assert f"Summary number {shown + 4}." in page and "Summary number 5." in page
    assert "Summary number 4." not in page and "archived 4 " not in page
    reads = [query["sql"] for query in queries if '"session_compactions"."archived_messages"' in query["sql"]]
    assert len(reads) == 1 and "LIMIT" in reads[0]


def test_compact_now_action_takes_a_place_under_the_cap_or_names_the_refusal(
    admin_client, settings, company, fake_anthropic
):
    from tests.conftest import beat, context_agent

    agents = [context_agent(company, keep_recent_turns=1) for _ in range(3)]
    for agent in agents:
        for i in range(3):
            beat(agent, f"step {i}: " + "x" * 400)
    settings.PAPERCLIP_MAX_CONCURRENT_RUNS = 1
    busy = make_run(agents[2], status=RunStatus.RUNNING)
    sessions = [AgentSession.objects.get(agent=agent) for agent in agents[:2]]
    sent = len(fake_anthropic.message_requests)
    data = {"action": "compact_now", "_selected_action": [str(s.pk) for s in sessions]}

    page = admin_client.post(reverse(CHANGELIST), data, follow=True).content.decode()

    assert "Compacted 0 session(s)." in page
    assert all(f"Session {s.public_id}: run_cap_reached" in page for s in sessions)
    assert fake_anthropic.message_requests[sent:] == []
    HeartbeatRun.objects.filter(pk=busy.pk).update(status=RunStatus.SUCCEEDED)
    page = admin_client.post(reverse(CHANGELIST), data, follow=True).content.decode()
    assert "Compacted 2 session(s)." in page  # one at a time: each took the free place and gave it back


def test_compact_now_action_names_a_session_whose_history_is_not_turns_and_compacts_the_others(
    admin_client, company, fake_anthropic
):
    from tests.conftest import beat, context_agent

    talkative = context_agent(company, keep_recent_turns=1)
    for i in range(3):
        beat(talkative, f"step {i}: " + "x" * 400)
    history = conversation(12)
    history.insert(3, 42)  # the session's page shows it as an unreadable turn
    damaged = make_session(context_agent(company), history=history, status=SessionStatus.ACTIVE)
    sessions = [damaged, AgentSession.objects.get(agent=talkative)]
    assert "unreadable turn" in admin_client.get(change_url(damaged)).content.decode()
    data = {"action": "compact_now", "_selected_action": [str(s.pk) for s in sessions]}

    response = admin_client.post(reverse(CHANGELIST), data, follow=True)

    assert [(m.level_tag, str(m)) for m in response.context["messages"]] == [
        (
            "warning",
            f"Session {damaged.public_id}: history_malformed: The session's history cannot be compacted: "
            "entry 4 is not a turn (a JSON number, not an object).",
        ),
        ("success", "Compacted 1 session(s)."),
    ]
    assert [AgentSession.objects.get(pk=s.pk).compaction_count for s in sessions] == [0, 1]


def test_compact_now_action_names_a_session_whose_agent_configuration_is_not_an_object(
    admin_client, company, fake_anthropic
):
    from tests.conftest import beat, context_agent

    talkative = context_agent(company, keep_recent_turns=1)
    for i in range(3):
        beat(talkative, f"step {i}: " + "x" * 400)
    broken = context_agent(company, keep_recent_turns=1)
    damaged = make_session(broken, history=conversation(12), status=SessionStatus.ACTIVE)
    Agent.objects.filter(pk=broken.pk).update(adapter_config=["not", "an", "object"])  # written by SQL
    sessions = [damaged, AgentSession.objects.get(agent=talkative)]
    data = {"action": "compact_now", "_selected_action": [str(s.pk) for s in sessions]}

    response = admin_client.post(reverse(CHANGELIST), data, follow=True)

    assert response.status_code == 200
    assert [(m.level_tag, str(m)) for m in response.context["messages"]] == [
        (
            "warning",
            f"Session {damaged.public_id}: agent_config_invalid: The agent's stored configuration is not valid "
            "(adapter_config: must be a JSON object): correct it (PATCH the agent, or its page in the admin).",
        ),
        ("success", "Compacted 1 session(s)."),
    ]
    assert [AgentSession.objects.get(pk=s.pk).compaction_count for s in sessions] == [0, 1]
    assert not HeartbeatRun.objects.filter(agent=broken).exists()
