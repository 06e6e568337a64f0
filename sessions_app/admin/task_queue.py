"""django-q2's schedules in the admin, kept to the types this service can run.

django-q2's CRON type needs croniter, which this service does not install: an agent's
`heartbeat_cron` is read by `sessions_app.wakes` instead. Without croniter, django-q2's own
admin still offers "Cron" and its save raised ImportError (a 500 on the add page); on a
change the row was saved, and the cluster's scheduler would fail on it at every pass.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django_q.admin import ScheduleAdmin as QueueScheduleAdmin
from django_q.conf import croniter
from django_q.models import Schedule


class ScheduleForm(forms.ModelForm):
    def clean_schedule_type(self) -> str:
        value = self.cleaned_data["schedule_type"]
        if value == Schedule.CRON and not croniter:
            raise forms.ValidationError(
                "Cron schedules are not available here (croniter is not installed): choose another type. "
                "An agent wakes on a cron expression through its heartbeat_cron setting."
            )
        return value


class ScheduleAdmin(QueueScheduleAdmin):
    form = ScheduleForm


admin.site.unregister(Schedule)
admin.site.register(Schedule, ScheduleAdmin)
