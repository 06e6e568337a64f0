"""Approving or denying the tool call a Managed Agents turn waits on (`sessions_app.approvals`)."""

from __future__ import annotations

from uuid import UUID

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from sessions_app.api.base import ApiView, error_responses
from sessions_app.api.exceptions import BadRequest, Conflict, NotFound, ServiceUnavailable
from sessions_app.approvals import MAX_REASON_CHARS, ApprovalRefused, approval_decide
from sessions_app.errors import QueueUnavailable
from sessions_app.models import ApiKey, HeartbeatRun
from sessions_app.serializers import NoUnknownFieldsMixin, RunSerializer, StrictCharField


class DecisionSerializer(NoUnknownFieldsMixin, serializers.Serializer):
    # Unknown fields are refused: a misspelt reason would never reach the agent, and an
    # `allow` sent to /deny would be ignored while the path decides.
    reason = StrictCharField(
        required=False,
        allow_blank=True,
        max_length=MAX_REASON_CHARS,
        help_text="Why (a denial's reason is sent to the agent as the tool call's answer).",
    )


class ApprovalView(ApiView):
    allow: bool

    def post(self, request, company_id: UUID, agent_id: UUID, run_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        serializer = DecisionSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        run = HeartbeatRun.objects.filter(pk=run_id, agent=agent).select_related("agent").first()
        if run is None:
            raise NotFound("No such run.")
        try:
            run = approval_decide(
                run,
                allow=self.allow,
                reason=serializer.validated_data.get("reason", ""),
                by=f"api key {request.auth.name}" if isinstance(request.auth, ApiKey) else "api",
                now=timezone.now(),
            )
        except ApprovalRefused as refused:
            if refused.status == 400:
                raise BadRequest(refused.message, code=refused.code, fields={"reason": refused.message}) from None
            raise Conflict(refused.message, code=refused.code) from None
        except QueueUnavailable as unqueued:
            raise ServiceUnavailable(unqueued.message, code=unqueued.code) from unqueued
        run.refresh_from_db()
        return Response(RunSerializer(run).data)


DESCRIPTION = (
    "The run must be `waiting_approval` (its `approval` names the tool calls). The decision applies to every tool "
    "call it waits on; a worker then sends it to the session and the turn goes on. 409 `run_not_waiting_approval` "
    "when it no longer waits (decided already, or expired)."
)


class RunApproveView(ApprovalView):
    allow = True

    @extend_schema(
        operation_id="run_approve",
        request=DecisionSerializer,
        responses={200: RunSerializer, **error_responses(400, 409, 503)},
        description="Approve the tool calls a Managed Agents turn waits on. " + DESCRIPTION,
    )
    def post(self, request, company_id: UUID, agent_id: UUID, run_id: UUID):
        return super().post(request, company_id, agent_id, run_id)


class RunDenyView(ApprovalView):
    allow = False

    @extend_schema(
        operation_id="run_deny",
        request=DecisionSerializer,
        responses={200: RunSerializer, **error_responses(400, 409, 503)},
        description="Deny the tool calls a Managed Agents turn waits on; `reason` reaches the agent. " + DESCRIPTION,
    )
    def post(self, request, company_id: UUID, agent_id: UUID, run_id: UUID):
        return super().post(request, company_id, agent_id, run_id)
