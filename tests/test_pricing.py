"""Prices: what a call's reported usage costs, to the micro-dollar, priced by the model
requested: the price library's published prices (long-prompt tiers, both cache-write
lifetimes, cache reads, web searches), the operator's overrides from their date on, the
Batch discount and the geo factor."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, date, datetime
from decimal import Decimal
from importlib import import_module

import genai_prices
import pytest
from django.apps import apps
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from costs_app import pricing
from costs_app.budgets import call_cost_bound
from costs_app.models import Budget, CostEvent, ModelPrice, PriceOverridesRevision
from costs_app.pricing import LIBRARY_SOURCE, OVERRIDE_SOURCE, call_price, is_priced, overrides_forget
from sessions_app.models import Agent, AgentSession, RunStatus
from tests.conftest import agent_on_unknown_model, beat
from tests.fake_anthropic import Reply, dense_tokens

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
MTOK = Decimal(1_000_000)


def published(usage: dict, *, input, output, write_5m, write_1h, read) -> Decimal:
    """A usage priced at the rates given (USD per million tokens), as Anthropic's table says."""
    split = usage.get("cache_creation") or {}
    return (
        usage.get("input_tokens", 0) * Decimal(input)
        + usage.get("output_tokens", 0) * Decimal(output)
        + split.get("ephemeral_5m_input_tokens", 0) * Decimal(write_5m)
        + split.get("ephemeral_1h_input_tokens", 0) * Decimal(write_1h)
        + usage.get("cache_read_input_tokens", 0) * Decimal(read)
    ) / MTOK


def usage_of(*, uncached: int, output: int, write_5m: int = 0, write_1h: int = 0, read: int = 0) -> dict:
    return {
        "input_tokens": uncached,
        "output_tokens": output,
        "cache_creation_input_tokens": write_5m + write_1h,
        "cache_creation": {"ephemeral_5m_input_tokens": write_5m, "ephemeral_1h_input_tokens": write_1h},
        "cache_read_input_tokens": read,
    }


# Anthropic's published prices (USD per MTok: input, output, 5-minute write, 1-hour write,
# cache read), as genai-prices 0.2.3 carries them.
SONNET_5_5 = {"input": "2", "output": "10", "write_5m": "2.5", "write_1h": "4", "read": "0.1"}
OPUS_5_5 = {"input": "4", "output": "20", "write_5m": "5", "write_1h": "8", "read": "0.2"}
HAIKU_5_5 = {"input": "0.1", "output": "0.5", "write_5m": "0.125", "write_1h": "0.2", "read": "0.01"}
# Haiku 5.5 past 100,000 prompt tokens (input + cache reads + cache writes): 5x, every token.
HAIKU_5_5_LONG = {"input": "0.5", "output": "2.5", "write_5m": "0.625", "write_1h": "1", "read": "0.05"}
CACHED = usage_of(uncached=1234, output=567, write_5m=2000, write_1h=1000, read=45678)


@pytest.mark.parametrize(
    ("model", "usage", "rates"),
    [
        ("claude-sonnet-5-5", CACHED, SONNET_5_5),
        ("claude-opus-5-5", CACHED, OPUS_5_5),
        # A 150k-token prompt (20k + 110k read + 20k written) and a 20k one.
        (
            "claude-haiku-5-5",
            usage_of(uncached=20_000, output=900, write_5m=15_000, write_1h=5_000, read=110_000),
            HAIKU_5_5_LONG,
        ),
        (
            "claude-haiku-5-5",
            usage_of(uncached=8_000, output=900, write_5m=4_000, write_1h=3_000, read=5_000),
            HAIKU_5_5,
        ),
        # A dated snapshot and Claude Code's 1M-context id take their family's price.
        ("claude-opus-5-5-20261118", CACHED, OPUS_5_5),
        ("claude-sonnet-5-5[1m]", CACHED, SONNET_5_5),
    ],
    ids=["sonnet-5-5", "opus-5-5", "haiku-5-5-150k", "haiku-5-5-20k", "snapshot", "1m-variant"],
)
def test_each_call_is_billed_at_the_published_price(company, fake_anthropic, model, usage, rates):
    agent = Agent.objects.create(company=company, name="priced", adapter_config={"model": model})
    fake_anthropic.push(Reply.message("priced", usage=usage))

    run = beat(agent, "price me")

    event = CostEvent.objects.get(run=run)
    expected = published(usage, **rates)
    assert abs(event.cost_usd - expected) <= Decimal("0.000001")
    assert event.cost_usd == expected  # exact: the ledger keeps ten places
    assert (event.model, event.unpriced, event.price_id) == (model, False, None)
    assert (event.price_source, event.delivery) == (f"library {genai_prices.__version__}", "direct")
    assert run.cost_usd == expected
    assert fake_anthropic.message_requests[-1]["model"] == model


def test_the_session_total_and_the_run_carry_the_rows_price(persistent_agent, fake_anthropic):
    fake_anthropic.push(Reply.message("priced", usage=CACHED, message_id="msg_priced"))

    run = beat(persistent_agent, "price me")

    event = CostEvent.objects.get()
    # claude-opus-4-5: $5 in, $25 out, $6.25 5-minute write, $10 1-hour write, $0.50 read per MTok.
    expected = published(CACHED, input="5", output="25", write_5m="6.25", write_1h="10", read="0.5")
    assert event.cost_usd == run.cost_usd == AgentSession.objects.get().total_cost_usd == expected
    assert (event.cache_creation_5m_input_tokens, event.cache_creation_1h_input_tokens) == (2000, 1000)
    assert event.message_id == "msg_priced" and event.raw_usage == CACHED
    assert (event.session_id, event.run_id) == (run.session_id, run.id)


def test_an_override_wins_from_its_date_on_and_not_before(company, fake_anthropic):
    agent = Agent.objects.create(company=company, name="negotiated", adapter_config={"model": "claude-sonnet-5-5"})
    override = ModelPrice.objects.create(
        model="claude-sonnet-5-5",
        effective_from=date(2026, 12, 1),
        input_usd_per_mtok=Decimal("1.5"),
        output_usd_per_mtok=Decimal("8"),
        cache_write_5m_usd_per_mtok=Decimal("1.9"),
        cache_write_1h_usd_per_mtok=Decimal("3"),
        cache_read_usd_per_mtok=Decimal("0.08"),
    )
    fake_anthropic.push(Reply.message("before", usage=CACHED), Reply.message("from", usage=CACHED))

    before = beat(agent, "the day before", now=datetime(2026, 11, 30, 12, 0, tzinfo=UTC))
    on = beat(agent, "the day it takes effect", now=datetime(2026, 12, 1, 0, 0, 1, tzinfo=UTC))

    library_row, override_row = CostEvent.objects.get(run=before), CostEvent.objects.get(run=on)
    assert (library_row.price_source, library_row.price_id) == (LIBRARY_SOURCE, None)
    assert library_row.cost_usd == published(CACHED, **SONNET_5_5)
    assert (override_row.price_source, override_row.price_id) == (OVERRIDE_SOURCE, override.id)
    assert override_row.cost_usd == published(
        CACHED, input="1.5", output="8", write_5m="1.9", write_1h="3", read="0.08"
    )


def test_an_override_of_a_family_prices_its_snapshots_unless_one_has_its_own(db):
    usage = {"input_tokens": 1_000_000}
    family = ModelPrice.from_list_price("claude-opus-5-5", date(2026, 1, 1), Decimal("3"), Decimal("15"))
    family.save()
    assert call_price(usage=usage, model="claude-opus-5-5-20261118", at=NOW).override == family
    own = ModelPrice.from_list_price("claude-opus-5-5-20261118", date(2026, 1, 1), Decimal("2"), Decimal("10"))
    own.save()
    priced = call_price(usage=usage, model="claude-opus-5-5-20261118", at=NOW)
    assert (priced.override, priced.cost_usd, priced.source) == (own, Decimal(2), OVERRIDE_SOURCE)


def test_the_batch_discount_halves_every_rate(db):
    usage = usage_of(uncached=1000, output=1000, write_5m=1000, write_1h=1000, read=1000)
    direct = call_price(usage=usage, model="claude-opus-5-5", at=NOW)
    batch = call_price(usage=usage, model="claude-opus-5-5", at=NOW, delivery="batch")
    assert direct.cost_usd == published(usage, **OPUS_5_5)
    assert batch.cost_usd == direct.cost_usd / 2  # the library's batch variant
    # A model the library has no batch price for: half of its price all the same.
    assert call_price(usage=usage, model="claude-3-haiku", at=NOW, delivery="batch").cost_usd == (
        call_price(usage=usage, model="claude-3-haiku", at=NOW).cost_usd / 2
    )
    ModelPrice.from_list_price("claude-opus-5-5", date(2026, 1, 1), Decimal("3"), Decimal("15")).save()
    overridden = call_price(usage=usage, model="claude-opus-5-5", at=NOW)
    assert (
        call_price(usage=usage, model="claude-opus-5-5", at=NOW, delivery="batch").cost_usd == overridden.cost_usd / 2
    )


def test_an_agent_inferring_in_the_us_sends_its_geo_and_pays_its_factor(company, fake_anthropic, settings):
    agent = Agent.objects.create(
        company=company, name="us-only", adapter_config={"model": "claude-opus-5-5", "inference_geo": "us"}
    )
    usage = usage_of(uncached=10_000, output=2_000)
    fake_anthropic.push(Reply.message("from the US", usage=usage))

    run = beat(agent, "stay in the US")

    assert fake_anthropic.message_requests[-1]["inference_geo"] == "us"
    assert CostEvent.objects.get(run=run).cost_usd == published(usage, **OPUS_5_5) * Decimal("1.1")
    # The factor is configuration; a geo the usage reports prices as one asked for.
    settings.PAPERCLIP_INFERENCE_GEO_MULTIPLIERS = {"us": Decimal("1.25")}
    reported = {**usage, "inference_geo": "us"}
    assert call_price(usage=reported, model="claude-opus-5-5", at=NOW).cost_usd == published(
        usage, **OPUS_5_5
    ) * Decimal("1.25")
    assert call_price(usage={**usage, "inference_geo": "global"}, model="claude-opus-5-5", at=NOW).cost_usd == (
        published(usage, **OPUS_5_5)
    )


def test_web_searches_the_usage_reports_are_billed(db):
    usage = {"input_tokens": 1000, "output_tokens": 100, "server_tool_use": {"web_search_requests": 3}}
    # $10 per thousand searches on every Claude model.
    expected = published(usage, **SONNET_5_5) + 3 * Decimal(10) / 1000
    assert call_price(usage=usage, model="claude-sonnet-5-5", at=NOW).cost_usd == expected


def test_each_compaction_pass_is_priced_at_its_own_tier(db):
    # The summarising pass read 180k tokens (the long tier); the answer after it 23k (the base).
    usage = {
        "input_tokens": 23_000,
        "output_tokens": 1000,
        "iterations": [
            {"type": "compaction", "input_tokens": 180_000, "output_tokens": 3500},
            {"type": "message", "input_tokens": 23_000, "output_tokens": 1000},
        ],
    }
    expected = (
        180_000 * Decimal("0.5") + 3500 * Decimal("2.5") + 23_000 * Decimal("0.1") + 1000 * Decimal("0.5")
    ) / MTOK
    assert call_price(usage=usage, model="claude-haiku-5-5", at=NOW).cost_usd == expected


def test_the_reservation_bound_of_a_haiku_request_that_could_pass_100k_prices_the_high_tier(db):
    bound = call_cost_bound(model="claude-haiku-5-5", max_output_tokens=4096, at=NOW, inference_geo="global")
    # A prompt that may be 150,000 tokens is held at the long-prompt tier, every token.
    assert bound(150_000) == (150_000 * Decimal("0.5") + 4096 * Decimal("2.5")) / MTOK
    assert bound(100_000) == (100_000 * Decimal("0.1") + 4096 * Decimal("0.5")) / MTOK
    # The dearest cache write its markers ask for, at the tier.
    hour = call_cost_bound(
        model="claude-haiku-5-5", max_output_tokens=0, at=NOW, cache_lifetimes=frozenset({"1h"}), inference_geo="global"
    )
    assert hour(150_000) == 150_000 * Decimal("1") / MTOK
    batch_us = call_cost_bound(
        model="claude-haiku-5-5", max_output_tokens=0, at=NOW, delivery="batch", inference_geo="us"
    )
    assert batch_us(150_000) == 150_000 * Decimal("0.25") * Decimal("1.1") / MTOK


def test_a_haiku_request_past_100k_tokens_is_reserved_at_the_high_tier(company, fake_anthropic, settings):
    settings.PAPERCLIP_MAX_TASK_CHARS = 200_000
    fake_anthropic.tokens = dense_tokens  # one token a CJK character, as real tokenizers count
    agent = Agent.objects.create(
        company=company, name="reader", adapter_config={"model": "claude-haiku-5-5", "max_tokens": 1000}
    )
    # 110,000 tokens, measured with count_tokens: at the long tier ($0.5 in, $2.5 out)
    # $0.0575; at the base tier it would be $0.0115, which the limit of $0.03 holds.
    Budget.objects.create(company=company, monthly_limit_usd=Decimal("0.03"))

    run = beat(agent, "\u6587" * 110_000)

    assert (run.status, run.error_code) == (RunStatus.FAILED, "budget_exceeded")
    assert fake_anthropic.message_requests == []


def test_an_answer_naming_a_snapshot_is_priced_and_trips_the_budget(stateless_agent, fake_anthropic):
    # One call of 4,000 output tokens on opus costs $0.10: the limit fits one.
    Budget.objects.create(company=stateless_agent.company, monthly_limit_usd=Decimal("0.25"))
    usage = {"input_tokens": 100, "output_tokens": 4000}
    fake_anthropic.push(
        *[Reply.message("ok", usage=usage, extra={"model": "claude-opus-4-5-20251101"}) for _ in range(10)]
    )

    runs = [beat(stateless_agent, f"call {i}") for i in range(10)]

    assert [run.status for run in runs[:2]] == [RunStatus.SUCCEEDED] * 2
    assert {(run.status, run.error_code) for run in runs[2:]} == {(RunStatus.FAILED, "budget_exceeded")}
    event = CostEvent.objects.filter(run=runs[0]).get()
    assert (event.model, event.unpriced) == ("claude-opus-4-5", False)
    assert event.cost_usd == Decimal("0.1005")
    assert runs[0].model == "claude-opus-4-5-20251101"  # the run shows what answered


def test_unknown_model_is_recorded_unpriced_not_refused(company, fake_anthropic):
    agent = agent_on_unknown_model(company, "claude-future-9")
    run = beat(agent, "hi")
    assert run.status == RunStatus.SUCCEEDED
    event = CostEvent.objects.get()
    assert event.unpriced and event.cost_usd == 0 and event.input_tokens > 0
    assert event.price_source == "" and not is_priced(model="claude-future-9", at=NOW)


def test_the_price_library_never_reaches_the_network():
    """Its bundled data is read at import and at calc time; its updater is never started."""
    script = (
        "import socket, threading\n"
        "def refuse(*args, **kwargs):\n"
        "    raise OSError('the price library used the network')\n"
        "socket.socket.connect = refuse\n"
        "socket.create_connection = refuse\n"
        "import genai_prices\n"
        "from genai_prices import data_snapshot\n"
        "price = genai_prices.calc_price(genai_prices.Usage(input_tokens=1000, output_tokens=100), "
        "'claude-opus-5-5', provider_id='anthropic')\n"
        "assert data_snapshot._custom_snapshot is None and not data_snapshot.get_snapshot().from_auto_update\n"
        "assert not [t for t in threading.enumerate() if t.name.startswith('genai_prices')]\n"
        "print(price.total_price)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert Decimal(done.stdout.strip()) == (1000 * Decimal(4) + 100 * Decimal(20)) / MTOK


def test_the_hand_seeded_prices_are_removed_unless_an_operator_changed_them(db):
    seed = import_module("costs_app.migrations.0002_seed_list_prices")
    drop = import_module("costs_app.migrations.0009_drop_hand_seeded_prices")
    seed.seed_prices(apps, None)
    changed = next(iter(seed.LIST_PRICES))
    ModelPrice.objects.filter(model=changed).update(output_usd_per_mtok=Decimal("99"))

    drop.drop_seeded(apps, None)

    assert list(ModelPrice.objects.values_list("model", flat=True)) == [changed]


# --- the overrides in memory ---------------------------------------------------------------


def negotiated(model: str = "claude-sonnet-5-5", input_price: str = "1.5") -> ModelPrice:
    return ModelPrice.from_list_price(model, date(2026, 1, 1), Decimal(input_price), Decimal("8"))


def another_process_stores(price: ModelPrice) -> None:
    """What a save in another process leaves in the database: the row and, by the trigger on
    model_prices, a moved revision (bulk_create sends no signal, so this process's memory is
    not told)."""
    ModelPrice.objects.bulk_create([price])


def revision() -> int:
    return PriceOverridesRevision.objects.get(pk=1).revision


def test_every_way_of_changing_the_overrides_moves_the_revision_in_its_own_statement(db):
    ModelPrice.objects.bulk_create([negotiated()])
    first = revision()
    ModelPrice.objects.filter(model="claude-sonnet-5-5").update(input_usd_per_mtok=Decimal("1.25"))
    assert revision() > first
    second = revision()
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM model_prices WHERE model = %s", ["claude-sonnet-5-5"])
    assert revision() > second


def test_an_override_changed_by_a_queryset_update_reaches_the_next_claim(company, fake_anthropic):
    agent = Agent.objects.create(company=company, name="negotiated", adapter_config={"model": "claude-sonnet-5-5"})
    negotiated().save()
    overrides_forget()
    beat(agent, "priced at 1.5")  # this process now holds the 1.5 override

    ModelPrice.objects.filter(model="claude-sonnet-5-5").update(input_usd_per_mtok=Decimal("3"))
    run = beat(agent, "claimed after the update")

    event = CostEvent.objects.get(run=run)
    price = ModelPrice.objects.get(model="claude-sonnet-5-5")
    assert (event.price_id, price.input_usd_per_mtok) == (price.id, Decimal("3"))
    expected = (
        event.input_tokens * price.input_usd_per_mtok
        + event.output_tokens * price.output_usd_per_mtok
        + event.cache_creation_5m_input_tokens * price.cache_write_5m_usd_per_mtok
        + event.cache_creation_1h_input_tokens * price.cache_write_1h_usd_per_mtok
        + event.cache_read_input_tokens * price.cache_read_usd_per_mtok
    ) / 1_000_000
    assert event.input_tokens > 0 and event.cost_usd == expected


def test_a_heartbeat_reads_no_price_from_the_database(company, fake_anthropic):
    agent = Agent.objects.create(company=company, name="negotiated", adapter_config={"model": "claude-sonnet-5-5"})
    override = negotiated()
    override.save()
    overrides_forget()  # as in a later transaction: the one that saved it has committed
    beat(agent, "warm")  # reads the overrides once

    with CaptureQueriesContext(connection) as queries:
        run = beat(agent, "priced from memory")

    assert CostEvent.objects.get(run=run).price_id == override.id
    assert not [q["sql"] for q in queries if '"model_prices"' in q["sql"]]


def test_an_override_saved_here_prices_the_next_call_at_once(db):
    usage = {"input_tokens": 1_000_000}
    assert call_price(usage=usage, model="claude-sonnet-5-5", at=NOW).source == LIBRARY_SOURCE
    negotiated().save()
    assert call_price(usage=usage, model="claude-sonnet-5-5", at=NOW).cost_usd == Decimal("1.5")
    ModelPrice.objects.filter(model="claude-sonnet-5-5").delete()
    assert call_price(usage=usage, model="claude-sonnet-5-5", at=NOW).source == LIBRARY_SOURCE


def test_another_process_s_override_reaches_the_next_claim(company, fake_anthropic):
    agent = Agent.objects.create(company=company, name="negotiated", adapter_config={"model": "claude-sonnet-5-5"})
    beat(agent, "library price")  # this process now holds "no overrides"

    another_process_stores(negotiated())
    run = beat(agent, "claimed after the change")

    assert CostEvent.objects.get(run=run).price_source == OVERRIDE_SOURCE


def test_another_process_s_override_reaches_other_callers_within_the_trusted_time(db, monkeypatch):
    usage = {"input_tokens": 1_000_000}
    assert call_price(usage=usage, model="claude-sonnet-5-5", at=NOW).source == LIBRARY_SOURCE
    another_process_stores(negotiated())
    assert call_price(usage=usage, model="claude-sonnet-5-5", at=NOW).source == LIBRARY_SOURCE  # trusted still

    monkeypatch.setattr(pricing, "OVERRIDES_TRUSTED_SECONDS", 0.0)
    assert call_price(usage=usage, model="claude-sonnet-5-5", at=NOW).cost_usd == Decimal("1.5")


def test_an_override_rolled_back_never_prices_a_call(db):
    usage = {"input_tokens": 1_000_000}
    with pytest.raises(RuntimeError), transaction.atomic():
        negotiated().save()
        assert call_price(usage=usage, model="claude-sonnet-5-5", at=NOW).cost_usd == Decimal("1.5")
        raise RuntimeError("rolled back")
    assert call_price(usage=usage, model="claude-sonnet-5-5", at=NOW).source == LIBRARY_SOURCE
