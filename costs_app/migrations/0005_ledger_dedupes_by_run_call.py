"""The ledger identifies a call by its run and its number within the run, in its company.

The unique (message_id, kind) index let an id reported by an agent command (or shared by
two companies' agents) stand for several calls: one row for many, and another company's
budget charged nothing. Rows written before this migration have no call number and are
left as they are.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("costs_app", "0004_drop_redundant_fk_indexes"),
        ("sessions_app", "0009_drop_redundant_fk_indexes"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="costevent",
            name="cost_events_one_per_message",
        ),
        migrations.AddField(
            model_name="costevent",
            name="call_number",
            field=models.PositiveSmallIntegerField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name="costevent",
            constraint=models.UniqueConstraint(
                condition=models.Q(("call_number__isnull", False), ("run__isnull", False)),
                fields=("company", "run", "call_number"),
                name="cost_events_one_per_call",
            ),
        ),
    ]
