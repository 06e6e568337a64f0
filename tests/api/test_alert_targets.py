"""Budget alert targets, alert settings and forecasts through the API: the secret is
write-only, bad input is a 400 naming the field."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from costs_app.models import AlertTarget, Budget, CostEvent

SECRET = "whsec-test-0123456789abcdef"


@pytest.fixture
def budget(company):
    return Budget.objects.create(company=company, monthly_limit_usd=Decimal("10"))


def targets_url(company, agent=None) -> str:
    scope = f"/api/companies/{company.id}" + (f"/agents/{agent.id}" if agent else "")
    return f"{scope}/budget/targets"


def test_a_target_is_created_listed_and_deleted_and_its_secret_never_returned(api, company, budget):
    response = api.post(targets_url(company), {"url": "https://alerts.example/hook", "secret": SECRET})

    assert response.status_code == 201, response.json()
    created = response.json()
    assert set(created) == {"id", "url", "active", "quota_events", "health_events", "created_at"}
    assert AlertTarget.objects.get().secret == SECRET
    listed = api.get(targets_url(company))
    assert listed.json() == {"targets": [created], "next": None}
    assert SECRET not in listed.content.decode() and SECRET not in response.content.decode()

    assert api.delete(f"{targets_url(company)}/{created['id']}").status_code == 204
    assert api.delete(f"{targets_url(company)}/{created['id']}").status_code == 404
    assert not AlertTarget.objects.exists()


def test_a_secret_is_stored_as_sent_spaces_included(api, company, budget):
    secret = f"  {SECRET} "
    response = api.post(targets_url(company), {"url": "https://alerts.example/hook", "secret": secret})

    assert response.status_code == 201, response.json()
    assert AlertTarget.objects.get().secret == secret


def test_targets_page_oldest_first_with_a_cursor_in_a_fixed_number_of_queries(
    api, company, budget, django_assert_max_num_queries
):
    for n in range(12):
        AlertTarget.objects.create(budget=budget, url=f"https://alerts.example/{n}", secret=SECRET)
    with django_assert_max_num_queries(3):
        first = api.get(targets_url(company), {"limit": 5}).json()
    rest = api.get(targets_url(company), {"limit": 200, "next": first["next"]}).json()

    urls = [target["url"] for target in first["targets"] + rest["targets"]]
    assert urls == [f"https://alerts.example/{n}" for n in range(12)]
    assert rest["next"] is None
    assert len(api.get(targets_url(company)).json()["targets"]) == 12
    assert api.get(targets_url(company), {"limit": 201}).status_code == 400


def test_an_agent_budget_has_its_own_targets(api, company, persistent_agent):
    Budget.objects.create(company=company, agent=persistent_agent, daily_limit_usd=Decimal("1"))
    response = api.post(targets_url(company, persistent_agent), {"url": "http://127.0.0.1:9/hook", "secret": SECRET})
    assert response.status_code == 201, response.json()
    assert AlertTarget.objects.get().budget.agent_id == persistent_agent.id
    assert api.get(targets_url(company)).json() == {"targets": [], "next": None}


def test_in_authenticated_mode_a_target_must_name_a_host_the_operator_listed(key_api, company, budget, settings):
    settings.PAPERCLIP_ALERT_HOSTS = frozenset({"alerts.example"})

    for url in ["http://127.0.0.1:5432/", "http://169.254.169.254/latest/meta-data", "https://ALERTS.example.evil/"]:
        refused = key_api.post(targets_url(company), {"url": url, "secret": SECRET})
        assert refused.status_code == 400, url
        assert "PAPERCLIP_ALERT_HOSTS" in refused.json()["error"]["fields"]["url"]
    assert not AlertTarget.objects.exists()

    listed = key_api.post(targets_url(company), {"url": "https://Alerts.Example/hook", "secret": SECRET})
    assert listed.status_code == 201, listed.json()


def test_a_listed_host_is_reachable_on_its_schemes_port_or_the_port_listed_with_it(key_api, company, budget, settings):
    settings.PAPERCLIP_ALERT_HOSTS = frozenset({"alerts.example", "hooks.internal:8443", "[fd00::7]:9000"})

    for url in [
        "https://alerts.example:5432/hook",  # a listed host, another port: its database, say
        "http://alerts.example:443/hook",  # http's port is 80
        "https://hooks.internal/hook",  # listed with a port: only that one
        "https://hooks.internal:9443/hook",
        "http://[fd00::7]/hook",
    ]:
        refused = key_api.post(targets_url(company), {"url": url, "secret": SECRET})
        assert refused.status_code == 400, url
        assert "PAPERCLIP_ALERT_HOSTS" in refused.json()["error"]["fields"]["url"], url
    assert not AlertTarget.objects.exists()

    for url in [
        "https://alerts.example/hook",
        "https://alerts.example:443/hook",
        "http://alerts.example:80/hook",
        "https://Hooks.Internal:8443/hook",
        "http://[fd00::7]:9000/hook",
    ]:
        assert key_api.post(targets_url(company), {"url": url, "secret": SECRET}).status_code == 201, url


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://alerts.example/hook", "secret": SECRET}, "url"),
        ({"url": "file:///etc/passwd", "secret": SECRET}, "url"),
        ({"url": "not a url", "secret": SECRET}, "url"),
        ({"url": "https://alerts.example/" + "a" * 2000, "secret": SECRET}, "url"),
        ({"url": "https://alerts.example/hook", "secret": "short"}, "secret"),
        ({"url": "https://alerts.example/hook"}, "secret"),
        ({"url": "https://alerts.example/hook", "secret": SECRET, "active": "maybe"}, "active"),
        # Strict types: "no" is not false, "yes" not true, a number not a secret.
        ({"url": "https://alerts.example/hook", "secret": SECRET, "active": "no"}, "active"),
        ({"url": "https://alerts.example/hook", "secret": SECRET, "active": 0}, "active"),
        ({"url": "https://alerts.example/hook", "secret": SECRET, "quota_events": "yes"}, "quota_events"),
        ({"url": "https://alerts.example/hook", "secret": SECRET, "health_events": 1}, "health_events"),
        ({"url": "https://alerts.example/hook", "secret": 12345678901234567890}, "secret"),
        # A typo is not ignored: {"activ": false} must not make an active target.
        ({"url": "https://alerts.example/hook", "secret": SECRET, "activ": False}, "activ"),
        ({"url": "https://alerts.example/hook", "secret": SECRET, "health_event": True}, "health_event"),
        ({"url": "https://alerts.example/hook", "secret": SECRET, "id": 7}, "id"),
    ],
)
def test_bad_targets_are_a_400_naming_the_field(api, company, budget, body, field):
    response = api.post(targets_url(company), body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], list(error["fields"])) == ("invalid", [field])
    assert not AlertTarget.objects.exists()


@pytest.mark.parametrize("url", ["https://ops:hunter2-pw@alerts.example/hook", "https://hunter2-pw@alerts.example/"])
def test_a_url_carrying_credentials_is_refused_and_never_echoed(api, company, budget, url):
    """The secret is write-only; a password in the URL would be shown by every GET of the
    targets and their deliveries (and urllib would not send it anyway)."""
    response = api.post(targets_url(company), {"url": url, "secret": SECRET})

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], list(error["fields"])) == ("invalid", ["url"])
    assert "hunter2-pw" not in response.content.decode()
    assert not AlertTarget.objects.exists()


def test_a_target_needs_a_budget_first(api, company):
    response = api.post(targets_url(company), {"url": "https://alerts.example/hook", "secret": SECRET})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "no_budget"


def test_targets_of_another_company_are_404(api, company, other_company, other_agent):
    other = Budget.objects.create(company=other_company, monthly_limit_usd=Decimal("1"))
    target = AlertTarget.objects.create(budget=other, url="https://alerts.example/hook", secret=SECRET)
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("1"))
    assert api.get(targets_url(company, other_agent)).status_code == 404
    assert api.delete(f"{targets_url(company)}/{target.id}").status_code == 404
    assert AlertTarget.objects.filter(pk=target.pk).exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"alert_percent": 0}, "alert_percent"),
        ({"alert_percent": 101}, "alert_percent"),
        ({"session_limit_usd": "0"}, "session_limit_usd"),
        ({"session_limit_usd": "-1"}, "session_limit_usd"),
        ({"session_limit_usd": "lots"}, "session_limit_usd"),
    ],
)
def test_bad_alert_settings_are_a_400_naming_the_field(api, company, body, field):
    response = api.put(f"/api/companies/{company.id}/budget", body)
    assert response.status_code == 400
    assert field in response.json()["error"]["fields"]


def test_alert_settings_and_the_session_limit_are_set_and_read(api, company):
    response = api.put(
        f"/api/companies/{company.id}/budget",
        {"monthly_limit_usd": "10", "alert_percent": 90, "session_limit_usd": "1.5"},
    )
    assert response.status_code == 200, response.json()
    budget = response.json()["budget"]
    assert (budget["alert_percent"], budget["session_limit_usd"], budget["warn_percent"]) == (90, "1.50", 80)


def test_the_summary_and_the_budget_show_each_limits_forecast(api, company, stateless_agent):
    now = timezone.now()
    CostEvent.objects.create(
        company=company, agent=stateless_agent, model="m", cost_usd=Decimal("4"), created_at=now - timedelta(days=2)
    )
    Budget.objects.create(company=company, lifetime_limit_usd=Decimal("100"), daily_run_limit=10)

    summary = api.get(f"/api/companies/{company.id}/costs/summary").json()
    budget = api.get(f"/api/companies/{company.id}/budget").json()

    runs, lifetime = sorted(summary["budgets"], key=lambda row: row["period"])
    # $4 over the 2 days since the first spend (and the moments the requests took): $2 a
    # day, $96 left, 48 days.
    assert Decimal(lifetime["daily_rate_usd"]).quantize(Decimal("0.001")) == Decimal("2.000")
    assert lifetime["forecast_date"] in {
        (now + timedelta(days=48, seconds=seconds)).date().isoformat() for seconds in (0, 60)
    }
    assert (runs["period"], runs["forecast_date"], runs["daily_rate_usd"]) == ("day_runs", None, None)
    assert [(row["period"], row["forecast_date"]) for row in budget["use"]] == [
        (row["period"], row["forecast_date"]) for row in summary["budgets"]
    ]


def delivered_twice(budget: Budget, url: str = "https://alerts.example/hook", threshold: str = "soft"):
    """A soft alert of `budget` whose delivery failed with a 500, then could not connect."""
    from costs_app.models import AlertAttempt, AlertDelivery, BudgetAlert

    now = timezone.now()
    target = AlertTarget.objects.create(budget=budget, url=url, secret=SECRET)
    alert = BudgetAlert.objects.create(
        budget=budget,
        period="month",
        period_key=f"{now:%Y-%m}",
        threshold=threshold,
        percent=80,
        limit=Decimal("10"),
        spent=Decimal("8.0125"),
    )
    delivery = AlertDelivery.objects.create(
        alert=alert,
        target=target,
        attempts=2,
        last_error="ConnectionRefusedError: [Errno 111] Connection refused",
        next_attempt_at=now + timedelta(minutes=4),
    )
    AlertAttempt.objects.create(delivery=delivery, number=1, at=now, status_code=500, error="HTTP 500", duration_ms=12)
    AlertAttempt.objects.create(
        delivery=delivery,
        number=2,
        at=now + timedelta(minutes=1),
        status_code=None,
        error="ConnectionRefusedError: [Errno 111] Connection refused",
        duration_ms=3,
    )
    return delivery


def test_each_delivery_shows_every_attempts_status_and_error_to_its_company_only(
    key_api, other_key_api, company, budget, persistent_agent, django_assert_max_num_queries
):
    delivery = delivered_twice(budget)
    agent_budget = Budget.objects.create(company=company, agent=persistent_agent, daily_limit_usd=Decimal("1"))
    delivered_twice(agent_budget, url="https://alerts.example/agent")
    url = f"/api/companies/{company.id}/budget/deliveries"

    with django_assert_max_num_queries(8):
        response = key_api.get(url)

    assert response.status_code == 200, response.json()
    (shown,) = response.json()["deliveries"]  # the company budget's, not the agent budget's
    assert (shown["id"], shown["status"], shown["target"]["url"]) == (delivery.id, "pending", delivery.target.url)
    assert (shown["alert"]["threshold"], shown["alert"]["limit"], shown["alert"]["spent"]) == (
        "soft",
        "10.00",
        "8.0125",
    )
    assert [(a["number"], a["status_code"], a["error"]) for a in shown["attempts"]] == [
        (1, 500, "HTTP 500"),
        (2, None, "ConnectionRefusedError: [Errno 111] Connection refused"),
    ]
    assert SECRET not in response.content.decode()
    agent_url = f"/api/companies/{company.id}/agents/{persistent_agent.id}/budget/deliveries"
    (of_agent,) = key_api.get(agent_url).json()["deliveries"]
    assert of_agent["target"]["url"] == "https://alerts.example/agent"
    # Another company's key sees none of it: its URL is a 404, as an unknown id is.
    assert other_key_api.get(url).status_code == 404
    assert other_key_api.get(agent_url).status_code == 404


def test_deliveries_page_newest_first_with_a_cursor(api, company, budget):
    for threshold in ("soft", "second", "hard"):
        delivered_twice(budget, threshold=threshold)
    url = f"/api/companies/{company.id}/budget/deliveries"

    first = api.get(url, {"limit": 2}).json()
    rest = api.get(url, {"limit": 2, "next": first["next"]}).json()

    ids = [d["id"] for d in first["deliveries"] + rest["deliveries"]]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 3
    assert rest["next"] is None
    assert api.get(f"/api/companies/{company.id}/budget/deliveries").status_code == 200
    assert api.get(url, {"next": "garbage"}).status_code == 400
