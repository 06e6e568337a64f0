"""One way to write a time on every admin page: `2026-11-30 18:04 UTC` (ISO order, the zone
named), instead of Django's English "Nov. 30, 2026, 6:04 p.m." beside the ISO dates the
pages write themselves. Times are stored and shown in UTC (settings.TIME_ZONE)."""

DATETIME_FORMAT = "Y-m-d H:i T"
SHORT_DATETIME_FORMAT = "Y-m-d H:i T"
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i"
MONTH_DAY_FORMAT = "F j"
YEAR_MONTH_FORMAT = "F Y"
