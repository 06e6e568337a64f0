"""Budget endpoints: read and set a company's or an agent's limits, with their use."""

from __future__ import annotations

from decimal import Decimal
from uuid import UUID

from django.db import IntegrityError, transaction
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from costs_app.budgets import budget_uses
from costs_app.forecast import Forecast, budget_forecasts
from costs_app.models import Budget
from costs_app.money import AmountField, MoneyField
from costs_app.signals import budget_changed
from sessions_app.api.base import ApiView, error_responses
from sessions_app.serializers import NoUnknownFieldsMixin, StrictIntegerField

SET_DESCRIPTION = (
    "Set limits (fields left out keep their value; null removes a limit). Raising a limit resumes "
    "agents that the budget had paused."
)
LIMIT = {
    "max_digits": 12,
    "decimal_places": 6,
    "min_value": 0,
    "allow_null": True,
    "required": False,
    "error_messages": {"blank": 'Must be a decimal, such as "12.50"; null, not a blank string, removes a limit.'},
}


class BudgetUseSerializer(serializers.Serializer):
    scope = serializers.ChoiceField(choices=["agent", "company"])
    period = serializers.ChoiceField(choices=["day", "month", "lifetime", "day_runs"])
    limit = AmountField(help_text="USD as a decimal string; for the daily run cap (`day_runs`), runs.")
    spent = AmountField(help_text="USD spent (the ledger's); for the daily run cap, runs started today.")
    reserved = AmountField(help_text="Held by calls in flight (0 for the daily run cap).")
    percent = serializers.FloatField()
    warning = serializers.BooleanField(help_text="At or past the soft warning percentage.")
    exceeded = serializers.BooleanField(help_text="At or past the hard limit.")
    daily_rate_usd = MoneyField(
        allow_null=True,
        help_text="Spend of the limit's scope per day over the last 7 days (null for the run cap).",
    )
    forecast_date = serializers.DateField(
        allow_null=True,
        help_text="UTC day the limit will be crossed at that rate; null when the rate is zero, the limit is "
        "reached, or the period ends first.",
    )


class BudgetSerializer(NoUnknownFieldsMixin, serializers.ModelSerializer):
    monthly_limit_usd = MoneyField(**LIMIT, help_text="UTC calendar month; null = none.")
    lifetime_limit_usd = MoneyField(**LIMIT)
    daily_limit_usd = MoneyField(**LIMIT, help_text="UTC day.")
    daily_run_limit = StrictIntegerField(min_value=0, max_value=2_147_483_647, allow_null=True, required=False)
    warn_percent = StrictIntegerField(min_value=1, max_value=100, required=False)
    alert_percent = StrictIntegerField(
        min_value=1, max_value=100, required=False, help_text="Second alert threshold (percent of a limit)."
    )
    session_limit_usd = MoneyField(
        **{**LIMIT, "min_value": Decimal("0.000001")},
        help_text="A session that has spent this much is ended with a handoff to a new one; null = none. With "
        "both a company and an agent budget, the lower applies.",
    )

    class Meta:
        model = Budget
        fields = [
            "monthly_limit_usd",
            "lifetime_limit_usd",
            "daily_limit_usd",
            "daily_run_limit",
            "warn_percent",
            "alert_percent",
            "session_limit_usd",
            "updated_at",
        ]
        read_only_fields = ["updated_at"]


class BudgetResponseSerializer(serializers.Serializer):
    budget = BudgetSerializer(allow_null=True)
    use = BudgetUseSerializer(many=True)


def use_rows(uses, forecasts: dict | None = None) -> list[dict]:
    """The API's rows of budget uses, with the forecast of each money limit when given."""
    forecasts = forecasts or {}
    return [
        {
            "scope": u.scope,
            "period": u.period,
            "limit": u.amount(u.limit),
            "spent": u.amount(u.spent),
            "reserved": u.amount(u.reserved),
            "percent": round(u.percent, 2),
            "warning": u.warning,
            "exceeded": u.exceeded,
            **forecast_fields(forecasts.get((u.scope, u.period))),
        }
        for u in uses
    ]


def forecast_fields(forecast: Forecast | None) -> dict:
    if forecast is None:
        return {"daily_rate_usd": None, "forecast_date": None}
    return {"daily_rate_usd": forecast.daily_rate_usd, "forecast_date": forecast.date}


def budget_set(*, company, agent, values: dict) -> Budget:
    """Set `values` on the budget of the scope (the company's when `agent` is None), creating
    it when there is none; fields not in `values` keep theirs (a new budget's defaults)."""
    with transaction.atomic():
        budget = Budget.objects.select_for_update().filter(company=company, agent=agent).first()
        if budget is None:
            try:
                with transaction.atomic():
                    return Budget.objects.create(company=company, agent=agent, **values)
            except IntegrityError:
                # No row to lock when we read: another writer created the scope's budget
                # since (on PostgreSQL this insert waited for its commit). Update that one.
                budget = Budget.objects.select_for_update().filter(company=company, agent=agent).first()
                if budget is None:
                    raise
        for name, value in values.items():
            setattr(budget, name, value)
        budget.save(update_fields=[*values, "updated_at"])
    return budget


class BudgetView(ApiView):
    """Shared by the company budget (`agent_id` absent) and an agent's budget."""

    def scope(self, company_id: UUID, agent_id: UUID | None):
        if agent_id is None:
            return self.get_company(company_id), None
        agent = self.get_agent(company_id, agent_id)
        return agent.company, agent

    def answer(self, company, agent, budget):
        now = timezone.now()
        uses = budget_uses(company_id=company.id, agent_id=agent.id if agent else None, now=now)
        if agent is None:
            uses = [u for u in uses if u.scope == "company"]
        forecasts = budget_forecasts(company_id=company.id, uses=uses, now=now)
        body = {"budget": BudgetSerializer(budget).data if budget else None, "use": use_rows(uses, forecasts)}
        return Response(BudgetResponseSerializer(body).data)

    def get(self, request, company_id: UUID, agent_id: UUID | None = None):
        company, agent = self.scope(company_id, agent_id)
        budget = Budget.objects.filter(company=company, agent=agent).first()
        return self.answer(company, agent, budget)

    def put(self, request, company_id: UUID, agent_id: UUID | None = None):
        company, agent = self.scope(company_id, agent_id)
        serializer = BudgetSerializer(data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        budget = budget_set(company=company, agent=agent, values=serializer.validated_data)
        budget_changed.send(sender=Budget, company_id=company.id, now=timezone.now())
        return self.answer(company, agent, budget)

    def delete(self, request, company_id: UUID, agent_id: UUID | None = None):
        company, agent = self.scope(company_id, agent_id)
        Budget.objects.filter(company=company, agent=agent).delete()
        budget_changed.send(sender=Budget, company_id=company.id, now=timezone.now())
        return Response(status=status.HTTP_204_NO_CONTENT)


class CompanyBudgetView(BudgetView):
    @extend_schema(
        operation_id="company_budget_retrieve", responses={200: BudgetResponseSerializer, **error_responses()}
    )
    def get(self, request, company_id: UUID):
        return super().get(request, company_id)

    @extend_schema(
        operation_id="company_budget_set",
        request=BudgetSerializer,
        responses={200: BudgetResponseSerializer, **error_responses(400)},
        description=SET_DESCRIPTION,
    )
    def put(self, request, company_id: UUID):
        return super().put(request, company_id)

    @extend_schema(operation_id="company_budget_delete", responses={204: None, **error_responses()})
    def delete(self, request, company_id: UUID):
        return super().delete(request, company_id)


class AgentBudgetView(BudgetView):
    @extend_schema(operation_id="agent_budget_retrieve", responses={200: BudgetResponseSerializer, **error_responses()})
    def get(self, request, company_id: UUID, agent_id: UUID):
        return super().get(request, company_id, agent_id)

    @extend_schema(
        operation_id="agent_budget_set",
        request=BudgetSerializer,
        responses={200: BudgetResponseSerializer, **error_responses(400)},
        description=SET_DESCRIPTION,
    )
    def put(self, request, company_id: UUID, agent_id: UUID):
        return super().put(request, company_id, agent_id)

    @extend_schema(operation_id="agent_budget_delete", responses={204: None, **error_responses()})
    def delete(self, request, company_id: UUID, agent_id: UUID):
        return super().delete(request, company_id, agent_id)
