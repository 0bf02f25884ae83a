"""Logging set-up shared by the three services (one place to change the format)."""

from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    """Level from IGNIS_LOG_LEVEL (default INFO), one line per record."""
    logging.basicConfig(level=os.environ.get("IGNIS_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
