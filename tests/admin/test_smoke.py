"""Every admin page of every registered model opens, with data present."""

from __future__ import annotations

import re

import pytest
from django import forms
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.db import models
from django.test import RequestFactory
from django.urls import reverse


def admin_url(model, name: str, *args) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_{name}", args=args)


def test_every_admin_page_opens(admin_client, admin_user, full_house):
    request = RequestFactory().get("/admin/")
    request.user = admin_user
    failures = []
    opened = 0
    for model, model_admin in admin.site._registry.items():
        obj = model._default_manager.first()
        assert obj is not None, f"no {model.__name__} row to open: add one to the full_house fixture"
        pages = [
            ("changelist", admin_url(model, "changelist"), 200),
            ("add", admin_url(model, "add"), 200 if model_admin.has_add_permission(request) else 403),
            ("change", admin_url(model, "change", quote(obj.pk)), 200),
            (
                "delete",
                admin_url(model, "delete", quote(obj.pk)),
                200 if model_admin.has_delete_permission(request, obj) else 403,
            ),
            ("history", admin_url(model, "history", quote(obj.pk)), 200),
        ]
        for page, url, expected in pages:
            status = admin_client.get(url).status_code
            opened += 1
            if status != expected:
                failures.append(f"{model.__name__} {page} {url}: {status}, expected {expected}")
    assert not failures, "\n".join(failures)
    assert opened >= 5 * 12


def test_the_extra_admin_pages_open(admin_client, full_house):
    session, run = full_house["session"], full_house["run"]
    for url in [
        reverse("admin:index"),
        reverse("admin:costs_app_costevent_report"),
        reverse("admin:sessions_app_agentsession_export", args=[session.pk]),
        reverse("admin:sessions_app_agent_heartbeat", args=[run.agent_id]),
        reverse("admin:app_list", args=["sessions_app"]),
        reverse("admin:app_list", args=["costs_app"]),
        reverse("admin:app_list", args=["django_q"]),
    ]:
        assert admin_client.get(url).status_code == 200, url


def test_the_index_links_to_the_costs_page_and_the_task_queue(admin_client, full_house):
    page = admin_client.get(reverse("admin:index")).content.decode()
    assert reverse("admin:costs_app_costevent_report") in page
    for name in ("schedule", "failure", "success"):
        assert reverse(f"admin:django_q_{name}_changelist") in page


def test_changelist_filters_and_searches_open(admin_client, full_house):
    session = full_house["session"]
    url = reverse("admin:sessions_app_agentsession_changelist")
    for query in [
        {"status__exact": "active"},
        {"company__id__exact": str(session.company_id)},
        {"agent__id__exact": str(session.agent_id)},
        {"adapter_type": "claude-code"},
        {"model": "claude-opus-4-5"},
        {"agent": str(session.agent_id)},
        {"last_used__year": str(session.last_used.year)},
        {"q": "Persistent"},
        {"o": "-5"},
    ]:
        response = admin_client.get(url, query)
        assert response.status_code == 200, query
        assert session.public_id in response.content.decode(), query
    runs = reverse("admin:sessions_app_heartbeatrun_changelist")
    assert admin_client.get(runs, {"session": str(session.pk)}).status_code == 200
    costs = reverse("admin:costs_app_costevent_changelist")
    for query in [{"session": str(session.pk)}, {"agent": str(session.agent_id)}, {"unpriced__exact": "1"}]:
        assert admin_client.get(costs, query).status_code == 200, query


def test_budget_changelist_shows_use_bars_in_constant_queries(admin_client, company, django_assert_max_num_queries):
    from decimal import Decimal

    from costs_app.models import Budget, CostEvent
    from sessions_app.models import Agent

    agents = [Agent.objects.create(company=company, name=f"b{i}") for i in range(6)]
    for agent in agents:
        Budget.objects.create(company=company, agent=agent, monthly_limit_usd=Decimal("1"))
        CostEvent.objects.create(company=company, agent=agent, model="m", cost_usd=Decimal("0.9"))
    Budget.objects.create(company=company, lifetime_limit_usd=Decimal("10"))
    with django_assert_max_num_queries(10):
        response = admin_client.get("/admin/costs_app/budget/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "$0.90 of $1.00 (90%)" in page
    assert "#c58f00" in page  # past the 80% warning level
    assert "$5.40 of $10.00 (54%)" in page


def test_budget_paused_agents_are_flagged(admin_client, persistent_agent):
    from sessions_app.services import agent_pause

    agent_pause(agent=persistent_agent, reason="budget")
    response = admin_client.get("/admin/sessions_app/agent/?paused_reason=budget")
    assert response.status_code == 200
    assert "paused: budget spent" in response.content.decode()


@pytest.mark.parametrize("url", ["/admin/", "/admin/sessions_app/agentsession/", "/admin/costs_app/costevent/report/"])
def test_admin_requires_a_staff_login(client, django_user_model, url):
    assert client.get(url).status_code == 302  # anonymous: to the login page
    user = django_user_model.objects.create_user("visitor", password="not-staff-pw-1")
    client.force_login(user)
    response = client.get(url)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


# Filters and searches Django accepts when it builds a list but the database refuses when
# the query runs; a few that Django itself turns away, to show those still work as before.
BAD_FILTERS = [
    {"q": "a\x00b"},  # PostgreSQL: NUL in a search term
    {"status": "a\x00"},
    {"company__id__exact": "\x00"},
    {"created_at__year": "99999"},  # year outside 1..9999, raised at query time
    {"created_at__year": "x"},
    {"p": "999999"},
    {"o": "x.y"},
    {"q": "x" * 5000},
]


def test_every_admin_list_survives_bad_filters(admin_client, full_house):
    failures = []
    for model in admin.site._registry:
        url = admin_url(model, "changelist")
        for query in BAD_FILTERS:
            response = admin_client.get(url, query)
            if response.status_code >= 500:
                failures.append(f"{model.__name__} {query}: {response.status_code}")
    assert not failures, "\n".join(failures)


def test_every_admin_bulk_action_survives_a_tampered_selection(admin_client, full_house):
    failures = []
    for model in admin.site._registry:
        url = admin_url(model, "changelist")
        for selected in ["not-an-id", "\x00", "9" * 30]:
            response = admin_client.post(url, {"action": "delete_selected", "_selected_action": [selected]})
            if response.status_code >= 500:
                failures.append(f"{model.__name__} {selected!r}: {response.status_code}")
    assert not failures, "\n".join(failures)


OUT_OF_RANGE_ID = "9" * 30  # past any integer column, and past SQLite's 64-bit integers


def forms_choosing_rows_by_an_integer_id(admin_user) -> list[tuple]:
    """(model, view, object, field name) of every admin form with a choice of rows (one or
    several) keyed by an integer column: auth's permissions and groups today."""
    request = RequestFactory().get("/admin/")
    request.user = admin_user
    found = []
    for model, model_admin in admin.site._registry.items():
        for view in ("add", "change"):
            obj = model._default_manager.first() if view == "change" else None
            allowed = (
                model_admin.has_add_permission(request)
                if view == "add"
                else obj is not None and model_admin.has_change_permission(request, obj)
            )
            if not allowed:
                continue
            for name, field in model_admin.get_form(request, obj, change=obj is not None).base_fields.items():
                if isinstance(field, forms.ModelChoiceField):
                    meta = field.queryset.model._meta
                    key = meta.get_field(field.to_field_name) if field.to_field_name else meta.pk
                    if isinstance(key, models.IntegerField):
                        found.append((model, view, obj, name))
    return found


def test_every_admin_form_refuses_an_out_of_range_id_as_a_form_error(admin_client, admin_user, full_house):
    # SQLite's driver cannot bind the id: the choice of several rows (`__in`) was a 500 there.
    cases = forms_choosing_rows_by_an_integer_id(admin_user)
    assert {(model.__name__, name) for model, _, _, name in cases} >= {
        ("Group", "permissions"),
        ("User", "groups"),
        ("User", "user_permissions"),
    }
    failures = []
    for model, view, obj, name in cases:
        url = admin_url(model, view, *([quote(obj.pk)] if obj is not None else []))
        response = admin_client.post(url, {name: [OUT_OF_RANGE_ID]})
        errors = response.context["adminform"].form.errors if response.status_code == 200 else {}
        if name not in errors or OUT_OF_RANGE_ID not in str(errors[name]):
            failures.append(f"{model.__name__} {view} {name}: {response.status_code} {errors.get(name)}")
    assert not failures, "\n".join(failures)


def test_a_user_given_an_out_of_range_permission_id_is_shown_the_form_again_unchanged(admin_client, admin_user):
    from django.contrib.auth.models import Group, Permission

    url = admin_url(type(admin_user), "change", admin_user.pk)
    email = admin_user.email
    kept = Permission.objects.get(codename="view_agent")
    admin_user.user_permissions.add(kept)
    form = {
        "username": admin_user.username,
        "email": "changed@example.com",
        "is_active": "on",
        "is_staff": "on",
        "is_superuser": "on",
        "date_joined_0": "2026-01-01",
        "date_joined_1": "00:00:00",
        "user_permissions": [str(kept.pk), OUT_OF_RANGE_ID],
    }

    response = admin_client.post(url, form)

    assert response.status_code == 200
    assert f"Select a valid choice. {OUT_OF_RANGE_ID} is not one of the available choices." in str(
        response.context["adminform"].form.errors["user_permissions"]
    )
    admin_user.refresh_from_db()
    assert (admin_user.email, list(admin_user.user_permissions.all())) == (email, [kept])

    group = admin_client.post(admin_url(Group, "add"), {"name": "ops", "permissions": [OUT_OF_RANGE_ID]})

    assert group.status_code == 200 and "permissions" in group.context["adminform"].form.errors
    assert not Group.objects.exists()


def test_out_of_range_ids_in_a_list_search_selection_or_url_are_never_a_500(admin_client, full_house):
    from django.contrib.auth.models import Group

    changelist = admin_url(Group, "changelist")
    for query in ({"id__in": OUT_OF_RANGE_ID}, {"id__exact": OUT_OF_RANGE_ID}, {"q": OUT_OF_RANGE_ID}):
        assert admin_client.get(changelist, query).status_code in (200, 302), query
    selection = {"action": "delete_selected", "_selected_action": [OUT_OF_RANGE_ID]}
    assert admin_client.post(changelist, selection).status_code in (200, 302)
    assert admin_client.get(admin_url(Group, "change", OUT_OF_RANGE_ID)).status_code == 302  # "does not exist"
    search = {"app_label": "costs_app", "model_name": "budget", "field_name": "agent", "term": OUT_OF_RANGE_ID}
    assert admin_client.get(reverse("admin:autocomplete"), search).json()["results"] == []
    assert Group.objects.count() == 1


def relations_to_integer_keys(admin_user) -> list[tuple]:
    """(model, lookup) of every filter an admin list accepts in its URL through a relation to
    rows keyed by an integer column: `?alert__in=`, `?alert=`, ..."""
    request = RequestFactory().get("/admin/")
    request.user = admin_user
    found = []
    for model, model_admin in admin.site._registry.items():
        for field in model._meta.get_fields():
            if not field.is_relation or field.related_model is None:
                continue
            key = field.target_field if field.many_to_one else field.related_model._meta.pk
            if isinstance(key, models.IntegerField):
                for lookup in (f"{field.name}__in", field.name):
                    if model_admin.lookup_allowed(lookup, OUT_OF_RANGE_ID, request):
                        found.append((model, lookup))
    return found


def test_an_out_of_range_id_through_a_relation_lists_no_row(admin_client, admin_user, full_house):
    # Before, on SQLite: its driver cannot bind the id, and the list came back whole with
    # "Those filters or search terms cannot be used (Python int too large ...)".
    from costs_app.models import AlertDelivery

    cases = relations_to_integer_keys(admin_user)
    assert {(model.__name__, lookup) for model, lookup in cases} >= {
        ("AlertDelivery", "alert__in"),
        ("AlertDelivery", "target"),
        ("CostEvent", "price__in"),
        ("User", "groups__in"),
    }
    failures = []
    for model, lookup in cases:
        response = admin_client.get(admin_url(model, "changelist"), {lookup: OUT_OF_RANGE_ID})
        if response.status_code != 200 or response.context["cl"].result_count != 0:
            failures.append(f"{model.__name__} {lookup}: {response.status_code} {response.get('Location')}")
    assert not failures, "\n".join(failures)

    target = AlertDelivery.objects.order_by("pk").first().target_id
    mixed = admin_client.get(admin_url(AlertDelivery, "changelist"), {"target__in": f"{OUT_OF_RANGE_ID},{target}"})
    assert mixed.status_code == 200
    assert {d.pk for d in mixed.context["cl"].result_list} == set(
        AlertDelivery.objects.filter(target_id=target).values_list("pk", flat=True)
    )


def test_every_admin_page_of_a_row_whose_id_holds_a_nul_is_a_404(admin_client, full_house):
    # PostgreSQL refuses a NUL in any lookup: django-q2's tasks, keyed by text, were 500s.
    failures = []
    for model in admin.site._registry:
        for page in ("change", "delete", "history"):
            url = admin_url(model, page, "abc\x00")
            for method in ("get", "post"):
                status = getattr(admin_client, method)(url).status_code
                if status != 404:
                    failures.append(f"{model.__name__} {page} {method}: {status}")
    assert not failures, "\n".join(failures)


def test_a_filter_the_database_refuses_is_a_message_on_the_whole_list(admin_client, full_house):
    url = reverse("admin:sessions_app_agent_changelist")  # no date_hierarchy: Django does not check the year

    response = admin_client.get(url, {"created_at__year": "99999"}, follow=True)

    assert response.redirect_chain == [(url, 302)]
    assert "Those filters or search terms cannot be used (year 99999 is out of range)" in response.content.decode()


def test_every_model_of_ours_is_named_in_plain_english():
    from django.apps import apps

    ours = ("sessions_app", "costs_app", "memory_app")
    names = {
        model.__name__: model._meta.verbose_name_plural for model in apps.get_models() if model._meta.app_label in ours
    }
    # "deliverys", "entrys": Django adds an "s" unless told the plural.
    wrong = {name: plural for name, plural in names.items() if re.search(r"[^aeiou]ys$", str(plural))}
    assert not wrong
    assert names["AlertDelivery"] == "alert deliveries"


# Django's English date format ("Nov. 30, 2026, 6:04 p.m.") beside the pages' own ISO dates.
ENGLISH_DATE = re.compile(r"\b(Jan|Feb|March|April|May|June|July|Aug|Sept|Oct|Nov|Dec)\.? \d{1,2}, \d{4}|\b[ap]\.m\.")
ONE_FORMAT = re.compile(r"\b\d{4}-\d\d-\d\d \d\d:\d\d UTC\b")


def test_every_admin_page_writes_its_times_one_way_with_the_zone(admin_client, full_house):
    from costs_app.models import AlertDelivery, CostEvent

    session, run = full_house["session"], full_house["run"]
    pages = [
        admin_url(type(session), "changelist"),
        admin_url(type(session), "change", session.pk),
        admin_url(type(run), "changelist"),
        admin_url(type(run), "change", run.pk),
        admin_url(CostEvent, "changelist"),
        admin_url(CostEvent, "change", CostEvent.objects.first().pk),
        admin_url(AlertDelivery, "changelist"),
        admin_url(AlertDelivery, "change", AlertDelivery.objects.first().pk),
        admin_url(type(session.agent), "change", session.agent_id),
        reverse("admin:index"),
    ]
    for url in pages:
        page = admin_client.get(url).content.decode()
        text = re.sub(r"<[^>]+>", " ", page)  # what is shown, not attributes or data
        assert not ENGLISH_DATE.search(text), (url, ENGLISH_DATE.search(text).group(0))
        assert ONE_FORMAT.search(text), url
