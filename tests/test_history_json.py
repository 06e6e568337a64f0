"""The history's JSON codec: msgspec's speed with the standard library's answers."""

from __future__ import annotations

import json

import pytest

from sessions_app.history_json import history_dumps, history_loads

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
