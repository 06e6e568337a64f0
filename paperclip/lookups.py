"""Lookups on an integer column given a value no such column can hold.

Django answers `exact`, `gt`, `lt` and the others on an integer field without sending the
value (`IntegerFieldOverflow`), but not `in`, `range`, or a lookup through a relation
itself (`permissions__in=[...]`, `alert=...`: Django's related lookups). SQLite's driver
cannot bind an integer past 64 bits and raised OverflowError: a 500 wherever a form chooses
several rows by id (auth's permissions and groups in the admin, posted with a 30-digit id),
and an admin list filtered through a relation (`?alert__in=`, `?price=`) came back whole
with "cannot be used", where PostgreSQL answered with the rows that match (comparing the
column as numeric, which no index serves). Here such a value is never sent:

- `in` leaves it out of the list; a list left empty matches no row, as `exact` does;
- `exact` through a relation matches no row;
- `range` narrows a bound past the column's range to the range's end, and matches no row
  when the whole range lies beyond it (`id__range=(1, 10**30)` is every id from 1 up).
  Nothing reaches it with such a value today (the admin reads a range from the query
  string as text, one character per bound); it holds for code that will.

The related comparisons (`alert__lt=...`) are left to Django: its answer on an integer
column past the range drops the condition, which on a nullable column would also match
the rows without a relation, as the database's comparison never does.
"""

from __future__ import annotations

import copy

from django.core.exceptions import EmptyResultSet
from django.db.models import ForeignObject, IntegerField
from django.db.models.expressions import ColPairs
from django.db.models.fields.related_lookups import RelatedExact, RelatedIn
from django.db.models.lookups import In, Range


@IntegerField.register_lookup
class IntegerFieldIn(In):
    def as_sql(self, compiler, connection):
        if not self.rhs_is_direct_value():
            return super().as_sql(compiler, connection)
        return in_range_sql(self, In, self.lhs.output_field, compiler, connection)


@IntegerField.register_lookup
class IntegerFieldRange(Range):
    def as_sql(self, compiler, connection):
        if (
            not self.rhs_is_direct_value()
            or len(self.rhs) != 2
            or not all(isinstance(value, int) for value in self.rhs)
        ):
            return super().as_sql(compiler, connection)
        low, high = column_range(self.lhs.output_field, connection)
        start, end = self.rhs
        if (high is not None and start > high) or (low is not None and end < low):
            raise EmptyResultSet
        clamped = (start if low is None else max(start, low), end if high is None else min(end, high))
        if clamped == tuple(self.rhs):
            return super().as_sql(compiler, connection)
        lookup = copy.copy(self)  # as for `in`, below
        lookup.rhs = clamped
        return super(IntegerFieldRange, lookup).as_sql(compiler, connection)


@ForeignObject.register_lookup
class IntegerRelatedIn(RelatedIn):
    def as_sql(self, compiler, connection):
        target = integer_target(self.lhs)
        if target is None or not self.rhs_is_direct_value():
            return super().as_sql(compiler, connection)
        return in_range_sql(self, RelatedIn, target, compiler, connection)


@ForeignObject.register_lookup
class IntegerRelatedExact(RelatedExact):
    def process_rhs(self, compiler, connection):
        target = integer_target(self.lhs)
        if target is not None and isinstance(self.rhs, int):
            low, high = column_range(target, connection)
            if out_of_range(self.rhs, low, high):
                raise EmptyResultSet
        return super().process_rhs(compiler, connection)


def in_range_sql(lookup, base, field, compiler, connection):
    """The SQL of `lookup` (an `in` of class `base`) without the values `field` cannot hold."""
    low, high = column_range(field, connection)
    kept = [value for value in lookup.rhs if not out_of_range(value, low, high)]
    if len(kept) == len(lookup.rhs):
        return base.as_sql(lookup, compiler, connection)
    # A copy: the lookup stays in its query, which may be compiled again for a database
    # whose column holds more (AutoField is 32 bits on PostgreSQL, 64 on SQLite).
    narrowed = copy.copy(lookup)
    narrowed.rhs = kept
    return base.as_sql(narrowed, compiler, connection)


def integer_target(lhs) -> IntegerField | None:
    """The integer column a single-column relation's lookup compares, or None."""
    if isinstance(lhs, ColPairs):
        return None
    path_infos = getattr(lhs.output_field, "path_infos", None)
    if not path_infos:
        return None
    target = path_infos[-1].target_fields[-1]
    while target.is_relation:  # a key that is itself a relation (a one-to-one primary key)
        target = target.target_field
    return target if isinstance(target, IntegerField) else None


def column_range(field: IntegerField, connection) -> tuple[int | None, int | None]:
    return connection.ops.integer_field_range(field.get_internal_type())


def out_of_range(value, low: int | None, high: int | None) -> bool:
    if not isinstance(value, int):
        return False
    return (low is not None and value < low) or (high is not None and value > high)
