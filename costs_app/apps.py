from django.apps import AppConfig


class CostsAppConfig(AppConfig):
    name = "costs_app"
    verbose_name = "Costs"

    def ready(self) -> None:
        from costs_app import checks  # noqa: F401 - registers the system checks
