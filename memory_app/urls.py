"""The memory endpoints under /api/ (docs/api.md, "Memory")."""

from django.urls import path, register_converter
from django.urls.converters import PathConverter

from memory_app import views

app_name = "memory"


class MemoryPathConverter(PathConverter):
    """Any path, newlines included. Django's `path` converter (`.+`) stops at a newline, so
    a path holding one matched no URL (a bare 404): the view's own path check must answer
    it, as it answers every other control character (400 `memory_path_invalid`)."""

    regex = r"[\s\S]+"


register_converter(MemoryPathConverter, "memory_path")

agent = "companies/<uuid:company_id>/agents/<uuid:agent_id>"

urlpatterns = [
    path(f"{agent}/memory", views.MemoryListView.as_view(), name="memory-list"),
    path(f"{agent}/memory/<memory_path:memory_path>", views.MemoryFileView.as_view(), name="memory-file"),
]
