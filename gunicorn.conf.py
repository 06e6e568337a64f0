"""gunicorn reads this file from its working directory: the checkout, where the recipe in
docs/deployment.md starts it. Its parent process never loads Django, so it hides its
environment here, as every process that loads Django does (paperclip/process_privacy.py);
its workers are forked from it. `manage.py serve` configures its gunicorn itself."""

from paperclip.process_privacy import environment_hide


def on_starting(server) -> None:
    environment_hide()
