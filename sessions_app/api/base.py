"""What every API view shares: auth, parsing, company scoping, query parameters, errors."""

from __future__ import annotations

from datetime import UTC, datetime, time
from uuid import UUID

from django.utils.dateparse import parse_date, parse_datetime
from django.utils.timezone import is_naive, make_aware
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework.views import APIView

from sessions_app.api.authentication import ApiKeyAuthentication, ApiKeyRequired, key_company_id
from sessions_app.api.exceptions import BadRequest, NotFound
from sessions_app.api.pagination import DEFAULT_LIMIT, MAX_LIMIT
from sessions_app.api.parsers import StrictJSONParser, check_text
from sessions_app.models import Agent, AgentStatus, Company, parse_session_id
from sessions_app.serializers import ErrorSerializer

ERROR_DESCRIPTIONS = {
    400: "Bad input: malformed JSON, wrong types, unknown fields, NUL characters, bad query parameters.",
    401: "`authenticated` mode: missing, unknown or revoked API key.",
    403: "Not allowed for this key.",
    404: "Unknown object, another company's object, or an id that is not a UUID.",
    409: "Conflicts with the object's state.",
    413: "The request body is over PAPERCLIP_MAX_BODY_BYTES.",
    429: "A key over its heartbeat ceiling, a budget spent, or the agent's queue full; see Retry-After.",
    503: "A dependency (database, history file store) is unavailable.",
}


def error_responses(*statuses: int) -> dict[int, OpenApiResponse]:
    # 401 applies to every endpoint (authenticated mode), 404 to every company URL, 503 to
    # anything that reads the database.
    return {
        status: OpenApiResponse(ErrorSerializer, description=ERROR_DESCRIPTIONS[status])
        for status in sorted({401, 404, 503, *statuses})
    }


PAGE_PARAMETERS = [
    OpenApiParameter(
        "limit", int, description=f"Rows per page, 1..{MAX_LIMIT} (default {DEFAULT_LIMIT}).", required=False
    ),
    OpenApiParameter("next", str, description="The `next` cursor of the previous page.", required=False),
]


def parse_uuid(value: str | UUID) -> UUID | None:
    if isinstance(value, UUID):
        return value
    try:
        return UUID(str(value))
    except ValueError:
        return None


class ApiView(APIView):
    """Base of every company-scoped endpoint."""

    authentication_classes = [ApiKeyAuthentication]
    permission_classes = [ApiKeyRequired]
    parser_classes = [StrictJSONParser]

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        for name, values in request.query_params.lists():
            check_text(name, name)
            for value in values:
                check_text(value, name)

    # Scoping. Another company's object is a 404, exactly like an unknown one.

    def check_company_access(self, company_id: UUID) -> None:
        allowed = key_company_id(self.request)
        if allowed is not None and allowed != company_id:
            raise NotFound("No such company.")

    def get_company(self, company_id: UUID) -> Company:
        self.check_company_access(company_id)
        company = Company.objects.filter(pk=company_id).first()
        if company is None:
            raise NotFound("No such company.")
        return company

    def get_agent(self, company_id: UUID, agent_id: UUID) -> Agent:
        """The company's (not deleted) agent, in one query."""
        self.check_company_access(company_id)
        agent = Agent.objects.filter(pk=agent_id, company_id=company_id).exclude(status=AgentStatus.DELETED).first()
        if agent is None:
            raise NotFound("No such agent.")
        return agent

    # Query parameters.

    def query_choice(self, name: str, choices) -> str | None:
        value = self.request.query_params.get(name)
        if value in (None, ""):
            return None
        if value not in choices:
            raise BadRequest(
                f"{name} must be one of {', '.join(choices)}.", code="invalid_parameter", fields={name: value}
            )
        return value

    def query_datetime(self, name: str) -> datetime | None:
        """An ISO 8601 time (naive means UTC) or date (its UTC midnight)."""
        raw = self.request.query_params.get(name)
        if raw in (None, ""):
            return None
        try:
            value = parse_datetime(raw)
            if value is None:
                day = parse_date(raw)
                value = datetime.combine(day, time.min) if day else None
            # In UTC: PostgreSQL refuses offsets beyond +-15:59 that ISO 8601 allows (+23:05).
            if value is not None:
                value = make_aware(value, UTC) if is_naive(value) else value.astimezone(UTC)
        except (ValueError, OverflowError):
            value = None
        if value is None:
            raise BadRequest(f"{name} must be an ISO 8601 date or time.", code="invalid_parameter", fields={name: raw})
        return value

    def query_uuid(self, name: str) -> UUID | None:
        return self._query_id(name, parse_uuid, expected="a UUID")

    def query_session_id(self, name: str) -> UUID | None:
        """A session id in the form the API shows it (`sess_` + 32 hex digits) or as the plain UUID."""
        return self._query_id(name, parse_session_id, expected="a session id (sess_ + 32 hex digits) or a UUID")

    def _query_id(self, name: str, parse, *, expected: str) -> UUID | None:
        raw = self.request.query_params.get(name)
        if raw in (None, ""):
            return None
        value = parse(raw)
        if value is None:
            raise BadRequest(f"{name} must be {expected}.", code="invalid_parameter", fields={name: raw})
        return value

    def query_int(self, name: str, *, default: int, minimum: int, maximum: int) -> int:
        raw = self.request.query_params.get(name)
        if raw in (None, ""):
            return default
        try:
            value = int(raw)
        except ValueError:
            value = minimum - 1
        if not minimum <= value <= maximum:
            raise BadRequest(
                f"{name} must be a whole number from {minimum} to {maximum}.",
                code="invalid_parameter",
                fields={name: raw},
            )
        return value
