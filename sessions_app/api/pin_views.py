"""An agent's pinned facts: what every summary of its sessions must keep (`sessions_app.pins`)."""

from __future__ import annotations

from uuid import UUID

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from sessions_app.api.base import ApiView, error_responses
from sessions_app.api.exceptions import Conflict, NotFound
from sessions_app.models import MAX_PINS_PER_AGENT, PinnedFact
from sessions_app.pins import PinRefused, pin_create
from sessions_app.serializers import PinSerializer


class PinListSerializer(serializers.Serializer):
    pins = PinSerializer(many=True)


class PinListView(ApiView):
    @extend_schema(
        operation_id="agent_pins_list",
        responses={200: PinListSerializer, **error_responses()},
        description=f"The agent's pinned facts, oldest first (at most {MAX_PINS_PER_AGENT}, so never paged).",
    )
    def get(self, request, company_id: UUID, agent_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        pins = PinnedFact.objects.filter(agent=agent).order_by("created_at")
        return Response({"pins": PinSerializer(pins, many=True).data})

    @extend_schema(
        operation_id="agent_pin_create",
        request=PinSerializer,
        responses={201: PinSerializer, **error_responses(400, 409, 413)},
        description="Pin a fact on the agent: every later summary of its sessions (a compaction, compact now, a "
        "rotation's handoff note) must contain it, or it is carried verbatim after the summary. "
        f"400 names `text`; 409 `too_many_pins` past {MAX_PINS_PER_AGENT}.",
    )
    def post(self, request, company_id: UUID, agent_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        serializer = PinSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            pin = pin_create(agent=agent, text=serializer.validated_data["text"])
        except PinRefused as exc:
            raise Conflict(exc.message, code=exc.code) from None
        return Response(PinSerializer(pin).data, status=status.HTTP_201_CREATED)


class PinDetailView(ApiView):
    @extend_schema(operation_id="agent_pin_delete", responses={204: None, **error_responses()})
    def delete(self, request, company_id: UUID, agent_id: UUID, pin_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        if not PinnedFact.objects.filter(pk=pin_id, agent=agent).delete()[0]:
            raise NotFound("No such pinned fact.")
        return Response(status=status.HTTP_204_NO_CONTENT)
