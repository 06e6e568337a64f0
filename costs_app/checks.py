"""System checks for pricing: a model in use without a price is said out loud."""

from __future__ import annotations

from django.core.checks import Warning, register
from django.db import DatabaseError


@register("paperclip")
def check_unpriced_models(app_configs, **kwargs):
    from costs_app.models import ModelPrice
    from costs_app.pricing import model_family
    from sessions_app.models import Agent, AgentStatus

    try:
        models_in_use = set(
            Agent.objects.exclude(status=AgentStatus.DELETED).values_list("adapter_config__model", flat=True)
        )
        priced = set(ModelPrice.objects.values_list("model", flat=True))
    except DatabaseError:
        return []  # before migrate, or database down: other checks and commands report that
    missing = sorted(m for m in models_in_use if m and m not in priced and model_family(m) not in priced)
    return [
        Warning(
            f"Model {model!r} is used by an agent but has no price; its calls are recorded with cost 0.",
            hint="Add a model price in the admin (Costs > Model prices).",
            id="paperclip.W001",
        )
        for model in missing
    ]
