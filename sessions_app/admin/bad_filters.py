"""Admin lists given filters or searches the database cannot run: a message, not a 500.

Django validates most lookups in the query string when it builds the changelist, but
some fail only when the query runs, after its own check: a year outside 1..9999
(`?created_at__year=99999`) and, on PostgreSQL, a NUL character in any filter or search
term. That holds for every list in the admin (django-q2's and auth's included), so the
guard is a middleware around the admin rather than a base class.
"""

from __future__ import annotations

import logging

from django.contrib import messages
from django.db import DataError
from django.http import HttpResponseRedirect
from django.urls import reverse

logger = logging.getLogger(__name__)


class AdminBadFilterMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, (DataError, ValueError, OverflowError)):
            return None
        if request.method != "GET" or not request.GET or not request.path.startswith(reverse("admin:index")):
            return None  # not a filtered page: a real error, left to the usual 500 handling
        logger.warning("Admin filters refused on %s: %s", request.path, exception, exc_info=exception)
        messages.error(
            request, f"Those filters or search terms cannot be used ({first_line(exception)}); showing the whole list."
        )
        return HttpResponseRedirect(request.path)


def first_line(exception: Exception) -> str:
    return (str(exception).splitlines() or [type(exception).__name__])[0][:200]
