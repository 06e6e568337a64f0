from django.db import migrations, models

import sessions_app.models


class Migration(migrations.Migration):
    """The history column's field decodes with msgspec (`sessions_app.history_json`); the
    column is as it was. State only: on SQLite an AlterField would rebuild the table, which
    the ledger's triggers on `agent_sessions` refuse."""

    dependencies = [
        ("sessions_app", "0032_beside_heartbeats"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="agentsession",
                    name="history",
                    field=sessions_app.models.HistoryField(
                        db_default=models.Value([], output_field=models.JSONField()), default=list
                    ),
                ),
            ],
        ),
    ]
