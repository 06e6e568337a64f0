"""System checks for pricing: a model in use without a price is said out loud."""

from __future__ import annotations

from django.core.checks import Warning, register
from django.db import DatabaseError


@register("paperclip")
def check_unpriced_models(app_configs, **kwargs):
    from django.utils import timezone

    from costs_app.pricing import is_priced
    from sessions_app.models import Agent, AgentStatus

    now = timezone.now()
    try:
        models_in_use = set(
            Agent.objects.exclude(status=AgentStatus.DELETED).values_list("adapter_config__model", flat=True)
        )
        missing = sorted(m for m in models_in_use if m and isinstance(m, str) and not is_priced(model=m, at=now))
    except DatabaseError:
        return []  # before migrate, or database down: other checks and commands report that
    return [
        Warning(
            f"Model {model!r} is used by an agent but has no price; its calls are recorded with cost 0.",
            hint="Add a model price in the admin (Costs > Model prices).",
            id="paperclip.W001",
        )
        for model in missing
    ]
