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


# Message Batches, through the SDK's own `client.messages.batches`.


def batch_client(fake) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fake.base_url, api_key=conftest.FAKE_API_KEY, max_retries=0)


def batch_request(custom_id: str, text: str = "hi") -> dict:
    return {
        "custom_id": custom_id,
        "params": {"model": "claude-opus-4-5", "max_tokens": 16, "messages": [{"role": "user", "content": text}]},
    }


def test_a_batch_processes_for_its_scripted_time_then_answers_every_request_as_jsonl(monkeypatch):
    with conftest.fake_api(monkeypatch) as fake:
        clock = [1000.0]
        fake.clock = lambda: clock[0]
        fake.batch_seconds = 600
        client = batch_client(fake)
        batch = client.messages.batches.create(requests=[batch_request("a", "one"), batch_request("b", "two")])
        assert batch.processing_status == "in_progress" and batch.request_counts.processing == 2
        assert client.messages.batches.retrieve(batch.id).processing_status == "in_progress"
        with pytest.raises(anthropic.AnthropicError, match="results_url"):
            list(client.messages.batches.results(batch.id))
        clock[0] += 600
        ended = client.messages.batches.retrieve(batch.id)
        assert ended.processing_status == "ended" and ended.request_counts.succeeded == 2
        results = {line.custom_id: line.result for line in client.messages.batches.results(batch.id)}
        assert [results[key].type for key in ("a", "b")] == ["succeeded", "succeeded"]
        assert "one" in results["a"].message.content[0].text and "two" in results["b"].message.content[0].text
        # The API reports a batch's tokens as it bills them: at the batch tier.
        assert results["a"].message.usage.service_tier == "batch"
        assert [answer["custom_id"] for answer in fake.batch_answers] == ["a", "b"]
        assert fake.batch_creates == 1 and fake.message_requests == []  # nothing sent as a direct request
        assert [listed.id for listed in client.messages.batches.list()] == [batch.id]


def test_scripted_errored_and_expired_results_and_bad_requests_errored(monkeypatch):
    with conftest.fake_api(monkeypatch) as fake:
        fake.batch_outcomes = ["errored", "expired"]
        client = batch_client(fake)
        bad = {"custom_id": "d", "params": {"model": "claude-opus-4-5", "max_tokens": 16, "messages": []}}
        batch = client.messages.batches.create(
            requests=[batch_request("a"), batch_request("b"), batch_request("c"), bad]
        )
        results = {line.custom_id: line.result for line in client.messages.batches.results(batch.id)}
        assert {key: result.type for key, result in results.items()} == {
            "a": "errored",
            "b": "expired",
            "c": "succeeded",
            "d": "errored",
        }
        assert results["a"].error.error.type == "invalid_request_error"
        assert "at least one message" in results["d"].error.error.message
        counts = client.messages.batches.retrieve(batch.id).request_counts
        assert (counts.succeeded, counts.errored, counts.expired) == (1, 2, 1)
        assert len(fake.batch_answers) == 1


def test_a_cancelled_batch_ends_with_its_requests_canceled_and_an_ended_one_is_not_cancelled(monkeypatch):
    with conftest.fake_api(monkeypatch) as fake:
        fake.batch_seconds = 3600
        client = batch_client(fake)
        batch = client.messages.batches.create(requests=[batch_request("a")])
        assert client.messages.batches.cancel(batch.id).processing_status == "ended"
        (line,) = client.messages.batches.results(batch.id)
        assert line.result.type == "canceled" and fake.batch_answers == []
        fake.batch_seconds = 0
        done = client.messages.batches.create(requests=[batch_request("b")])
        client.messages.batches.cancel(done.id)
        assert [line.result.type for line in client.messages.batches.results(done.id)] == ["succeeded"]


def test_the_api_refuses_a_batch_with_duplicate_or_malformed_custom_ids(monkeypatch):
    with conftest.fake_api(monkeypatch) as fake:
        client = batch_client(fake)
        with pytest.raises(anthropic.BadRequestError, match="unique"):
            client.messages.batches.create(requests=[batch_request("a"), batch_request("a")])
        with pytest.raises(anthropic.BadRequestError, match="custom_id"):
            client.messages.batches.create(requests=[batch_request("not ok!")])
        with pytest.raises(anthropic.NotFoundError):
            client.messages.batches.retrieve("msgbatch_missing")
