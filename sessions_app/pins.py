"""Pinned facts: what every summary of an agent's sessions must keep.

An operator pins text on an agent (API, admin). Each summary request names the agent's
pins; after the summary is written:
1. every pin is looked for in it (case and spacing ignored);
2. when one is missing, the summary is asked for once more, naming the missing ones
   (that call is reserved against the budgets like the first, which is billed first);
3. a pin still missing is carried verbatim in a "kept facts" block after the summary.
So a pin survives any number of compactions, whatever the model writes.

The engine also gathers candidates from the replaced turns (URLs, file paths, ids and
numbers). They are only checked: the compaction record says which the summary kept, so an
operator sees what was dropped and can pin it. Forcing them in would let every summary
grow with everything ever mentioned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.db import transaction

from sessions_app.models import MAX_PINS_PER_AGENT, Agent, PinnedFact, PinRefused, pin_text_validate

MAX_CANDIDATES = 50
KEPT_FACTS_HEADING = "Kept facts (pinned; carried verbatim because the summary left them out):"

# What a candidate fact looks like in the replaced turns, most specific first: one pass
# of the alternation takes the first that matches at each place, so the number inside an
# id or a URL is not a candidate of its own.
CANDIDATE = re.compile(
    "|".join(
        [
            r"https?://[^\s<>\"')\]]+",  # URLs
            r"(?<![\w/.])(?:~|\.{1,2})?(?:/[\w.-]+){2,}/?",  # absolute and ./relative paths
            r"\b[\w-]+(?:/[\w.-]+)+\.[A-Za-z0-9]{1,8}\b",  # relative paths with an extension
            r"\b[A-Za-z][A-Za-z0-9]*(?:[-_][A-Za-z0-9]+)*[-_]\d[A-Za-z0-9]*\b",  # ids: PAP-1234, sess_9f2c
            r"\b[0-9a-f]{7,40}\b",  # hashes
            r"(?<![\w.])\$?\d[\d,]*(?:\.\d+)?%?(?![\w.])",  # numbers
        ]
    )
)


def pin_create(*, agent: Agent, text: object) -> PinnedFact:
    """Pin `text` on the agent. The agent's row is locked while its pins are counted, so two
    pins created at once cannot both take the last place."""
    text = pin_text_validate(text)
    with transaction.atomic():
        Agent.objects.select_for_update(no_key=True).filter(pk=agent.pk).first()
        if PinnedFact.objects.filter(agent=agent).count() >= MAX_PINS_PER_AGENT:
            raise PinRefused("too_many_pins", f"The agent already has {MAX_PINS_PER_AGENT} pinned facts.")
        return PinnedFact.objects.create(agent=agent, text=text)


def pinned_texts(agent: Agent) -> list[str]:
    return list(PinnedFact.objects.filter(agent=agent).order_by("created_at").values_list("text", flat=True))


# --- checking a summary ----------------------------------------------------------------


def normalised(text: str) -> str:
    return " ".join(text.split()).casefold()


def facts_missing(summary: str, facts: list[str]) -> list[str]:
    """The facts `summary` does not contain (case and spacing ignored)."""
    found = normalised(summary)
    return [fact for fact in facts if normalised(fact) not in found]


def fact_candidates(text: str) -> list[str]:
    """URLs, paths, ids and numbers in `text`, first seen first, at most MAX_CANDIDATES."""
    found: dict[str, None] = {}
    for match in CANDIDATE.finditer(text):
        value = match.group(0).rstrip(".,;:")
        if len(value) >= 2:
            found[value] = None
            if len(found) == MAX_CANDIDATES:
                break
    return list(found)


def keep_instruction(pins: list[str]) -> str:
    if not pins:
        return ""
    listed = "\n".join(f"- {pin}" for pin in pins)
    return f"\n\n[Pinned facts]\nThe summary must contain each of these facts verbatim:\n{listed}"


def retry_instruction(missing: list[str]) -> str:
    listed = "\n".join(f"- {fact}" for fact in missing)
    return (
        "\n\n[Missing from your previous summary]\nA summary of these turns left out these pinned facts. "
        f"Write the summary again and include each of them verbatim:\n{listed}"
    )


def with_kept_facts(summary: str, missing: list[str]) -> str:
    if not missing:
        return summary
    listed = "\n".join(f"- {fact}" for fact in missing)
    return f"{summary.rstrip()}\n\n{KEPT_FACTS_HEADING}\n{listed}"


@dataclass(frozen=True)
class CheckedSummary:
    """A summary as it goes into the session, and the facts it was checked for."""

    text: str
    facts: list[dict]
    attempts: int


def checked_summary(*, written: str, attempts: int, pins: list[str], candidates: list[str]) -> CheckedSummary:
    """`written` (the model's last summary) with the pins it lacks appended verbatim, and
    the record of each fact checked."""
    missing_pins = facts_missing(written, pins)
    text = normalised(written)
    found = {fact for fact in pins + candidates if normalised(fact) in text}
    via_model = "summary" if attempts == 1 else "retry"
    facts = [
        {"text": pin, "source": "pin", "passed": pin in found, "via": via_model if pin in found else "kept_facts"}
        for pin in pins
    ]
    facts += [
        {"text": fact, "source": "candidate", "passed": fact in found, "via": via_model if fact in found else ""}
        for fact in candidates
        if fact not in pins
    ]
    return CheckedSummary(text=with_kept_facts(written, missing_pins), facts=facts, attempts=attempts)
