"""A map of what a process used last, of bounded size: the least recently used goes first.

Thread-safe (a web process runs requests in threads). Its bound is read at each `put`, so a
setting changed under a test or a reload applies at once."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable


class RecentlyUsed:
    def __init__(self, bound: Callable[[], int]) -> None:
        self._bound = bound
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable):
        """The value under `key` (now the most recently used), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value) -> None:
        """Keep `value` under `key`; with a bound of 0, nothing is kept."""
        bound = self._bound()
        with self._lock:
            if not bound:
                self._entries.clear()
                return
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > bound:
                self._entries.popitem(last=False)

    def pop(self, key: Hashable) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
