"""Byte sizes: parse ``"18GiB"`` / ``"512MiB"`` / ``0.8``; print bytes in the unit that fits.

Bytes are ``int`` everywhere inside the package. Metrics (TensorBoard, the ``*_gib`` keys) are GiB (1024³); printed
text uses the binary unit that fits: :func:`format_bytes` for one size in a sentence, :func:`unit_for` for a table
(one unit for the whole table, chosen from its largest value and named in its header).
"""

from __future__ import annotations

import math
import re
from typing import Tuple, Union

__all__ = ["GiB", "KiB", "MiB", "format_bytes", "parse_size", "parse_size_or_fraction", "to_gib", "unit_for"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
_BINARY = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))

_UNITS = {
    "b": 1,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_SIZE_HELP = "a size such as '18GiB', '512MiB', '2.5GB' or an int number of bytes"


def parse_size(value: Union[int, str], *, name: str = "size") -> int:
    """Parse a byte size into a positive ``int``.

    Args:
        value: an ``int`` number of bytes or a string with a binary (``KiB``, ``MiB``, ``GiB``, ``TiB``) or
            decimal (``KB``, ``MB``, ``GB``, ``TB``) unit; a bare numeric string means bytes.
        name: the argument name used in error messages.

    Raises:
        TypeError: for ``bool`` or other non-size types.
        ValueError: for malformed, unknown-unit, non-finite, zero or negative sizes.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name}={value!r} is not a size; pass {_SIZE_HELP}.")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive size; pass {_SIZE_HELP}.")
        return value  # exact: no float round trip for sizes above 2**53
    else:
        match = _SIZE_RE.match(value)
        if not match:
            raise ValueError(f"{name}={value!r} is not a size; pass {_SIZE_HELP}.")
        number, unit = float(match.group(1)), (match.group(2) or "b").lower()
        if unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} has an unknown unit {match.group(2)!r}; valid units are "
                f"{', '.join(('B', 'KiB', 'MiB', 'GiB', 'TiB', 'KB', 'MB', 'GB', 'TB'))}."
            )
    size = number * _UNITS[unit]
    if not math.isfinite(size) or int(size) <= 0:
        raise ValueError(f"{name}={value!r} must be a positive size; pass {_SIZE_HELP}.")
    return int(size)


def parse_size_or_fraction(value: Union[int, float, str], *, name: str = "threshold") -> Union[int, float]:
    """Parse a size (returns ``int`` bytes) or a fraction of capacity in ``(0, 1]`` (returns ``float``).

    A float, or a string that parses as a plain number ≤ 1 with a decimal point (``"0.8"``), is a fraction;
    everything else is a size handed to :func:`parse_size`.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a size ('18GiB') or a fraction of capacity (0.8), not a bool.")
    shown = value
    if isinstance(value, str):
        try:
            as_float = float(value)
        except ValueError:
            return parse_size(value, name=name)
        if "." in value or "e" in value.lower():
            value = as_float
    if isinstance(value, float):
        if not math.isfinite(value) or not 0.0 < value <= 1.0:
            raise ValueError(
                f"{name}={shown!r} is not a valid fraction of capacity; a fraction must lie in (0, 1] "
                f"(e.g. 0.8), or pass {_SIZE_HELP}."
            )
        return value
    return parse_size(value, name=name)


def to_gib(num_bytes: int) -> float:
    """Bytes as binary gigabytes (1024³)."""
    return num_bytes / GiB


def unit_for(num_bytes: float) -> Tuple[str, int]:
    """The binary unit that fits ``num_bytes``: ``(name, scale)``, e.g. ``("MiB", 1048576)``; ``("B", 1)`` below 1 KiB.

    A table passes its largest value and prints every value divided by ``scale``, naming the unit in its header, so
    a small model's table reads ``params 300.00`` under ``KiB`` rather than ``0.000`` under ``GiB``.
    """
    size = abs(float(num_bytes))
    for unit, scale in _BINARY:
        if size >= scale:
            return unit, scale
    return "B", 1


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size in the unit that fits, e.g. ``'2.42 GiB'``, ``'16.0 MiB'``, ``'512 B'``."""
    unit, scale = unit_for(num_bytes)
    if scale == 1:
        return f"{int(num_bytes)} B"
    return f"{num_bytes / scale:.2f} {unit}" if unit in ("TiB", "GiB") else f"{num_bytes / scale:.1f} {unit}"
