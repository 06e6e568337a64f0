"""What the admin's lists share (sessions_app/admin/common.py): the agent filter of their
sidebars, bounded however many agents there are."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from urllib.parse import parse_qs

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from sessions_app.admin.common import AGENT_CHOICES_CAP
from sessions_app.models import Agent
from tests.admin.conftest import make_cost, make_run, make_session

SESSIONS = "admin:sessions_app_agentsession_changelist"
RUNS = "admin:sessions_app_heartbeatrun_changelist"
MEMORY_FILES = "admin:memory_app_memoryfile_changelist"
COSTS = "admin:costs_app_costevent_changelist"
# Each list and the name its agent filter's id box takes.
LISTS = [(SESSIONS, "agent_id"), (RUNS, "agent_id"), (MEMORY_FILES, "store__agent_id"), (COSTS, "agent_id")]


def agents_created(company, count: int, *, name: str, days_ago: int = 0) -> list[Agent]:
    created_at = timezone.now() - timedelta(days=days_ago)
    return Agent.objects.bulk_create(
        Agent(company=company, name=f"{name} {n:03}", system_prompt="You are thorough. " * 200, created_at=created_at)
        for n in range(count)
    )


@pytest.fixture
def crowd(company):
    """More agents than the filter lists: the oldest, then the cap's worth of newer ones."""
    old = agents_created(company, 3, name="veteran", days_ago=30)
    new = agents_created(company, AGENT_CHOICES_CAP, name="recruit")
    return {"old": old, "new": new}


def agent_sidebar(page: str) -> str:
    found = re.search(r'<details data-filter-title="agent".*?</details>', page, re.S)
    assert found, "no agent filter in the sidebar"
    return found.group(0)


def listed(sidebar: str) -> list[str]:
    """The agents the filter offers (its "All" left out)."""
    names = re.findall(r"<li[^>]*>\s*<a [^>]*>([^<]*)</a>", sidebar)
    return [name for name in names if name != "All"]


def selected(sidebar: str) -> list[str]:
    return re.findall(r'<li class="selected">\s*<a [^>]*>([^<]*)</a>', sidebar)


def get(client, url_name: str, params=None):
    with CaptureQueriesContext(connection) as queries:
        response = client.get(reverse(url_name), params or {})
    assert response.status_code == 200
    return response.content.decode(), [query["sql"] for query in queries]


@pytest.mark.parametrize(("url_name", "id_parameter"), LISTS)
def test_past_the_cap_the_newest_agents_are_listed_and_any_other_by_its_id(admin_client, crowd, url_name, id_parameter):
    page, queries = get(admin_client, url_name)
    sidebar = agent_sidebar(page)
    assert sorted(listed(sidebar)) == sorted(agent.name for agent in crowd["new"])
    assert f'name="{id_parameter}"' in sidebar  # the id box
    named = [sql for sql in queries if re.match(r'SELECT "agents"\."id"( AS "pk")?, "agents"\."name"', sql)]
    assert len(named) == 1 and f"LIMIT {AGENT_CHOICES_CAP + 1}" in named[0], named
    assert not any('"system_prompt"' in sql.split(" FROM ")[0] for sql in queries)


@pytest.mark.parametrize(("url_name", "id_parameter"), LISTS)
def test_a_small_install_lists_every_agent_by_name_without_a_box(admin_client, company, url_name, id_parameter):
    agents = agents_created(company, 4, name="crew")
    Agent.objects.filter(pk=agents[0].pk).update(name="zed")
    sidebar = agent_sidebar(get(admin_client, url_name)[0])
    assert listed(sidebar) == ["crew 001", "crew 002", "crew 003", "zed"]
    assert f'name="{id_parameter}"' not in sidebar


def test_the_page_costs_the_same_queries_with_a_few_agents_or_thousands_of_them(
    admin_client, company, django_assert_max_num_queries
):
    agents = agents_created(company, 3, name="crew")
    make_session(agents[0], history=[])
    get(admin_client, SESSIONS)  # warm the per-process caches
    few = len(get(admin_client, SESSIONS)[1])
    agents_created(company, 2_000, name="recruit")
    with django_assert_max_num_queries(few):
        page = admin_client.get(reverse(SESSIONS)).content.decode()
    assert len(listed(agent_sidebar(page))) == AGENT_CHOICES_CAP


@pytest.mark.parametrize("spelling", ["agent_id", "agent", "agent__id__exact"])
@pytest.mark.parametrize("url_name", [SESSIONS, RUNS])
def test_an_agent_past_the_cap_filters_by_its_id_and_shows_as_selected(admin_client, crowd, url_name, spelling):
    veteran, recruit = crowd["old"][0], crowd["new"][0]
    mine = make_session(veteran, history=[]) if url_name == SESSIONS else make_run(veteran)
    theirs = make_session(recruit, history=[]) if url_name == SESSIONS else make_run(recruit)
    # As an operator pastes it from a log: no dashes, capitals.
    page, _ = get(admin_client, url_name, {spelling: veteran.pk.hex.upper()})
    rows = re.findall(r'<tr>\s*<td class="action-checkbox">.*?</tr>', page, re.S)
    assert len(rows) == 1
    shown = mine.public_id if url_name == SESSIONS else str(mine.pk)
    assert shown in rows[0] and (theirs.public_id if url_name == SESSIONS else str(theirs.pk)) not in page
    sidebar = agent_sidebar(page)
    assert selected(sidebar) == [veteran.name]
    assert f'value="{veteran.pk}"' in sidebar  # the box says which
    # Choosing another agent replaces this one, however it was spelled.
    links = [parse_qs(link[1:]) for link in re.findall(r'href="(\?[^"]*)"', sidebar)]
    assert len(links) == AGENT_CHOICES_CAP + 2  # All, the newest, and the one chosen
    assert all(set(link) <= {"agent__id__exact"} and len(link.get("agent__id__exact", [])) <= 1 for link in links)


@pytest.mark.parametrize(("url_name", "id_parameter"), LISTS)
def test_the_id_box_of_every_list_chooses_the_agent(admin_client, crowd, url_name, id_parameter):
    # The memory files' box reaches the agent through the store: Django refused the lookup
    # with a 400 before the filter saw it.
    veteran = crowd["old"][0]
    page, _ = get(admin_client, url_name, {id_parameter: str(veteran.pk)})
    assert selected(agent_sidebar(page)) == [veteran.name]


def test_the_id_box_keeps_the_other_filters_and_the_search(admin_client, crowd, company):
    page, _ = get(admin_client, SESSIONS, {"status__exact": "ended", "q": "recruit", "o": "2"})
    sidebar = agent_sidebar(page)
    hidden = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', sidebar))
    assert hidden == {"status__exact": "ended", "q": "recruit", "o": "2"}


def test_a_company_filtered_lists_its_own_agents_only(admin_client, crowd, other_company):
    theirs = agents_created(other_company, 2, name="foreign")
    page, _ = get(admin_client, SESSIONS, {"company__id__exact": str(other_company.pk)})
    sidebar = agent_sidebar(page)
    assert listed(sidebar) == [agent.name for agent in theirs]
    assert 'name="agent_id"' not in sidebar


def test_an_agent_chosen_filters_even_where_the_sidebar_has_nothing_to_offer(admin_client, persistent_agent):
    # With one agent there is no choice to list, and Django dropped the filter (and its
    # parameter) with its sidebar entry: an agent's id, a retired one's say, listed every row.
    make_session(persistent_agent, history=[])
    page, _ = get(admin_client, SESSIONS, {"agent__id__exact": str(uuid.uuid4())})
    assert "0 agent sessions" in page


@pytest.mark.parametrize("spelling", ["agent_id", "agent", "agent__id__exact"])
@pytest.mark.parametrize("value", ["not-an-id", "0" * 31, "\x00"])
def test_a_malformed_agent_id_is_a_message_not_a_500(admin_client, crowd, spelling, value):
    response = admin_client.get(reverse(SESSIONS), {spelling: value}, follow=True)
    assert response.status_code == 200
    assert response.redirect_chain and response.redirect_chain[-1][0].endswith("?e=1")
    said = [str(message) for message in response.context["messages"]]
    assert len(said) == 1 and "takes an agent's id" in said[0], said


def test_an_empty_id_box_lists_every_agents_rows(admin_client, crowd):
    make_session(crowd["old"][0], history=[])
    make_session(crowd["new"][0], history=[])
    page, _ = get(admin_client, SESSIONS, {"agent_id": ""})
    assert "2 agent sessions" in page
    assert selected(agent_sidebar(page)) == ["All"]


def test_the_ledger_filtered_from_an_agents_page_shows_that_agent_chosen(admin_client, crowd):
    veteran, recruit = crowd["old"][0], crowd["new"][0]
    make_cost(veteran, model="claude-veteran-1")
    make_cost(recruit, model="claude-recruit-1")
    agent_page = admin_client.get(reverse("admin:sessions_app_agent_change", args=[veteran.pk])).content.decode()
    costs_url = re.search(r'href="([^"]*/costs_app/costevent/\?agent=[^"]*)"', agent_page).group(1)
    page = admin_client.get(costs_url.replace("&amp;", "&")).content.decode()
    assert "claude-veteran-1" in page and "claude-recruit-1" not in page
    assert selected(agent_sidebar(page)) == [veteran.name]


@pytest.mark.parametrize("url_name", [SESSIONS, COSTS])
def test_the_model_filter_reads_one_row_per_model_not_per_agent(admin_client, company, url_name):
    crew = agents_created(company, 3, name="crew")
    for agent, model in zip(crew, ["claude-opus-4-5", "claude-opus-4-5", "claude-haiku-4-5"], strict=True):
        Agent.objects.filter(pk=agent.pk).update(adapter_config={"model": model})
    page, queries = get(admin_client, url_name)
    assert "claude-opus-4-5" in page and "claude-haiku-4-5" in page
    models = [sql for sql in queries if "adapter_config" in sql.split(" FROM ")[0] and 'FROM "agents"' in sql]
    assert len(models) == 1 and "DISTINCT" in models[0] and "ORDER BY" not in models[0], models
