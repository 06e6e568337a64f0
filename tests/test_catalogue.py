"""The model catalogue: learned from the Models API (every page, every lifecycle), refreshed
by the maintenance pass at most once per interval by one process of many, kept when the API
is down, and the price library's models on an install that never had one."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from costs_app.catalogue import catalogue, catalogue_refresh
from costs_app.models import CatalogueModel, CatalogueRefresh
from sessions_app.maintenance import maintenance_pass
from tests.conftest import on_own_connection
from tests.fake_anthropic import CATALOGUE

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def stored() -> dict[str, tuple]:
    return {
        row.model: (row.lifecycle, row.max_input_tokens, row.max_tokens, row.retires_at)
        for row in CatalogueModel.objects.all()
    }


def test_a_refresh_stores_every_model_the_api_lists_on_every_page(db, fake_anthropic):
    fake_anthropic.models_page_size = 5

    assert catalogue_refresh(now=NOW) == len(CATALOGUE)

    rows = stored()
    assert set(rows) == {entry["id"] for entry in CATALOGUE}
    assert rows["claude-opus-5-5"] == ("active", 1_000_000, 128_000, None)
    assert rows["claude-opus-4-5"] == ("deprecated", 200_000, 64_000, datetime(2027, 2, 1, tzinfo=UTC))
    assert rows["claude-opus-4-1"][0] == "retired"  # listed only when asked for: it was
    # Three pages of five, each after the last id of the one before.
    pages = fake_anthropic.models_requests
    assert len(pages) == 3
    assert [page.get("after_id") for page in pages] == [None, [CATALOGUE[4]["id"]], [CATALOGUE[9]["id"]]]
    assert all(page["lifecycle[]"] == ["active", "deprecated", "retired"] for page in pages)
    assert catalogue().source == "api" and catalogue().get("claude-sonnet-5-5").line == "sonnet"
    assert CatalogueRefresh.objects.get().refreshed_at == NOW


def test_a_refresh_replaces_the_catalogue_models_dropped_included(db, fake_anthropic):
    catalogue_refresh(now=NOW)
    assert catalogue().get(CATALOGUE[0]["id"]).lifecycle == "active"
    fake_anthropic.models = [entry for entry in CATALOGUE if entry["id"] != "claude-sonnet-5"]
    fake_anthropic.models[0] = {**fake_anthropic.models[0], "lifecycle": "deprecated"}

    catalogue_refresh(now=NOW + timedelta(hours=6))

    assert "claude-sonnet-5" not in stored()
    assert stored()[CATALOGUE[0]["id"]][0] == "deprecated"
    assert catalogue().get(CATALOGUE[0]["id"]).lifecycle == "deprecated"  # read again at once


@pytest.mark.parametrize("fault", ["down", "500", "empty"])
def test_with_the_models_api_down_the_last_catalogue_stays(db, fake_anthropic, settings, caplog, fault):
    settings.PAPERCLIP_MODELS_REFRESH_MINUTES = 60
    assert maintenance_pass(now=NOW)["models_refreshed"] == len(CATALOGUE)
    before = stored()
    if fault == "down":
        fake_anthropic.stop()
    elif fault == "500":
        fake_anthropic.models_error = 500
    else:
        fake_anthropic.models = []

    result = maintenance_pass(now=NOW + timedelta(minutes=61))

    assert result["models_refreshed"] is None
    assert stored() == before
    assert catalogue().source == "api" and catalogue().get("claude-haiku-5-5") is not None
    assert "The model catalogue could not be refreshed" in caplog.text
    refresh = CatalogueRefresh.objects.get()
    assert refresh.refreshed_at == NOW and refresh.error
    # The other steps ran.
    assert result["expired"] == 0 and result["alerts_queued"] == 0


def test_the_maintenance_pass_refreshes_at_most_once_per_interval(db, fake_anthropic, settings):
    settings.PAPERCLIP_MODELS_REFRESH_MINUTES = 60

    results = [maintenance_pass(now=NOW + timedelta(minutes=minutes))["models_refreshed"] for minutes in (0, 1, 59, 61)]

    assert results == [len(CATALOGUE), 0, 0, len(CATALOGUE)]
    assert len(fake_anthropic.models_requests) == 2


def test_a_failed_refresh_is_tried_again_one_interval_later_not_every_pass(db, fake_anthropic, settings):
    settings.PAPERCLIP_MODELS_REFRESH_MINUTES = 60
    fake_anthropic.models_error = 500

    results = [maintenance_pass(now=NOW + timedelta(minutes=minutes))["models_refreshed"] for minutes in (0, 1, 61)]

    assert results == [None, 0, None]
    assert CatalogueModel.objects.count() == 0


def test_refresh_is_off_at_zero_minutes(db, fake_anthropic, settings):
    settings.PAPERCLIP_MODELS_REFRESH_MINUTES = 0
    assert maintenance_pass(now=NOW)["models_refreshed"] == 0
    assert fake_anthropic.models_requests == []


@pytest.mark.django_db(transaction=True)
def test_two_passes_at_once_ask_the_models_api_once(fake_anthropic, settings):
    """The second pass runs while the first one's request is in flight (another process,
    another connection): it finds the turn taken and asks nothing."""
    settings.PAPERCLIP_MODELS_REFRESH_MINUTES = 60
    second = []

    def second_pass():
        fake_anthropic.models_before = None  # once
        second.append(maintenance_pass(now=NOW + timedelta(seconds=5))["models_refreshed"])

    fake_anthropic.models_before = on_own_connection(second_pass)

    first = maintenance_pass(now=NOW)["models_refreshed"]

    assert fake_anthropic.action_errors == []
    assert (first, second) == (len(CATALOGUE), [0])
    assert len(fake_anthropic.models_requests) == 1


def test_an_install_without_a_catalogue_uses_the_models_the_price_library_knows(db):
    models = catalogue()
    assert models.source == "library"
    for model in ("claude-opus-5-5", "claude-sonnet-5-5", "claude-haiku-5-5", "claude-fable-5-1", "claude-opus-4-5"):
        assert models.get(model) is not None, model
    assert models.get("claude-opus-5-5-20261118").id == "claude-opus-5-5"  # a snapshot finds its family
    assert models.get("claude-sonnet-5-5[1m]").id == "claude-sonnet-5-5"
    assert models.get("claude-sonnet-5-5").max_input_tokens == 1_000_000
    assert models.get("claude-opus-4-5").max_input_tokens == 200_000
    assert models.get("claude-nonexistent-1") is None


def test_the_cheapest_active_model_of_a_generation_is_found_in_the_catalogue(db, fake_anthropic):
    now = timezone.now()
    assert catalogue().cheapest_of_generation("claude-opus-5-5", at=now) == "claude-haiku-5-5"
    assert catalogue().cheapest_of_generation("claude-opus-4-5", at=now) == "claude-haiku-4-5"
    catalogue_refresh(now=now)
    assert catalogue().cheapest_of_generation("claude-fable-5-1", at=now) == "claude-haiku-5-5"
    assert catalogue().cheapest_of_generation("claude-opus-4-6", at=now) == "claude-haiku-4-5"
    assert catalogue().cheapest_of_generation("claude-unknown-1", at=now) is None
