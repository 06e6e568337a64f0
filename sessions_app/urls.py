"""The REST API under /api/ (docs/api.md). Ids in paths that are not UUIDs match
nothing and answer the JSON 404 of `paperclip.urls.handler404`."""

from django.urls import path

from sessions_app import views
from sessions_app.api.approval_views import RunApproveView, RunDenyView
from sessions_app.api.history_views import AgentGrowthView, SessionArchiveView
from sessions_app.api.output_views import OutputDetailView, OutputListView
from sessions_app.api.pin_views import PinDetailView, PinListView
from sessions_app.api.schema_views import DocsView, SchemaView

app_name = "api"

company = "companies/<uuid:company_id>"
agent = f"{company}/agents/<uuid:agent_id>"

urlpatterns = [
    path("schema/", SchemaView.as_view(), name="schema"),
    path("docs/", DocsView.as_view(url_name="api:schema"), name="docs"),
    path("companies", views.CompanyCreateView.as_view(), name="company-create"),
    path(company, views.CompanyDetailView.as_view(), name="company-detail"),
    path(f"{company}/agents", views.AgentListView.as_view(), name="agent-list"),
    path(agent, views.AgentDetailView.as_view(), name="agent-detail"),
    path(f"{agent}/heartbeat", views.HeartbeatView.as_view(), name="agent-heartbeat"),
    path(f"{agent}/runs", views.RunListView.as_view(), name="run-list"),
    path(f"{agent}/runs/<uuid:run_id>", views.RunDetailView.as_view(), name="run-detail"),
    path(f"{agent}/runs/<uuid:run_id>/approve", RunApproveView.as_view(), name="run-approve"),
    path(f"{agent}/runs/<uuid:run_id>/deny", RunDenyView.as_view(), name="run-deny"),
    path(f"{agent}/sessions", views.SessionListView.as_view(), name="session-list"),
    path(f"{agent}/sessions/<str:session_id>", views.SessionDetailView.as_view(), name="session-detail"),
    path(f"{agent}/sessions/<str:session_id>/compact", views.SessionCompactView.as_view(), name="session-compact"),
    path(f"{agent}/sessions/<str:session_id>/archive", SessionArchiveView.as_view(), name="session-archive"),
    path(f"{agent}/growth", AgentGrowthView.as_view(), name="agent-growth"),
    path(f"{agent}/pins", PinListView.as_view(), name="agent-pins"),
    path(f"{agent}/pins/<uuid:pin_id>", PinDetailView.as_view(), name="agent-pin-detail"),
    path(f"{agent}/outputs", OutputListView.as_view(), name="agent-outputs"),
    path(f"{agent}/outputs/<int:output_id>", OutputDetailView.as_view(), name="agent-output-detail"),
]
