"""Kubernetes resource quantities as the adapter reads them from the API server.

A real server answers every Quantity in its canonical form, which is often not what was sent:
``2`` GPUs may come back as ``2``, ``2000m`` or ``2e0``, memory as ``16Gi``, ``17179869184`` or
``16384Mi``, and a count of 1000 as ``1k``. :func:`parse_quantity` reads every form
k8s.io/apimachinery's ParseQuantity accepts (a sign, a fraction, binary ``Ki``..``Ei``, decimal
``n u m k M G T P E``, exponents ``1e3`` and ``1.5E-2``) to the exact value Kubernetes holds: finer
than nano rounds away from zero to the next nano, and a binary-suffixed value is capped at 2^63-1,
as the server does. Its results equal the test server's (integration/test_k8s_quantity.py checks
that with random quantities, before and after canonicalisation).

This is the adapter's only quantity reader; render.py writes quantities (``quantity_mib``).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<whole>[0-9]*)(?:\.(?P<fraction>[0-9]*))?"
    r"(?P<suffix>[numkMGTPE]?|[KMGTPE]i|[eE][+-]?[0-9]+)"
)
_DECIMAL = {"": 0, "n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_NANO = Fraction(1, 10**9)
_MAX_INT64 = 2**63 - 1
# Beyond this a decimal exponent is no resource count or size any cluster has; refusing it keeps
# a hostile "1e999999999" from costing a gigabyte-sized integer.
_MAX_EXPONENT = 400


def parse_quantity(value: Any) -> Fraction:
    """The exact value of a Quantity (a string, or a JSON number); ValueError when it is none."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        return Fraction(value)
    text = repr(value) if isinstance(value, float) else str(value).strip()
    m = _QUANTITY.fullmatch(text)
    if not m or not (m["whole"] or m["fraction"] is not None):
        raise ValueError(f"not a quantity: {value!r}")
    digits = (m["whole"] or "") + (m["fraction"] or "")
    number = Fraction(int(digits or "0"), 10 ** len(m["fraction"] or ""))
    suffix = m["suffix"]
    if suffix in _BINARY:
        number *= 2 ** _BINARY[suffix]
        number = min(number, Fraction(_MAX_INT64))
    else:
        exponent = _DECIMAL[suffix] if suffix in _DECIMAL else int(suffix[1:])
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"quantity out of range: {value!r}")
        number *= Fraction(10) ** exponent
    if number.denominator != 1 and (number / _NANO).denominator != 1:
        number = math.ceil(number / _NANO) * _NANO  # Kubernetes keeps nano precision, rounding up
    return -number if m["sign"] == "-" else number


def count(value: Any, default: int = 0) -> int:
    """A Quantity as a whole number, as Kubernetes' ``Value()`` gives it (rounded up, away from
    zero): an extended resource's count (``nvidia.com/gpu``: ``2``, ``2000m``, ``1k``); ``default``
    when there is no value or it is not a quantity."""
    if value is None or value == "":
        return default
    try:
        number = parse_quantity(value)
    except ValueError:
        return default
    return math.ceil(number) if number >= 0 else -math.ceil(-number)
