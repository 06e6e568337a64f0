"""`manage.py create_api_key --company ID [--name N]`: prints the new key once."""

from __future__ import annotations

from uuid import UUID

from django.core.management.base import BaseCommand, CommandError

from sessions_app.api_keys import api_key_create
from sessions_app.models import ApiKey, Company
from sessions_app.text import is_storable

NAME_MAX_LENGTH = ApiKey._meta.get_field("name").max_length


class Command(BaseCommand):
    help = "Create an API key for a company and print it. Only its SHA-256 is stored: copy it now."

    def add_arguments(self, parser):
        parser.add_argument("--company", required=True, help="The company's id (UUID).")
        parser.add_argument("--name", default="", help="A label to tell keys apart (e.g. the script using it).")

    def handle(self, *args, company: str, name: str, **options):
        try:
            company_id = UUID(company)
        except ValueError:
            raise CommandError(f"--company must be a company id (UUID), got {company!r}.") from None
        # Bytes that are not UTF-8 arrive as lone surrogates (surrogateescape), which no
        # database stores; SQLite does not enforce the column's length, PostgreSQL refuses it.
        if not is_storable(name):
            raise CommandError("--name must be valid UTF-8 text without NUL characters.")
        if len(name) > NAME_MAX_LENGTH:
            raise CommandError(f"--name is {len(name)} characters; the limit is {NAME_MAX_LENGTH}.")
        found = Company.objects.filter(pk=company_id).first()
        if found is None:
            raise CommandError(f"No company with id {company_id}.")
        api_key, plaintext = api_key_create(company=found, name=name)
        self.stderr.write(f"API key {api_key.prefix}… for {found.name} ({found.id}). It is shown only this once:")
        self.stdout.write(plaintext)
