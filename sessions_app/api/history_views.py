"""What compaction did to history: a session's archive of compacted turns, and how much
input an agent's calls carry over time (its growth)."""

from __future__ import annotations

from uuid import UUID

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from costs_app.money import MoneyField
from costs_app.reports import daily_input_growth, input_growth
from sessions_app.api.base import ApiView, error_responses
from sessions_app.api.exceptions import NotFound
from sessions_app.api.pagination import Keyset
from sessions_app.context_defaults import growth_advice, growth_ceiling, growth_flag
from sessions_app.models import AgentSession, SessionCompaction, parse_session_id, session_public_id

MAX_COMPACTIONS = 100


class CompactionSummarySerializer(serializers.ModelSerializer):
    cost_usd = MoneyField(read_only=True, help_text="USD, as a decimal string (every call of the summary).")
    facts = serializers.JSONField(
        help_text='The facts the summary was checked for: [{"text", "source": "pin" | "candidate", "passed": in '
        'the model\'s summary, "via": "summary" | "retry" | "kept_facts" | ""}].'
    )

    class Meta:
        model = SessionCompaction
        fields = [
            "id",
            "kind",
            "created_at",
            "run",
            "messages_before",
            "messages_after",
            "tokens_before",
            "tokens_after",
            "summary",
            "model",
            "cost_usd",
            "summary_attempts",
            "facts",
        ]


class CompactionSerializer(CompactionSummarySerializer):
    archived_messages = serializers.JSONField(help_text="The replaced turns, verbatim (only with ?messages=true).")

    class Meta(CompactionSummarySerializer.Meta):
        fields = [*CompactionSummarySerializer.Meta.fields, "archived_messages"]


class ArchiveSerializer(serializers.Serializer):
    session_id = serializers.CharField()
    archived_message_count = serializers.IntegerField()
    compaction_count = serializers.IntegerField()
    predecessor_id = serializers.CharField(allow_null=True)
    compactions = CompactionSerializer(many=True)
    next = serializers.CharField(allow_null=True, help_text="Cursor of the next page; null on the last page.")


ARCHIVE_ORDER = Keyset("created_at", descending=False)  # compactions_session_idx


class SessionArchiveView(ApiView):
    @extend_schema(
        operation_id="session_archive",
        parameters=[
            OpenApiParameter("messages", bool, required=False, description="Include the archived turns verbatim."),
            OpenApiParameter("limit", int, required=False, description=f"1..{MAX_COMPACTIONS}, default 20."),
            OpenApiParameter("next", str, required=False, description="The `next` cursor of the previous page."),
        ],
        responses={200: ArchiveSerializer, **error_responses(400)},
        description="The compactions of a session, oldest first: what each replaced, its summary and cost. "
        "With the active history, the archived turns account for every message ever sent (`seq`).",
    )
    def get(self, request, company_id: UUID, agent_id: UUID, session_id: str):
        agent = self.get_agent(company_id, agent_id)
        parsed = parse_session_id(session_id)
        session = AgentSession.objects.filter(pk=parsed, agent=agent).defer("history").first() if parsed else None
        if session is None:
            raise NotFound("No such session.")
        limit = self.query_int("limit", default=20, minimum=1, maximum=MAX_COMPACTIONS)
        with_messages = self.request.query_params.get("messages") in ("1", "true", "yes")
        compactions = session.compactions.order_by("created_at")
        if not with_messages:
            compactions = compactions.defer("archived_messages")
        serializer = CompactionSerializer if with_messages else CompactionSummarySerializer
        page, cursor = ARCHIVE_ORDER.page(compactions, limit=limit, cursor=self.request.query_params.get("next"))
        body = {
            "session_id": session.public_id,
            "archived_message_count": session.archived_message_count,
            "compaction_count": session.compaction_count,
            # By id: the predecessor's row would bring its whole history along.
            "predecessor_id": session_public_id(session.predecessor_id),
            "compactions": [serializer(compaction).data for compaction in page],
            "next": cursor,
        }
        return Response(body)


class GrowthSerializer(serializers.Serializer):
    agent_id = serializers.UUIDField()
    runs = serializers.IntegerField(help_text="Recent model calls considered.")
    slope_tokens_per_run = serializers.FloatField()
    first_input_tokens = serializers.IntegerField()
    last_input_tokens = serializers.IntegerField()
    ceiling_tokens = serializers.IntegerField(
        help_text="What the agent's input per call may grow to: its context_budget_tokens, or its model's window "
        "less max_tokens."
    )
    growing = serializers.BooleanField(
        help_text="At least 10 calls, rising, at a slope that adds a tenth of ceiling_tokens within 50 runs."
    )
    advice = serializers.CharField(allow_blank=True, help_text="Which setting to change, and to what (when growing).")
    slope_tokens_per_day = serializers.FloatField()
    daily = serializers.ListField(child=serializers.DictField())


class AgentGrowthView(ApiView):
    @extend_schema(
        operation_id="agent_growth",
        responses={200: GrowthSerializer, **error_responses()},
        description="Whether the agent's input tokens per call grow steadily (replayed history accumulating): "
        "the least-squares slope over its last 30 calls and per UTC day over 14 days, judged against what its "
        "requests may grow to, with the setting to change.",
    )
    def get(self, request, company_id: UUID, agent_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        growth = input_growth(agent_id=agent.id)
        daily = daily_input_growth(agent_id=agent.id, now=timezone.now())
        growing = growth_flag(agent, growth)
        body = {
            "agent_id": agent.id,
            "runs": growth.runs,
            "slope_tokens_per_run": round(growth.slope_tokens_per_run, 2),
            "first_input_tokens": growth.first_input_tokens,
            "last_input_tokens": growth.last_input_tokens,
            "ceiling_tokens": growth_ceiling(agent),
            "growing": growing,
            "advice": growth_advice(agent, growth) if growing else "",
            "slope_tokens_per_day": round(daily["slope_tokens_per_day"], 2),
            "daily": daily["days"],
        }
        return Response(GrowthSerializer(body).data)
