"""Cost endpoints, included under /api/companies/<company_id>/costs/ by sessions_app.urls."""

from django.urls import path

from costs_app import views

urlpatterns = [
    path("daily", views.DailyCostsView.as_view(), name="costs-daily"),
    path("summary", views.CostSummaryView.as_view(), name="costs-summary"),
]
