"""The fake Messages API's own promises to the tests that use it: an action that breaks
fails the test instead of letting it pass with its second actor never having acted."""

from __future__ import annotations

import anthropic
import pytest

from tests import conftest
from tests.fake_anthropic import Reply


def ask(fake) -> None:
    client = anthropic.Anthropic(base_url=fake.base_url, api_key=conftest.FAKE_API_KEY, max_retries=0)
    client.messages.create(model="claude-opus-4-5", max_tokens=16, messages=[{"role": "user", "content": "hi"}])


def broken_action() -> None:
    raise RuntimeError("the reaper crashed")


def test_an_action_that_raises_fails_the_test_when_the_fake_closes(monkeypatch):
    with pytest.raises(AssertionError, match="the reaper crashed") as caught:
        with conftest.fake_api(monkeypatch) as fake:
            fake.push(Reply(before=broken_action))
            ask(fake)  # the client still gets its answer: the error is the test's, not the SDK's
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_test_that_expects_the_error_takes_it_and_passes(monkeypatch):
    with conftest.fake_api(monkeypatch) as fake:
        fake.push(Reply.during(broken_action))
        ask(fake)
        (error,) = fake.take_action_errors()
    assert str(error) == "the reaper crashed"  # and closing raised nothing
