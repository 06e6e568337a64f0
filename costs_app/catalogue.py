"""The model catalogue: which models exist, their context window and largest `max_tokens`,
their lifecycle (active, deprecated, retired) and retirement date.

It comes from the Models API (`client.models.list()`, every lifecycle), stored in
`model_catalogue` and refreshed by the maintenance pass at most once per
PAPERCLIP_MODELS_REFRESH_MINUTES (`catalogue_refresh_due`, then `catalogue_refresh`). A
refresh that fails keeps the catalogue it had. An install that never had one (no network,
no API key yet) uses the models the price library knows instead.

Reads are from memory: each process keeps the catalogue it loaded for CACHE_SECONDS (one
query), and a refresh in the process forgets it at once.
"""

from __future__ import annotations

import difflib
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from django.db import transaction
from django.db.models import Q

from costs_app.models import CatalogueModel, CatalogueRefresh, Lifecycle
from costs_app.pricing import library_models, library_table, model_base, model_family
from sessions_app.text import storable

CACHE_SECONDS = 60
SOURCE_API = "api"
SOURCE_LIBRARY = "library"
# A model line (the API's `line`) and its generation: "Claude Opus 5.5" is of line opus,
# generation 5, as is "Claude Fable 5.1" of line fable.
FIRST_NUMBER = re.compile(r"(\d+)(?:\.(\d+))?")
ID_NUMBER = re.compile(r"-(\d+)(?:-(\d{1,2}))?(?=-|$)")

if TYPE_CHECKING:
    import anthropic


@dataclass(frozen=True)
class CatalogueEntry:
    id: str
    display_name: str
    line: str
    max_input_tokens: int | None
    max_tokens: int | None
    lifecycle: str
    released_at: datetime | None = None
    deprecated_at: datetime | None = None
    retires_at: datetime | None = None
    source: str = SOURCE_API

    @property
    def version(self) -> tuple[int, int] | None:
        """(generation, minor) from the display name ("Claude Opus 5.5": (5, 5)), else the id."""
        found = FIRST_NUMBER.search(self.display_name) or ID_NUMBER.search(self.id)
        if found is None:
            return None
        return int(found.group(1)), int(found.group(2) or 0)

    @property
    def generation(self) -> int | None:
        """The family line a model belongs to: its major version (5 for Opus 5.5 and Fable 5.1)."""
        return self.version[0] if self.version else None

    @property
    def retired(self) -> bool:
        return self.lifecycle == Lifecycle.RETIRED

    @property
    def warning(self) -> str:
        """What an operator should know about the model's lifecycle ("" for an active one)."""
        if self.lifecycle == Lifecycle.RETIRED:
            return f"{self.id} is retired: its runs are refused (model_retired). Choose another model."
        if self.lifecycle == Lifecycle.DEPRECATED or self.retires_at is not None:
            when = f" and retires on {self.retires_at:%Y-%m-%d}" if self.retires_at else ""
            return f"{self.id} is deprecated{when}. Choose another model before then."
        return ""


@dataclass
class Catalogue:
    entries: dict[str, CatalogueEntry]
    source: str
    _by_family: dict[str, CatalogueEntry] = field(default_factory=dict)
    # cheapest_of_generation's answers, per generation and UTC day (every heartbeat asks).
    _cheapest: dict[tuple, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A family (an alias, a snapshot's family, a `[1m]` variant) finds its newest entry.
        for entry in sorted(self.entries.values(), key=_newest_last):
            self._by_family[model_family(entry.id)] = entry

    def get(self, model: str) -> CatalogueEntry | None:
        """The entry of a model id, or of its family (a dated snapshot, a `[1m]` variant)."""
        if not isinstance(model, str) or not model:
            return None
        for name in (model, model_base(model)):
            if name in self.entries:
                return self.entries[name]
        return self._by_family.get(model_family(model))

    def close_matches(self, model: str, *, n: int = 3) -> list[str]:
        return difflib.get_close_matches(model, list(self.entries), n=n, cutoff=0.5)

    def active(self) -> list[CatalogueEntry]:
        return [entry for entry in self.entries.values() if entry.lifecycle == Lifecycle.ACTIVE]

    def newest(self, *, line: str) -> CatalogueEntry | None:
        """The most recent active model of a line (by release, else by version)."""
        found = [entry for entry in self.active() if entry.line == line]
        return max(found, key=_newest_last) if found else None

    def cheapest_of_generation(self, model: str, *, at: datetime) -> str | None:
        """The active model of `model`'s family line (its generation) with the lowest list
        price (input, then output, from the library), None when the line is unknown."""
        entry = self.get(model)
        if entry is None or entry.generation is None:
            return None
        key = (entry.generation, at.astimezone(UTC).date())
        if key not in self._cheapest:
            self._cheapest[key] = self._cheapest_of(entry.generation, at=at)
        return self._cheapest[key]

    def _cheapest_of(self, generation: int, *, at: datetime) -> str | None:
        priced = []
        for candidate in self.active():
            if candidate.generation != generation:
                continue
            table = library_table(model=candidate.id, at=at)
            if table is not None:
                rates = table.rates()
                priced.append(((rates.input, rates.output, candidate.id), candidate.id))
        return min(priced)[1] if priced else None


def _newest_last(entry: CatalogueEntry):
    released = entry.released_at.timestamp() if entry.released_at else 0.0
    return (released, entry.version or (0, 0), entry.id)


def _entry_of(row: CatalogueModel) -> CatalogueEntry:
    return CatalogueEntry(
        id=row.model,
        display_name=row.display_name,
        line=row.line,
        max_input_tokens=row.max_input_tokens,
        max_tokens=row.max_tokens,
        lifecycle=row.lifecycle,
        released_at=row.released_at,
        deprecated_at=row.deprecated_at,
        retires_at=row.retires_at,
    )


def library_catalogue() -> Catalogue:
    """The models the price library knows, as a catalogue: what a fresh install accepts.
    Its line is read from the model's name (the library has no line of its own)."""
    entries = {}
    for model in library_models():
        name = model.name or model.id
        words = [word.lower() for word in name.split() if word.isalpha() and word.lower() != "claude"]
        entries[model.id] = CatalogueEntry(
            id=model.id,
            display_name=name,
            line=words[0] if words else "",
            max_input_tokens=model.context_window,
            max_tokens=None,
            lifecycle=Lifecycle.DEPRECATED if model.deprecated else Lifecycle.ACTIVE,
            source=SOURCE_LIBRARY,
        )
    return Catalogue(entries=entries, source=SOURCE_LIBRARY)


_loaded: tuple[float, Catalogue] | None = None
_lock = threading.Lock()


def catalogue() -> Catalogue:
    """The catalogue (the stored one, or the library's when none was ever stored), as this
    process last loaded it (at most CACHE_SECONDS ago)."""
    global _loaded
    loaded = _loaded
    if loaded is not None and time.monotonic() - loaded[0] < CACHE_SECONDS:
        return loaded[1]
    rows = list(CatalogueModel.objects.all())
    fresh = Catalogue(entries={row.model: _entry_of(row) for row in rows}, source=SOURCE_API) if rows else None
    with _lock:
        _loaded = (time.monotonic(), fresh or library_catalogue())
        return _loaded[1]


def catalogue_forget() -> None:
    """Load the catalogue again at the next read (after a refresh, or a test's rows)."""
    global _loaded
    with _lock:
        _loaded = None


# --- the refresh ----------------------------------------------------------------------------

LIFECYCLES = [Lifecycle.ACTIVE, Lifecycle.DEPRECATED, Lifecycle.RETIRED]


def catalogue_refresh_due(*, now: datetime, interval: timedelta) -> bool:
    """Whether this process should ask for the catalogue now, and if so take the turn: one
    conditional update, so of several maintenance passes (hosts, clusters) one asks per
    interval, a failed attempt included (a Models API that is down is asked again one
    interval later, not every minute)."""
    CatalogueRefresh.objects.get_or_create(pk=1)
    return bool(
        CatalogueRefresh.objects.filter(
            Q(attempted_at__isnull=True) | Q(attempted_at__lte=now - interval), pk=1
        ).update(attempted_at=now)
    )


class CatalogueUnavailable(Exception):
    """The Models API could not be read, or answered with nothing usable."""


# The Models API answers at once or not at all: a refresh never holds a worker for long.
REFRESH_TIMEOUT_SECONDS = 30


def catalogue_refresh(*, now: datetime, client: anthropic.Anthropic | None = None) -> int:
    """Replace the stored catalogue with the Models API's list (every lifecycle, every
    page); the number of models stored. The client reads ANTHROPIC_API_KEY and
    ANTHROPIC_BASE_URL as the adapters' does. The request is made before any transaction;
    a failure (CatalogueUnavailable, or the SDK's error) leaves the catalogue as it was,
    is recorded on the refresh row, and is raised."""
    try:
        if client is None:
            # Imported here, not at start-up: the SDK is most of what a process would import.
            import anthropic

            client = anthropic.Anthropic(timeout=REFRESH_TIMEOUT_SECONDS, max_retries=1)
        listed = list(client.models.list(lifecycle=LIFECYCLES))
        if not listed:
            raise CatalogueUnavailable("The Models API listed no models; the catalogue is kept.")
        rows = [catalogue_row(info, now=now) for info in listed]
    except Exception as exc:
        CatalogueRefresh.objects.update_or_create(
            pk=1, defaults={"error": storable(f"{type(exc).__name__}: {exc}")[:2000]}
        )
        raise
    with transaction.atomic():
        catalogue_store(rows)
        CatalogueRefresh.objects.update_or_create(pk=1, defaults={"refreshed_at": now, "error": ""})
    catalogue_forget()
    return len(rows)


def catalogue_store(rows: Iterable[CatalogueModel]) -> None:
    """Make the stored catalogue exactly `rows` (inside the caller's transaction)."""
    rows = list(rows)
    CatalogueModel.objects.exclude(model__in=[row.model for row in rows]).delete()
    fields = [f.name for f in CatalogueModel._meta.concrete_fields if not f.primary_key and f.name != "model"]
    CatalogueModel.objects.bulk_create(rows, update_conflicts=True, unique_fields=["model"], update_fields=fields)


def catalogue_row(info, *, now: datetime) -> CatalogueModel:
    """A row from the SDK's `ModelInfo` (the fields this SDK version carries)."""
    lifecycle = getattr(info, "lifecycle", None) or Lifecycle.ACTIVE
    if lifecycle not in Lifecycle.values:
        lifecycle = Lifecycle.ACTIVE if getattr(info, "deprecated_at", None) is None else Lifecycle.DEPRECATED
    return CatalogueModel(
        model=storable(info.id)[:200],
        display_name=storable(info.display_name or "")[:200],
        line=storable(str(getattr(info, "line", None) or ""))[:32],
        max_input_tokens=_tokens(getattr(info, "max_input_tokens", None)),
        max_tokens=_tokens(getattr(info, "max_tokens", None)),
        lifecycle=lifecycle,
        released_at=getattr(info, "created_at", None),
        deprecated_at=getattr(info, "deprecated_at", None),
        retires_at=getattr(info, "retires_at", None),
        refreshed_at=now,
    )


def _tokens(value) -> int | None:
    """A token limit the column can hold; anything else is unknown."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31 else None
