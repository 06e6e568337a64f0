from django.apps import AppConfig


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = "Agents and sessions"

    def ready(self) -> None:
        from sessions_app import checks  # noqa: F401 - registers the system checks
