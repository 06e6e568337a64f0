"""The admin's run pages."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from tests.admin.conftest import make_run

pytestmark = pytest.mark.django_db


def test_the_run_page_shows_the_ticks_merged_into_it(admin_client, persistent_agent):
    run = make_run(persistent_agent, merged_ticks=4)
    page = admin_client.get(reverse("admin:sessions_app_heartbeatrun_change", args=[run.pk])).content.decode()
    assert re.search(r"Merged ticks:.*?<div class=\"readonly\">4</div>", page, re.S)


def test_run_triggers_read_as_words_an_operator_uses(admin_client, persistent_agent):
    make_run(persistent_agent, trigger="api")
    page = admin_client.get(reverse("admin:sessions_app_heartbeatrun_changelist")).content.decode()
    assert re.search(r'<td class="field-trigger">API</td>', page)
    assert ">Api<" not in page
