"""The forecast (costs_app.forecast): the last 7 days' daily rate, and the UTC day each
limit is crossed at it; none when the rate is zero, the limit is reached or the period
ends first."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from costs_app.budgets import budget_uses
from costs_app.forecast import budget_forecasts, daily_rates
from costs_app.models import Budget, CostEvent

NOW = datetime(2026, 11, 10, 12, 0, tzinfo=UTC)


def spend(agent, usd: str, at: datetime) -> None:
    CostEvent.objects.create(company=agent.company, agent=agent, model="m", cost_usd=Decimal(usd), created_at=at)


def forecasts(company, agent=None) -> dict:
    uses = budget_uses(company_id=company.id, agent_id=agent.id if agent else None, now=NOW)
    return budget_forecasts(company_id=company.id, uses=uses, now=NOW)


def test_the_rate_is_the_last_seven_days_over_the_days_they_cover(company, stateless_agent, persistent_agent):
    spend(stateless_agent, "3.00", NOW - timedelta(days=3))
    spend(stateless_agent, "3.00", NOW - timedelta(days=1))
    spend(persistent_agent, "7.00", NOW - timedelta(days=7))  # the window's first moment
    spend(persistent_agent, "100.00", NOW - timedelta(days=8))  # before the window
    spend(persistent_agent, "50.00", NOW + timedelta(hours=1))  # after now (a clock ahead)

    rates = daily_rates(company_id=company.id, agent_ids={None, stateless_agent.id, persistent_agent.id}, now=NOW)

    # The stateless agent began 3 days ago: $6 over 3 days, not over 7.
    assert rates[stateless_agent.id] == Decimal(2)
    assert rates[persistent_agent.id] == Decimal(1)
    assert rates[None] == Decimal(13) / Decimal(7)


def test_a_first_spend_within_the_day_counts_as_one_day(company, stateless_agent):
    spend(stateless_agent, "2.00", NOW - timedelta(hours=2))
    assert daily_rates(company_id=company.id, agent_ids={stateless_agent.id}, now=NOW) == {
        stateless_agent.id: Decimal(2)
    }


def test_each_limit_is_forecast_at_the_current_rate(company, stateless_agent):
    spend(stateless_agent, "3.00", NOW - timedelta(days=3))
    spend(stateless_agent, "3.00", NOW - timedelta(days=1))  # $2 a day, $6 this month
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("30"), lifetime_limit_usd=Decimal("1000"))
    Budget.objects.create(
        company=company, agent=stateless_agent, monthly_limit_usd=Decimal("6"), daily_limit_usd=Decimal("5")
    )

    found = forecasts(company, stateless_agent)

    # $24 left at $2 a day: 12 days from Nov 10 12:00.
    assert found[("company", "month")].date == date(2026, 11, 22)
    assert found[("company", "month")].daily_rate_usd == Decimal(2)
    # $994 left at $2 a day: 497 days.
    assert found[("company", "lifetime")].date == (NOW + timedelta(days=497)).date()
    # The agent's month is spent already; its day has $5 left, 2.5 days at this rate:
    # the day ends first.
    assert found[("agent", "month")].date is None
    assert found[("agent", "day")].date is None


def test_a_month_that_ends_before_the_crossing_has_no_forecast(company, stateless_agent):
    spend(stateless_agent, "2.00", NOW - timedelta(days=1))
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("100"))  # 49 days at $2: after Nov 30
    assert forecasts(company)[("company", "month")].date is None


def test_no_spend_in_the_window_has_no_forecast(company, stateless_agent):
    spend(stateless_agent, "9.00", NOW - timedelta(days=9))
    Budget.objects.create(company=company, lifetime_limit_usd=Decimal("10"), daily_run_limit=5)
    found = forecasts(company)
    assert found[("company", "lifetime")].daily_rate_usd == 0
    assert found[("company", "lifetime")].date is None
    assert ("company", "day_runs") not in found


def test_forecasts_cost_one_query_however_many_limits(company, stateless_agent, django_assert_num_queries):
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("30"), lifetime_limit_usd=Decimal("1000"))
    Budget.objects.create(company=company, agent=stateless_agent, daily_limit_usd=Decimal("5"))
    uses = budget_uses(company_id=company.id, agent_id=stateless_agent.id, now=NOW)
    with django_assert_num_queries(1):
        budget_forecasts(company_id=company.id, uses=uses, now=NOW)
