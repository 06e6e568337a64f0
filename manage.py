#!/usr/bin/env python
"""Django's command-line utility for Paperclip Sessions."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        from django.conf import settings

        settings.INSTALLED_APPS  # noqa: B018 - load settings now so a bad environment fails here
    except ImproperlyConfigured as exc:
        # One clear line for a configuration mistake; a traceback helps nobody here.
        sys.stderr.write(f"paperclip: configuration error: {exc}\n")
        sys.exit(2)
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
