"""The REST API: its plumbing (authentication, parsing, pagination, errors), the sessions
list page (session_list.py) and the history endpoints (history_views.py). The resource
views are in sessions_app/views.py."""
