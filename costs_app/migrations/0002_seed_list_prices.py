"""Anthropic list prices (USD per million tokens), effective from the start of 2025.

Cache writes cost 1.25x input for the 5-minute lifetime and 2x for one hour; cache reads
0.1x input. Operators add later prices in the admin with their own effective dates.
"""

import datetime
from decimal import Decimal

from django.db import migrations

LIST_PRICES = {
    "claude-opus-4-5": ("5", "25"),
    "claude-opus-4-6": ("5", "25"),
    "claude-sonnet-4-5": ("3", "15"),
    "claude-sonnet-4-6": ("3", "15"),
    "claude-haiku-4-5": ("1", "5"),
}
EFFECTIVE_FROM = datetime.date(2025, 1, 1)


def seeded_values(model: str) -> dict:
    """The rates this migration writes for `model` (0009 removes rows still equal to them)."""
    input_price, output_price = LIST_PRICES[model]
    base = Decimal(input_price)
    return {
        "input_usd_per_mtok": base,
        "output_usd_per_mtok": Decimal(output_price),
        "cache_write_5m_usd_per_mtok": base * Decimal("1.25"),
        "cache_write_1h_usd_per_mtok": base * 2,
        "cache_read_usd_per_mtok": base * Decimal("0.1"),
    }


def seed_prices(apps, schema_editor):
    ModelPrice = apps.get_model("costs_app", "ModelPrice")
    for model in LIST_PRICES:
        ModelPrice.objects.get_or_create(model=model, effective_from=EFFECTIVE_FROM, defaults=seeded_values(model))


def unseed_prices(apps, schema_editor):
    ModelPrice = apps.get_model("costs_app", "ModelPrice")
    ModelPrice.objects.filter(model__in=LIST_PRICES, effective_from=EFFECTIVE_FROM).delete()


class Migration(migrations.Migration):
    dependencies = [("costs_app", "0001_initial")]

    operations = [migrations.RunPython(seed_prices, unseed_prices)]
