"""Money as text: one rule for the API, the admin, refusals, warnings, alert deliveries and
the commands, so that one amount reads the same wherever it is shown.

An amount is written to the ledger's precision (10 decimal places), without the zeros after
its last significant digit but with at least two decimals: "0.00", "14.00", "0.005",
"0.0743886". A cent fraction is always shown, and a non-zero amount never reads as zero (an
amount below the ledger's precision, such as a reservation's tiniest estimate, keeps its
own digits). Counts (the daily run cap, runs started) are whole numbers, never money.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

# The places of cost_events.cost_usd (tests/test_money.py holds the two together); not read
# from the model, so that the adapters, which import no model, may format money too.
LEDGER_QUANTUM = Decimal("1E-10")


def usd(amount: Decimal | float | int | str) -> str:
    """`amount` (USD) as text, by the module's rule. A float is read by its shortest repr,
    then rounded to the ledger's precision: Claude Code's 0.07438860000000001 is "0.0743886"."""
    value = amount if isinstance(amount, Decimal) else Decimal(str(amount))
    exact = value.quantize(LEDGER_QUANTUM, rounding=ROUND_HALF_UP)
    if exact == 0:
        if value == 0:
            return "0.00"
        exact = value  # below the ledger's precision: its own digits, never "0.00"
    whole, _, fraction = f"{exact:f}".partition(".")
    return f"{whole}.{fraction.rstrip('0').ljust(2, '0')}"


def amount_text(value: Decimal | int, *, count: bool) -> int | str:
    """A budget figure for JSON: a whole number of runs, or money by the rule."""
    return int(value) if count else usd(value)


class MoneyField(serializers.DecimalField):
    """A DecimalField whose output follows the rule. Input is a decimal string ("12.50") or a
    JSON number, as DRF reads them; a blank string is refused, where DRF would read it as
    null, and null removes a budget's limit."""

    default_error_messages = {"blank": 'Must be a decimal, such as "12.50", not blank.'}

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("max_digits", 30)
        kwargs.setdefault("decimal_places", 10)
        super().__init__(**kwargs)

    def validate_empty_values(self, data):
        if isinstance(data, str) and not data.strip():
            self.fail("blank")
        return super().validate_empty_values(data)

    def to_internal_value(self, data):
        if isinstance(data, bool):  # a JSON true is no amount (DRF would say "True" is not a number)
            self.fail("invalid")
        return super().to_internal_value(data)

    def to_representation(self, value):
        return usd(value)


@extend_schema_field({"oneOf": [{"type": "string", "format": "decimal"}, {"type": "integer"}]})
class AmountField(serializers.Field):
    """A budget use's limit, spent and reserved: money as a decimal string, or for the daily
    run cap (`period: day_runs`) a whole number of runs."""

    def to_representation(self, value):
        return value if isinstance(value, int) else usd(value)
