"""Lookups on an integer column given values no such column holds (paperclip/lookups.py):
`in`, `range`, and `in` and `exact` through a relation."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, Permission, User

from memory_app.models import MemoryFile, MemoryStore
from sessions_app.models import Agent

BIG = 10**30
TOP = 2**63 - 1  # the largest value a 64-bit column holds


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


@pytest.mark.parametrize(
    ("bounds", "expected"),
    [
        ((1, BIG), "all"),
        (("1", str(BIG)), "all"),
        ((-BIG, BIG), "all"),
        ((-BIG, 0), "none"),
        (("kept", BIG), "from kept"),
        ((-BIG, "kept"), "up to kept"),
        ((BIG, BIG + 1), "none"),
        ((BIG, 1), "none"),
        ((-BIG - 1, -BIG), "none"),
    ],
)
def test_a_range_past_the_column_is_narrowed_to_it_or_matches_nothing(db, bounds, expected):
    # Before: OverflowError on SQLite for any bound past 64 bits. A bound past the column's
    # range is the range's end (every row from 1 up), not a range matching nothing.
    kept = Permission.objects.order_by("pk")[3]
    start, end = (kept.pk if bound == "kept" else bound for bound in bounds)
    everything = list(Permission.objects.order_by("pk"))
    wanted = {
        "all": everything,
        "none": [],
        "from kept": [p for p in everything if p.pk >= kept.pk],
        "up to kept": [p for p in everything if p.pk <= kept.pk],
    }[expected]

    assert list(Permission.objects.filter(pk__range=(start, end)).order_by("pk")) == wanted
    assert Permission.objects.exclude(pk__range=(start, end)).count() == len(everything) - len(wanted)


def test_a_range_keeps_the_largest_value_a_big_integer_column_holds(company):
    # Narrowed to the column's end, not past it: the row at the very end still matches.
    agent = Agent.objects.create(company=company, name="Keeper")
    store = MemoryStore.objects.create(company=company, agent=agent)
    first = MemoryFile.objects.create(store=store, path="first.md")
    last = MemoryFile.objects.create(pk=TOP, store=store, path="last.md")  # after: SQLite numbers none past it

    assert list(MemoryFile.objects.filter(pk__range=(TOP, BIG))) == [last]
    assert list(MemoryFile.objects.filter(pk__range=(TOP + 1, BIG))) == []
    assert set(MemoryFile.objects.filter(pk__range=(-BIG, BIG))) == {first, last}
    assert set(MemoryFile.objects.filter(size__range=(-BIG, 0))) == {first, last}


@pytest.mark.parametrize("value", [BIG, -BIG, str(BIG), 2**63, -(2**63) - 1])
def test_a_relation_given_an_id_past_its_key_matches_no_row_and_the_others_still_do(db, value):
    # `permissions__in`, not `permissions__id__in`: the relation's own lookups (Django's
    # RelatedIn, RelatedExact) sent the value; OverflowError on SQLite.
    kept, other = Permission.objects.order_by("pk")[:2]
    group = Group.objects.create(name="ops")
    group.permissions.add(kept)
    user = User.objects.create(username="op")
    user.groups.add(group)
    Group.objects.create(name="idle").permissions.add(other)

    assert list(Group.objects.filter(permissions__in=[value, kept.pk])) == [group]
    assert not Group.objects.filter(permissions__in=[value]).exists()
    assert not Group.objects.filter(permissions=value).exists()
    assert Group.objects.exclude(permissions__in=[value]).count() == 2
    assert Group.objects.exclude(permissions=value).count() == 2
    assert list(User.objects.filter(groups__in=[value, group.pk])) == [user]  # a user's groups
    assert not Group.objects.filter(user__in=[value]).exists()  # the reverse side
    assert list(Permission.objects.filter(content_type__in=[value, kept.content_type_id])) == list(
        Permission.objects.filter(content_type=kept.content_type_id)
    )
