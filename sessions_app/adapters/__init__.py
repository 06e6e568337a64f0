"""The adapter registry: one module per adapter type, looked up by `agents.adapter_type`."""

from __future__ import annotations

from sessions_app.adapters.base import (
    COMMON_KEYS,
    Adapter,
    AdapterError,
    AdapterReply,
    AdapterRequest,
    AgentConfigError,
    validate_common,
)
from sessions_app.adapters.claude_code import ClaudeCodeAdapter
from sessions_app.adapters.claude_managed import ClaudeManagedAdapter
from sessions_app.adapters.process import ProcessAdapter
from sessions_app.text import holds_unstorable, storable

# A module, not its names: `work_checks` imports the process adapter's launcher, so it may
# be the one still importing this package.
from sessions_app import work_checks  # noqa: E402  isort: skip

ADAPTERS: dict[str, Adapter] = {
    ClaudeCodeAdapter.type_name: ClaudeCodeAdapter(),
    ClaudeManagedAdapter.type_name: ClaudeManagedAdapter(),
    ProcessAdapter.type_name: ProcessAdapter(),
}

# The runtime whose requests go in the provider's Message Batches: a batch is read, listed
# and cancelled through it even after its runs' agents moved to a runtime without one.
BATCH_API: Adapter = next(adapter for adapter in ADAPTERS.values() if adapter.delivers_batch)

__all__ = [
    "ADAPTERS",
    "BATCH_API",
    "AdapterError",
    "AdapterReply",
    "AdapterRequest",
    "AgentConfigError",
    "adapter_for",
    "get_adapter",
]


def get_adapter(adapter_type: str, config: dict | None = None) -> Adapter:
    """The adapter of a type; with the agent's configuration, the one it selects (the
    `claude-code` type runs the Messages API or, with `runtime: "cli"`, Claude Code)."""
    try:
        adapter = ADAPTERS[adapter_type]
    except KeyError:
        raise AgentConfigError({"adapter_type": f"unknown adapter type {adapter_type!r}"}) from None
    return _selected(adapter, config)


def adapter_for(adapter_type: str, config: dict) -> Adapter | None:
    """As `get_adapter`, None for an unknown type."""
    adapter = ADAPTERS.get(adapter_type)
    return _selected(adapter, config) if adapter is not None else None


def _selected(adapter: Adapter, config) -> Adapter:
    return adapter.for_config(config) if isinstance(config, dict) else adapter


def validate_agent_config(adapter_type: str, config: object) -> dict:
    """Check an agent's adapter configuration; return it with defaults filled in.

    Raises AgentConfigError naming every offending field, so the API answers 400 with
    all of them at once and the admin marks the field.
    """
    if not isinstance(adapter_type, str) or adapter_type not in ADAPTERS:
        raise AgentConfigError(
            {"adapter_type": f"unknown adapter type {adapter_type!r}; expected one of {', '.join(sorted(ADAPTERS))}"}
        )
    if not isinstance(config, dict):
        raise AgentConfigError({"adapter_config": "must be a JSON object"})
    adapter = _selected(ADAPTERS[adapter_type], config)
    errors: dict[str, str] = {}
    clean = validate_common(config, errors)
    work_checks.validate_work_settings(config, errors, clean)
    clean.update(adapter.validate_config(config, errors))
    if clean.get("delivery") == "batch" and not adapter.delivers_batch:
        errors["delivery"] = "this runtime cannot deliver by batch (only the Messages API runtime can): use 'direct'"
    allowed = COMMON_KEYS | adapter.config_keys
    for key in sorted(set(config) - allowed):
        errors[key] = f"unknown setting for adapter {adapter_type!r}"
    for key, value in config.items():
        if holds_unstorable(key) or holds_unstorable(value):
            errors[key] = "must not contain NUL characters or invalid Unicode"
    # A key is quoted back in the error; it must be printable itself.
    errors = {storable(key): message for key, message in errors.items()}
    if errors:
        raise AgentConfigError({f"adapter_config.{key}": message for key, message in errors.items()})
    return clean
