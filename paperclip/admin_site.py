"""The operator admin's site: the console as its front page, and any id an API answer shows
opened from one URL.

Django's own admin, set up for a laptop screen: no navigation sidebar (it took a fifth of
a 1366-pixel screen from every list; the breadcrumbs and the console lead everywhere), no
"View site" link (`/` is the admin itself).
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.admin.apps import AdminConfig
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone


class PaperclipAdminSite(admin.AdminSite):
    site_header = "Paperclip Sessions"
    site_title = "Paperclip Sessions"
    index_title = "Console"
    site_url = None
    enable_nav_sidebar = False

    def get_urls(self):
        return [
            path("id/", self.admin_view(self.find_view), name="find_form"),
            path("id/<str:object_id>/", self.admin_view(self.find_view), name="find"),
            *super().get_urls(),
        ]

    def index(self, request: HttpRequest, extra_context=None):
        from paperclip.console import console

        return super().index(request, {**(extra_context or {}), **console(request=request, now=timezone.now())})

    def find_view(self, request: HttpRequest, object_id: str = ""):
        """The admin page of whatever `object_id` names (a session's `sess_...` id, a run,
        agent or company id, with or without dashes): one URL an operator pastes any id into."""
        from paperclip.console import admin_url_of

        object_id = object_id or request.GET.get("id", "")
        url = admin_url_of(object_id.strip(), user=request.user)
        if url is None:
            self.message_user(request, f"Nothing here has the id {object_id!r}.", messages.WARNING)
            return HttpResponseRedirect(reverse("admin:index"))
        return HttpResponseRedirect(url)

    def message_user(self, request: HttpRequest, message: str, level: int) -> None:
        messages.add_message(request, level, message)


class PaperclipAdminConfig(AdminConfig):
    default_site = "paperclip.admin_site.PaperclipAdminSite"
