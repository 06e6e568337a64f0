"""Alert target endpoints: the webhooks a company's or an agent's budget notifies, and the
deliveries sent to them with every attempt's status and error.

The secret is write-only: accepted on create, never returned (and never logged)."""

from __future__ import annotations

from uuid import UUID

from django.db.models import Prefetch
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from costs_app.alerts import target_url_problem
from costs_app.models import AlertAttempt, AlertDelivery, AlertEvent, AlertTarget, Budget, BudgetAlert
from costs_app.money import AmountField
from sessions_app.api.base import PAGE_PARAMETERS, ApiView, error_responses
from sessions_app.api.exceptions import Conflict, NotFound
from sessions_app.api.pagination import Keyset, parse_limit
from sessions_app.serializers import NoUnknownFieldsMixin, StrictBooleanField, StrictCharField


class AlertTargetSerializer(NoUnknownFieldsMixin, serializers.ModelSerializer):
    url = serializers.URLField(
        max_length=2000, help_text="http(s) URL that receives a signed JSON POST at each threshold."
    )
    secret = StrictCharField(
        write_only=True,
        min_length=16,
        max_length=200,
        # The receiver verifies with the secret it was given: one trimmed here would sign
        # every delivery with another key, and no signature would ever verify.
        trim_whitespace=False,
        help_text="HMAC-SHA256 key of the X-Paperclip-Signature header. Write-only: never returned.",
    )
    active = StrictBooleanField(required=False, default=True)
    quota_events = StrictBooleanField(
        required=False, default=False, help_text="Also receive `quota_held` and `quota_released` (docs/operations.md)."
    )
    health_events = StrictBooleanField(
        required=False, default=False, help_text="Also receive `agent_down` and `agent_up` for agents of its scope."
    )

    class Meta:
        model = AlertTarget
        fields = ["id", "url", "secret", "active", "quota_events", "health_events", "created_at"]
        read_only_fields = ["id", "created_at"]

    def validate_url(self, value: str) -> str:
        if problem := target_url_problem(value):
            raise serializers.ValidationError(problem)
        return value


class AlertTargets(ApiView):
    """Shared by the company budget's targets (`agent_id` absent) and an agent budget's."""

    def budget(self, company_id: UUID, agent_id: UUID | None) -> Budget | None:
        if agent_id is None:
            company, agent = self.get_company(company_id), None
        else:
            agent = self.get_agent(company_id, agent_id)
            company = agent.company
        return Budget.objects.filter(company=company, agent=agent).first()


TARGET_ORDER = Keyset("created_at", descending=False)


class AlertTargetsView(AlertTargets):
    def get(self, request, company_id: UUID, agent_id: UUID | None = None):
        # Paged as every list is: nothing bounds how many targets a budget is given.
        budget = self.budget(company_id, agent_id)
        limit = parse_limit(request.query_params.get("limit"))
        targets = AlertTarget.objects.filter(budget=budget) if budget else AlertTarget.objects.none()
        rows, cursor = TARGET_ORDER.page(targets, limit=limit, cursor=request.query_params.get("next"))
        return Response({"targets": AlertTargetSerializer(rows, many=True).data, "next": cursor})

    def post(self, request, company_id: UUID, agent_id: UUID | None = None):
        budget = self.budget(company_id, agent_id)
        serializer = AlertTargetSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        if budget is None:
            raise Conflict("Set a budget first: alert targets belong to a budget.", code="no_budget")
        target = serializer.save(budget=budget)
        return Response(AlertTargetSerializer(target).data, status=status.HTTP_201_CREATED)


class AlertAttemptSerializer(serializers.ModelSerializer):
    class Meta:
        model = AlertAttempt
        fields = ["number", "at", "status_code", "error", "duration_ms"]


class DeliveredAlertSerializer(serializers.ModelSerializer):
    limit = AmountField(help_text="USD as a decimal string; for the daily run cap, runs.")
    spent = AmountField(help_text="What the ledger (or the run count) held when it fired.")
    fired_at = serializers.DateTimeField(source="created_at")

    class Meta:
        model = BudgetAlert
        fields = ["id", "period", "period_key", "threshold", "percent", "limit", "spent", "fired_at"]

    def to_representation(self, alert):
        # The run cap's figures are counts, every other limit's money (as in alert payloads).
        data = super().to_representation(alert)
        if alert.period == "day_runs":
            data["limit"], data["spent"] = int(alert.limit), int(alert.spent)
        return data


class TargetOfDeliverySerializer(serializers.ModelSerializer):
    class Meta:
        model = AlertTarget
        fields = ["id", "url", "active"]


class DeliveredEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = AlertEvent
        fields = ["id", "kind", "agent_id", "payload", "created_at"]


class DeliverySerializer(serializers.ModelSerializer):
    alert = DeliveredAlertSerializer(allow_null=True, help_text="The budget alert; null for an operations event.")
    event = DeliveredEventSerializer(allow_null=True, help_text="The operations event; null for a budget alert.")
    target = TargetOfDeliverySerializer()
    attempts = AlertAttemptSerializer(
        source="attempt_rows", many=True, help_text="Every HTTP attempt, oldest first: the status or the error."
    )

    class Meta:
        model = AlertDelivery
        fields = [
            "id",
            "alert",
            "event",
            "target",
            "status",
            "attempts",
            "last_status_code",
            "last_error",
            "next_attempt_at",
            "created_at",
            "finished_at",
        ]


class DeliveryListSerializer(serializers.Serializer):
    deliveries = DeliverySerializer(many=True)
    next = serializers.CharField(allow_null=True, help_text="Cursor of the next page; null on the last page.")


DELIVERY_ORDER = Keyset("created_at", descending=True)


class AlertDeliveriesView(AlertTargets):
    """The deliveries of one budget's alerts, newest first. Each attempt's status code and
    error are shown to the budget's own company only (its URL answers 404 to any other):
    in authenticated mode the hosts a target may name are the operator's
    (PAPERCLIP_ALERT_HOSTS), so what an attempt reports cannot map a network."""

    def get(self, request, company_id: UUID, agent_id: UUID | None = None):
        budget = self.budget(company_id, agent_id)
        limit = parse_limit(request.query_params.get("limit"))
        deliveries = (
            AlertDelivery.objects.filter(target__budget=budget).select_related("alert", "event", "target")
            if budget
            else AlertDelivery.objects.none()
        )
        deliveries = deliveries.prefetch_related(
            Prefetch("attempt_rows", queryset=AlertAttempt.objects.order_by("number"))
        )
        rows, cursor = DELIVERY_ORDER.page(deliveries, limit=limit, cursor=request.query_params.get("next"))
        return Response({"deliveries": DeliverySerializer(rows, many=True).data, "next": cursor})


class AlertTargetView(AlertTargets):
    def delete(self, request, company_id: UUID, target_id: int, agent_id: UUID | None = None):
        budget = self.budget(company_id, agent_id)
        if budget is None or not AlertTarget.objects.filter(budget=budget, pk=target_id).delete()[0]:
            raise NotFound("No such alert target.")
        return Response(status=status.HTTP_204_NO_CONTENT)


class TargetListSerializer(serializers.Serializer):
    targets = AlertTargetSerializer(many=True)
    next = serializers.CharField(allow_null=True, help_text="Cursor of the next page; null on the last page.")


LIST = {
    "parameters": PAGE_PARAMETERS,
    "responses": {200: TargetListSerializer, **error_responses(400)},
    "description": "The budget's alert targets, oldest first.",
}
CREATE = {
    "request": AlertTargetSerializer,
    "responses": {201: AlertTargetSerializer, **error_responses(400, 409)},
    "description": "Add a webhook to the budget (409 `no_budget` when there is none yet).",
}
DELETE = {"responses": {204: None, **error_responses()}}
DELIVERIES = {
    "parameters": PAGE_PARAMETERS,
    "responses": {200: DeliveryListSerializer, **error_responses(400)},
    "description": "The budget's alert deliveries, newest first, each with its alert, its target and every "
    "attempt's status code or error.",
}


class CompanyAlertTargetsView(AlertTargetsView):
    @extend_schema(operation_id="company_alert_targets_list", **LIST)
    def get(self, request, company_id: UUID):
        return super().get(request, company_id)

    @extend_schema(operation_id="company_alert_targets_create", **CREATE)
    def post(self, request, company_id: UUID):
        return super().post(request, company_id)


class AgentAlertTargetsView(AlertTargetsView):
    @extend_schema(operation_id="agent_alert_targets_list", **LIST)
    def get(self, request, company_id: UUID, agent_id: UUID):
        return super().get(request, company_id, agent_id)

    @extend_schema(operation_id="agent_alert_targets_create", **CREATE)
    def post(self, request, company_id: UUID, agent_id: UUID):
        return super().post(request, company_id, agent_id)


class CompanyAlertTargetView(AlertTargetView):
    @extend_schema(operation_id="company_alert_target_delete", **DELETE)
    def delete(self, request, company_id: UUID, target_id: int):
        return super().delete(request, company_id, target_id)


class AgentAlertTargetView(AlertTargetView):
    @extend_schema(operation_id="agent_alert_target_delete", **DELETE)
    def delete(self, request, company_id: UUID, agent_id: UUID, target_id: int):
        return super().delete(request, company_id, target_id, agent_id)


class CompanyAlertDeliveriesView(AlertDeliveriesView):
    @extend_schema(operation_id="company_alert_deliveries_list", **DELIVERIES)
    def get(self, request, company_id: UUID):
        return super().get(request, company_id)


class AgentAlertDeliveriesView(AlertDeliveriesView):
    @extend_schema(operation_id="agent_alert_deliveries_list", **DELIVERIES)
    def get(self, request, company_id: UUID, agent_id: UUID):
        return super().get(request, company_id, agent_id)
