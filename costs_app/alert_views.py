"""Alert target endpoints: the webhooks a company's or an agent's budget notifies.

The secret is write-only: accepted on create, never returned (and never logged)."""

from __future__ import annotations

from uuid import UUID

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from costs_app.alerts import target_url_problem
from costs_app.models import AlertTarget, Budget
from sessions_app.api.base import ApiView, error_responses
from sessions_app.api.exceptions import Conflict, NotFound


class AlertTargetSerializer(serializers.ModelSerializer):
    url = serializers.URLField(
        max_length=2000, help_text="http(s) URL that receives a signed JSON POST at each threshold."
    )
    secret = serializers.CharField(
        write_only=True,
        min_length=16,
        max_length=200,
        help_text="HMAC-SHA256 key of the X-Paperclip-Signature header. Write-only: never returned.",
    )
    active = serializers.BooleanField(required=False, default=True)

    class Meta:
        model = AlertTarget
        fields = ["id", "url", "secret", "active", "created_at"]
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


class AlertTargetsView(AlertTargets):
    def get(self, request, company_id: UUID, agent_id: UUID | None = None):
        budget = self.budget(company_id, agent_id)
        targets = AlertTarget.objects.filter(budget=budget) if budget else AlertTarget.objects.none()
        return Response({"targets": AlertTargetSerializer(targets, many=True).data})

    def post(self, request, company_id: UUID, agent_id: UUID | None = None):
        budget = self.budget(company_id, agent_id)
        serializer = AlertTargetSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        if budget is None:
            raise Conflict("Set a budget first: alert targets belong to a budget.", code="no_budget")
        target = serializer.save(budget=budget)
        return Response(AlertTargetSerializer(target).data, status=status.HTTP_201_CREATED)


class AlertTargetView(AlertTargets):
    def delete(self, request, company_id: UUID, target_id: int, agent_id: UUID | None = None):
        budget = self.budget(company_id, agent_id)
        if budget is None or not AlertTarget.objects.filter(budget=budget, pk=target_id).delete()[0]:
            raise NotFound("No such alert target.")
        return Response(status=status.HTTP_204_NO_CONTENT)


class TargetListSerializer(serializers.Serializer):
    targets = AlertTargetSerializer(many=True)


LIST = {"responses": {200: TargetListSerializer, **error_responses()}}
CREATE = {
    "request": AlertTargetSerializer,
    "responses": {201: AlertTargetSerializer, **error_responses(400, 409)},
    "description": "Add a webhook to the budget (409 `no_budget` when there is none yet).",
}
DELETE = {"responses": {204: None, **error_responses()}}


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
