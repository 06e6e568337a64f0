"""Prices now come from the genai-prices library (costs_app.pricing): the list prices 0002
seeded by hand go. Only rows still exactly as seeded are removed; a row an operator changed
is an override and stays. What was seeded is read from 0002 itself, never typed again.
Reversed, 0002's prices are put back for the code that needs them."""

from importlib import import_module

from django.db import migrations

SEED = import_module("costs_app.migrations.0002_seed_list_prices")


def drop_seeded(apps, schema_editor):
    ModelPrice = apps.get_model("costs_app", "ModelPrice")
    for model in SEED.LIST_PRICES:
        ModelPrice.objects.filter(model=model, effective_from=SEED.EFFECTIVE_FROM, **SEED.seeded_values(model)).delete()


class Migration(migrations.Migration):
    dependencies = [("costs_app", "0008_model_catalogue_and_price_sources")]

    operations = [migrations.RunPython(drop_seeded, SEED.seed_prices)]
