"""An agent's model against the model catalogue (costs_app.catalogue) and the prices.

- Saving: a `claude-code` agent's `model` (and `summary_model`) must be in the catalogue
  (a dated snapshot or `[1m]` id of a listed model counts) or have an override price, and
  must not be retired; `max_tokens` must be within the model's. Otherwise a field error
  naming `adapter_config.model` with the close matches. Checked when the value is set or
  changed, so an agent whose model was later deprecated or dropped can still be paused,
  renamed or moved to another model.
- The default model of an agent configured without one: PAPERCLIP_DEFAULT_MODEL, else the
  newest active model of the catalogue's Sonnet line (else its newest active model).
- Running: a retired model refuses runs (`model_retired`, `retired_model_refusal`).
- Showing: a deprecated model, or one with a retirement date, is named with its date on
  the agent (`model_info`: the API's agent object, the admin's agent page) and by
  `manage.py check`.
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings

from costs_app.catalogue import CatalogueEntry, catalogue
from costs_app.pricing import override_for
from sessions_app.adapters import AgentConfigError

# The line whose newest model is the default model (README, "Agent configuration").
DEFAULT_LINE = "sonnet"
# The adapters whose models are Claude's (the `process` adapter runs any command's own).
CLAUDE_ADAPTER = "claude-code"
CLAUDE_ADAPTERS = (CLAUDE_ADAPTER, "claude-managed")
CHECKED_KEYS = ("model", "summary_model")


def default_model() -> str:
    """The model of a `claude-code` agent configured without one ("" when none is known)."""
    if settings.PAPERCLIP_DEFAULT_MODEL:
        return settings.PAPERCLIP_DEFAULT_MODEL
    models = catalogue()
    newest = models.newest(line=DEFAULT_LINE) or max(
        models.active(),
        key=lambda entry: (entry.released_at is not None, entry.released_at, entry.version or (0, 0)),
        default=None,
    )
    return newest.id if newest is not None else ""


def with_default_model(adapter_type: object, config: object) -> object:
    """`config` with the default model filled in when a `claude-code` agent names none."""
    if adapter_type not in CLAUDE_ADAPTERS or not isinstance(config, dict) or "model" in config:
        return config
    model = default_model()
    if not model:
        raise AgentConfigError(
            {"adapter_config.model": "is required: no default model is known (set PAPERCLIP_DEFAULT_MODEL)"}
        )
    return {**config, "model": model}


def model_problem(model: str, *, now: datetime) -> str | None:
    """Why an agent may not be set to `model` (None when it may)."""
    entry = catalogue().get(model)
    if entry is not None:
        return f"{entry.id} is retired; choose another model" if entry.retired else None
    if override_for(model=model, at=now) is not None:
        return None  # the operator priced it: a model the catalogue does not list yet
    matches = catalogue().close_matches(model)
    hint = f"; did you mean {', '.join(repr(m) for m in matches)}?" if matches else ""
    return (
        f"unknown model {model!r}: not in the model catalogue and without an override price "
        f"(admin: Costs > Model prices){hint}"
    )


def agent_models_validate(*, adapter_type: str, config: dict, previous: dict | None, now: datetime) -> None:
    """Refuse a `claude-code` agent's model, summary model or max_tokens (see the module),
    each checked when set or changed (`previous`: the stored configuration, None for a new
    agent). Raises AgentConfigError naming the fields."""
    if adapter_type not in CLAUDE_ADAPTERS:
        return
    previous = previous if isinstance(previous, dict) else {}
    errors = {}
    for key in CHECKED_KEYS:
        value = config.get(key)
        if isinstance(value, str) and value and value != previous.get(key):
            if problem := model_problem(value, now=now):
                errors[f"adapter_config.{key}"] = problem
    entry = catalogue().get(config.get("model") or "")
    max_tokens = config.get("max_tokens")
    changed = (config.get("model"), max_tokens) != (previous.get("model"), previous.get("max_tokens"))
    if (
        changed
        and entry is not None
        and entry.max_tokens
        and isinstance(max_tokens, int)
        and max_tokens > entry.max_tokens
    ):
        errors["adapter_config.max_tokens"] = (
            f"{entry.id} answers with at most {entry.max_tokens} tokens, got {max_tokens}"
        )
    if errors:
        raise AgentConfigError(errors)


def retired_model_refusal(config: dict) -> str | None:
    """Why a run of an agent with this configuration is refused (`model_retired`), or None."""
    for key in CHECKED_KEYS:
        entry = catalogue().get(config.get(key) or "")
        if entry is not None and entry.retired:
            return (
                f"The agent's {key} {entry.id!r} is retired: calls naming it fail. "
                f"Set adapter_config.{key} to another model."
            )
    return None


def agent_model_info(config: dict) -> dict | None:
    """What the catalogue says of an agent's model (the API's `model_info`), None without one."""
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, str) or not model:
        return None
    entry = catalogue().get(model)
    if entry is None:
        return {
            "model": model,
            "display_name": None,
            "lifecycle": "unknown",
            "deprecated_at": None,
            "retires_at": None,
            "max_input_tokens": None,
            "max_tokens": None,
            "warning": "",
        }
    return {
        "model": model,
        "display_name": entry.display_name or None,
        "lifecycle": entry.lifecycle,
        "deprecated_at": entry.deprecated_at,
        "retires_at": entry.retires_at,
        "max_input_tokens": entry.max_input_tokens,
        "max_tokens": entry.max_tokens,
        "warning": model_warning(config),
    }


def model_warning(config: dict) -> str:
    """The lifecycle warnings of an agent's model and summary model ("" when none)."""
    if not isinstance(config, dict):
        return ""
    entries: list[CatalogueEntry] = []
    for key in CHECKED_KEYS:
        entry = catalogue().get(config.get(key) or "")
        if entry is not None and entry.warning and entry not in entries:
            entries.append(entry)
    return " ".join(entry.warning for entry in entries)
