from django.apps import AppConfig


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = "Agents and sessions"

    def ready(self) -> None:
        from costs_app.signals import budget_changed
        from sessions_app import checks  # noqa: F401 - registers the system checks
        from sessions_app.services import budget_changed_release

        budget_changed.connect(budget_changed_release, dispatch_uid="sessions_app.budget_changed_release")
