from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from paperclip.health import health

urlpatterns = [
    # The service has no site of its own: its front page is the operator console.
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("api/health", health, name="health"),
    path("api/", include("sessions_app.urls")),
    path("api/", include("costs_app.urls")),
    path("api/", include("memory_app.urls")),
    path("admin/", admin.site.urls),
]

# JSON errors for /api/ paths (Django's pages elsewhere): unknown URLs, ids that are not
# UUIDs, bodies over the limit caught outside a view, and crashes.
handler400 = "sessions_app.api.exceptions.json_bad_request"
handler404 = "sessions_app.api.exceptions.json_not_found"
handler500 = "sessions_app.api.exceptions.json_server_error"
