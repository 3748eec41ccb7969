"""Numbers typed by people (CLI arguments, admin API bodies), in ASCII digits only (pure).

Python's ``int()``, ``float()`` and a regex ``\\d`` also take other scripts' digits
("٣" is 3 to them), and ``float()`` takes ``nan``, ``inf``, ``1e3`` and ``1_000``. A value
that reaches logs, saved state or another tool should be written the way it will be read
back, so these accept plain ``123`` or ``1.5`` and nothing else.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?|\.[0-9]+")


def parse_int(text: str, what: str) -> int:
    """``text`` (surrounding blanks ignored) as a non-negative integer of ASCII digits.

    ``what`` names the value in the error. Raises ValueError naming ``what`` and ``text``.
    """
    spec = text.strip()
    if not _INTEGER.fullmatch(spec):
        raise ValueError(f"{what} {text!r} is not a whole number in ASCII digits 0-9")
    return int(spec)


def parse_decimal(text: str, what: str) -> float:
    """``text`` (surrounding blanks ignored) as a non-negative decimal of ASCII digits
    (``5``, ``2.5``, ``.5``): no sign, exponent, ``nan``/``inf`` or underscores.

    ``what`` names the value in the error. Raises ValueError naming ``what`` and ``text``.
    """
    spec = text.strip()
    if not _DECIMAL.fullmatch(spec):
        raise ValueError(f"{what} {text!r} is not a number in ASCII digits 0-9 (for example 2.5)")
    return float(spec)
