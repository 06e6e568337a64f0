from django.db import migrations, models


def batch_runs_mark(apps, schema_editor):
    """Runs queued before the column existed: a batched run asked for batch, and so does
    a scheduled tick of an agent delivering by batch that has not reached its call yet
    (its delivery was read from the agent's configuration at the call until now)."""
    runs = apps.get_model("sessions_app", "HeartbeatRun").objects
    runs.exclude(batch_state="").update(delivery="batch")
    runs.filter(trigger="schedule", status__in=["queued", "running"], agent__adapter_config__delivery="batch").update(
        delivery="batch"
    )


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0025_run_trigger_compaction"),
    ]

    operations = [
        migrations.AddField(
            model_name="heartbeatrun",
            name="delivery",
            field=models.CharField(
                choices=[("direct", "Direct"), ("batch", "Batch")],
                db_default="direct",
                default="direct",
                max_length=16,
            ),
        ),
        migrations.RunPython(batch_runs_mark, migrations.RunPython.noop),
    ]
