"""The memory endpoints under /api/ (docs/api.md, "Memory")."""

from django.urls import path

from memory_app import views

app_name = "memory"

agent = "companies/<uuid:company_id>/agents/<uuid:agent_id>"

urlpatterns = [
    path(f"{agent}/memory", views.MemoryListView.as_view(), name="memory-list"),
    path(f"{agent}/memory/<path:memory_path>", views.MemoryFileView.as_view(), name="memory-file"),
]
