"""Text as the databases can store it.

PostgreSQL keeps NUL in neither text nor jsonb, and a lone surrogate (which Python lets a
string hold, from JSON escapes or undecodable command-line bytes) cannot be encoded as
UTF-8 by any database: either fails a write deep inside a save.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")

# The longest message id and stop reason a run (and a ledger row) stores. Here rather than
# read off the models, so that the adapters, which validate what an agent reports, import
# no model; PostgreSQL would refuse a longer value only at commit time.
MESSAGE_ID_MAX_LENGTH = 255
STOP_REASON_MAX_LENGTH = 64


def storable(value: Any) -> Any:
    """`value` with NUL and lone surrogates replaced by U+FFFD, in strings at any depth.

    For what must be kept although it arrived damaged (a model's answer was paid for): the
    mark a UTF-8 decoder would show rather than a failed write.
    """
    if isinstance(value, str):
        if value.isascii() and "\x00" not in value:
            return value  # the common case, without a regex pass over a long answer
        return _UNSTORABLE.sub("\ufffd", value)
    if isinstance(value, list):
        return [storable(item) for item in value]
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    return value


def is_storable(text: str) -> bool:
    """For what can be refused instead (input): whether `text` is storable as it is."""
    return _UNSTORABLE.search(text) is None


def holds_control_character(text: str) -> bool:
    """Whether `text` holds a control character (Cc): C0, DEL and the C1 range, among them
    NEL (U+0085), a line break to str.splitlines() and many readers, as a newline is. For
    names that must stay one line (paths)."""
    return any(unicodedata.category(char) == "Cc" for char in text)


def holds_unstorable(value: Any) -> bool:
    """Whether any string in a JSON value (keys included) is not storable as it is."""
    pending = [value]  # a loop, not recursion: parsed JSON can nest as deep as the parser allows
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if not is_storable(item):
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False
