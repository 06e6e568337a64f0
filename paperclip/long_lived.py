"""A heartbeat process's long-lived objects, left out of the garbage collector's full passes.

A process that runs heartbeats holds some 220,000 objects that live as long as it does
(Django, the SDK's types, the price tables). Python's full collection walks all of them
whenever enough young objects have survived younger passes, which a persistent agent's long
history makes frequent (every heartbeat decodes and copies it): at turn 200, one pass of
about 125 ms every 60 heartbeats, 2 ms a heartbeat on average, all of it landing on one.
Frozen, they are never walked again, and the same pass takes about 9 ms (bench/RESULTS.md,
heartbeat overhead, 2026-12-06). What is frozen is never collected: only objects alive when
the process's first heartbeat has ended are, nearly all of them modules' own (half of them
are made during that heartbeat: the SDK's types and the price tables load on first use).
"""

from __future__ import annotations

import gc
import threading

_state = {"frozen": False}
_lock = threading.Lock()


def long_lived_objects_freeze() -> None:
    """Once per process, at the end of its first heartbeat: what a heartbeat uses is loaded
    by then. A process forked after it inherits the frozen objects and the flag."""
    if _state["frozen"]:
        return
    with _lock:
        if not _state["frozen"]:
            gc.freeze()
            _state["frozen"] = True
