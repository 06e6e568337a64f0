"""What the admin's lists share (sessions_app/admin/common.py): the agent and company filters
of their sidebars, bounded however many agents and companies there are."""

from __future__ import annotations

import html
import re
import uuid
from datetime import timedelta
from decimal import Decimal
from urllib.parse import parse_qs

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from costs_app.models import Budget
from memory_app.models import MemoryFile, MemoryStore
from sessions_app.admin.common import AGENT_CHOICES_CAP, COMPANY_CHOICES_CAP
from sessions_app.models import Agent, ApiKey, Company
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
    return sidebar_of(page, "agent")


def sidebar_of(page: str, title: str) -> str:
    found = re.search(rf'<details data-filter-title="{title}".*?</details>', page, re.S)
    assert found, f"no {title} filter in the sidebar"
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


# The company filter (CompanyFilter): every list with one, and the name its id box takes.
AGENTS = "admin:sessions_app_agent_changelist"
API_KEYS = "admin:sessions_app_apikey_changelist"
BUDGETS = "admin:costs_app_budget_changelist"
MEMORY_STORES = "admin:memory_app_memorystore_changelist"
COMPANY_LISTS = [
    (SESSIONS, "company_id"),
    (RUNS, "company_id"),
    (AGENTS, "company_id"),
    (API_KEYS, "company_id"),
    (BUDGETS, "company_id"),
    (COSTS, "company_id"),
    (MEMORY_FILES, "store__company_id"),
    (MEMORY_STORES, "company_id"),
]


def companies_created(count: int, *, name: str) -> list[Company]:
    return Company.objects.bulk_create(Company(name=f"{name} {n:03}") for n in range(count))


def rows_of(company: Company) -> dict[str, object]:
    """One row of `company` in each list with a company filter: its primary key by list."""
    agent = Agent.objects.create(
        company=company, name=f"{company.name} agent", adapter_config={"model": "claude-opus-4-5"}
    )
    session = make_session(agent, history=[])
    store = MemoryStore.objects.create(company=company, agent=agent, name="default")
    key = ApiKey.objects.create(company=company, name="ci", prefix="pc_abcde", key_hash=uuid.uuid4().hex * 2)
    return {
        SESSIONS: session.pk,
        RUNS: make_run(agent, session=session).pk,
        AGENTS: agent.pk,
        API_KEYS: key.pk,
        BUDGETS: Budget.objects.create(company=company, monthly_limit_usd=Decimal("100")).pk,
        COSTS: make_cost(agent, session=session).pk,
        MEMORY_FILES: MemoryFile.objects.create(store=store, path="notes.md", content="Friday.", size=7).pk,
        MEMORY_STORES: store.pk,
    }


def shown(client, url_name: str, params) -> tuple[list, str]:
    """The primary keys of the rows a list shows, and its page."""
    response = client.get(reverse(url_name), params)
    assert response.status_code == 200
    return [row.pk for row in response.context["cl"].result_list], response.content.decode()


@pytest.fixture
def companies(company):
    """More companies than the filter lists: `company` the oldest, then the cap's worth of newer ones."""
    Company.objects.filter(pk=company.pk).update(created_at=timezone.now() - timedelta(days=30))
    return companies_created(COMPANY_CHOICES_CAP, name="newco")


@pytest.mark.parametrize(("url_name", "id_parameter"), COMPANY_LISTS)
def test_the_page_costs_the_same_queries_with_a_few_companies_or_hundreds(
    admin_client, company, url_name, id_parameter
):
    rows_of(company)
    companies_created(2, name="few")
    get(admin_client, url_name)  # warm the per-process caches
    page, few = get(admin_client, url_name)
    assert f'name="{id_parameter}"' not in sidebar_of(page, "company")
    companies_created(200, name="many")
    page, many = get(admin_client, url_name)
    assert len(many) == len(few), "\n".join(many)
    sidebar = sidebar_of(page, "company")
    assert len(listed(sidebar)) == COMPANY_CHOICES_CAP
    assert f'name="{id_parameter}"' in sidebar and "Any company by its id" in sidebar


@pytest.mark.parametrize(("url_name", "id_parameter"), COMPANY_LISTS)
def test_the_companies_are_read_in_one_limited_query_of_their_ids_and_names(
    admin_client, companies, url_name, id_parameter
):
    _, queries = get(admin_client, url_name)
    named = [sql for sql in queries if re.match(r'SELECT "companies"\."id"( AS "pk")?, "companies"\."name"', sql)]
    assert len(named) == 1 and f"LIMIT {COMPANY_CHOICES_CAP + 1}" in named[0], named
    # The newest first (SQLite names the id by its place in the SELECT).
    assert re.search(r'ORDER BY "companies"\."created_at" DESC, ("companies"\."id"|1) DESC', named[0]), named[0]
    unbounded = [sql for sql in queries if re.search(r'^SELECT .*? FROM "companies"', sql) and "LIMIT" not in sql]
    assert not unbounded, unbounded


@pytest.mark.parametrize(("url_name", "id_parameter"), COMPANY_LISTS)
def test_a_company_past_the_cap_filters_by_its_id_and_shows_as_selected(
    admin_client, company, companies, other_company, url_name, id_parameter
):
    mine, theirs = rows_of(company), rows_of(other_company)
    # As an operator pastes it from a log: no dashes, capitals.
    rows, page = shown(admin_client, url_name, {id_parameter: company.pk.hex.upper()})
    assert rows == [mine[url_name]] and theirs[url_name] not in rows
    sidebar = sidebar_of(page, "company")
    assert selected(sidebar) == [company.name]
    assert f'value="{company.pk}"' in sidebar  # the box says which
    assert len(listed(sidebar)) == COMPANY_CHOICES_CAP + 1  # the newest, and the one chosen


@pytest.mark.parametrize("spelling", ["company_id", "company", "company__id__exact"])
def test_a_company_chosen_any_way_is_the_one_link_choosing_another_replaces(admin_client, company, companies, spelling):
    page, _ = get(admin_client, SESSIONS, {spelling: str(company.pk), "status__exact": "ended"})
    sidebar = sidebar_of(page, "company")
    assert selected(sidebar) == [company.name]
    links = [parse_qs(html.unescape(link)[1:]) for link in re.findall(r'href="(\?[^"]*)"', sidebar)]
    assert len(links) == COMPANY_CHOICES_CAP + 2  # All, the newest, and the one chosen
    for link in links:
        assert set(link) <= {"company__id__exact", "status__exact"} and link["status__exact"] == ["ended"]
        assert len(link.get("company__id__exact", [])) <= 1


@pytest.mark.parametrize(
    ("url_name", "spelling"),
    [(SESSIONS, "company_id"), (SESSIONS, "company"), (SESSIONS, "company__id__exact"), (COSTS, "company_id")]
    + [(MEMORY_FILES, "store__company_id"), (MEMORY_FILES, "store__company")],
)
def test_the_agent_filter_lists_the_agents_of_the_company_chosen_however_spelled(
    admin_client, crowd, companies, other_company, url_name, spelling
):
    theirs = agents_created(other_company, 2, name="foreign")
    page, _ = get(admin_client, url_name, {spelling: other_company.pk.hex})
    sidebar = agent_sidebar(page)
    assert listed(sidebar) == [agent.name for agent in theirs]
    assert 'agent_id"' not in sidebar  # two agents: no box


def test_a_small_install_lists_every_company_by_name_without_a_box(admin_client, company):
    for name in ["bravo", "Charlie", "alpha co"]:
        Company.objects.create(name=name)
    sidebar = sidebar_of(get(admin_client, SESSIONS)[0], "company")
    assert listed(sidebar) == ["Acme", "alpha co", "bravo", "Charlie"]
    assert 'name="company_id"' not in sidebar


@pytest.mark.parametrize(
    ("url_name", "spelling"),
    [(SESSIONS, "company_id"), (SESSIONS, "company"), (SESSIONS, "company__id__exact")]
    + [(COSTS, "company_id"), (MEMORY_FILES, "store__company_id"), (MEMORY_STORES, "company")],
)
@pytest.mark.parametrize("value", ["not-a-company", "0" * 31, "\x00"])
def test_a_malformed_company_id_is_a_message_not_a_500(admin_client, companies, url_name, spelling, value):
    response = admin_client.get(reverse(url_name), {spelling: value}, follow=True)
    assert response.status_code == 200
    assert response.redirect_chain and response.redirect_chain[-1][0].endswith("?e=1")
    said = [str(message) for message in response.context["messages"]]
    assert len(said) == 1 and "The company filter takes a company's id" in said[0], said


def test_an_empty_company_box_lists_every_companys_rows(admin_client, company, companies, other_company):
    mine, theirs = rows_of(company), rows_of(other_company)
    rows, page = shown(admin_client, SESSIONS, {"company_id": ""})
    assert sorted(rows) == sorted([mine[SESSIONS], theirs[SESSIONS]])
    assert selected(sidebar_of(page, "company")) == ["All"]


@pytest.mark.parametrize(("model", "index"), [(Company, "companies_newest_idx"), (Agent, "agents_newest_idx")])
def test_the_newest_choices_are_read_from_an_index_not_a_sort_of_the_table(postgres_only, company, model, index):
    newest = model.objects.order_by("-created_at", "-pk").values_list("pk", "name")[: COMPANY_CHOICES_CAP + 1]
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table would be scanned anyway
        plan = newest.explain()
    assert index in plan and "Sort" not in plan, plan


# The forms that choose a company or an agent, and the fields they choose them with.
CHOOSING_FORMS = [
    ("admin:sessions_app_agent_add", ["company"]),
    ("admin:sessions_app_apikey_add", ["company"]),
    ("admin:costs_app_budget_add", ["company", "agent"]),
    ("admin:memory_app_memorystore_add", ["company", "agent"]),
]


@pytest.mark.parametrize(("url_name", "fields"), CHOOSING_FORMS)
def test_a_form_choosing_a_company_or_an_agent_searches_for_it_and_lists_none(
    admin_client, crowd, companies, url_name, fields
):
    with CaptureQueriesContext(connection) as captured:
        page = admin_client.get(reverse(url_name)).content.decode()
    for field in fields:
        assert re.search(rf'<select name="{field}"[^>]*class="admin-autocomplete', page), field
    # Before: an <option> for every company and agent, read on every form.
    assert "newco 007" not in page and "recruit 007" not in page
    reads = [query["sql"] for query in captured.captured_queries]
    unbounded = [sql for sql in reads if re.search(r'FROM "(companies|agents)"', sql) and "LIMIT" not in sql]
    assert not unbounded, unbounded


@pytest.mark.parametrize(("model_name", "field", "term", "found"), [
    ("budget", "agent", "recruit", "recruit"),
    ("budget", "company", "newco", "newco"),
    ("agent", "company", "newco", "newco"),
])  # fmt: skip
def test_the_search_answers_twenty_names_at_a_time(admin_client, crowd, companies, model_name, field, term, found):
    app_label = "costs_app" if model_name == "budget" else "sessions_app"
    query = {"app_label": app_label, "model_name": model_name, "field_name": field, "term": term}
    answer = admin_client.get(reverse("admin:autocomplete"), query).json()
    names = [result["text"] for result in answer["results"]]
    assert len(names) == 20 and answer["pagination"]["more"] is True
    assert all(name.startswith(found) for name in names)


def test_the_agent_search_never_offers_a_deleted_agent(admin_client, company):
    kept, retired = agents_created(company, 2, name="scout")
    Agent.objects.filter(pk=retired.pk).update(status="deleted")
    query = {"app_label": "costs_app", "model_name": "budget", "field_name": "agent", "term": "scout"}
    answer = admin_client.get(reverse("admin:autocomplete"), query).json()
    assert [result["id"] for result in answer["results"]] == [str(kept.pk)]


def test_a_search_term_holding_nul_finds_nothing_rather_than_a_403(admin_client, company):
    # PostgreSQL refuses NUL in the lookup; the bad-filter guard had redirected the widget's
    # JSON request to the lookup without its parameters, which Django answers 403.
    agents_created(company, 2, name="scout")
    query = {"app_label": "costs_app", "model_name": "budget", "field_name": "agent", "term": "sc\x00"}

    response = admin_client.get(reverse("admin:autocomplete"), query)

    assert response.status_code == 200
    assert response.json() == {"results": [], "pagination": {"more": False}}


def autocomplete_fields_of_every_admin() -> list[tuple]:
    from django.contrib import admin

    return [
        (model, name) for model, model_admin in admin.site._registry.items() for name in model_admin.autocomplete_fields
    ]


@pytest.mark.parametrize(
    ("model", "field"), autocomplete_fields_of_every_admin(), ids=lambda v: getattr(v, "__name__", v)
)
def test_a_search_box_given_no_id_is_a_form_error_not_a_500(admin_client, company, model, field):
    # Django's widget looked the value up again to show the form: a UUID column raised.
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_add")
    before = model.objects.count()
    for value in ["not-an-id", "\x00"]:
        response = admin_client.post(url, {field: value, "name": "probe"})

        assert response.status_code == 200
        assert field in response.context["adminform"].form.errors
        # An add page's link that fills the box (`?company=<id>`) with no id in it.
        assert admin_client.get(url, {field: value}).status_code == 200
    assert model.objects.count() == before
