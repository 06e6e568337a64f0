"""The REST API plumbing: authentication, parsing, pagination, errors (views are in views.py)."""
