from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0011_session_history_version"),
    ]

    operations = [
        migrations.AddField(
            model_name="heartbeatrun",
            name="merged_ticks",
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
    ]
