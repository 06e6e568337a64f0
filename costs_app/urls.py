"""The budget and cost endpoints, included under /api/ by paperclip.urls (docs/api.md)."""

from django.urls import path

from costs_app import views
from costs_app.alert_views import (
    AgentAlertDeliveriesView,
    AgentAlertTargetsView,
    AgentAlertTargetView,
    CompanyAlertDeliveriesView,
    CompanyAlertTargetsView,
    CompanyAlertTargetView,
)
from costs_app.budget_views import AgentBudgetView, CompanyBudgetView

app_name = "costs"

company = "companies/<uuid:company_id>"
agent = f"{company}/agents/<uuid:agent_id>"

urlpatterns = [
    path(f"{agent}/budget", AgentBudgetView.as_view(), name="agent-budget"),
    path(f"{company}/budget", CompanyBudgetView.as_view(), name="company-budget"),
    path(f"{agent}/budget/targets", AgentAlertTargetsView.as_view(), name="agent-alert-targets"),
    path(f"{agent}/budget/targets/<int:target_id>", AgentAlertTargetView.as_view(), name="agent-alert-target"),
    path(f"{company}/budget/targets", CompanyAlertTargetsView.as_view(), name="company-alert-targets"),
    path(f"{company}/budget/targets/<int:target_id>", CompanyAlertTargetView.as_view(), name="company-alert-target"),
    path(f"{agent}/budget/deliveries", AgentAlertDeliveriesView.as_view(), name="agent-alert-deliveries"),
    path(f"{company}/budget/deliveries", CompanyAlertDeliveriesView.as_view(), name="company-alert-deliveries"),
    path(f"{company}/costs/daily", views.DailyCostsView.as_view(), name="costs-daily"),
    path(f"{company}/costs/summary", views.CostSummaryView.as_view(), name="costs-summary"),
]
