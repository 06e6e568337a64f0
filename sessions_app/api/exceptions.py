"""One error shape for the API: `{"error": {"code", "message", "fields"?}}`.

Everything a view raises passes through `api_exception_handler`; Django's own 400/404/500
pages are replaced for `/api/` paths by the handlers at the bottom, so a client never has
to parse HTML.
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import DisallowedHost, PermissionDenied, RequestDataTooBig, TooManyFieldsSent
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpRequest, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from sessions_app.adapters import AgentConfigError

logger = logging.getLogger(__name__)


class BadRequest(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "bad_request"
    default_detail = "The request is not valid."

    def __init__(self, message: str | None = None, *, code: str | None = None, fields: dict | None = None):
        super().__init__(message or self.default_detail, code or self.default_code)
        self.fields = fields


class NotFound(exceptions.NotFound):
    default_code = "not_found"


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "conflict"
    default_detail = "The request conflicts with the current state of the object."


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "payload_too_large"
    default_detail = "The request body is too large."


def payload_too_large() -> PayloadTooLarge:
    """The 413, naming the limit and the setting that raises it."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return PayloadTooLarge(f"The request body is over {limit} bytes, the limit PAPERCLIP_MAX_BODY_BYTES sets.")


class TooManyRequests(exceptions.APIException):
    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_code = "too_many_requests"
    default_detail = "Too many requests."

    def __init__(self, message: str | None = None, *, code: str | None = None, retry_after: int | None = None):
        super().__init__(message, code)
        self.retry_after = retry_after


class ServiceUnavailable(exceptions.APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_code = "service_unavailable"
    default_detail = "A service this request depends on is unavailable."


# DRF's generic codes, renamed where a client benefits from a more specific one.
DRF_CODES = {
    exceptions.ParseError: "malformed_json",
    exceptions.NotAuthenticated: "not_authenticated",
    exceptions.AuthenticationFailed: "authentication_failed",
    exceptions.PermissionDenied: "permission_denied",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.NotAcceptable: "not_acceptable",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.Throttled: "rate_limited",
}


def error_body(code: str, message: str, fields: dict | None = None) -> dict:
    error = {"code": code, "message": message}
    if fields:
        error["fields"] = fields
    return {"error": error}


def flatten_fields(detail, prefix: str = "") -> dict[str, str]:
    """DRF's nested validation detail as {"field.sub": "its messages, joined"}."""
    flat: dict[str, str] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            flat.update(flatten_fields(value, name))
    elif isinstance(detail, list):
        if detail and all(not isinstance(item, (dict, list)) for item in detail):
            flat[prefix or "non_field_errors"] = " ".join(str(item) for item in detail)
        else:
            for index, item in enumerate(detail):
                flat.update(flatten_fields(item, f"{prefix}.{index}" if prefix else str(index)))
    else:
        flat[prefix or "non_field_errors"] = str(detail)
    return flat


def _validation_response(fields: dict[str, str]) -> Response:
    names = ", ".join(sorted(fields))
    return Response(error_body("invalid", f"Invalid input: {names}.", fields), status=status.HTTP_400_BAD_REQUEST)


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, AgentConfigError):
        return _validation_response(dict(exc.fields))
    if isinstance(exc, DjangoValidationError):
        fields = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return _validation_response({key: " ".join(messages) for key, messages in fields.items()})
    if isinstance(exc, (OperationalError, InterfaceError)):
        # The database is down or the connection dropped: a dependency, not a bug.
        logger.warning("Database unavailable: %s", exc.__class__.__name__)
        exc = ServiceUnavailable("The database is unavailable; try again shortly.", code="database_unavailable")
    elif isinstance(exc, RequestDataTooBig):
        exc = payload_too_large()
    elif isinstance(exc, Http404):
        exc = NotFound("Not found.")
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()

    if isinstance(exc, exceptions.ValidationError):
        return _validation_response(flatten_fields(exc.detail))

    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # a bug: Django logs it and answers 500 (JSON, through handler500)

    detail = exc.detail if isinstance(exc, exceptions.APIException) else None
    # Exact classes only: our own subclasses (Conflict("...", code="agent_paused")) keep theirs.
    code = DRF_CODES.get(type(exc)) or getattr(detail, "code", None) or getattr(exc, "default_code", "error")
    message = str(detail) if detail is not None else "Error."
    response.data = error_body(code, message, getattr(exc, "fields", None))
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response["Retry-After"] = str(max(int(retry_after), 1))
    return response


# Django-level handlers (paperclip/urls.py): JSON for /api/, Django's pages elsewhere.


def is_api_request(request: HttpRequest) -> bool:
    # "/api" too: a client that left out the slash is an API client, owed JSON.
    return request.path == "/api" or request.path.startswith("/api/")


def json_bad_request(request: HttpRequest, exception: Exception | None = None):
    if not is_api_request(request):
        return defaults.bad_request(request, exception)
    if isinstance(exception, RequestDataTooBig):
        too_large = payload_too_large()
        return JsonResponse(error_body(too_large.default_code, str(too_large.detail)), status=too_large.status_code)
    if isinstance(exception, TooManyFieldsSent):
        # Django refuses the query string before any view reads it; say which limit it passed.
        limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
        return JsonResponse(
            error_body("invalid_parameter", f"The query string has more than {limit} parameters."), status=400
        )
    if isinstance(exception, DisallowedHost):
        # The host is not echoed: it is whatever the client wrote, and the fix is the server's.
        return JsonResponse(
            error_body(
                "disallowed_host",
                "The request's Host header names a host this server does not answer for "
                "(the operator lists them in DJANGO_ALLOWED_HOSTS and PAPERCLIP_PUBLIC_URL).",
            ),
            status=400,
        )
    return JsonResponse(error_body("bad_request", "The request is not valid."), status=400)


def json_not_found(request: HttpRequest, exception: Exception | None = None):
    if not is_api_request(request):
        return defaults.page_not_found(request, exception)
    return JsonResponse(error_body("not_found", "Not found."), status=404)


def json_server_error(request: HttpRequest):
    if not is_api_request(request):
        return defaults.server_error(request)
    return JsonResponse(error_body("server_error", "Internal server error."), status=500)
