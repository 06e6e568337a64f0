"""The every-minute maintenance schedule (expiry, reaper, retention, stuck queues).

Created here, idempotently by name, rather than in AppConfig.ready(): ready() runs in every
process (web workers, shells, tests) and must not write to the database.
"""

from django.db import migrations

NAME = "paperclip:maintenance"


def create_schedule(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.update_or_create(
        name=NAME,
        defaults={"func": "sessions_app.tasks.maintenance", "schedule_type": "I", "minutes": 1, "repeats": -1},
    )


def remove_schedule(apps, schema_editor):
    apps.get_model("django_q", "Schedule").objects.filter(name=NAME).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0002_session_history_purged_at"),
        ("django_q", "0019_alter_task_options_alter_ormq_key_alter_ormq_lock_and_more"),
    ]

    operations = [migrations.RunPython(create_schedule, remove_schedule)]
