"""`paperclip.recently_used`: a bounded map that drops the least recently used first."""

from __future__ import annotations

from paperclip.recently_used import RecentlyUsed


def test_the_least_recently_used_goes_first_and_a_read_counts_as_a_use():
    bound = [2]
    last = RecentlyUsed(lambda: bound[0])
    last.put("a", 1)
    last.put("b", 2)
    assert last.get("a") == 1  # now "b" is the least recently used

    last.put("c", 3)

    assert (last.get("a"), last.get("b"), last.get("c")) == (1, None, 3)


def test_a_bound_of_zero_keeps_nothing_and_is_read_at_each_put():
    bound = [2]
    last = RecentlyUsed(lambda: bound[0])
    last.put("a", 1)

    bound[0] = 0
    last.put("b", 2)

    assert (last.get("a"), last.get("b")) == (None, None)
