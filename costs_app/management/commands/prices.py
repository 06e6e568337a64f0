"""`manage.py prices [--at YYYY-MM-DD] [--refresh]`: the price in force per model and its source."""

from __future__ import annotations

from datetime import UTC, date, datetime, time

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from costs_app.catalogue import catalogue, catalogue_refresh
from costs_app.models import CatalogueRefresh, ModelPrice
from costs_app.pricing import LIBRARY_VERSION, price_table


class Command(BaseCommand):
    help = (
        "List every model of the catalogue and every model with an override price: its lifecycle, the price in "
        "force (USD per million tokens) and where it comes from (the genai-prices library, or an override)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--at", help="The UTC day to price (YYYY-MM-DD); default: now.")
        parser.add_argument(
            "--refresh", action="store_true", help="Refresh the model catalogue from the Models API first."
        )

    def handle(self, *args, at: str | None, refresh: bool, **options):
        now = timezone.now()
        when = now if at is None else self.day(at)
        if refresh:
            try:
                stored = catalogue_refresh(now=now)
            except Exception as exc:
                raise CommandError(
                    f"The model catalogue could not be refreshed ({type(exc).__name__}: {exc}); the last one is kept."
                ) from None
            self.stdout.write(f"Refreshed the model catalogue: {stored} models.")
        models = catalogue()
        names = sorted(set(models.entries) | set(ModelPrice.objects.values_list("model", flat=True)))
        for name in names:
            entry = models.get(name)
            lifecycle = entry.lifecycle if entry is not None and entry.id == name else "not in the catalogue"
            if entry is not None and entry.retires_at:
                lifecycle += f", retires {entry.retires_at:%Y-%m-%d}"
            table = price_table(model=name, at=when)
            price = f"{table.source}: {table.describe()}" if table is not None else "unpriced (add a model price)"
            self.stdout.write(f"{name} ({lifecycle}): {price}")
        refreshed = CatalogueRefresh.objects.filter(pk=1).values_list("refreshed_at", flat=True).first()
        source = (
            f"the Models API, refreshed {refreshed:%Y-%m-%d %H:%M} UTC"
            if models.source == "api" and refreshed
            else "the Models API"
            if models.source == "api"
            else "the price library's models (no catalogue stored yet)"
        )
        self.stdout.write(
            f"Models from {source}. Prices of {when:%Y-%m-%d %H:%M} UTC from genai-prices {LIBRARY_VERSION} "
            "(upgrading the package updates them) unless an override (admin: Costs > Model prices) applies."
        )

    def day(self, value: str) -> datetime:
        try:
            return datetime.combine(date.fromisoformat(value), time(12), UTC)
        except ValueError:
            raise CommandError(f"--at must be a day as YYYY-MM-DD, got {value!r}.") from None
