"""Cost endpoints: the daily rollup and the month-to-date summary (costs_app.reports)."""

from __future__ import annotations

from datetime import UTC
from uuid import UUID

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.response import Response

from costs_app.budget_views import use_rows
from costs_app.budgets import budget_uses
from costs_app.forecast import budget_forecasts
from costs_app.reports import ZERO, daily_costs, month_to_date, window_start
from costs_app.serializers import CostSummarySerializer, DailyCostsSerializer
from sessions_app.api.base import ApiView, error_responses
from sessions_app.api.exceptions import NotFound
from sessions_app.models import Agent

MAX_DAYS = 366
TOTAL_KEYS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "cost_usd",
    "events",
)


def totals(rows: list[dict]) -> dict:
    return {key: sum((row[key] for row in rows), ZERO if key == "cost_usd" else 0) for key in TOTAL_KEYS}


AGENT_FILTER = OpenApiParameter(
    "agent_id", UUID, required=False, description="Only this agent's costs (deleted agents included)."
)


class CostsView(ApiView):
    def agent_filter(self, company_id: UUID) -> UUID | None:
        """The `agent_id` filter, which must name one of the company's agents (deleted ones too:
        their spend stays on the ledger)."""
        agent_id = self.query_uuid("agent_id")
        if agent_id is not None and not Agent.objects.filter(pk=agent_id, company_id=company_id).exists():
            raise NotFound("No such agent.")
        return agent_id


class DailyCostsView(CostsView):
    @extend_schema(
        operation_id="costs_daily",
        parameters=[
            AGENT_FILTER,
            OpenApiParameter("days", int, required=False, description=f"1..{MAX_DAYS}, default 30."),
        ],
        responses={200: DailyCostsSerializer, **error_responses(400)},
        description="Tokens and cost per UTC day, newest first.",
    )
    def get(self, request, company_id: UUID):
        company = self.get_company(company_id)
        days = self.query_int("days", default=30, minimum=1, maximum=MAX_DAYS)
        agent_id = self.agent_filter(company.id)
        now = timezone.now()
        rows = daily_costs(company_id=company.id, now=now, days=days, agent_id=agent_id)
        body = {
            "agent_id": agent_id,
            "days": days,
            "since": window_start(now=now, days=days).date(),
            "daily": rows,
            "totals": totals(rows),
        }
        return Response(DailyCostsSerializer(body).data)


class CostSummaryView(CostsView):
    @extend_schema(
        operation_id="costs_summary",
        parameters=[AGENT_FILTER],
        responses={200: CostSummarySerializer, **error_responses(400)},
        description="This UTC month so far, per agent and model.",
    )
    def get(self, request, company_id: UUID):
        company = self.get_company(company_id)
        agent_id = self.agent_filter(company.id)
        now = timezone.now()
        rows = month_to_date(company_id=company.id, now=now, agent_id=agent_id)
        names = dict(Agent.objects.filter(pk__in={row["agent_id"] for row in rows}).values_list("id", "name"))
        for row in rows:
            row["agent_name"] = names.get(row["agent_id"])
        month_start = now.astimezone(UTC).date().replace(day=1)
        # Budget use beside the spend, with each limit's forecast: the company's limits,
        # and the agent's when filtered.
        uses = [
            u
            for u in budget_uses(company_id=company.id, agent_id=agent_id, now=now)
            if agent_id or u.scope == "company"
        ]
        body = {
            "month": month_start.strftime("%Y-%m"),
            "since": month_start,
            "agent_id": agent_id,
            "rows": rows,
            "totals": totals(rows),
            "budgets": use_rows(uses, budget_forecasts(company_id=company.id, uses=uses, now=now)),
        }
        return Response(CostSummarySerializer(body).data)
