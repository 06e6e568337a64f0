from django.apps import AppConfig

from paperclip.process_privacy import environment_hide


class SessionsAppConfig(AppConfig):
    name = "sessions_app"
    verbose_name = "Agents and sessions"

    def ready(self) -> None:
        from costs_app.signals import budget_changed
        from paperclip import lookups  # noqa: F401 - registers the lookups on integer columns
        from sessions_app import checks  # noqa: F401 - registers the system checks
        from sessions_app.services import budget_changed_release

        budget_changed.connect(budget_changed_release, dispatch_uid="sessions_app.budget_changed_release")
        # Before any agent runs a command: this process's secrets stay out of its reach.
        environment_hide()
        telemetry_start_from_environment()


def telemetry_start_from_environment() -> None:
    """OpenTelemetry when the OTEL_* variables ask for it (paperclip/telemetry.py); with
    them unset this imports nothing of it. Before any request or query: the Django and
    database instrumentations must be in place first."""
    from paperclip import telemetry

    if telemetry.enabled():
        from sessions_app.quota import holds_count

        telemetry.telemetry_start(held_count=holds_count)
