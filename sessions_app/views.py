"""The REST API: companies, agents, heartbeats, runs and sessions.

Thin views: they scope every lookup to the company in the URL (and to the key's company in
`authenticated` mode), validate input with the serializers, and call the same functions as
the admin and the commands (`sessions_app.services`, `sessions_app.heartbeat`).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.http import HttpResponse
from django.urls import reverse
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from costs_app.budgets import next_month
from sessions_app import heartbeat
from sessions_app.adapters.base import QuotaRefused
from sessions_app.agent_health import with_health_facts
from sessions_app.api.authentication import HeartbeatRateThrottle, is_authenticated_mode
from sessions_app.api.base import PAGE_PARAMETERS, ApiView, error_responses
from sessions_app.api.exceptions import BadRequest, Conflict, NotFound, ServiceUnavailable, TooManyRequests
from sessions_app.api.history_views import CompactionSerializer
from sessions_app.api.pagination import Keyset, parse_limit
from sessions_app.api.session_list import SESSION_ORDER, session_list_page
from sessions_app.compact_now import session_compact
from sessions_app.errors import HeartbeatRefused, HistoryUnavailable, QueueUnavailable, RunFailure, SummaryFailed
from sessions_app.models import (
    RUN_BATCH_COLUMNS,
    Agent,
    AgentSession,
    AgentStatus,
    HeartbeatRun,
    PausedReason,
    RunStatus,
    RunTrigger,
    SessionStatus,
    parse_session_id,
)
from sessions_app.schedules import agent_schedule_sync
from sessions_app.serializers import (
    AgentListSerializer,
    AgentSerializer,
    CompactRequestSerializer,
    CompanySerializer,
    HeartbeatRequestSerializer,
    RunListSerializer,
    RunSerializer,
    SessionDetailSerializer,
    SessionListSerializer,
)
from sessions_app.services import agent_delete, agent_pause, agent_resume, session_delete
from sessions_app.stores import store_for

# Keyset orderings; each is served by an index named in the models.
AGENT_ORDER = Keyset("name", descending=False)  # agents_company_status_idx
RUN_ORDER = Keyset("created_at", descending=True)  # runs_agent_created_idx


# Companies


class CompanyCreateView(ApiView):
    @extend_schema(
        operation_id="company_create",
        request=CompanySerializer,
        responses={201: CompanySerializer, **error_responses(400, 403, 413)},
        description="Create a company. In `authenticated` mode keys are company-scoped, so companies are "
        "created by an operator (admin) instead: 403.",
    )
    def post(self, request):
        if is_authenticated_mode():
            raise PermissionDenied("API keys are company-scoped; create companies in the admin.")
        serializer = CompanySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        company = serializer.save()
        return Response(CompanySerializer(company).data, status=status.HTTP_201_CREATED)


class CompanyDetailView(ApiView):
    @extend_schema(operation_id="company_retrieve", responses={200: CompanySerializer, **error_responses()})
    def get(self, request, company_id: UUID):
        return Response(CompanySerializer(self.get_company(company_id)).data)


# Agents


def agent_apply_status(*, agent: Agent, wanted: str | None) -> None:
    if wanted == AgentStatus.PAUSED and agent.status == AgentStatus.ACTIVE:
        agent_pause(agent=agent, reason=PausedReason.API)
    elif wanted == AgentStatus.ACTIVE and agent.status == AgentStatus.PAUSED:
        agent_resume(agent=agent)


class AgentListView(ApiView):
    @extend_schema(
        operation_id="agents_list",
        parameters=[
            *PAGE_PARAMETERS,
            OpenApiParameter("status", str, enum=["active", "paused"], required=False),
        ],
        responses={200: AgentListSerializer, **error_responses(400)},
        description="The company's agents by name (deleted agents are not listed).",
    )
    def get(self, request, company_id: UUID):
        company = self.get_company(company_id)
        limit = parse_limit(request.query_params.get("limit"))
        wanted = self.query_choice("status", [AgentStatus.ACTIVE, AgentStatus.PAUSED])
        agents = with_health_facts(Agent.objects.filter(company=company).exclude(status=AgentStatus.DELETED))
        if wanted:
            agents = agents.filter(status=wanted)
        rows, cursor = AGENT_ORDER.page(agents, limit=limit, cursor=request.query_params.get("next"))
        return Response({"agents": AgentSerializer(rows, many=True).data, "next": cursor})

    @extend_schema(
        operation_id="agent_create",
        request=AgentSerializer,
        responses={201: AgentSerializer, **error_responses(400, 413)},
    )
    def post(self, request, company_id: UUID):
        company = self.get_company(company_id)
        serializer = AgentSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        wanted = serializer.validated_data.pop("status", None)
        with transaction.atomic():
            agent = serializer.save(company=company)
            agent_schedule_sync(agent=agent)
            agent_apply_status(agent=agent, wanted=wanted)
        return Response(AgentSerializer(agent).data, status=status.HTTP_201_CREATED)


# What a PUT leaves out: the model's defaults, as for a new agent.
AGENT_DEFAULTS = {
    name: Agent._meta.get_field(name).get_default() for name in ("system_prompt", "adapter_type", "adapter_config")
}


class AgentDetailView(ApiView):
    @extend_schema(operation_id="agent_retrieve", responses={200: AgentSerializer, **error_responses()})
    def get(self, request, company_id: UUID, agent_id: UUID):
        return Response(AgentSerializer(self.get_agent(company_id, agent_id)).data)

    @extend_schema(
        operation_id="agent_update",
        request=AgentSerializer(partial=True),
        responses={200: AgentSerializer, **error_responses(400, 413)},
    )
    def patch(self, request, company_id: UUID, agent_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        return self.save(AgentSerializer(agent, data=request.data, partial=True))

    @extend_schema(
        operation_id="agent_replace",
        request=AgentSerializer,
        responses={200: AgentSerializer, **error_responses(400, 413)},
        description="Replace the agent: `name` is required; `system_prompt`, `adapter_type` and `adapter_config` "
        "left out take their defaults, as when the agent is created; `status` left out is kept.",
    )
    def put(self, request, company_id: UUID, agent_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        body = request.data
        if isinstance(body, dict):
            body = {**AGENT_DEFAULTS, **body}
        return self.save(AgentSerializer(agent, data=body))

    def save(self, serializer: AgentSerializer) -> Response:
        serializer.is_valid(raise_exception=True)
        wanted = serializer.validated_data.pop("status", None)
        with transaction.atomic():
            agent = serializer.save()
            agent_schedule_sync(agent=agent)
            agent_apply_status(agent=agent, wanted=wanted)
        return Response(AgentSerializer(agent).data)

    @extend_schema(operation_id="agent_delete", responses={204: None, **error_responses()})
    def delete(self, request, company_id: UUID, agent_id: UUID):
        agent_delete(agent=self.get_agent(company_id, agent_id), now=timezone.now())
        return Response(status=status.HTTP_204_NO_CONTENT)


# Heartbeats and runs

REFUSALS = {
    "invalid_idempotency_key": BadRequest,
    "agent_paused": Conflict,
    "idempotency_key_reused": Conflict,
    "agent_deleted": NotFound,
    "budget_exceeded": TooManyRequests,
    # The agent's configuration and the price list disagree: fixed by a price, not by waiting.
    "model_unpriced": Conflict,
    # The catalogue lists the agent's model as retired: fixed by another model.
    "model_retired": Conflict,
    "queue_full": TooManyRequests,
}

# A full queue drains one run at a time; a few seconds is a fair first wait.
QUEUE_FULL_RETRY_AFTER_SECONDS = 5


def seconds_until_next_utc_month(now: datetime) -> int:
    """An agent paused by its budget is released when the UTC month turns (budgets_release)."""
    return max(int((next_month(now) - now) / timedelta(seconds=1)), 1)


# Refusals of the body's own fields answer as its other field errors do: 400 `invalid`,
# naming the field.
FIELD_REFUSALS = {"invalid_task": "task", "task_too_long": "task", "invalid_delivery": "delivery"}


def refusal_error(exc: HeartbeatRefused, now: datetime) -> Exception:
    if field := FIELD_REFUSALS.get(exc.code):
        return BadRequest(f"Invalid input: {field}.", code="invalid", fields={field: exc.message})
    error_class = REFUSALS.get(exc.code, Conflict)
    if error_class is TooManyRequests:
        retry_after = QUEUE_FULL_RETRY_AFTER_SECONDS if exc.code == "queue_full" else seconds_until_next_utc_month(now)
        return TooManyRequests(exc.message, code=exc.code, retry_after=retry_after)
    return error_class(exc.message, code=exc.code)


def run_url(run: HeartbeatRun) -> str:
    return reverse("api:run-detail", args=[run.company_id, run.agent_id, run.id])


class HeartbeatView(ApiView):
    throttle_classes = [HeartbeatRateThrottle]

    @extend_schema(
        operation_id="agent_heartbeat",
        request=HeartbeatRequestSerializer,
        responses={
            200: OpenApiResponse(RunSerializer, description="`wait` true: the finished run (see its status)."),
            202: OpenApiResponse(RunSerializer, description="The queued run (or an unfinished earlier run)."),
            **error_responses(400, 409, 413, 429, 503),
        },
        description="Wake the agent with a task. Repeating an `idempotency_key` returns the run it started "
        "(200 when finished, 202 when not) and never runs it again.",
    )
    def post(self, request, company_id: UUID, agent_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        serializer = HeartbeatRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        now = timezone.now()
        try:
            run, _ = heartbeat.heartbeat_start(
                agent=agent,
                task=data["task"],
                trigger=RunTrigger.API,
                now=now,
                wait=data["wait"],
                idempotency_key=data.get("idempotency_key"),
                force_fresh=data["force_fresh"],
                delivery=data["delivery"],
            )
        except HeartbeatRefused as exc:
            raise refusal_error(exc, now) from None
        except QueueUnavailable as exc:
            raise ServiceUnavailable(exc.message, code=exc.code) from exc
        answer = status.HTTP_200_OK if run.is_finished else status.HTTP_202_ACCEPTED
        headers = {"Location": run_url(run)} if answer == status.HTTP_202_ACCEPTED else None
        return Response(RunSerializer(run).data, status=answer, headers=headers)


class RunListView(ApiView):
    @extend_schema(
        operation_id="runs_list",
        parameters=[*PAGE_PARAMETERS, OpenApiParameter("status", str, enum=RunStatus.values, required=False)],
        responses={200: RunListSerializer, **error_responses(400)},
        description="The agent's heartbeat runs, newest first.",
    )
    def get(self, request, company_id: UUID, agent_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        limit = parse_limit(request.query_params.get("limit"))
        wanted = self.query_choice("status", RunStatus.values)
        runs = HeartbeatRun.objects.filter(agent=agent).select_related("tool_loop").defer(*RUN_BATCH_COLUMNS)
        if wanted:
            runs = runs.filter(status=wanted)
        rows, cursor = RUN_ORDER.page(runs, limit=limit, cursor=request.query_params.get("next"))
        return Response({"runs": RunSerializer(rows, many=True).data, "next": cursor})


class RunDetailView(ApiView):
    @extend_schema(operation_id="run_retrieve", responses={200: RunSerializer, **error_responses()})
    def get(self, request, company_id: UUID, agent_id: UUID, run_id: UUID):
        agent = self.get_agent(company_id, agent_id)
        run = (
            HeartbeatRun.objects.filter(pk=run_id, agent=agent)
            .select_related("tool_loop")
            .defer(*RUN_BATCH_COLUMNS)
            .first()
        )
        if run is None:
            raise NotFound("No such run.")
        return Response(RunSerializer(run).data)


# Sessions

SESSION_ID_PARAMETER = OpenApiParameter(
    "session_id", str, OpenApiParameter.PATH, description="`sess_` + 32 hex digits, or the plain UUID."
)


class SessionListView(ApiView):
    @extend_schema(
        operation_id="sessions_list",
        parameters=[
            *PAGE_PARAMETERS,
            OpenApiParameter("status", str, enum=SessionStatus.values, required=False),
            OpenApiParameter("created_after", datetime, required=False, description="ISO 8601; inclusive."),
            OpenApiParameter("created_before", datetime, required=False, description="ISO 8601; exclusive."),
        ],
        responses={200: SessionListSerializer, **error_responses(400)},
        description="The agent's sessions, most recently used first, without their history.",
    )
    def get(self, request, company_id: UUID, agent_id: UUID):
        self.check_company_access(company_id)
        limit = parse_limit(request.query_params.get("limit"))
        status_wanted = self.query_choice("status", SessionStatus.values)
        created_after = self.query_datetime("created_after")
        created_before = self.query_datetime("created_before")
        cursor = request.query_params.get("next")
        # One query for the page and the agent's scope (the join is on the agents' primary
        # key); only an empty page needs a second look, to tell "no sessions" from a 404.
        page = session_list_page(
            company_id=company_id,
            agent_id=agent_id,
            limit=limit,
            status=status_wanted,
            created_after=created_after,
            created_before=created_before,
            after=SESSION_ORDER.decode(cursor, AgentSession) if cursor else None,
        )
        if page.empty:
            self.get_agent(company_id, agent_id)
        # Already JSON (see sessions_app.api.session_list); auth, permissions and the error
        # handler ran as for any view, only the renderer is skipped.
        return HttpResponse(page.body, content_type="application/json")


HISTORY_STATUSES = {"history_unreadable": status.HTTP_503_SERVICE_UNAVAILABLE}


class SessionLookup(ApiView):
    """Views of one session of an agent, found by either id form."""

    def get_session(self, company_id: UUID, agent_id: UUID, session_id: str, *, with_history: bool) -> AgentSession:
        agent = self.get_agent(company_id, agent_id)
        parsed = parse_session_id(session_id)
        if parsed is None:
            raise NotFound("No such session.")
        sessions = AgentSession.objects.filter(pk=parsed, agent=agent)
        if not with_history:
            sessions = sessions.defer("history")
        session = sessions.first()
        if session is None:
            raise NotFound("No such session.")
        return session


class SessionDetailView(SessionLookup):
    @extend_schema(
        operation_id="session_retrieve",
        parameters=[SESSION_ID_PARAMETER],
        responses={200: SessionDetailSerializer, **error_responses(409, 503)},
        description="One session with its history. A history file that is missing or corrupt is a 409 "
        "naming the problem (`history_missing`, `history_corrupt`, `history_mismatch`); an unreadable one "
        "a 503 (`history_unreadable`).",
    )
    def get(self, request, company_id: UUID, agent_id: UUID, session_id: str):
        session = self.get_session(company_id, agent_id, session_id, with_history=True)
        try:
            history = store_for(session).read(session)
        except HistoryUnavailable as exc:
            if HISTORY_STATUSES.get(exc.code) == status.HTTP_503_SERVICE_UNAVAILABLE:
                raise ServiceUnavailable(exc.message, code=exc.code) from None
            raise Conflict(exc.message, code=exc.code) from None
        # Shown, never saved: for the file store the column itself stays empty.
        session.history = history
        return Response(SessionDetailSerializer(session).data)

    @extend_schema(
        operation_id="session_delete",
        parameters=[SESSION_ID_PARAMETER],
        responses={204: None, **error_responses()},
        description="Delete the session and its history (row and file). The next heartbeat starts fresh.",
    )
    def delete(self, request, company_id: UUID, agent_id: UUID, session_id: str):
        session_delete(
            session=self.get_session(company_id, agent_id, session_id, with_history=False), now=timezone.now()
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


# Compact now: the refusals a client can act on, by status; a failed summary call is the
# model's or the process agent command's (503, its code `compaction_<the call's code>`).
COMPACT_STATUSES = {
    "agent_deleted": NotFound,
    "budget_exceeded": TooManyRequests,
}


def compact_error(failure: RunFailure, now: datetime) -> Exception:
    if failure.code == "budget_exceeded":
        return TooManyRequests(failure.message, code=failure.code, retry_after=seconds_until_next_utc_month(now))
    if failure.code == "run_cap_reached":
        # A place frees when a run finishes: as soon as a full queue drains one run.
        return TooManyRequests(failure.message, code=failure.code, retry_after=QUEUE_FULL_RETRY_AFTER_SECONDS)
    if isinstance(failure, QuotaRefused):
        # The provider's quota: try again at its reset (the credential is held until then).
        reset = failure.reset(now=now)
        wait = (reset - now).total_seconds() if reset is not None else settings.PAPERCLIP_QUOTA_HOLD_SECONDS
        return TooManyRequests(failure.message, code=failure.code, retry_after=max(math.ceil(wait), 1))
    if failure.code in COMPACT_STATUSES:
        return COMPACT_STATUSES[failure.code](failure.message, code=failure.code)
    if isinstance(failure, SummaryFailed) or failure.code == "history_unreadable":
        return ServiceUnavailable(failure.message, code=failure.code)
    return Conflict(failure.message, code=failure.code)


class SessionCompactView(SessionLookup):
    @extend_schema(
        operation_id="session_compact",
        parameters=[SESSION_ID_PARAMETER],
        request=CompactRequestSerializer,
        responses={200: CompactionSerializer, **error_responses(400, 409, 429, 503)},
        description="Summarise the session's older turns now, keeping the last `keep_recent_turns` verbatim "
        "(same rules, record, ledger row and budget reservation as a heartbeat's compaction). 409: "
        "`session_busy` (a heartbeat is running), `nothing_to_compact`, `session_not_live`, "
        "`compaction_not_shrinking`, `compaction_not_supported`, `history_malformed` (an entry of the history is "
        "not a turn), `agent_paused`; 429 `budget_exceeded`, "
        "`run_cap_reached` (PAPERCLIP_MAX_CONCURRENT_RUNS runs in progress or waiting for a place).",
    )
    def post(self, request, company_id: UUID, agent_id: UUID, session_id: str):
        session = self.get_session(company_id, agent_id, session_id, with_history=False)
        serializer = CompactRequestSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        now = timezone.now()
        try:
            record = session_compact(
                session=session,
                now=now,
                keep_recent_turns=serializer.validated_data.get("keep_recent_turns"),
                trigger=RunTrigger.API,
            )
        except RunFailure as failure:
            raise compact_error(failure, now) from None
        return Response(CompactionSerializer(record).data)
