"""Admin lists given filters, searches or selections the database cannot use: a message, not a 500.

Django validates most lookups in the query string when it builds the changelist, but
some fail only when the query runs, after its own check: a year outside 1..9999
(`?created_at__year=99999`) and, on PostgreSQL, a NUL character in any filter or search
term. Bulk actions trust the posted ids the same way (`_selected_action=not-a-uuid`), and a
row's pages their URL's id (a NUL in it is a 404). A search box's own lookup
(`/admin/autocomplete/?term=...`) answers JSON, so a term the database refuses finds nothing.
That holds for every list in the admin (django-q2's and auth's included), so the guard
is a middleware around the admin rather than a base class.
"""

from __future__ import annotations

import logging

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db import DataError
from django.http import Http404, HttpResponseRedirect, JsonResponse
from django.urls import reverse

logger = logging.getLogger(__name__)

REFUSED_BY_THE_DATABASE = (DataError, ValueError, OverflowError, ValidationError)


class AdminBadFilterMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if "\x00" in request.path and request.path.startswith(reverse("admin:index")):
            # No row's id holds a NUL, and PostgreSQL refuses one in any lookup: the pages of a
            # row whose key is text (django-q2's tasks) were a 500 for `.../%00/change/`.
            raise Http404("No such page.")
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, REFUSED_BY_THE_DATABASE) or not request.path.startswith(reverse("admin:index")):
            return None
        if request.path == reverse("admin:autocomplete"):
            # The widget reads JSON: a redirect would land on the lookup without its parameters,
            # a 403. No stored name holds what PostgreSQL refuses to compare, so nothing matches.
            logger.info("Admin search term refused by the database: %s", exception)
            return JsonResponse({"results": [], "pagination": {"more": False}})
        if request.method == "GET" and request.GET:
            what, back = "Those filters or search terms", request.path
        elif request.method == "POST" and "action" in request.POST:
            what, back = "That selection", request.get_full_path()
        else:
            return None  # not a list's filters or selection: a real error, left to the usual 500
        logger.warning("Admin request refused on %s: %s", request.path, exception, exc_info=exception)
        messages.error(request, f"{what} cannot be used ({reason(exception)}); showing the whole list.")
        return HttpResponseRedirect(back)


def reason(exception: Exception) -> str:
    text = exception.messages[0] if isinstance(exception, ValidationError) else str(exception)
    return (text.splitlines() or [type(exception).__name__])[0][:200]
