from django.db import migrations, models


def create_the_row(apps, schema_editor):
    apps.get_model("costs_app", "PriceOverridesRevision").objects.get_or_create(pk=1)


class Migration(migrations.Migration):
    dependencies = [("costs_app", "0012_alert_events")]

    operations = [
        migrations.CreateModel(
            name="PriceOverridesRevision",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("revision", models.PositiveBigIntegerField(default=0)),
            ],
            options={"db_table": "price_overrides_revision"},
        ),
        migrations.RunPython(create_the_row, migrations.RunPython.noop),
    ]
