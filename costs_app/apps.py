from django.apps import AppConfig


class CostsAppConfig(AppConfig):
    name = "costs_app"
    verbose_name = "Costs"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from costs_app import checks  # noqa: F401 - registers the system checks
        from costs_app.models import ModelPrice
        from costs_app.pricing import overrides_changed

        # Every process holds the overrides in memory; a change moves their revision.
        post_save.connect(overrides_changed, sender=ModelPrice, dispatch_uid="overrides_changed_save")
        post_delete.connect(overrides_changed, sender=ModelPrice, dispatch_uid="overrides_changed_delete")
