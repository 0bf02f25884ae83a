"""Byte sizes written by people: ``512MiB``, ``4GiB``, ``1.5GB``, ``100KB``, ``4096``."""

from __future__ import annotations

import re
from decimal import ROUND_FLOOR, Decimal

# Binary (IEC) units are powers of 1024, decimal (SI) units powers of 1000.
# Matched case-insensitively; "B" or no unit means bytes.
UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(value: object) -> int:
    """A non-negative whole number of bytes from an int or a size string.

    Fractions round down to whole bytes (``1.5KiB`` is 1536, ``0.5B`` is 0).
    Raises ValueError naming the value when it is not a size.
    """
    if isinstance(value, bool):  # bool is an int subclass: True is not a size
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a size (>= 0 bytes), got {value}")
        return value
    if isinstance(value, float):
        if not value.is_integer() or value < 0:
            raise ValueError(f"expected a size (whole bytes >= 0), got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        unit = UNITS.get(m.group(2).lower()) if m else None
        if m is not None and unit is not None:
            amount = Decimal(m.group(1)) * unit
            return int(amount.to_integral_value(rounding=ROUND_FLOOR))
    raise ValueError(
        "expected a size (bytes, or a number with KB/MB/GB/TB or KiB/MiB/GiB/TiB), "
        f"got {value!r}"
    )
