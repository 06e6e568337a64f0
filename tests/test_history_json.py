"""The history's JSON codec: msgspec's speed with the standard library's answers."""

from __future__ import annotations

import json

import pytest
from django.db import connection, models

from sessions_app.history_json import history_dumps, history_loads, json_length, json_size
from sessions_app.models import AgentSession

HISTORY = [
    {"role": "user", "content": 'Ünïcode, emoji 🦀, "quotes", \u2028 and \\\n', "seq": 0, "at": "2026-12-06T00:00"},
    {
        "role": "assistant",
        "content": [{"type": "text", "text": "answer"}, {"type": "tool_use", "id": "t1", "input": {"n": 0.1}}],
        "usage": {"input_tokens": 12, "output_tokens": 3, "cache_creation": None, "big": 2**80},
    },
]


def test_what_is_written_reads_back_the_same_with_either_library():
    encoded = history_dumps(HISTORY)
    assert history_loads(encoded) == json.loads(encoded) == HISTORY
    assert history_loads(encoded.decode()) == HISTORY
    assert history_loads(json.dumps(HISTORY)) == HISTORY


@pytest.mark.parametrize(
    "text",
    [
        '{"x": NaN}',
        "[1e400]",
        '["\\ud800"]',
        '{"a": 1, "a": 2}',
        "[123456789012345678901234567890, 1.7976931348623157e308]",
    ],
    ids=["nan", "beyond a float", "lone surrogate", "repeated key", "exact numbers"],
)
def test_a_text_is_read_as_json_reads_it(text):
    assert repr(history_loads(text)) == repr(json.loads(text))


def test_corrupt_text_raises_as_json_does():
    with pytest.raises(ValueError):
        history_loads('[{"role": "user"')


@pytest.mark.parametrize(
    "text", ['[{"role": "user", "content": "hi", "n": 18446744073709551617}]', "[NaN]", "{not json"]
)
def test_the_history_column_reads_what_django_s_jsonfield_reads(text):
    history = AgentSession._meta.get_field("history")
    assert repr(history.from_db_value(text, None, connection)) == repr(
        models.JSONField().from_db_value(text, None, connection)
    )


def test_json_length_and_size_count_what_json_dumps_writes():
    request = {
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": HISTORY,
    }
    for value in (HISTORY, request, [], {}, {"a": {"b": [[], {}]}}, "plain"):
        written = json.dumps(value, ensure_ascii=False)
        assert (json_length(value), json_size(value)) == (len(written), len(written.encode()))


def test_json_length_and_size_of_what_msgspec_refuses_are_json_dumps_own():
    lone_surrogate = [{"role": "user", "content": "half a pair: \ud800"}]
    written = json.dumps(lone_surrogate, ensure_ascii=False)
    assert json_length(lone_surrogate) == len(written)
    assert json_size(lone_surrogate) == len(written.encode("utf-8", "surrogatepass"))
