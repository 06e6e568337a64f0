"""`{% load money %}`, then `{{ amount|usd }}`: money in a template by costs_app.money's rule."""

from __future__ import annotations

from django import template

from costs_app import money

register = template.Library()


@register.filter
def usd(amount) -> str:
    return "" if amount is None or amount == "" else money.usd(amount)
