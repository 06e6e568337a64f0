"""A heartbeat process freezes its long-lived objects once, when its first heartbeat ends."""

from __future__ import annotations

import gc

from paperclip import long_lived
from tests.conftest import beat


def test_the_first_heartbeat_of_a_process_freezes_what_lives_so_far_and_later_ones_do_not(
    stateless_agent, fake_anthropic, monkeypatch
):
    monkeypatch.setitem(long_lived._state, "frozen", False)  # as in a process that ran none yet
    before = gc.get_freeze_count()

    beat(stateless_agent, "one")
    frozen = gc.get_freeze_count()
    beat(stateless_agent, "two")

    assert frozen > before
    # Frozen objects still die of their last reference: the count only falls unless frozen again.
    assert gc.get_freeze_count() <= frozen
