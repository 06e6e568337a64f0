"""Compress session histories with lz4 on PostgreSQL.

Every persistent heartbeat rewrites the session's history value (`history || new turns`):
PostgreSQL decompresses, concatenates and recompresses the whole jsonb. With the default
pglz that took about twice as long as with lz4 for a 400-message history (~4 ms against
~2 ms here), and reads ~35% longer, for ~10% less space. Only the column's setting
changes (no table rewrite); each history moves to lz4 the next time it is written.
Servers built without lz4 keep pglz.
"""

from django.db import migrations


def lz4_available(schema_editor) -> bool:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_settings WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)")
        return cursor.fetchone() is not None


def set_compression(method: str):
    def apply(apps, schema_editor):
        if schema_editor.connection.vendor != "postgresql" or not lz4_available(schema_editor):
            return
        schema_editor.execute(f"ALTER TABLE agent_sessions ALTER COLUMN history SET COMPRESSION {method}")

    return apply


class Migration(migrations.Migration):
    dependencies = [
        ("sessions_app", "0007_run_claimed_by"),
    ]

    operations = [migrations.RunPython(set_compression("lz4"), set_compression("pglz"))]
