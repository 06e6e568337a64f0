"""The operator's path through the admin in a real browser (Debian's Chromium, headless).

Screenshots land in test-artifacts/ (ignored by git; CI keeps them as artifacts).
"""

from __future__ import annotations

import os
import re
import shutil
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connections
from django.utils import timezone

from costs_app.models import CostEvent
from sessions_app.models import AgentSession, HeartbeatRun, RunStatus, SessionCompaction, SessionStatus
from sessions_app.stores import STORES
from tests.admin.conftest import conversation, make_cost, make_run, make_session

# Playwright's sync API runs an event loop in this thread; the ORM calls the test makes
# between browser steps are plain synchronous ones.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(settings.BASE_DIR) / "test-artifacts"

pytestmark = [
    pytest.mark.browser,
    # Transactional, for the live server's thread (serialized_rollback would re-insert the
    # content types an earlier transactional test's flush already re-created, and fail).
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not shutil.which(CHROMIUM), reason=f"{CHROMIUM} is missing (apt-get install -y chromium)"),
]


@pytest.fixture
def browser_page():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(15_000)
            yield page
        finally:
            # Under Playwright's greenlets the test body gets its own database connection
            # (connections are per context); close it, or PostgreSQL cannot drop the test
            # database.
            connections.close_all()
            browser.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"admin-{name}.png"), full_page=True)


def api_session_ids(page, live_server, session: AgentSession) -> list[str]:
    """The agent's sessions as the API lists them (the contract's GET .../sessions)."""
    response = page.request.get(
        f"{live_server.url}/api/companies/{session.company_id}/agents/{session.agent_id}/sessions"
    )
    assert response.status == 200
    return [item["id"] for item in response.json()["sessions"]]


def test_operator_reads_and_deletes_a_session_and_sees_costs(
    live_server, browser_page, django_user_model, persistent_agent, stateless_agent
):
    page = browser_page
    now = timezone.now()
    history = conversation(4, text="Quarterly plan")
    history[0]["content"] = "Draft the quarterly plan. <script>alert('x')</script>"
    session = make_session(persistent_agent, history=history, status=SessionStatus.ACTIVE)
    run = make_run(persistent_agent, session=session)
    SessionCompaction.objects.create(
        session=session,
        run=run,
        kind="summarize",
        archived_messages=conversation(2, text="Kick-off"),
        messages_before=6,
        messages_after=4,
        tokens_before=52_000,
        tokens_after=9_000,
        summary="Kick-off: the team agreed on three goals.",
        cost_usd=Decimal("0.004"),
    )
    for day in range(10):
        for agent, tokens in ((persistent_agent, 1000 + 400 * day), (stateless_agent, 600)):
            event = make_cost(
                agent,
                session=session if agent == persistent_agent else None,
                run=run,
                input_tokens=tokens,
                cost_usd=Decimal(tokens) / Decimal(100_000),
            )
            CostEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(days=9 - day))
    history_path = STORES[session.store].path_for(session) if session.store == "file" else None

    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))

    log_in(page, live_server, django_user_model)
    page.wait_for_selector("#console")
    shot(page, "01-index")

    # The agent, then its sessions.
    page.click("a:text-is('Agents')")
    page.click(f"a:text-is('{persistent_agent.name}')")
    page.wait_for_selector("text=recent sessions")
    shot(page, "02-agent")
    page.click("ul.object-tools a:text-is('Sessions')")
    # The list shows the start of the id; the link's tooltip, all of it.
    session_link = f"#result_list a:has(span[title='{session.public_id}'])"
    page.wait_for_selector(session_link)
    shot(page, "03-sessions")

    # One session: its conversation reads as turns, and the script is only text.
    page.click(session_link)
    conversation_box = page.locator("#conversation")
    conversation_box.wait_for()
    assert conversation_box.locator("article.pc-turn").count() == 4
    text = conversation_box.inner_text()
    assert "Draft the quarterly plan. <script>alert('x')</script>" in text
    assert "Quarterly plan 1: the answer." in text
    page.click("#compactions summary")
    assert "Kick-off 1: the answer." in page.locator("#compactions").inner_text()
    assert not dialogs  # the script never ran
    shot(page, "04-session")

    assert session.public_id in api_session_ids(page, live_server, session)

    # Delete it from the admin.
    page.click("a.deletelink")
    page.click("input[type=submit]")  # "Yes, I'm sure"
    page.wait_for_selector("ul.messagelist li.success")
    assert (
        session.public_id not in page.locator("#result_list").inner_text()
        if page.locator("#result_list").count()
        else True
    )
    shot(page, "05-deleted")
    assert not AgentSession.objects.filter(pk=session.pk).exists()
    if history_path is not None:
        assert not history_path.exists()
    assert session.public_id not in api_session_ids(page, live_server, session)

    # The costs page: a chart with data, and the growing agent flagged.
    page.goto(f"{live_server.url}/admin/costs_app/costevent/")
    page.click("a:text-is('Costs page (30 days)')")
    page.wait_for_selector("#cost-chart svg")
    assert page.locator("#cost-chart svg rect.pc-bar").count() >= 10
    assert page.locator("#agents-table tbody tr").count() == 2
    assert re.search(r"Persistent.*input tokens per run grow", page.locator("ul.messagelist").inner_text())
    shot(page, "06-costs")

    # Model prices warn about a model used without a price.
    make_cost(stateless_agent, model="claude-mystery-1", unpriced=True, cost_usd=Decimal(0))
    page.goto(f"{live_server.url}/admin/costs_app/modelprice/")
    assert "claude-mystery-1" in page.locator("ul.messagelist li.warning").inner_text()
    shot(page, "07-model-prices")

    # The heartbeat form of an agent (not submitted: no task cluster runs here).
    page.goto(f"{live_server.url}/admin/sessions_app/agent/{persistent_agent.pk}/change/")
    page.click("a:text-is('Run a heartbeat now')")
    page.wait_for_selector("textarea[name=task]")
    shot(page, "08-heartbeat-form")


@pytest.fixture
def laptop_page(browser_page):
    browser_page.set_viewport_size({"width": 1366, "height": 768})
    return browser_page


def test_sessions_list_keeps_the_columns_an_operator_scans_inside_a_1366_pixel_screen(
    live_server, laptop_page, django_user_model, persistent_agent
):
    persistent_agent.name = "Quarterly planning researcher"
    persistent_agent.save(update_fields=["name"])
    now = timezone.now()
    # The widest values each column shows: a live session past its expiry not yet swept,
    # an expiry long ago, a five-digit message count.
    make_session(
        persistent_agent,
        history=conversation(6, text="Plan"),
        status=SessionStatus.ACTIVE,
        expires_at=now - timedelta(days=2),
    )
    for status in (SessionStatus.EXPIRED, SessionStatus.ENDED):
        session = make_session(persistent_agent, history=conversation(6, text="Plan"), status=status)
        AgentSession.objects.filter(pk=session.pk).update(message_count=12_345, expires_at=now - timedelta(days=40))
    page = laptop_page
    log_in(page, live_server, django_user_model, "/admin/sessions_app/agentsession/")
    page.wait_for_selector("#result_list")
    shot(page, "09-sessions-1366")
    for column in ("status_now", "message_count", "expires"):
        cells = page.locator(f"#result_list .field-{column}, #result_list th.column-{column}")
        assert cells.count() == 4, column
        # Visible means inside the window and inside the list's scrolling box, which
        # clips what is wider than the space the sidebars leave.
        overflow = cells.evaluate_all(
            """cells => cells.map(cell => {
                const box = cell.closest('.results').getBoundingClientRect();
                const right = cell.getBoundingClientRect().right;
                return right - Math.min(box.right, window.innerWidth);
            })"""
        )
        assert max(overflow) <= 0, (column, overflow)


def test_operator_edits_and_reverts_an_agents_memory(live_server, browser_page, django_user_model, persistent_agent):
    from memory_app.models import MemoryFile
    from memory_app.stores import Writer, mounts_for
    from memory_app.tool import StoreMemoryTool

    page, agent = browser_page, persistent_agent

    agent.adapter_config = {**agent.adapter_config, "memory": True}
    agent.save()
    run = make_run(agent, status=RunStatus.RUNNING)  # a run writes memory while it runs
    StoreMemoryTool(mounts_for(agent), writer=Writer(run_id=run.id)).call(
        {"command": "create", "path": "/memories/customers.md", "file_text": "Acme pays on net 30.\n<b>bold?</b>"}
    )
    HeartbeatRun.objects.filter(id=run.id).update(status=RunStatus.SUCCEEDED)
    log_in(page, live_server, django_user_model, f"/admin/sessions_app/agent/{agent.pk}/change/")

    # From the agent to its memory files, then the one file.
    page.click("a.memory-files")
    page.click("a:text-is('customers.md')")
    page.wait_for_selector("table.memory-versions")
    assert f"run {run.id}" in page.locator("table.memory-versions").inner_text()

    # An operator edit is a new version, shown as a diff against the run's.
    page.fill("textarea[name=content]", "Acme pays on net 45.\n<b>bold?</b>")
    page.click("input[name=_continue]")
    page.wait_for_selector("ul.messagelist li.success")
    versions = page.locator("table.memory-versions")
    assert versions.locator("tbody tr").count() == 2
    diff = versions.locator("pre.memory-diff").first.inner_text()
    assert "-Acme pays on net 30." in diff and "+Acme pays on net 45." in diff
    shot(page, "10-memory-file")

    # Revert to the run's version: a third version, with the run's content.
    versions.locator("button.memory-revert[value='1']").click()
    page.wait_for_selector("text=Reverted customers.md to version 1")
    assert page.locator("textarea[name=content]").input_value() == "Acme pays on net 30.\n<b>bold?</b>"
    found = MemoryFile.objects.get(path="customers.md")
    assert (found.version, found.content) == (3, "Acme pays on net 30.\n<b>bold?</b>")
    shot(page, "11-memory-reverted")


def log_in(page, live_server, django_user_model, next_url: str = "/admin/") -> None:
    django_user_model.objects.create_superuser("operator", "op@example.com", "correct horse battery")
    page.goto(f"{live_server.url}/admin/login/?next={next_url}")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "correct horse battery")
    page.click("input[type=submit]")


def wide_house(company) -> dict:
    """Rows with the widest values each list shows: long names, models, codes, URLs, errors."""
    from costs_app.models import Budget
    from sessions_app.models import Agent, RunStatus
    from tests.admin.conftest import budget_alert_delivered

    now = timezone.now()
    company.name = "Acme Intergalactic Holdings and Subsidiaries of the Outer Rim Ltd."
    company.save()
    agent = Agent.objects.create(
        company=company,
        name="Quarterly planning researcher for the northern European sales regions",
        adapter_config={"model": "claude-sonnet-4-5-20250929", "session_mode": "persistent"},
    )
    session = make_session(
        agent, history=conversation(4), status=SessionStatus.ACTIVE, expires_at=now - timedelta(days=2)
    )
    AgentSession.objects.filter(pk=session.pk).update(
        message_count=123_456, total_input_tokens=987_654_321, total_output_tokens=12_345_678, total_cost_usd=12345.6789
    )
    run = make_run(
        agent,
        session=session,
        status=RunStatus.FAILED,
        error_code="compaction_model_rate_limited_after_retries",
        input_tokens=190_000,
        cache_read_input_tokens=1_500_000,
        cost_usd=Decimal("1234.5678901234"),
    )
    make_cost(agent, session=session, run=run, model="claude-sonnet-4-5-20250929-experimental", input_tokens=9_999_999)
    budget = Budget.objects.create(company=company, agent=agent, monthly_limit_usd=Decimal("100000"))
    delivery = budget_alert_delivered(budget)
    delivery.target.url = "https://alerts.example.internal/hooks/paperclip/budget/" + "x" * 80
    delivery.target.save()
    delivery.last_error = "ConnectionRefusedError: [Errno 111] Connection refused " * 4
    delivery.save()
    return {"agent": agent, "session": session, "run": run}


# The columns an operator decides on, per list (issue 26): in view at 1366 px.
NAMED_COLUMNS = {
    "sessions_app/agentsession": ["agent_name", "status_now", "message_count", "tokens", "total_cost", "last_used_at"],
    "sessions_app/heartbeatrun": ["agent_name", "status", "trigger", "cost", "started"],
    "costs_app/costevent": ["agent_name", "model_name", "tokens", "cost"],
    "costs_app/alertdelivery": ["budget_link", "threshold", "target_short", "status"],
}

# Each cell's and header's right edge beyond the window or the list's scrolling box (> 0: hidden).
OVERFLOW = """cells => cells.map(cell => {
    const box = cell.closest('.results').getBoundingClientRect();
    return cell.getBoundingClientRect().right - Math.min(box.right, window.innerWidth);
})"""
# How far the list (or the page) scrolls sideways.
SIDEWAYS = """() => {
    const results = document.querySelector('.results');
    return Math.max(
        results ? results.scrollWidth - results.clientWidth : 0,
        document.documentElement.scrollWidth - window.innerWidth,
    );
}"""


def test_every_changelist_fits_a_1366_pixel_screen_with_its_named_columns_in_view(
    live_server, laptop_page, django_user_model, company, full_house
):
    from django.contrib import admin

    wide_house(company)
    page = laptop_page
    log_in(page, live_server, django_user_model)
    page.wait_for_selector("#console")
    problems = []
    for model in admin.site._registry:
        path = f"{model._meta.app_label}/{model._meta.model_name}"
        page.goto(f"{live_server.url}/admin/{path}/")
        page.wait_for_selector("#changelist")
        if (sideways := page.evaluate(SIDEWAYS)) > 0:
            shot(page, f"overflow-{model._meta.model_name}")
            problems.append(f"{path} scrolls sideways by {sideways}px")
        for column in NAMED_COLUMNS.get(path, []):
            cells = page.locator(f"#result_list .field-{column}, #result_list th.column-{column}")
            if cells.count() < 2:
                problems.append(f"{path}: no column {column}")
            elif max(cells.evaluate_all(OVERFLOW)) > 0:
                problems.append(f"{path}: {column} out of view")
        if path in NAMED_COLUMNS:
            shot(page, f"12-list-{model._meta.model_name}-1366")
    assert not problems, problems


def test_the_console_answers_above_the_fold_at_1366_by_768(live_server, laptop_page, django_user_model, company):
    from tests.admin.test_console import troubled_agent

    for index in range(8):
        agent = troubled_agent(company, f"Agent {index} of the quarterly planning team, northern regions")
        make_run(agent, status="failed", error_code=f"model_error_kind_{index}_with_a_long_name")
    page = laptop_page
    log_in(page, live_server, django_user_model)
    page.wait_for_selector("#console")
    shot(page, "13-console-1366x768")
    tiles = page.locator("#console .pc-tile")
    assert tiles.count() == 6
    edges = tiles.evaluate_all(
        "tiles => tiles.map(t => [t.id, t.getBoundingClientRect().bottom, t.getBoundingClientRect().right])"
    )
    assert all(bottom <= 768 and right <= 1366 for _, bottom, right in edges), edges
    assert page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth") <= 0
    # Every figure leads somewhere.
    assert page.locator("#console a[href]").count() >= 20
    page.click("#pc-failures a:text-is('model_timeout')")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list tbody tr").count() == 8 * 3


def test_a_page_keeps_its_buttons_clear_of_its_heading(live_server, laptop_page, django_user_model, company):
    wide = wide_house(company)
    wide["agent"].name = "Quarterly planning researcher for the northern European sales regions, " * 2
    wide["agent"].save()
    page = laptop_page
    log_in(page, live_server, django_user_model, f"/admin/sessions_app/agentsession/{wide['session'].pk}/change/")
    for url, name in (
        (f"/admin/sessions_app/agentsession/{wide['session'].pk}/change/", "14-session-1366"),
        (f"/admin/sessions_app/agent/{wide['agent'].pk}/change/", "15-agent-1366"),
    ):
        page.goto(f"{live_server.url}{url}")
        page.wait_for_selector("ul.object-tools")
        shot(page, name)
        overlaps = page.evaluate(
            """() => {
                const tools = document.querySelector('ul.object-tools').getBoundingClientRect();
                return [...document.querySelectorAll('#content h1, #content h2')].filter(h => {
                    const text = document.createRange();
                    text.selectNodeContents(h);
                    return [...text.getClientRects()].some(t => t.right > tools.left && t.left < tools.right
                        && t.bottom > tools.top && t.top < tools.bottom);
                }).map(h => h.textContent);
            }"""
        )
        assert overlaps == [], (url, overlaps)


def test_an_operator_finds_the_agent_of_a_new_budget_by_typing_its_name(
    live_server, browser_page, django_user_model, company, persistent_agent
):
    from costs_app.models import Budget
    from sessions_app.models import Agent

    page, agent = browser_page, persistent_agent

    Agent.objects.bulk_create(Agent(company=company, name=f"helper {n:03}") for n in range(60))
    log_in(page, live_server, django_user_model, "/admin/costs_app/budget/add/")

    # The company and the agent are search boxes (Select2, served with the admin), not lists
    # of every company and agent.
    for field, term, name in (("company", company.name[:4], company.name), ("agent", agent.name[:5], agent.name)):
        page.click(f"#id_{field} + .select2 .select2-selection")
        page.fill(".select2-search__field", term)
        page.click(f".select2-results__option:text-is('{name}')")
    page.fill("#id_monthly_limit_usd", "25")
    shot(page, "budget-add")
    page.click("input[name=_save]")
    page.wait_for_url(re.compile(r"/admin/costs_app/budget/$"))

    budget = Budget.objects.get()
    assert (budget.company_id, budget.agent_id, budget.monthly_limit_usd) == (company.pk, agent.pk, Decimal("25"))
