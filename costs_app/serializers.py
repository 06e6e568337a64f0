"""Shapes of the cost endpoints. Money is a decimal string, never a float."""

from __future__ import annotations

from rest_framework import serializers

from costs_app.budget_views import BudgetUseSerializer
from costs_app.money import MoneyField


class TokenTotalsSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    cache_creation_input_tokens = serializers.IntegerField()
    cache_read_input_tokens = serializers.IntegerField()
    cost_usd = MoneyField(help_text="USD, as a decimal string.")
    events = serializers.IntegerField(help_text="Cost events (usually model calls) counted.")


class DailyCostSerializer(TokenTotalsSerializer):
    day = serializers.DateField(help_text="The UTC day.")


class DailyCostsSerializer(serializers.Serializer):
    agent_id = serializers.UUIDField(allow_null=True)
    days = serializers.IntegerField(help_text="Length of the window in UTC days, today included.")
    since = serializers.DateField(help_text="First UTC day of the window.")
    daily = DailyCostSerializer(many=True, help_text="Newest first; days without spend are omitted.")
    totals = TokenTotalsSerializer()


class AgentModelCostSerializer(TokenTotalsSerializer):
    agent_id = serializers.UUIDField()
    agent_name = serializers.CharField(allow_null=True)
    model = serializers.CharField()


class CostSummarySerializer(serializers.Serializer):
    month = serializers.CharField(help_text="The UTC month, YYYY-MM.")
    since = serializers.DateField(help_text="First day of the month (UTC).")
    agent_id = serializers.UUIDField(allow_null=True)
    rows = AgentModelCostSerializer(many=True, help_text="Month to date, per agent and model.")
    totals = TokenTotalsSerializer()
    budgets = BudgetUseSerializer(
        many=True,
        help_text="Use of each budget limit that applies, with its daily rate and forecast crossing date "
        "(see the budget endpoints).",
    )
