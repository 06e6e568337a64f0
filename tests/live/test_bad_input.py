"""A bad-input corpus (hypothesis): whatever JSON a client sends, the answer is a JSON
error with a 4xx status, never a 500 and never an exception out of validation.

Runs on SQLite and PostgreSQL (where NUL characters and huge numbers meet jsonb). The
example counts are bounded so the whole module stays well under a minute.
"""

from __future__ import annotations

import json
import math
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sessions_app.adapters import AgentConfigError, validate_agent_config
from sessions_app.adapters.base import COMMON_KEYS
from sessions_app.models import Agent
from tests.api.conftest import agent_url

pytestmark = pytest.mark.django_db

EXAMPLES = 60
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same corpus on every CI run; a failure is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

KNOWN_KEYS = sorted(
    COMMON_KEYS
    | {"model", "max_tokens", "temperature", "timeout_seconds", "max_retries", "prompt_caching", "cache_ttl"}
    | {"compaction_trigger_tokens", "command", "args", "cwd"}
)
NASTY_STRINGS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-0",
    "0x10",
    "",
    " ",
    "\x00",
    "nul\x00inside",
    "\ud800",  # a lone surrogate: not encodable as UTF-8
    "\u202e\u0301\U0001f4a9",
    "persistent\x00",
    "x" * 100_000,
    "null",
    "true",
    '{"nested": "json"}',
]
NASTY_NUMBERS = [
    0,
    -1,
    2**31,
    2**63,
    -(2**63) - 1,
    10**400,
    -(10**400),
    1e308,
    -1e308,
    5e-324,
    0.1,
    24.000000001,
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**500), max_value=10**500),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=50),
    st.sampled_from(NASTY_STRINGS),
    st.sampled_from(NASTY_NUMBERS),
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
NUMERIC_KEYS = [
    "session_ttl_hours",
    "timeout_seconds",
    "temperature",
    "rotate_after_hours",
    "max_tokens",
    "idle_pause_minutes",
    "heartbeat_interval_minutes",
    "context_budget_tokens",
]
adapter_configs = st.one_of(
    # Numbers where numbers belong, at the edges of what JSON can carry.
    st.dictionaries(
        st.sampled_from(NUMERIC_KEYS),
        st.sampled_from(NASTY_NUMBERS) | st.integers(min_value=-(10**500), max_value=10**500),
        min_size=1,
        max_size=3,
    ),
    st.dictionaries(st.sampled_from(KNOWN_KEYS), json_values, max_size=6),
    st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=20), json_values, max_size=4),
    json_values,  # not even an object
)
adapter_types = st.one_of(st.sampled_from(["claude-code", "process"]), st.sampled_from(NASTY_STRINGS), json_values)


def raw_json(value, *, ascii_only: bool) -> bytes:
    """As a client would send it; float('inf') and NaN are written as the bare tokens
    (invalid JSON that Python, and many clients, produce anyway)."""
    return json.dumps(value, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")


def assert_json_answer(response, allowed: set[int]) -> None:
    assert response.status_code in allowed, (response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] and error["message"]


@FUZZ
@given(adapter_type=adapter_types, config=adapter_configs)
# Found by this corpus: math.isfinite(10**400) raised OverflowError (a 500 on save), and an
# unbounded rotate_after_hours passed validation, then overflowed the datetime at heartbeat.
@example(adapter_type="claude-code", config={"session_ttl_hours": 10**400})
@example(adapter_type="claude-code", config={"temperature": -(10**400)})
@example(adapter_type="claude-code", config={"rotate_after_hours": 1e300})
@example(adapter_type=["claude-code"], config={})
def test_validate_agent_config_accepts_or_names_fields_and_raises_nothing_else(adapter_type, config):
    try:
        clean = validate_agent_config(adapter_type, config)
    except AgentConfigError as exc:
        assert exc.fields and all(isinstance(message, str) for message in exc.fields.values())
        return
    assert isinstance(clean, dict)
    for key in ("session_ttl_hours", "timeout_seconds", "temperature", "rotate_after_hours"):
        value = clean.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            assert math.isfinite(value) and abs(value) < 10**6, (key, value)


@FUZZ
@given(
    name=st.one_of(st.text(max_size=30), st.sampled_from(NASTY_STRINGS), json_values),
    adapter_type=adapter_types,
    config=adapter_configs,
    extra=st.dictionaries(st.text(max_size=10), json_values, max_size=2),
    ascii_only=st.booleans(),
)
@example(name="a", adapter_type="claude-code", config={"timeout_seconds": 10**400}, extra={}, ascii_only=True)
@example(name="a", adapter_type="process", config={"command": ["x"], "model": "m\x00"}, extra={}, ascii_only=False)
def test_creating_an_agent_with_any_body_is_201_or_a_json_4xx(
    api, company, name, adapter_type, config, extra, ascii_only
):
    body = {**extra, "name": name, "adapter_type": adapter_type, "adapter_config": config}
    response = api.post(f"/api/companies/{company.id}/agents", raw=raw_json(body, ascii_only=ascii_only))
    assert_json_answer(response, {201, 400, 413})
    if response.status_code == 201:
        # What was accepted can be read back and used: it survives a round trip.
        agent = Agent.objects.get(id=response.json()["id"])
        assert agent.adapter_config == response.json()["adapter_config"]


@FUZZ
@given(
    body=st.one_of(
        st.fixed_dictionaries({"adapter_config": adapter_configs}),
        st.fixed_dictionaries({}, optional={"name": json_values, "adapter_type": adapter_types, "status": json_values}),
        json_values,
    ),
    ascii_only=st.booleans(),
)
def test_patching_an_agent_with_any_body_is_200_or_a_json_4xx(api, persistent_agent, body, ascii_only):
    response = api.patch(agent_url(persistent_agent), raw=raw_json(body, ascii_only=ascii_only))
    assert_json_answer(response, {200, 400, 413})
    # Whatever happened, the stored agent is still one the engine can load and run.
    persistent_agent.refresh_from_db()
    validate_agent_config(persistent_agent.adapter_type, persistent_agent.adapter_config)


@FUZZ
@given(
    body=st.one_of(
        st.fixed_dictionaries(
            {"task": st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(NASTY_STRINGS), json_values)},
            optional={
                "idempotency_key": st.one_of(st.text(max_size=300), st.sampled_from(NASTY_STRINGS), json_values),
                "force_fresh": json_values,
                # Mostly not true: a true `wait` runs the model inline, against the fake.
                "wait": st.one_of(st.just(False), json_values),
                "extra": json_values,
            },
        ),
        json_values,
    ),
    ascii_only=st.booleans(),
)
def test_any_heartbeat_body_is_answered_with_a_run_or_a_json_4xx(
    api, persistent_agent, fake_anthropic, body, ascii_only
):
    response = api.post(agent_url(persistent_agent, "/heartbeat"), raw=raw_json(body, ascii_only=ascii_only))
    # 409: an idempotency key the corpus already used for another task.
    assert_json_answer(response, {200, 202, 400, 409, 413})


@FUZZ
@example(company_id="\ud800", suffix="/agents/{agent}/sessions/{x}", x="\ud800", query={})
@given(
    company_id=st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(NASTY_STRINGS[:13])),
    suffix=st.sampled_from(["", "/agents", "/agents/{agent}", "/agents/{agent}/sessions/{x}", "/costs/daily"]),
    x=st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(["sess_" + "0" * 32, "sess_zz", "0" * 400])),
    query=st.dictionaries(
        st.sampled_from(["limit", "next", "status", "days", "agent_id", "created_after"]), st.text(max_size=30)
    ),
)
def test_any_id_or_query_in_a_url_is_a_json_4xx_or_an_answer(api, persistent_agent, company_id, suffix, x, query):
    def segment(text: str) -> str:
        # A lone surrogate goes out as the invalid UTF-8 bytes a careless client would send.
        return quote(text.encode("utf-8", "surrogatepass"), safe="")

    agent = str(persistent_agent.id)
    path = f"/api/companies/{segment(company_id)}" + suffix.format(agent=agent, x=segment(x))
    response = api.get(path, query)
    assert response.status_code in {200, 400, 404, 405}, (path, response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/json")
    # The same paths under the right company, with the fuzzed query.
    real = f"/api/companies/{persistent_agent.company_id}" + suffix.format(agent=agent, x=segment(x))
    assert_json_answer(api.get(real, query), {200, 400, 404, 405})
