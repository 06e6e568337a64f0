"""An agent's pinned facts through the API: listed, created (validated: 400 naming `text`),
capped (409) and deleted, within the company in the URL."""

from __future__ import annotations

import pytest

from sessions_app.models import MAX_PIN_CHARS, PinnedFact
from tests.api.conftest import agent_url, assert_error

pytestmark = pytest.mark.django_db


def test_a_pin_is_created_listed_and_deleted(api, persistent_agent):
    url = agent_url(persistent_agent, "/pins")

    created = api.post(url, {"text": "  Customer ACME-42 renews on 2027-03-01 "})

    assert created.status_code == 201, created.content
    pin = created.json()
    assert pin["text"] == "Customer ACME-42 renews on 2027-03-01"
    assert api.get(url).json() == {"pins": [pin]}
    assert api.delete(f"{url}/{pin['id']}").status_code == 204
    assert api.get(url).json() == {"pins": []}
    assert_error(api.delete(f"{url}/{pin['id']}"), 404, "not_found")


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"text": ""},
        {"text": "   "},
        {"text": 42},
        {"text": None},
        {"text": ["a"]},
        {"text": "a\x00b"},
        {"text": "x" * (MAX_PIN_CHARS + 1)},
        {"text": "ok", "pinned": True},
    ],
)
def test_bad_input_is_400_naming_the_field(api, persistent_agent, body):
    error = assert_error(api.post(agent_url(persistent_agent, "/pins"), body), 400)
    assert set(error["fields"]) == (set(body) - {"text"} or {"text"})
    assert not PinnedFact.objects.exists()


def test_a_body_that_is_not_json_is_400(api, persistent_agent):
    assert_error(api.post(agent_url(persistent_agent, "/pins"), raw="{not json"), 400)


def test_past_fifty_pins_is_409_too_many_pins(api, persistent_agent):
    PinnedFact.objects.bulk_create(PinnedFact(agent=persistent_agent, text=f"fact {i}") for i in range(50))
    assert_error(api.post(agent_url(persistent_agent, "/pins"), {"text": "one more"}), 409, "too_many_pins")


def test_another_companys_agent_and_pins_are_not_found(api, persistent_agent, other_agent):
    pin = PinnedFact.objects.create(agent=other_agent, text="theirs")
    foreign = f"/api/companies/{persistent_agent.company_id}/agents/{other_agent.id}/pins"
    assert_error(api.get(foreign), 404)
    assert_error(api.delete(agent_url(persistent_agent, f"/pins/{pin.id}")), 404)
    assert PinnedFact.objects.filter(pk=pin.pk).exists()


def test_listing_pins_takes_the_same_queries_for_many(api, persistent_agent, django_assert_max_num_queries):
    PinnedFact.objects.bulk_create(PinnedFact(agent=persistent_agent, text=f"fact {i}") for i in range(50))
    with django_assert_max_num_queries(2):
        response = api.get(agent_url(persistent_agent, "/pins"))
    assert len(response.json()["pins"]) == 50
