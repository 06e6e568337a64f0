"""`__in` on an integer column given values no such column holds (paperclip/lookups.py)."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, Permission

from memory_app.models import MemoryFile, MemoryStore
from sessions_app.models import Agent

BIG = 10**30


@pytest.mark.parametrize("value", [BIG, -BIG, str(BIG), 2**63, -(2**63) - 1])
def test_a_value_past_the_column_matches_no_row_and_the_others_still_do(db, value):
    # Before: OverflowError on SQLite, which cannot bind it; a numeric comparison on PostgreSQL.
    kept = Permission.objects.order_by("pk").first()

    assert list(Permission.objects.filter(pk__in=[value, kept.pk])) == [kept]
    assert not Permission.objects.filter(pk__in=[value]).exists()
    assert Permission.objects.exclude(pk__in=[value]).count() == Permission.objects.count()
    assert not Group.objects.filter(permissions__id__in=[value]).exists()


def test_a_big_integer_column_keeps_the_values_it_can_hold(company):
    agent = Agent.objects.create(company=company, name="Keeper")
    store = MemoryStore.objects.create(company=company, agent=agent)
    found = MemoryFile.objects.create(store=store, path="a.md")

    assert list(MemoryFile.objects.filter(pk__in=[found.pk, 2**63 - 1, 2**63])) == [found]
    assert list(MemoryFile.objects.filter(size__in=[0, -1])) == [found]
