"""What costs_app announces to the apps built on it.

costs_app decides about money and never drives agents itself; an app that pauses agents
for their budget listens here to resume them when a budget allows again.
"""

from django.dispatch import Signal

# Sent after a company's or an agent's budget was set or removed, with `company_id` and `now`.
budget_changed = Signal()
