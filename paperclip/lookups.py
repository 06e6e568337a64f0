"""`__in` on an integer column, given a value no such column can hold: that value matches nothing.

Django does this for `exact`, `gt`, `lt` and the others (`IntegerFieldOverflow`), not for
`in`: SQLite's driver cannot bind an integer past 64 bits and raised OverflowError, a 500
wherever a form chooses several rows by id (auth's permissions and groups in the admin,
posted with a 30-digit id), where PostgreSQL answered the form's "Select a valid choice"
(comparing the column as numeric, which no index serves). The value is left out of the
list; a list left empty matches no row, as `exact` does.
"""

from __future__ import annotations

import copy

from django.db.models import IntegerField
from django.db.models.lookups import In


@IntegerField.register_lookup
class IntegerFieldIn(In):
    def as_sql(self, compiler, connection):
        if not self.rhs_is_direct_value():
            return super().as_sql(compiler, connection)
        low, high = connection.ops.integer_field_range(self.lhs.output_field.get_internal_type())
        kept = [value for value in self.rhs if not out_of_range(value, low, high)]
        if len(kept) == len(self.rhs):
            return super().as_sql(compiler, connection)
        # A copy: the lookup stays in its query, which may be compiled again for a database
        # whose column holds more (AutoField is 32 bits on PostgreSQL, 64 on SQLite).
        lookup = copy.copy(self)
        lookup.rhs = kept
        return super(IntegerFieldIn, lookup).as_sql(compiler, connection)


def out_of_range(value, low: int | None, high: int | None) -> bool:
    if not isinstance(value, int):
        return False
    return (low is not None and value < low) or (high is not None and value > high)
