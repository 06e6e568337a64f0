"""The configuration keys docs/runtimes.md lists for each runtime are keys that runtime takes:
a key the page offers must never be refused as unknown when an agent is saved."""

from __future__ import annotations

import re

import pytest

from sessions_app.adapters import AgentConfigError, validate_agent_config
from tests.conftest import ROOT

# Each key table of the page, by the heading of its section: the configuration it applies to.
TABLES = {
    '## Claude Code agents (`runtime: "cli"`)': ("claude-code", {"runtime": "cli"}),
    "## Managed Agents agents (`claude-managed`)": ("claude-managed", {}),
}


def documented_keys() -> list[tuple[str, str, dict, str]]:
    text = (ROOT / "docs" / "runtimes.md").read_text()
    rows = []
    for heading, (adapter_type, base) in TABLES.items():
        section = text.split(heading, 1)[1].split("\n## ", 1)[0]
        table = re.search(r"^\| key \| default \| meaning \|\n\|[-| ]+\|\n((?:\|.*\n)+)", section, re.M)
        assert table, f"no key table under {heading!r}"
        for row in table.group(1).splitlines():
            for key in re.findall(r"`([a-z_]+)`", row.split("|")[1]):
                rows.append((heading, adapter_type, base, key))
    return rows


def unknown_key_message(adapter_type: str, config: dict, key: str) -> str | None:
    try:
        validate_agent_config(adapter_type, config)
    except AgentConfigError as exc:
        message = exc.fields.get(f"adapter_config.{key}", "")
        return message if message.startswith("unknown setting") else None
    return None


@pytest.mark.parametrize(("heading", "adapter_type", "base", "key"), documented_keys())
def test_each_documented_key_is_one_its_runtime_takes(heading, adapter_type, base, key):
    assert unknown_key_message(adapter_type, {**base, key: "x"}, key) is None, (
        f"docs/runtimes.md lists `{key}` under {heading!r}, but that runtime refuses it as unknown"
    )


def test_session_ttl_hours_takes_the_range_the_page_states():
    """The contract's "positive number": fractions too, up to the stated ceiling."""
    text = (ROOT / "docs" / "runtimes.md").read_text()
    stated = re.search(r"`session_ttl_hours`\s+\(a positive number of hours, fractions allowed, at most (\d+)", text)
    assert stated, "docs/runtimes.md no longer states the range of session_ttl_hours"
    ceiling = int(stated.group(1))
    for accepted in (0.5, 1, 24, ceiling):
        assert validate_agent_config("claude-code", {"session_ttl_hours": accepted})["session_ttl_hours"] == accepted
    for refused in (0, -1, ceiling + 0.5, "24", True):
        with pytest.raises(AgentConfigError) as refusal:
            validate_agent_config("claude-code", {"session_ttl_hours": refused})
        assert set(refusal.value.fields) == {"adapter_config.session_ttl_hours"}
