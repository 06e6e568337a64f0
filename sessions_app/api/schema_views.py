"""The OpenAPI schema (/api/schema/) and its Swagger UI page (/api/docs/), answering errors
as every other endpoint does: JSON, `{"error": {"code", "message"}}` (docs/api.md)."""

from __future__ import annotations

from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.renderers import JSONRenderer


class JsonErrors:
    """An error is rendered as JSON: the schema's own renderers would write it in YAML, and
    the page's template renderer as bare text ("405 Method Not Allowed")."""

    def handle_exception(self, exc):
        response = super().handle_exception(exc)
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = JSONRenderer.media_type
        return response


class SchemaView(JsonErrors, SpectacularAPIView):
    pass


class DocsView(JsonErrors, SpectacularSwaggerView):
    # A page to read. DRF would answer OPTIONS with its metadata rendered through the
    # page's template, which has none for it: a 500.
    http_method_names = ["get", "head"]
