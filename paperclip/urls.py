from django.contrib import admin
from django.urls import include, path

from paperclip.health import health

urlpatterns = [
    path("api/health", health, name="health"),
    path("api/", include("sessions_app.urls")),
    path("admin/", admin.site.urls),
]
