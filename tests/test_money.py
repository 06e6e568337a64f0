"""Money as text: one rule for the API, the admin, refusals, warnings and alert deliveries."""

from __future__ import annotations

from decimal import Decimal

import pytest

from costs_app.money import usd


@pytest.mark.parametrize(
    ("amount", "text"),
    [
        (Decimal(0), "0.00"),
        (Decimal("0E-10"), "0.00"),
        (Decimal("-0E-10"), "0.00"),
        (Decimal("14.000000"), "14.00"),
        (Decimal("50.0000000000"), "50.00"),
        (Decimal("0.005"), "0.005"),  # a limit below a cent is not "$0.00"
        (Decimal("0.0002500000"), "0.00025"),
        (Decimal("0.0616000000"), "0.0616"),
        (Decimal("1234.5"), "1234.50"),
        (Decimal("-0.25"), "-0.25"),
        (Decimal("0.00000000004"), "0.00000000004"),  # below the ledger's precision: never zero
        (Decimal("0.12345678904"), "0.123456789"),
        (0.07438860000000001, "0.0743886"),  # Claude Code's float cost figure
        (0.30000000000000004, "0.30"),
        (3, "3.00"),
        ("0.1", "0.10"),
    ],
)
def test_an_amount_keeps_its_cent_fractions_and_never_reads_as_zero(amount, text):
    assert usd(amount) == text


def test_the_rule_rounds_to_the_ledgers_own_precision():
    from costs_app.models import CostEvent
    from costs_app.money import LEDGER_QUANTUM
    from costs_app.pricing import LEDGER_QUANTUM as PRICED

    assert LEDGER_QUANTUM == PRICED
    assert LEDGER_QUANTUM == Decimal(1).scaleb(-CostEvent._meta.get_field("cost_usd").decimal_places)
