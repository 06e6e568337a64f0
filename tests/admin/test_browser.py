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
    try:
        operator_journey(live_server, browser_page, django_user_model, persistent_agent, stateless_agent)
    finally:
        # Under Playwright's greenlets the test body gets its own database connection
        # (connections are per context); close it, or PostgreSQL cannot drop the test database.
        connections.close_all()


def operator_journey(live_server, page, django_user_model, persistent_agent, stateless_agent) -> None:
    django_user_model.objects.create_superuser("operator", "op@example.com", "correct horse battery")
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

    # Log in.
    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "correct horse battery")
    page.click("input[type=submit]")
    page.wait_for_selector("#paperclip-reports")
    shot(page, "01-index")

    # The agent, then its sessions.
    page.click("a:text-is('Agents')")
    page.click(f"a:text-is('{persistent_agent.name}')")
    page.wait_for_selector("text=recent sessions")
    shot(page, "02-agent")
    page.click("ul.object-tools a:text-is('Sessions')")
    page.wait_for_selector(f"a:text-is('{session.public_id}')")
    shot(page, "03-sessions")

    # One session: its conversation reads as turns, and the script is only text.
    page.click(f"a:text-is('{session.public_id}')")
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
    try:
        django_user_model.objects.create_superuser("operator", "op@example.com", "correct horse battery")
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
        page.goto(f"{live_server.url}/admin/login/?next=/admin/sessions_app/agentsession/")
        page.fill("#id_username", "operator")
        page.fill("#id_password", "correct horse battery")
        page.click("input[type=submit]")
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
    finally:
        connections.close_all()


def test_operator_edits_and_reverts_an_agents_memory(live_server, browser_page, django_user_model, persistent_agent):
    try:
        memory_journey(live_server, browser_page, django_user_model, persistent_agent)
    finally:
        connections.close_all()


def memory_journey(live_server, page, django_user_model, agent) -> None:
    from memory_app.models import MemoryFile
    from memory_app.stores import Writer, mounts_for
    from memory_app.tool import StoreMemoryTool

    django_user_model.objects.create_superuser("operator", "op@example.com", "correct horse battery")
    agent.adapter_config = {**agent.adapter_config, "memory": True}
    agent.save()
    run = make_run(agent, status=RunStatus.RUNNING)  # a run writes memory while it runs
    StoreMemoryTool(mounts_for(agent), writer=Writer(run_id=run.id)).call(
        {"command": "create", "path": "/memories/customers.md", "file_text": "Acme pays on net 30.\n<b>bold?</b>"}
    )
    HeartbeatRun.objects.filter(id=run.id).update(status=RunStatus.SUCCEEDED)
    page.goto(f"{live_server.url}/admin/login/?next=/admin/sessions_app/agent/{agent.pk}/change/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "correct horse battery")
    page.click("input[type=submit]")

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
