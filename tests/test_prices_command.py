"""`manage.py prices`: the price in force per model (the catalogue's, and any overridden),
where it comes from, and the catalogue refreshed on request."""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from io import StringIO

import genai_prices
import pytest
from django.core.management import CommandError, call_command

from costs_app.models import CatalogueModel, ModelPrice
from tests.conftest import catalogue_stored
from tests.fake_anthropic import CATALOGUE, model_entry


def prices(*args: str) -> str:
    out = StringIO()
    call_command("prices", *args, stdout=out)
    return out.getvalue()


def line_of(output: str, model: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(f"{model} ("))


def test_every_model_is_listed_with_its_price_and_source(db):
    catalogue_stored([*CATALOGUE, model_entry("claude-future-9", "Claude Future 9", "opus", "2026-12-01")])
    ModelPrice.from_list_price("claude-sonnet-5-5", date(2026, 12, 1), Decimal("1.5"), Decimal("8")).save()
    ModelPrice.from_list_price("acme-finetune-1", date(2026, 1, 1), Decimal("1"), Decimal("2")).save()

    output = prices("--at", "2026-12-02")

    library = f"library {genai_prices.__version__}"
    assert line_of(output, "claude-haiku-5-5") == (
        f"claude-haiku-5-5 (active): {library}: $0.10 in / $0.50 out, cache writes $0.125 (5m) / $0.20 (1h), "
        "reads $0.01 per MTok; prompts over 100,000 tokens: $0.50 in / $2.50 out, cache writes $0.625 (5m) / "
        "$1.00 (1h), reads $0.05 per MTok"
    )
    assert line_of(output, "claude-sonnet-5-5").startswith("claude-sonnet-5-5 (active): override: $1.50 in / $8.00 out")
    assert line_of(output, "claude-opus-4-5").startswith("claude-opus-4-5 (deprecated, retires 2027-02-01): library")
    assert line_of(output, "acme-finetune-1").startswith("acme-finetune-1 (not in the catalogue): override: $1.00 in")
    assert line_of(output, "claude-future-9") == "claude-future-9 (active): unpriced (add a model price)"
    assert f"genai-prices {genai_prices.__version__} (upgrading the package updates them)" in output
    # Before the override's day, the library's price.
    assert line_of(prices("--at", "2026-11-30"), "claude-sonnet-5-5").startswith(
        f"claude-sonnet-5-5 (active): {library}"
    )


def test_refresh_reads_the_models_api_first_and_keeps_the_catalogue_when_it_is_down(db, fake_anthropic):
    output = prices("--refresh")
    assert f"Refreshed the model catalogue: {len(CATALOGUE)} models." in output
    assert "claude-opus-4-1 (retired" in output
    fake_anthropic.stop()
    with pytest.raises(CommandError, match="could not be refreshed.*the last one is kept"):
        prices("--refresh")
    assert CatalogueModel.objects.count() == len(CATALOGUE)


def test_a_bad_day_is_a_clear_error(db):
    with pytest.raises(CommandError, match="--at must be a day as YYYY-MM-DD"):
        prices("--at", "yesterday")
