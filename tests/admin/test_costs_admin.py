"""The ledger (read-only), model prices, API keys and the costs page."""

from __future__ import annotations

import hashlib
import re
import uuid
from datetime import date, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from costs_app.admin import GROWTH_MAX_AGENTS
from costs_app.budgets import budget_uses
from costs_app.models import Budget, CostEvent, ModelPrice
from sessions_app.models import Agent, AgentStatus, ApiKey, PausedReason
from tests.admin.conftest import make_cost, make_run
from tests.conftest import catalogue_stored

REPORT = "admin:costs_app_costevent_report"


def test_the_ledger_is_read_only(admin_client, persistent_agent):
    event = make_cost(persistent_agent)
    assert admin_client.get(reverse("admin:costs_app_costevent_add")).status_code == 403
    assert admin_client.get(reverse("admin:costs_app_costevent_delete", args=[event.pk])).status_code == 403
    change = reverse("admin:costs_app_costevent_change", args=[event.pk])
    assert admin_client.get(change).status_code == 200
    assert admin_client.post(change, {"cost_usd": "0"}).status_code == 403
    page = admin_client.get(reverse("admin:costs_app_costevent_changelist")).content.decode()
    assert 'name="action"' not in page
    assert reverse(REPORT) in page


def test_ledger_rows_of_a_deleted_agent_still_list(admin_client, persistent_agent):
    make_cost(persistent_agent, model="claude-opus-4-5")
    Agent.objects.filter(pk=persistent_agent.pk).delete()
    assert CostEvent.objects.count() == 1
    page = admin_client.get(reverse("admin:costs_app_costevent_changelist")).content.decode()
    assert f"(deleted {persistent_agent.pk})" in page


def test_model_prices_warn_about_unpriced_models_in_use(admin_client, persistent_agent):
    make_cost(persistent_agent, model="claude-mystery-1", unpriced=True, cost_usd=Decimal(0))
    make_cost(persistent_agent, model="claude-opus-4-5", unpriced=True, cost_usd=Decimal(0))  # priced since
    page = admin_client.get(reverse("admin:costs_app_modelprice_changelist")).content.decode()
    assert "Unpriced models in use" in page
    assert "claude-mystery-1" in page
    assert "?model=claude-mystery-1" in page
    warning = re.search(r"Unpriced models in use.*?</li>", page, re.S).group(0)
    assert "claude-opus-4-5" not in warning


PRICE_FORM = {
    "model": "claude-new-1",
    "effective_from": "2026-01-01",
    "input_usd_per_mtok": "2",
    "output_usd_per_mtok": "10",
    "cache_write_5m_usd_per_mtok": "2.5",
    "cache_write_1h_usd_per_mtok": "4",
    "cache_read_usd_per_mtok": "0.2",
}


def test_model_prices_are_editable(admin_client):
    assert admin_client.post(reverse("admin:costs_app_modelprice_add"), PRICE_FORM).status_code == 302


def test_a_negative_model_price_is_refused_with_a_message_and_a_free_one_is_not(admin_client):
    add = reverse("admin:costs_app_modelprice_add")

    response = admin_client.post(add, {**PRICE_FORM, "output_usd_per_mtok": "-10", "cache_read_usd_per_mtok": "-0.2"})

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert sorted(errors) == ["cache_read_usd_per_mtok", "output_usd_per_mtok"]
    assert "cannot be negative" in errors["output_usd_per_mtok"][0]
    assert not ModelPrice.objects.exists()
    assert admin_client.post(add, {**PRICE_FORM, "cache_read_usd_per_mtok": "0"}).status_code == 302
    assert ModelPrice.objects.get().cache_read_usd_per_mtok == 0


def test_api_key_is_shown_once_and_only_its_hash_is_stored(admin_client, company):
    response = admin_client.post(
        reverse("admin:sessions_app_apikey_add"), {"company": str(company.pk), "name": "ci"}, follow=True
    )
    assert response.status_code == 200
    page = response.content.decode()
    plaintext = re.search(r"The new key is <code>([^<]+)</code>", page).group(1)
    key = ApiKey.objects.get()
    assert key.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert len(key.prefix) >= 8 and plaintext.startswith(key.prefix)
    assert plaintext not in str(ApiKey.objects.values().get())
    later = admin_client.get(reverse("admin:sessions_app_apikey_change", args=[key.pk])).content.decode()
    assert plaintext not in later
    admin_client.post(
        reverse("admin:sessions_app_apikey_changelist"), {"action": "revoke", "_selected_action": [str(key.pk)]}
    )
    key.refresh_from_db()
    assert key.revoked_at is not None

    # The change form cannot bring a revoked key back.
    admin_client.post(reverse("admin:sessions_app_apikey_change", args=[key.pk]), {"name": "ci", "revoked_at": ""})
    assert ApiKey.objects.get(pk=key.pk).revoked_at == key.revoked_at


def test_costs_page_shows_a_chart_and_flags_growing_agents(admin_client, persistent_agent, stateless_agent):
    now = timezone.now()
    for i in range(12):  # replayed history: every call reads more than the last
        event = make_cost(persistent_agent, input_tokens=1000 + 800 * i, cost_usd=Decimal("0.01") * (i + 1))
        CostEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(days=12 - i))
    for i in range(8):
        event = make_cost(stateless_agent, input_tokens=500, cost_usd=Decimal("0.002"))
        CostEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(days=i))
    old = make_cost(stateless_agent, input_tokens=999_999)
    CostEvent.objects.filter(pk=old.pk).update(created_at=now - timedelta(days=45))
    response = admin_client.get(reverse(REPORT))
    assert response.status_code == 200
    page = response.content.decode()
    assert "<svg" in page and 'class="pc-bar"' in page
    assert response.context["cost_chart"].bars and not response.context["cost_chart"].is_empty
    agents = {row["name"]: row for row in response.context["agents_table"]}
    assert agents["Persistent"]["growing"] and not agents["Stateless"]["growing"]
    assert agents["Stateless"]["events"] == 8  # the 45-day-old event is outside the window
    assert "999,999" not in page
    assert "grow by about 800 tokens per run" in page
    # The advice itself, in this agent's terms (its defaults: rotate sessions), not a pointer to the API.
    assert re.search(r"set rotate_after_turns to \d+ to start fresh sessions", page)
    assert "GET .../agents" not in page


def test_costs_page_does_not_flag_a_few_calls_of_small_growth(admin_client, persistent_agent, company):
    """The flag needs enough calls and a slope that matters against what the agent's requests
    may grow to: "from 12 to 119 over 6 calls" is noise; the same rise per call against a
    1,000-token context budget, over 12 calls, is not."""
    now = timezone.now()
    for i, tokens in enumerate([12, 30, 51, 77, 98, 119]):
        event = make_cost(persistent_agent, input_tokens=tokens)
        CostEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(minutes=6 - i))
    budgeted = Agent.objects.create(
        company=company,
        name="Budgeted",
        adapter_config={"model": "claude-opus-4-5", "session_mode": "persistent", "context_budget_tokens": 1000},
    )
    for i in range(12):
        event = make_cost(budgeted, input_tokens=12 + 21 * i)
        CostEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(minutes=12 - i))
    response = admin_client.get(reverse(REPORT))
    agents = {row["name"]: row for row in response.context["agents_table"]}
    assert not agents["Persistent"]["growing"]
    assert agents["Budgeted"]["growing"]
    assert "context_budget_tokens is 1000" in agents["Budgeted"]["advice"]
    assert "Lower it to 1000" in agents["Budgeted"]["advice"]


@pytest.mark.parametrize(
    "config",
    [
        ["not", "an", "object"],
        {"model": "claude-opus-4-5", "context_budget_tokens": "many"},  # read by the flag
        {"model": "claude-opus-4-5", "session_mode": "persistent", "keep_recent_turns": "some"},  # by the advice
    ],
    ids=["not-an-object", "budget-not-a-number", "turns-not-a-number"],
)
def test_costs_page_lists_an_agent_whose_configuration_no_longer_validates(admin_client, persistent_agent, config):
    now = timezone.now()
    for i in range(12):  # enough calls for its growth to be judged
        event = make_cost(persistent_agent, input_tokens=1000 + 800 * i)
        CostEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(minutes=12 - i))
    Agent.objects.filter(pk=persistent_agent.pk).update(adapter_config=config)  # written by SQL

    response = admin_client.get(reverse(REPORT))

    assert response.status_code == 200
    [row] = response.context["agents_table"]
    assert (row["name"], row["events"], row["growing"]) == ("Persistent", 12, False)


def test_costs_page_filters_by_company(admin_client, persistent_agent, other_agent):
    make_cost(persistent_agent)
    make_cost(other_agent)
    response = admin_client.get(reverse(REPORT), {"company": str(other_agent.company_id)})
    assert [row["name"] for row in response.context["agents_table"]] == ["Foreign"]


def test_costs_page_queries_are_bounded(admin_client, company, django_assert_max_num_queries):
    agents = [
        Agent.objects.create(company=company, name=f"agent {i}", adapter_config={})
        for i in range(GROWTH_MAX_AGENTS + 10)
    ]
    for agent in agents:
        make_cost(agent)
    with django_assert_max_num_queries(GROWTH_MAX_AGENTS + 10):
        response = admin_client.get(reverse(REPORT))
    assert len(response.context["agents_table"]) == len(agents)


def test_budget_page_shows_current_use(admin_client, company, persistent_agent):
    from costs_app.models import Budget

    budget = Budget.objects.create(
        company=company, agent=persistent_agent, daily_limit_usd=Decimal("1"), daily_run_limit=50
    )
    make_cost(persistent_agent, cost_usd=Decimal("0.25"))
    for _ in range(14):
        make_run(persistent_agent)
    page = admin_client.get(reverse("admin:costs_app_budget_change", args=[budget.pk])).content.decode()
    assert "agent daily limit: 0.25 of 1.00 USD used (25%)" in page
    assert "agent daily run limit: 14 of 50 runs used (28%)" in page


def budget_form(budget, **targets) -> dict:
    """The budget change form as a browser posts it, with the alert target inline rows given."""
    rows = targets.get("rows", [])
    data = {
        "company": str(budget.company_id),
        "agent": "",
        "monthly_limit_usd": str(budget.monthly_limit_usd or ""),
        "lifetime_limit_usd": "",
        "daily_limit_usd": "",
        "daily_run_limit": "",
        "warn_percent": "80",
        "alert_percent": "95",
        "session_limit_usd": "",
        "alert_targets-TOTAL_FORMS": str(len(rows)),
        "alert_targets-INITIAL_FORMS": str(sum(1 for row in rows if row.get("id"))),
        "alert_targets-MIN_NUM_FORMS": "0",
        "alert_targets-MAX_NUM_FORMS": "1000",
    }
    for i, row in enumerate(rows):
        data.update({f"alert_targets-{i}-{name}": value for name, value in row.items()})
        data[f"alert_targets-{i}-budget"] = str(budget.pk)
    return data


def paused_for_budget(agent, budget) -> None:
    """`agent` has spent past `budget`'s monthly limit and is paused for it."""
    make_cost(agent, cost_usd=budget.monthly_limit_usd + 1)
    Agent.objects.filter(pk=agent.pk).update(status=AgentStatus.PAUSED, paused_reason=PausedReason.BUDGET)


@pytest.mark.parametrize("change", ["raised", "deleted", "deleted from the list"])
def test_a_budget_raised_or_deleted_in_the_admin_resumes_the_agents_it_paused_at_once(
    admin_client, company, persistent_agent, django_capture_on_commit_callbacks, change
):
    """As the API's PUT and DELETE do, without waiting for the maintenance pass (before:
    the agent stayed paused until it ran)."""
    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("1"))
    paused_for_budget(persistent_agent, budget)
    with django_capture_on_commit_callbacks(execute=True):
        if change == "raised":
            budget.monthly_limit_usd = Decimal("100")
            url = reverse("admin:costs_app_budget_change", args=[budget.pk])
            assert admin_client.post(url, budget_form(budget)).status_code == 302
        elif change == "deleted":
            url = reverse("admin:costs_app_budget_delete", args=[budget.pk])
            assert admin_client.post(url, {"post": "yes"}).status_code == 302
        else:
            url = reverse("admin:costs_app_budget_changelist")
            action = {"action": "delete_selected", "_selected_action": [budget.pk], "post": "yes"}
            assert admin_client.post(url, action).status_code == 302
    persistent_agent.refresh_from_db()
    assert (persistent_agent.status, persistent_agent.paused_reason) == (AgentStatus.ACTIVE, "")


def test_a_budget_saved_in_the_admin_still_spent_keeps_its_agents_paused(
    admin_client, company, persistent_agent, django_capture_on_commit_callbacks
):
    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("1"))
    paused_for_budget(persistent_agent, budget)
    budget.monthly_limit_usd = Decimal("2")  # still below the spend
    with django_capture_on_commit_callbacks(execute=True):
        url = reverse("admin:costs_app_budget_change", args=[budget.pk])
        assert admin_client.post(url, budget_form(budget)).status_code == 302
    persistent_agent.refresh_from_db()
    assert (persistent_agent.status, persistent_agent.paused_reason) == (AgentStatus.PAUSED, PausedReason.BUDGET)


def test_budget_alert_targets_are_added_in_the_admin_and_their_secret_never_shown(admin_client, company):
    from costs_app.models import AlertTarget, Budget

    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("10"))
    change = reverse("admin:costs_app_budget_change", args=[budget.pk])
    secret = " whsec-admin-0123456789abcdef "  # its spaces are part of it: the receiver signs with them

    response = admin_client.post(
        change, budget_form(budget, rows=[{"url": "https://alerts.example/hook", "secret": secret, "active": "on"}])
    )

    assert response.status_code == 302, response.context["inline_admin_formsets"][0].formset.errors
    target = AlertTarget.objects.get()
    assert target.secret == secret
    assert secret not in admin_client.get(change).content.decode()
    # Saved again without a secret: the secret stays.
    rows = [{"id": str(target.pk), "url": "https://alerts.example/other", "secret": "", "active": "on"}]
    assert admin_client.post(change, budget_form(budget, rows=rows)).status_code == 302
    target.refresh_from_db()
    assert (target.url, target.secret) == ("https://alerts.example/other", secret)


def test_a_new_target_without_a_secret_or_with_a_bad_url_is_refused_with_a_message(admin_client, company):
    from costs_app.models import AlertTarget, Budget

    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("10"))
    change = reverse("admin:costs_app_budget_change", args=[budget.pk])
    for row in (
        {"url": "https://alerts.example/hook", "secret": ""},
        {"url": "ftp://alerts.example/hook", "secret": "whsec-admin-0123456789abcdef"},
    ):
        response = admin_client.post(change, budget_form(budget, rows=[row]))
        assert response.status_code == 200
        assert response.context["inline_admin_formsets"][0].formset.errors
    assert not AlertTarget.objects.exists()


def test_in_authenticated_mode_the_admin_refuses_a_target_host_the_operator_did_not_list(
    admin_client, company, settings
):
    from costs_app.models import AlertTarget, Budget

    settings.PAPERCLIP_DEPLOYMENT_MODE = "authenticated"
    settings.PAPERCLIP_ALERT_HOSTS = frozenset({"alerts.example"})
    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("10"))
    change = reverse("admin:costs_app_budget_change", args=[budget.pk])
    row = {"url": "http://10.0.0.7/hook", "secret": "whsec-admin-0123456789abcdef", "active": "on"}

    response = admin_client.post(change, budget_form(budget, rows=[row]))

    assert response.status_code == 200
    assert "PAPERCLIP_ALERT_HOSTS" in str(response.context["inline_admin_formsets"][0].formset.errors)
    assert not AlertTarget.objects.exists()
    row["url"] = "https://alerts.example/hook"
    assert admin_client.post(change, budget_form(budget, rows=[row])).status_code == 302
    assert AlertTarget.objects.get().url == "https://alerts.example/hook"


def test_budget_pages_show_the_forecast(admin_client, company, persistent_agent):
    from costs_app.models import Budget

    budget = Budget.objects.create(company=company, lifetime_limit_usd=Decimal("10"))
    make_cost(persistent_agent, cost_usd=Decimal("5"))  # today: $5 a day, $5 left

    changelist = admin_client.get(reverse("admin:costs_app_budget_changelist")).content.decode()
    page = admin_client.get(reverse("admin:costs_app_budget_change", args=[budget.pk])).content.decode()

    crossing = {f"{(timezone.now() + timedelta(days=1, seconds=s)):%Y-%m-%d}" for s in (0, 60)}
    assert any(f"lifetime limit on {day}" in changelist for day in crossing)
    assert any(f"crossed on {day} at $5.00/day" in page for day in crossing)


def test_alert_deliveries_are_read_only_with_their_attempts(admin_client, company):
    from costs_app.models import Budget
    from tests.admin.conftest import budget_alert_delivered

    delivery = budget_alert_delivered(Budget.objects.create(company=company, monthly_limit_usd=Decimal("100")))
    change = reverse("admin:costs_app_alertdelivery_change", args=[delivery.pk])

    page = admin_client.get(change).content.decode()

    assert "soft (80%) of the month limit" in page and "HTTP 500" in page and "https://alerts.example/hook" in page
    assert "s" * 32 not in page
    assert admin_client.get(reverse("admin:costs_app_alertdelivery_add")).status_code == 403
    assert admin_client.post(change, {"status": "delivered"}).status_code == 403
    listing = admin_client.get(reverse("admin:costs_app_alertdelivery_changelist")).content.decode()
    assert 'name="action"' not in listing and "HTTP 500" in listing


def test_an_alert_of_the_run_cap_counts_runs_and_a_money_alert_keeps_its_cent_fractions(
    admin_client, company, persistent_agent
):
    from costs_app.models import AlertDelivery, Budget, BudgetAlert
    from tests.admin.conftest import budget_alert_delivered

    delivery = budget_alert_delivered(Budget.objects.create(company=company, daily_run_limit=50))
    BudgetAlert.objects.filter(pk=delivery.alert_id).update(period="day_runs", limit=50, spent=40)
    money = budget_alert_delivered(
        Budget.objects.create(company=company, agent=persistent_agent, daily_limit_usd=Decimal("0.005"))
    )
    BudgetAlert.objects.filter(pk=money.alert_id).update(period="day", limit=Decimal("0.005"), spent=Decimal("0.0045"))

    listing = admin_client.get(reverse("admin:costs_app_alertdelivery_changelist")).content.decode()
    runs, dollars = (
        admin_client.get(reverse("admin:costs_app_alertdelivery_change", args=[d.pk])).content.decode()
        for d in (delivery, money)
    )

    assert "soft: 80% of the day_runs limit" in listing and "soft: 80% of the day limit" in listing
    assert "soft (80%) of the day_runs limit" in runs and ": 40 of 50 runs" in runs
    assert "soft (80%) of the day limit" in dollars and ": $0.0045 of $0.005" in dollars
    assert AlertDelivery.objects.count() == 2


def test_bad_alert_settings_in_the_admin_are_refused_with_a_message(admin_client, company):
    from costs_app.models import Budget

    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("10"))
    change = reverse("admin:costs_app_budget_change", args=[budget.pk])
    for field, value in (("alert_percent", "101"), ("session_limit_usd", "0")):
        response = admin_client.post(change, {**budget_form(budget), field: value})
        assert response.status_code == 200
        assert field in response.context["adminform"].form.errors
    budget.refresh_from_db()
    assert (budget.alert_percent, budget.session_limit_usd) == (95, None)


@pytest.mark.parametrize(
    ("field", "refused", "accepted"),
    [
        ("monthly_limit_usd", "-5", "0"),
        ("lifetime_limit_usd", "-0.000001", "0"),
        ("daily_limit_usd", "-1", "0"),
        ("warn_percent", "0", "1"),
        ("warn_percent", "5000", "100"),
    ],
)
def test_the_budget_form_refuses_limits_and_percentages_the_api_refuses(
    admin_client, company, field, refused, accepted
):
    add = reverse("admin:costs_app_budget_add")

    response = admin_client.post(add, {**budget_form(Budget(company=company)), field: refused})

    assert response.status_code == 200
    assert list(response.context["adminform"].form.errors) == [field]
    assert not Budget.objects.exists()
    assert admin_client.post(add, {**budget_form(Budget(company=company)), field: accepted}).status_code == 302
    assert getattr(Budget.objects.get(), field) == Decimal(accepted)


def test_the_budget_form_refuses_an_agent_of_another_company(admin_client, company, other_agent):
    add = reverse("admin:costs_app_budget_add")
    data = {**budget_form(Budget(company=company)), "agent": str(other_agent.pk), "monthly_limit_usd": "1"}

    response = admin_client.post(add, data)

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert list(errors) == ["agent"]
    assert "Foreign is an agent of Globex" in errors["agent"][0]
    assert not Budget.objects.exists()
    # Under the agent's own company it is saved, and applies to the agent.
    assert admin_client.post(add, {**data, "company": str(other_agent.company_id)}).status_code == 302
    uses = budget_uses(company_id=other_agent.company_id, agent_id=other_agent.id, now=timezone.now())
    assert [(use.scope, use.period, use.limit) for use in uses] == [("agent", "month", Decimal("1"))]


def test_a_second_budget_of_a_company_is_refused_in_words(admin_client, company):
    budget = Budget.objects.create(company=company, monthly_limit_usd=Decimal("10"))
    add = reverse("admin:costs_app_budget_add")

    response = admin_client.post(add, {**budget_form(Budget(company=company)), "monthly_limit_usd": "1"})

    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "company": ["This company has a budget already: change that one (a company has one budget)."]
    }
    assert list(Budget.objects.all()) == [budget]
    # Its own budget is still changed.
    change = reverse("admin:costs_app_budget_change", args=[budget.pk])
    assert admin_client.post(change, {**budget_form(budget), "monthly_limit_usd": "20"}).status_code == 302
    budget.refresh_from_db()
    assert budget.monthly_limit_usd == Decimal("20")


def test_the_model_price_page_shows_the_librarys_price_beside_each_override(admin_client):
    override = ModelPrice.from_list_price("claude-sonnet-5-5", date(2026, 12, 1), Decimal("1.5"), Decimal("8"))
    override.save()
    ModelPrice.from_list_price("acme-finetune-1", date(2026, 12, 1), Decimal("1"), Decimal("2")).save()

    page = admin_client.get(reverse("admin:costs_app_modelprice_changelist")).content.decode()
    change = admin_client.get(reverse("admin:costs_app_modelprice_change", args=[override.pk])).content.decode()

    library = "$2.00 in / $10.00 out, cache writes $2.50 (5m) / $4.00 (1h), reads $0.10 per MTok (library"
    assert library in page and library in change
    assert "none: the price library does not know this model" in page


def test_the_catalogue_page_lists_the_models_with_their_lifecycle_and_price(admin_client):
    catalogue_stored()
    ModelPrice.from_list_price("claude-opus-5-5", date(2026, 1, 1), Decimal("3"), Decimal("15")).save()
    page = admin_client.get(reverse("admin:costs_app_cataloguemodel_changelist")).content.decode()
    assert "claude-haiku-5-5" in page and "retired" in page
    assert "prompts over 100,000 tokens: $0.50 in / $2.50 out" in page
    assert "overridden (Costs &gt; Model prices)" in page


def test_the_budget_delete_page_counts_its_alerts_in_a_fixed_number_of_queries(admin_client, company, persistent_agent):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from costs_app.models import AlertAttempt, AlertDelivery, AlertTarget, BudgetAlert

    def alerted(budget: Budget, days: range, target: AlertTarget | None = None) -> None:
        for day in days:
            alert = BudgetAlert.objects.create(
                budget=budget, period="day", period_key=f"2026-01-{day:02d}", threshold="soft", percent=80,
                limit=Decimal("5"), spent=Decimal("4.5"),
            )  # fmt: skip
            if target is not None:
                delivery = AlertDelivery.objects.create(alert=alert, target=target, attempts=1)
                AlertAttempt.objects.create(delivery=delivery, number=1, at=timezone.now(), duration_ms=3)

    def page(budget: Budget) -> tuple[int, str]:
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(reverse("admin:costs_app_budget_delete", args=[budget.pk]))
        assert response.status_code == 200
        return len(captured), response.content.decode()

    delivered = Budget.objects.create(company=company, daily_limit_usd=Decimal("5"))
    target = AlertTarget.objects.create(budget=delivered, url="https://alerts.example/hook", secret="s" * 32)
    alerted(delivered, range(1, 3), target)
    page(delivered)  # warm the per-process caches (content types)
    few, _ = page(delivered)
    alerted(delivered, range(3, 13), target)
    many, text = page(delivered)
    assert many == few
    # Deliveries go with their budget, as the API's DELETE takes them.
    assert "Cannot delete budget" not in text and "12 alert deliveries" in text

    undelivered = Budget.objects.create(company=company, agent=persistent_agent, monthly_limit_usd=Decimal("50"))
    alerted(undelivered, range(1, 13))
    assert page(undelivered)[0] == few
    assert "12 budget alerts" in page(undelivered)[1]


def test_the_deliveries_list_reads_no_payload_or_prompt_and_never_counts_the_table(
    admin_client, company, persistent_agent
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tests.admin.conftest import budget_alert_delivered, hold_and_event

    budget = Budget.objects.create(company=company, agent=persistent_agent, monthly_limit_usd=Decimal("100"))
    budget_alert_delivered(budget)
    hold_and_event(budget, now=timezone.now())
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(reverse("admin:costs_app_alertdelivery_changelist")).content.decode()
    assert "quota_held" in page and "agent Persistent" in page
    for query in queries:
        sql = query["sql"]
        columns = sql.split(" FROM ")[0]
        assert '"payload"' not in columns and '"system_prompt"' not in columns, sql
        if "COUNT(" in sql.upper() and 'FROM "budget_alert_deliveries"' in sql:
            assert "LIMIT" in sql.upper(), sql  # the capped count, never a full COUNT(*)


def test_a_budget_with_alert_deliveries_is_deleted_with_them_by_an_operator_allowed_to(admin_client, client, company):
    from django.contrib.auth.models import Permission, User

    from costs_app.models import AlertAttempt, AlertDelivery, AlertTarget, BudgetAlert

    def delivered_budget() -> Budget:
        budget = Budget.objects.create(company=company, daily_limit_usd=Decimal("5"))
        target = AlertTarget.objects.create(budget=budget, url="https://alerts.example/hook", secret="s" * 32)
        alert = BudgetAlert.objects.create(
            budget=budget, period="day", period_key="2026-01-01", threshold="soft", percent=80,
            limit=Decimal("5"), spent=Decimal("4.5"),
        )  # fmt: skip
        delivery = AlertDelivery.objects.create(alert=alert, target=target, attempts=1)
        AlertAttempt.objects.create(delivery=delivery, number=1, at=timezone.now(), duration_ms=3)
        return budget

    budget = delivered_budget()
    url = reverse("admin:costs_app_budget_delete", args=[budget.pk])
    response = admin_client.post(url, {"post": "yes"})
    assert response.status_code == 302
    assert not Budget.objects.filter(pk=budget.pk).exists()
    assert not AlertDelivery.objects.exists() and not AlertAttempt.objects.exists()

    # Django's model permissions still decide: an operator who may delete budgets but not
    # alert deliveries is told so, and nothing is deleted.
    kept = delivered_budget()
    operator = User.objects.create_user("operator", password="pw", is_staff=True)
    operator.user_permissions.set(
        Permission.objects.filter(content_type__app_label="costs_app", codename__in=["view_budget", "delete_budget"])
    )
    client.force_login(operator)
    url = reverse("admin:costs_app_budget_delete", args=[kept.pk])
    assert "alert delivery" in client.get(url).content.decode()
    assert client.post(url, {"post": "yes"}).status_code == 403
    assert Budget.objects.filter(pk=kept.pk).exists() and AlertDelivery.objects.count() == 1


def test_costs_page_offers_the_newest_companies_and_any_other_by_its_id(admin_client, company, other_agent):
    from sessions_app.admin.common import COMPANY_CHOICES_CAP
    from sessions_app.models import Company

    make_cost(other_agent)
    older = timezone.now() - timedelta(days=1)
    Company.objects.filter(pk__in=[company.pk, other_agent.company_id]).update(created_at=older)
    Company.objects.bulk_create([Company(name=f"newer {i}") for i in range(COMPANY_CHOICES_CAP)])

    def page(query: dict):
        with CaptureQueriesContext(connection) as captured:
            response = admin_client.get(reverse(REPORT), query)
        assert response.status_code == 200
        reads = [sql for sql in captured.captured_queries if 'FROM "companies"' in sql["sql"]]
        assert all("LIMIT" in sql["sql"] for sql in reads), reads
        return response

    everyone = page({})
    assert len(everyone.context["companies"]) == COMPANY_CHOICES_CAP and 'name="company_id"' in everyone.text
    # A company past the cap, by the id box (pasted with capitals, no dashes): it is shown
    # and listed as the one chosen.
    theirs = page({"company_id": other_agent.company_id.hex.upper()})
    assert theirs.context["company_id"] == str(other_agent.company_id)
    assert [row["name"] for row in theirs.context["agents_table"]] == ["Foreign"]
    assert len(theirs.context["companies"]) == COMPANY_CHOICES_CAP + 1
    assert f'<option value="{other_agent.company_id}" selected>Globex</option>' in theirs.text
    for unknown in ("not-an-id", str(uuid.uuid4())):
        shown = page({"company": unknown})
        assert shown.context["company_id"] is None
        assert "No company has the id" in [str(message) for message in shown.context["messages"]][0]
