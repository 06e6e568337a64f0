"""Deployment modes for the API.

`local_trusted`: the API is open (the server binds loopback only; see the serve command).
`authenticated`: every call carries `Authorization: Bearer <key>`; the key belongs to one
company, and any other company's URL answers 404, exactly as an unknown id would, so a key
cannot probe which companies exist.

The mode is read per request (not at import) so that tests can switch it.
"""

from __future__ import annotations

from django.conf import settings
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.throttling import SimpleRateThrottle

from sessions_app.api_keys import api_key_authenticate
from sessions_app.models import ApiKey


def is_authenticated_mode() -> bool:
    return settings.PAPERCLIP_DEPLOYMENT_MODE == "authenticated"


class ApiKeyAuthentication(BaseAuthentication):
    """`Authorization: Bearer <key>`; request.auth becomes the ApiKey row."""

    keyword = "Bearer"

    def authenticate(self, request):
        if not is_authenticated_mode():
            return None
        header = get_authorization_header(request).split()
        if not header:
            return None
        if header[0].lower() != self.keyword.lower().encode():
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <key>'.")
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Use 'Authorization: Bearer <key>' with exactly one key.")
        try:
            plaintext = header[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("Invalid API key.") from None
        api_key = api_key_authenticate(plaintext=plaintext, now=timezone.now())
        if api_key is None:
            # One message for unknown and revoked keys: the answer reveals nothing.
            raise exceptions.AuthenticationFailed("Invalid or revoked API key.")
        return (None, api_key)

    def authenticate_header(self, request) -> str:
        return f'{self.keyword} realm="api"'


class ApiKeyRequired(BasePermission):
    message = "Authentication required: 'Authorization: Bearer <key>'."

    def has_permission(self, request, view) -> bool:
        return not is_authenticated_mode() or isinstance(request.auth, ApiKey)


def key_company_id(request):
    """The company the request's key is limited to; None when nothing limits it."""
    return request.auth.company_id if isinstance(request.auth, ApiKey) else None


class HeartbeatRateThrottle(SimpleRateThrottle):
    """A generous ceiling on heartbeats per API key, in authenticated mode only.

    Not per client address: one host may run a script that wakes hundreds of agents. A
    `"wait": true` heartbeat is not counted: it is paced by its own answer, so a sequential
    loop is never throttled. What a flood of queued work costs is bounded per agent instead
    (PAPERCLIP_MAX_QUEUED_RUNS, `queue_full`).
    """

    scope = "heartbeat"

    def get_rate(self) -> str:
        return settings.PAPERCLIP_HEARTBEAT_RATE

    def allow_request(self, request, view) -> bool:
        if not isinstance(request.auth, ApiKey) or waits_for_answer(request):
            return True
        return super().allow_request(request, view)

    def get_cache_key(self, request, view) -> str:
        return self.cache_format % {"scope": self.scope, "ident": f"key:{request.auth.pk}"}


def waits_for_answer(request) -> bool:
    # The body is parsed here, before the view; a malformed one is the same 400 either way.
    data = request.data
    return isinstance(data, dict) and data.get("wait") is True


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "sessions_app.api.authentication.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "Needed in the `authenticated` deployment mode; ignored in `local_trusted`.",
        }
