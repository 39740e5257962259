"""structlog setup: JSON lines when stdout is not a terminal (containers, log shippers),
coloured console lines on a terminal. Per-request fields (request_id) are bound on a
request's own logger (`Flight.log`), never globally."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info") -> None:
    if sys.stdout.isatty():
        render = [structlog.dev.ConsoleRenderer()]
    else:
        render = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), *render],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
