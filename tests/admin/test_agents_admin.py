"""The agents admin: validated JSON configuration, pause/resume, heartbeats, deletes."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone
from django_q.models import Schedule

from sessions_app import services
from sessions_app.models import (
    Agent,
    AgentSession,
    AgentStatus,
    HeartbeatRun,
    HistoryStore,
    RunStatus,
    RunTrigger,
)
from sessions_app.schedules import schedule_name
from sessions_app.stores import STORES
from tests.admin.conftest import conversation, make_run, make_session
from tests.conftest import catalogue_stored

ADD = "admin:sessions_app_agent_add"
CHANGELIST = "admin:sessions_app_agent_changelist"


def agent_form(company, **overrides):
    data = {
        "company": str(company.pk),
        "name": "Writer",
        "system_prompt": "Write.",
        "adapter_type": "claude-code",
        "adapter_config": '{"model": "claude-opus-4-5", "session_mode": "persistent"}',
        # the inlines still post their management forms
        "pins-TOTAL_FORMS": "0",
        "pins-INITIAL_FORMS": "0",
        "sessions-TOTAL_FORMS": "0",
        "sessions-INITIAL_FORMS": "0",
        "runs-TOTAL_FORMS": "0",
        "runs-INITIAL_FORMS": "0",
    }
    data.update(overrides)
    return data


def test_valid_configuration_is_saved_with_defaults(admin_client, company):
    response = admin_client.post(reverse(ADD), agent_form(company))
    assert response.status_code == 302, response.context["adminform"].form.errors
    agent = Agent.objects.get(name="Writer")
    assert agent.adapter_config["session_ttl_hours"] == 24
    assert agent.is_persistent


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"session_mode": "forever"}', "session_mode: must be"),
        ('{"session_ttl_hours": -1}', "session_ttl_hours: must be a positive number"),
        ('{"sesion_mode": "persistent"}', "sesion_mode: unknown setting"),
        ('["not", "an", "object"]', "must be a JSON object"),
        ('{"model": "claude-opus-4-5",}', "Enter a valid JSON"),
        # PostgreSQL refuses both in jsonb: a field error, not a DataError at save.
        ('{"model": "claude\\u0000opus"}', "model: must not contain NUL characters or invalid Unicode"),
        ('{"heartbeat_task": "go \\ud800"}', "heartbeat_task: must not contain NUL characters or invalid Unicode"),
        ("[" * 100_000, "Enter a valid JSON"),
    ],
    ids=["bad-mode", "negative-ttl", "unknown-key", "not-an-object", "trailing-comma", "nul", "surrogate", "deep"],
)
def test_bad_configuration_is_a_field_error_not_a_500(admin_client, company, config, message):
    response = admin_client.post(reverse(ADD), agent_form(company, adapter_config=config))
    assert response.status_code == 200
    form = response.context["adminform"].form
    assert "adapter_config" in form.errors
    assert any(message in error for error in form.errors["adapter_config"]), form.errors
    assert not form.non_field_errors()
    assert message in response.content.decode().replace("&#x27;", "'")
    assert not Agent.objects.filter(name="Writer").exists()


def test_unknown_adapter_type_is_a_field_error(admin_client, company):
    response = admin_client.post(reverse(ADD), agent_form(company, adapter_type="gpt-shell"))
    assert response.status_code == 200
    assert "adapter_type" in response.context["adminform"].form.errors


def test_change_page_shows_configuration_as_indented_json(admin_client, persistent_agent):
    page = admin_client.get(reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])).content.decode()
    assert "&quot;session_mode&quot;: &quot;persistent&quot;" in page
    assert "Run a heartbeat now" in page


def test_an_agent_stays_in_its_company_as_in_the_api(admin_client, persistent_agent, other_company):
    # Moved, it left its sessions, runs, budget and memory in the old company.
    session = make_session(persistent_agent, history=conversation(2))
    url = reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])
    data = agent_form(
        other_company,
        name="Renamed",
        adapter_config='{"model": "claude-opus-4-5", "session_mode": "persistent", "session_ttl_hours": 24}',
    )

    response = admin_client.post(url, data)

    assert response.status_code == 302
    persistent_agent.refresh_from_db()
    assert (persistent_agent.name, persistent_agent.company_id) == ("Renamed", session.company_id)
    assert 'name="company"' not in admin_client.get(url).content.decode()
    assert 'name="company"' in admin_client.get(reverse(ADD)).content.decode()


def test_inlines_show_only_the_newest_ten(admin_client, persistent_agent):
    sessions = [make_session(persistent_agent, history=[], store=HistoryStore.DATABASE) for _ in range(12)]
    runs = [make_run(persistent_agent) for _ in range(12)]
    response = admin_client.get(reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk]))
    formsets = {f.formset.prefix: f.formset for f in response.context["inline_admin_formsets"]}
    assert len(formsets["sessions"].forms) == 10
    assert len(formsets["runs"].forms) == 10
    shown = {form.instance.pk for form in formsets["sessions"].forms}
    newest = {s.pk for s in sorted(sessions, key=lambda s: s.last_used, reverse=True)[:10]}
    assert shown == newest
    assert {form.instance.pk for form in formsets["runs"].forms} <= {r.pk for r in runs}


def test_pause_and_resume_actions(admin_client, persistent_agent):
    data = {"action": "pause_agents", "_selected_action": [str(persistent_agent.pk)]}
    admin_client.post(reverse(CHANGELIST), data)
    persistent_agent.refresh_from_db()
    assert persistent_agent.status == AgentStatus.PAUSED
    admin_client.post(reverse(CHANGELIST), {**data, "action": "resume_agents"})
    persistent_agent.refresh_from_db()
    assert persistent_agent.status == AgentStatus.ACTIVE


def queued_run_ids() -> list[str]:
    """Run ids the engine handed to the task queue (the ORM broker), in order."""
    from django_q.models import OrmQ
    from django_q.signing import SignedPackage

    return [SignedPackage.loads(row.payload)["args"][0] for row in OrmQ.objects.order_by("id")]


def test_run_a_heartbeat_now_from_the_agent_page(admin_client, persistent_agent, django_capture_on_commit_callbacks):
    url = reverse("admin:sessions_app_agent_heartbeat", args=[persistent_agent.pk])
    assert admin_client.get(url).status_code == 200
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(url, {"task": "Check the queue."}, follow=True)
    run = HeartbeatRun.objects.get(agent=persistent_agent)
    assert (run.task, run.trigger, run.status) == ("Check the queue.", RunTrigger.ADMIN, "queued")
    assert queued_run_ids() == [str(run.pk)]  # handed to the task cluster by the real engine
    assert response.redirect_chain[-1][0] == reverse("admin:sessions_app_heartbeatrun_change", args=[run.pk])
    assert reverse("admin:sessions_app_heartbeatrun_change", args=[run.pk]) in response.content.decode()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("way", ["page", "action"])
def test_a_task_queue_that_refuses_the_run_is_a_message_and_the_run_stays_recorded(admin_client, persistent_agent, way):
    from tests.conftest import task_queue_down

    with task_queue_down():
        if way == "page":
            url = reverse("admin:sessions_app_agent_heartbeat", args=[persistent_agent.pk])
            response = admin_client.post(url, {"task": "Look now."}, follow=True)
        else:
            data = {"action": "run_heartbeat_now", "_selected_action": [str(persistent_agent.pk)]}
            response = admin_client.post(reverse(CHANGELIST), data, follow=True)

    assert response.status_code == 200
    run = HeartbeatRun.objects.get(agent=persistent_agent)
    assert run.status == RunStatus.QUEUED  # recorded: the maintenance pass hands it on later
    assert [(m.level_tag, str(m)) for m in response.context["messages"]] == [
        ("error", f"Persistent: The task queue is unavailable; run {run.pk} is recorded but not started.")
    ]


def test_run_a_heartbeat_action_reports_refusals(
    admin_client, company, persistent_agent, stateless_agent, django_capture_on_commit_callbacks
):
    services.agent_pause(agent=stateless_agent)
    spent = Agent.objects.create(company=company, name="Spent", adapter_config={"model": "claude-opus-4-5"})
    services.agent_pause(agent=spent, reason="budget")
    selected = [str(persistent_agent.pk), str(stateless_agent.pk), str(spent.pk)]
    data = {"action": "run_heartbeat_now", "_selected_action": selected}

    with django_capture_on_commit_callbacks(execute=True):
        page = admin_client.post(reverse(CHANGELIST), data, follow=True).content.decode()

    assert "Persistent: heartbeat queued as" in page
    # The engine's own refusals, word for word.
    assert "Stateless: heartbeat refused (agent_paused): The agent is paused (manual); resume it first." in page
    assert (
        "Spent: heartbeat refused (budget_exceeded): The agent is paused: its budget is spent. "
        "Raise the budget to resume." in page
    )
    (run,) = HeartbeatRun.objects.all()
    assert (run.agent_id, run.trigger) == (persistent_agent.pk, RunTrigger.ADMIN)
    assert queued_run_ids() == [str(run.pk)]


def test_deleting_agents_removes_their_history_files(
    admin_client, persistent_agent, stateless_agent, django_capture_on_commit_callbacks
):
    session = make_session(persistent_agent, history=conversation(2))
    path = STORES[HistoryStore.FILE].path_for(session)
    assert path.exists()
    data = {"action": "delete_selected", "_selected_action": [str(persistent_agent.pk)], "post": "yes"}
    with django_capture_on_commit_callbacks(execute=True):
        assert admin_client.post(reverse(CHANGELIST), data).status_code == 302
    assert not Agent.objects.filter(pk=persistent_agent.pk).exists()
    assert not AgentSession.objects.filter(pk=session.pk).exists()
    assert not path.exists()
    other = make_session(stateless_agent, history=conversation(2))
    other_path = STORES[HistoryStore.FILE].path_for(other)
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(reverse("admin:sessions_app_agent_delete", args=[stateless_agent.pk]), {"post": "yes"})
    assert not Agent.objects.filter(pk=stateless_agent.pk).exists()
    assert not other_path.exists()


def test_retire_action_keeps_runs(admin_client, persistent_agent):
    run = make_run(persistent_agent)
    make_session(persistent_agent, history=[], store=HistoryStore.DATABASE)
    data = {"action": "retire_agents", "_selected_action": [str(persistent_agent.pk)]}
    admin_client.post(reverse(CHANGELIST), data)
    persistent_agent.refresh_from_db()
    assert persistent_agent.status == AgentStatus.DELETED
    assert HeartbeatRun.objects.filter(pk=run.pk).exists()
    assert not AgentSession.objects.filter(agent=persistent_agent).exists()


def test_run_a_heartbeat_now_really_runs_it(
    admin_client, persistent_agent, fake_anthropic, monkeypatch, django_capture_on_commit_callbacks
):
    from django_q.conf import Conf

    monkeypatch.setattr(Conf, "SYNC", True)  # the cluster's work, inline
    url = reverse("admin:sessions_app_agent_heartbeat", args=[persistent_agent.pk])
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(url, {"task": "Say hello to the operator."})
    run = HeartbeatRun.objects.get(agent=persistent_agent)
    assert run.trigger == RunTrigger.ADMIN
    assert run.status == "succeeded", run.error
    session = AgentSession.objects.get(agent=persistent_agent)
    page = admin_client.get(reverse("admin:sessions_app_agentsession_change", args=[session.pk])).content.decode()
    assert "Say hello to the operator." in page
    assert run.output[:40] in page


def test_delete_confirmation_counts_instead_of_listing_every_session(admin_client, persistent_agent):
    for _ in range(3):
        make_session(persistent_agent, history=conversation(2), store=HistoryStore.DATABASE)
    make_run(persistent_agent)
    page = admin_client.get(reverse("admin:sessions_app_agent_delete", args=[persistent_agent.pk])).content.decode()
    assert "3 agent sessions" in page and "1 heartbeat run" in page
    assert "sess_" not in page


def test_deleting_a_company_removes_its_agents_history_files(
    admin_client, company, persistent_agent, other_agent, django_capture_on_commit_callbacks
):
    from costs_app.models import CostEvent
    from sessions_app.models import Company
    from tests.admin.conftest import make_cost

    session = make_session(persistent_agent, history=conversation(2))
    kept = make_session(other_agent, history=conversation(2))
    make_cost(persistent_agent, session=session)
    path = STORES[HistoryStore.FILE].path_for(session)
    data = {"action": "delete_selected", "_selected_action": [str(company.pk)]}
    confirm = admin_client.post(reverse("admin:sessions_app_company_changelist"), data).content.decode()
    assert "1 agent session" in confirm
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(reverse("admin:sessions_app_company_changelist"), {**data, "post": "yes"})
    assert not Company.objects.filter(pk=company.pk).exists()
    assert not Agent.objects.filter(pk=persistent_agent.pk).exists()
    assert not path.exists()
    assert STORES[HistoryStore.FILE].path_for(kept).exists()
    assert CostEvent.objects.filter(agent_id=persistent_agent.pk).count() == 1  # the ledger stays


def test_saving_an_interval_schedules_the_agent(admin_client, persistent_agent):
    from django_q.models import Schedule

    from sessions_app.schedules import schedule_name

    url = reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])
    config = '{"model": "claude-opus-4-5", "session_mode": "persistent", "heartbeat_interval_minutes": 15}'
    response = admin_client.post(url, agent_form(persistent_agent.company, name="Persistent", adapter_config=config))
    assert response.status_code == 302
    assert Schedule.objects.get(name=schedule_name(persistent_agent.pk)).minutes == 15


def test_agent_page_query_count_does_not_grow_with_sessions_and_runs(admin_client, persistent_agent):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    url = reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert admin_client.get(url).status_code == 200
        return len(captured)

    make_session(persistent_agent, history=conversation(2), store=HistoryStore.DATABASE)
    make_run(persistent_agent)
    queries()  # warm the per-process caches (content types)
    few = queries()
    for _ in range(12):
        make_session(persistent_agent, history=conversation(2), store=HistoryStore.DATABASE)
        make_run(persistent_agent)
    assert queries() == few


@pytest.fixture
def listed_commands_authenticated(settings, tmp_path):
    from tests.conftest import listed_commands

    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_PROCESS_COMMANDS = listed_commands(tmp_path)


def test_staff_choose_a_listed_command_for_a_process_agent(admin_client, company, listed_commands_authenticated):
    page = admin_client.get(reverse(ADD)).content.decode()
    assert "listed commands: reporter" in page

    config = '{"command": "reporter", "args": ["--verbose"]}'
    response = admin_client.post(reverse(ADD), agent_form(company, adapter_type="process", adapter_config=config))

    assert response.status_code == 302, response.context["adminform"].form.errors
    assert Agent.objects.get(name="Writer").adapter_config["command"] == "reporter"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"command": ["sh", "-c", "id"]}', "command: a command list runs only in local_trusted mode"),
        ('{"command": "reporter", "args": ["--force"]}', "args: '--force' is not allowed for 'reporter'"),
    ],
)
def test_staff_cannot_widen_the_command_list(admin_client, company, listed_commands_authenticated, config, message):
    response = admin_client.post(reverse(ADD), agent_form(company, adapter_type="process", adapter_config=config))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["adapter_config"]
    assert any(message in error for error in errors), errors
    assert not Agent.objects.filter(name="Writer").exists()


def test_the_agent_page_shows_the_next_five_wakes_in_the_agents_zone_and_utc(admin_client, persistent_agent):
    from sessions_app.schedules import agent_schedule_sync

    config = {**persistent_agent.adapter_config, "heartbeat_cron": "30 2 * * *", "heartbeat_timezone": "Europe/Berlin"}
    persistent_agent.adapter_config = config
    persistent_agent.save()
    agent_schedule_sync(agent=persistent_agent)
    page = admin_client.get(reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])).content.decode()
    wakes = re.findall(r'<span class="next-wake">(.*?) <span class="quiet">\((.*?) UTC\)</span>', page)
    assert len(wakes) == 5
    for local, in_utc in wakes:
        assert re.fullmatch(r"\w{3} \d{4}-\d\d-\d\d 02:30 CES?T", local), local
        assert in_utc.endswith(("00:30", "01:30")), in_utc


def test_an_interval_agent_page_shows_its_wakes_and_a_paused_one_says_none(admin_client, persistent_agent):
    from sessions_app.schedules import agent_schedule_sync

    persistent_agent.adapter_config = {**persistent_agent.adapter_config, "heartbeat_interval_minutes": 60}
    persistent_agent.save()
    agent_schedule_sync(agent=persistent_agent)
    url = reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])
    assert admin_client.get(url).content.decode().count('class="next-wake"') == 5
    Schedule.objects.filter(name=schedule_name(persistent_agent.pk)).update(
        next_run=timezone.now() - timedelta(hours=3)
    )
    page = admin_client.get(url).content.decode()
    assert page.count('class="next-wake"') == 5
    assert page.count(": due, waiting for the task cluster") == 1  # fired once, not replayed
    services.agent_pause(agent=persistent_agent)
    assert "none: the agent is paused" in admin_client.get(url).content.decode()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"model": "claude-opus-4-5", "heartbeat_cron": "0 9 * *"}', "heartbeat_cron: must have 5 fields"),
        (
            '{"model": "claude-opus-4-5", "heartbeat_cron": "0 9 * * *", "heartbeat_timezone": "Berlin"}',
            "heartbeat_timezone: must be an IANA time zone",
        ),
    ],
)
def test_a_bad_cron_or_zone_is_a_field_error_in_the_admin(admin_client, company, config, message):
    response = admin_client.post(reverse(ADD), agent_form(company, adapter_config=config))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["adapter_config"]
    assert any(message in error for error in errors), errors
    assert not Agent.objects.filter(name="Writer").exists()


def test_the_agent_list_and_page_show_the_back_off(admin_client, persistent_agent):
    persistent_agent.adapter_config = {
        **persistent_agent.adapter_config,
        "heartbeat_interval_minutes": 30,
        "backoff_after_runs": 2,
    }
    persistent_agent.save()
    Agent.objects.filter(pk=persistent_agent.pk).update(idle_streak=3)  # as the engine counts it

    listing = admin_client.get(reverse("admin:sessions_app_agent_changelist")).content.decode()
    page = admin_client.get(reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])).content.decode()

    for html in (listing, page):
        assert '<strong class="backoff">x4</strong>: every 120 min instead of 30' in html
        assert "3 run(s) in a row without work" in html


def test_the_page_of_a_leap_day_cron_agent_backed_off_far_shows_the_wakes_that_exist(admin_client, persistent_agent):
    """x512 of `0 0 29 2 *` runs past the year 9999 within five wakes (before: a 500)."""
    persistent_agent.adapter_config = {
        **persistent_agent.adapter_config,
        "heartbeat_cron": "0 0 29 2 *",
        "backoff_after_runs": 1,
        "backoff_max_factor": 1024,
    }
    persistent_agent.save()
    Agent.objects.filter(pk=persistent_agent.pk).update(idle_streak=9)  # x512, as the engine counts it

    response = admin_client.get(reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk]))

    assert response.status_code == 200
    page = response.content.decode()
    assert '<strong class="backoff">x512</strong>' in page
    assert 1 <= page.count('class="next-wake"') < 5


def pin_form(agent, text: str) -> dict:
    return agent_form(
        agent.company,
        name=agent.name,
        adapter_config='{"model": "claude-opus-4-5", "session_mode": "persistent"}',
        **{"pins-TOTAL_FORMS": "1", "pins-0-text": text, "pins-0-agent": str(agent.pk)},
    )


def test_an_operator_pins_a_fact_on_the_agent_page(admin_client, persistent_agent):
    from sessions_app.models import PinnedFact

    url = reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])
    response = admin_client.post(url, pin_form(persistent_agent, "  Never deploy on Fridays "))
    assert response.status_code == 302, response.context["inline_admin_formsets"][0].formset.errors
    assert list(PinnedFact.objects.filter(agent=persistent_agent).values_list("text", flat=True)) == [
        "Never deploy on Fridays"
    ]
    assert "Never deploy on Fridays" in admin_client.get(url).content.decode()


@pytest.mark.parametrize("text", ["a\x00b", "x" * 501])
def test_a_bad_pin_is_a_field_error_in_the_admin(admin_client, persistent_agent, text):
    from sessions_app.models import PinnedFact

    url = reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])
    response = admin_client.post(url, pin_form(persistent_agent, text))
    assert response.status_code == 200
    (errors,) = response.context["inline_admin_formsets"][0].formset.errors
    assert "text" in errors
    assert not PinnedFact.objects.exists()


def test_the_admin_keeps_to_the_limit_of_pinned_facts_whatever_the_post_says(admin_client, persistent_agent):
    from sessions_app.models import MAX_PINS_PER_AGENT, PinnedFact

    url = reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])
    PinnedFact.objects.bulk_create(
        PinnedFact(agent=persistent_agent, text=f"kept {n}") for n in range(MAX_PINS_PER_AGENT - 2)
    )
    # The page offers two more forms; a post may carry any number, and leave the pins out.
    data = pin_form(persistent_agent, "new 0")
    data.update({"pins-TOTAL_FORMS": "3", "pins-1-text": "new 1", "pins-2-text": "new 2"})

    response = admin_client.post(url, data)

    assert response.status_code == 200
    assert response.context["inline_admin_formsets"][0].formset.non_form_errors() == [
        f"An agent has at most {MAX_PINS_PER_AGENT} pinned facts: this would make {MAX_PINS_PER_AGENT + 1}. "
        "Delete some first."
    ]
    assert PinnedFact.objects.filter(agent=persistent_agent).count() == MAX_PINS_PER_AGENT - 2
    # Up to the limit, they are saved.
    del data["pins-2-text"]
    data["pins-TOTAL_FORMS"] = "2"
    assert admin_client.post(url, data).status_code == 302
    assert PinnedFact.objects.filter(agent=persistent_agent).count() == MAX_PINS_PER_AGENT


def test_a_model_the_catalogue_does_not_have_is_a_field_error_with_close_matches(admin_client, company):
    catalogue_stored()
    response = admin_client.post(reverse(ADD), agent_form(company, adapter_config='{"model": "claude-haiku-5-6"}'))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["adapter_config"]
    assert any("model: unknown model 'claude-haiku-5-6'" in error and "'claude-haiku-5-5'" in error for error in errors)
    assert not Agent.objects.filter(name="Writer").exists()


def test_the_agent_page_says_its_model_is_deprecated_and_when_it_retires(admin_client, persistent_agent):
    catalogue_stored()  # claude-opus-4-5: deprecated, retires on 2027-02-01
    page = admin_client.get(reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])).content.decode()
    # The message at the top of the page, and the model field.
    assert page.lower().count("claude-opus-4-5 is deprecated and retires on 2027-02-01") == 2
    assert "context window 200,000 tokens" in page


def test_the_agent_list_shows_each_agents_model_under_a_model_heading(admin_client, persistent_agent, other_agent):
    from django.contrib.admin.templatetags.admin_list import result_headers

    response = admin_client.get(reverse(CHANGELIST))
    page = response.content.decode()
    headings = [str(header["text"]) for header in result_headers(response.context["cl"])]
    assert "model" in headings, headings
    assert "Agent" not in headings, headings
    assert '<td class="field-agent_model">claude-opus-4-5</td>' in page
    assert '<td class="field-agent_model">claude-haiku-4-5</td>' in page


def test_the_agent_page_shows_run_costs_and_session_totals_by_one_rule(admin_client, persistent_agent):
    from decimal import Decimal

    make_session(persistent_agent, history=[], store=HistoryStore.DATABASE, total_cost_usd=Decimal("0.0123"))
    make_run(persistent_agent, cost_usd=Decimal("0.0123"))
    make_run(persistent_agent, cost_usd=Decimal("0.00004"))

    page = admin_client.get(reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])).content.decode()

    assert page.count("<p>0.0123</p>") == 2, re.findall(r"<p>[0-9.]+</p>", page)
    assert "<p>0.00004</p>" in page
    assert "0.0123000000" not in page


@pytest.mark.parametrize("view", ["add", "change"])
def test_a_json_integer_longer_than_python_converts_is_a_field_error_not_a_500(admin_client, persistent_agent, view):
    # 4300 digits is Python's limit for int(str) (sys.get_int_max_str_digits).
    config = '{"session_ttl_hours": ' + "9" * 4301 + "}"
    url = reverse(ADD) if view == "add" else reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])
    response = admin_client.post(url, agent_form(persistent_agent.company, adapter_config=config))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["adapter_config"]
    assert errors == ["Enter a valid JSON: a number has more than 4300 digits."]
    assert "9" * 4301 in response.content.decode()  # the text comes back as typed, to correct
    assert Agent.objects.count() == 1
    persistent_agent.refresh_from_db()
    assert persistent_agent.adapter_config["session_ttl_hours"] == 24


def test_a_refused_change_describes_the_saved_configuration_not_the_posted_one(admin_client, persistent_agent):
    # A lone surrogate cannot go out in a UTF-8 page: the read-only "model" line showed the
    # posted model, and the page was a 500.
    url = reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])
    config = '{"model": "claude-opus-4-5\\ud800", "session_mode": "persistent"}'

    response = admin_client.post(url, agent_form(persistent_agent.company, adapter_config=config))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["adapter_config"]
    assert errors == ["model: must not contain NUL characters or invalid Unicode"]
    page = response.content.decode()
    assert '"readonly">claude-opus-4-5: ' in page  # the saved model, described
    assert "claude-opus-4-5\\ud800" in page  # the posted text, escaped, to correct
    persistent_agent.refresh_from_db()
    assert persistent_agent.adapter_config["model"] == "claude-opus-4-5"


def messages_of(response) -> list[tuple[str, str]]:
    return [(message.level_tag, str(message)) for message in response.context["messages"]]


def test_pause_and_resume_report_only_the_agents_they_changed(admin_client, company, persistent_agent, stateless_agent):
    retired = Agent.objects.create(company=company, name="Retired", adapter_config={})
    services.agent_delete(agent=retired, now=timezone.now())
    paused = Agent.objects.create(company=company, name="Resting", adapter_config={})
    services.agent_pause(agent=paused)
    everyone = [str(agent.pk) for agent in (persistent_agent, stateless_agent, retired, paused)]

    response = admin_client.post(
        reverse(CHANGELIST), {"action": "pause_agents", "_selected_action": everyone}, follow=True
    )
    assert messages_of(response) == [
        ("success", "Paused 2 agent(s)."),
        ("warning", "Not paused, as not active: Resting (paused), Retired (deleted)."),
    ]

    response = admin_client.post(
        reverse(CHANGELIST), {"action": "resume_agents", "_selected_action": everyone}, follow=True
    )
    assert messages_of(response) == [
        ("success", "Resumed 3 agent(s)."),
        ("warning", "Not resumed, as not paused: Retired (deleted)."),
    ]
    # Nothing changed: no count of agents that were not paused at all.
    response = admin_client.post(
        reverse(CHANGELIST), {"action": "pause_agents", "_selected_action": [str(retired.pk)]}, follow=True
    )
    assert messages_of(response) == [("warning", "Not paused, as not active: Retired (deleted).")]
    assert Agent.objects.get(pk=retired.pk).status == AgentStatus.DELETED


def agent_with_stored_config(company, config, *, name: str = "Stale") -> Agent:
    """An agent saved valid whose row now holds `config`, as a tzdata upgrade that dropped
    its zone, SQL or an older version leaves it: validation would refuse it now."""
    agent = Agent.objects.create(company=company, name=name, adapter_config={"model": "claude-opus-4-5"})
    Agent.objects.filter(pk=agent.pk).update(adapter_config=config)
    agent.refresh_from_db()
    return agent


def page_text(response) -> str:
    return response.content.decode().replace("&#x27;", "'")


def test_an_agent_whose_zone_is_gone_shows_the_problem_in_the_list_and_on_its_page(admin_client, persistent_agent):
    gone = agent_with_stored_config(
        persistent_agent.company, {"heartbeat_cron": "0 9 * * 1-5", "heartbeat_timezone": "Nowhere/Gone"}
    )
    problem = (
        "invalid configuration: heartbeat_timezone must be an IANA time zone name such as 'Europe/Berlin' "
        "or 'UTC', got 'Nowhere/Gone'"
    )

    listing = admin_client.get(reverse(CHANGELIST))
    assert listing.status_code == 200
    assert f'<strong class="config-invalid" style="color:#ba2121">down: {problem}</strong>' in page_text(listing)
    assert '<td class="field-agent_model">claude-opus-4-5</td>' in listing.content.decode()  # the others listed

    url = reverse("admin:sessions_app_agent_change", args=[gone.pk])
    page = admin_client.get(url)
    assert page.status_code == 200
    assert f"unknown: {problem}" in page_text(page)
    assert (
        "warning",
        f"The stored configuration of this agent no longer validates ({problem}): "
        "correct it below and save, or delete the agent.",
    ) in messages_of(page)

    # Paused and resumed as any agent; resumed, it says it will not wake.
    selected = {"_selected_action": [str(gone.pk)]}
    admin_client.post(reverse(CHANGELIST), {"action": "pause_agents", **selected})
    response = admin_client.post(reverse(CHANGELIST), {"action": "resume_agents", **selected}, follow=True)
    assert messages_of(response)[-1] == (
        "warning",
        "Resumed, but not woken by their schedule until their configuration is corrected: Stale.",
    )
    assert Agent.objects.get(pk=gone.pk).status == AgentStatus.ACTIVE
    assert not Schedule.objects.filter(name=schedule_name(gone.pk)).exists()

    # The operator corrects it on its page, and it is scheduled again.
    corrected = '{"model": "claude-opus-4-5", "heartbeat_cron": "0 9 * * 1-5", "heartbeat_timezone": "Europe/Berlin"}'
    response = admin_client.post(url, agent_form(gone.company, name="Stale", adapter_config=corrected))
    assert response.status_code == 302, response.context["adminform"].form.errors
    assert Schedule.objects.filter(name=schedule_name(gone.pk)).count() == 1
    assert "config-invalid" not in admin_client.get(reverse(CHANGELIST)).content.decode()


def test_a_claude_code_agent_whose_stored_workspace_is_no_path_can_be_seen_and_corrected(admin_client, company):
    agent = Agent.objects.create(
        company=company, name="Coder", adapter_config={"model": "claude-opus-4-5", "runtime": "cli"}
    )
    Agent.objects.filter(pk=agent.pk).update(
        adapter_config={"model": "claude-opus-4-5", "runtime": "cli", "workspace": 5}
    )
    url = reverse("admin:sessions_app_agent_change", args=[agent.pk])

    response = admin_client.get(url)

    assert response.status_code == 200
    assert "unknown: the stored workspace is not a path (5)" in response.content.decode()
    config = '{"model": "claude-opus-4-5", "runtime": "cli"}'
    assert admin_client.post(url, agent_form(company, name="Coder", adapter_config=config)).status_code == 302
    agent.refresh_from_db()
    assert "workspace" not in agent.adapter_config


def test_an_agent_whose_configuration_is_not_an_object_can_be_seen_corrected_and_deleted(
    admin_client, persistent_agent, django_capture_on_commit_callbacks
):
    broken = agent_with_stored_config(persistent_agent.company, [1])
    url = reverse("admin:sessions_app_agent_change", args=[broken.pk])
    not_acted = (
        "error",
        "Not {}, as their stored configuration is not a JSON object (correct it on the agent's page, "
        "or delete the agent): Stale.",
    )

    listing = admin_client.get(reverse(CHANGELIST))
    assert listing.status_code == 200
    assert "down: invalid configuration: not a JSON object" in page_text(listing)
    page = admin_client.get(url)
    assert page.status_code == 200
    assert "unknown: invalid configuration: not a JSON object" in page_text(page)

    heartbeat = admin_client.get(reverse("admin:sessions_app_agent_heartbeat", args=[broken.pk]), follow=True)
    assert heartbeat.redirect_chain[-1][0] == url
    assert (not_acted[0], not_acted[1].format("started")) in messages_of(heartbeat)
    for action, verb in [("pause_agents", "paused"), ("retire_agents", "retired"), ("run_heartbeat_now", "started")]:
        response = admin_client.post(
            reverse(CHANGELIST), {"action": action, "_selected_action": [str(broken.pk)]}, follow=True
        )
        assert (not_acted[0], not_acted[1].format(verb)) in messages_of(response)
    assert Agent.objects.get(pk=broken.pk).status == AgentStatus.ACTIVE
    assert not HeartbeatRun.objects.exists()

    response = admin_client.post(url, agent_form(broken.company, name="Stale"))
    assert response.status_code == 302, response.context["adminform"].form.errors
    assert Agent.objects.get(pk=broken.pk).adapter_config["session_mode"] == "persistent"

    Agent.objects.filter(pk=broken.pk).update(adapter_config="not an object")
    data = {"action": "delete_selected", "_selected_action": [str(broken.pk)]}
    assert admin_client.post(reverse(CHANGELIST), data).status_code == 200  # the confirmation
    with django_capture_on_commit_callbacks(execute=True):
        assert admin_client.post(reverse(CHANGELIST), {**data, "post": "yes"}).status_code == 302
    assert not Agent.objects.filter(pk=broken.pk).exists()


def test_the_agent_list_never_reads_the_columns_it_does_not_show(admin_client, company, django_assert_max_num_queries):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def page_queries(params=None) -> list[str]:
        with CaptureQueriesContext(connection) as captured:
            page = admin_client.get(reverse(CHANGELIST), params or {})
        assert page.status_code == 200
        return [query["sql"] for query in captured]

    prompt = "You are thorough. " * 500
    for n in range(3):
        Agent.objects.create(company=company, name=f"agent {n}", system_prompt=prompt, adapter_config={})
    page_queries()  # warm the per-process caches
    few = len(page_queries())
    for n in range(3, 20):
        Agent.objects.create(company=company, name=f"agent {n}", system_prompt=prompt, adapter_config={})
    # A deferred column read for each row would be one query more per agent.
    with django_assert_max_num_queries(few):
        admin_client.get(reverse(CHANGELIST))
    for sql in page_queries() + page_queries({"q": "agent 1"}):
        columns = sql.split(" FROM ")[0]
        assert '"system_prompt"' not in columns and '"managed_remote"' not in columns, sql


def test_the_agent_page_still_shows_and_saves_the_prompt(admin_client, persistent_agent):
    url = reverse("admin:sessions_app_agent_change", args=[persistent_agent.pk])
    assert "You remember." in admin_client.get(url).content.decode()
    config = '{"model": "claude-opus-4-5", "session_mode": "persistent"}'
    form = agent_form(
        persistent_agent.company, name="Persistent", system_prompt="Remember more.", adapter_config=config
    )
    assert admin_client.post(url, form).status_code == 302
    persistent_agent.refresh_from_db()
    assert persistent_agent.system_prompt == "Remember more."
