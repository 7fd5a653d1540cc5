"""resource.Quantity as kube-apiserver reads and writes it: the parser and the canonical form.

A real server decodes every Quantity of a built-in kind (a container's requests and limits, a
Node's capacity, a ResourceQuota's hard limits, ...) into k8s.io/apimachinery's ``Quantity`` and
encodes it back with ``Quantity.String()``, so what a client reads back is the canonical form, not
what it sent: ``0.5`` comes back ``500m``, ``1024Mi`` comes back ``1Gi``, ``1000m`` comes back ``1``.
This module is a port of pkg/api/resource (quantity.go, suffix.go, amount.go; the cases of its
quantity_test.go are the tests in integration/test_k8s_quantity.py):

* **Parsing** (``ParseQuantity``): a sign, digits with an optional fraction, and a suffix: binary SI
  (``Ki`` ... ``Ei``), decimal SI (``n u m "" k M G T P E``) or a decimal exponent (``e3``,
  ``E-2``). The suffix fixes the *format* the value keeps. Values are exact down to nano: a finer
  non-zero value is rounded away from zero to the next nano (``0.9n`` is ``1n``). A binary-SI value
  is capped at 2^63-1 (``9Ei``), and one between -1 and 1 becomes decimal SI.
* **Printing** (``CanonicalizeBytes``): zero is ``0``. Decimal SI and decimal exponent print the
  mantissa without trailing zeros and the largest power of ten that is a multiple of 3 and keeps it
  an integer (``1500m``, ``1e3``, ``80e-3``); decimal SI falls back to an exponent past ``E``
  (``1e21``; releases before the fix print the mantissa alone there). Binary SI prints the largest
  power of 1024 that keeps an integer (``1536Mi``), and prints as decimal SI when the value is
  under 1024 in magnitude or not an integer (``5``, ``107374182400m`` for ``0.1Gi``).
* **What parsing keeps as sent**: Kubernetes reuses the input string as the canonical form when its
  fast path judges it canonical (decimal: a power-of-ten multiple of 3, digits not ending in
  ``000`` nor starting with ``0``; binary: a numeral that is not a multiple of 8). That test looks at
  the digits only, so ``+1``, ``1.``, ``1.G`` and ``1.5E-2`` come back exactly as sent, as they do
  from a real server.

In JSON a client may send a number instead of a string (``"cpu": 2``) and the server trims the
string's surrounding whitespace first; :func:`from_json` does both.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

DECIMAL_SI = "DecimalSI"
BINARY_SI = "BinarySI"
DECIMAL_EXPONENT = "DecimalExponent"

QUANTITY_PATTERN = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
FORMAT_WRONG = f"quantities must match the regular expression '{QUANTITY_PATTERN}'"
NUMERIC = "unable to parse numeric part of quantity"
SUFFIX = "unable to parse quantity's suffix"

_MAX_INT64 = 2**63 - 1
_MAX_INT64_FACTORS = 18  # decimal digits an int64 always holds
_NANO = -9
_SUFFIX_LETTERS = frozenset("eEinumkKMGTP")
_DIGITS = frozenset("0123456789")
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL_NAMES = {e: s for s, e in _DECIMAL_SUFFIXES.items()}
_BINARY_NAMES = {e // 10: s for s, e in _BINARY_SUFFIXES.items()}
# What Go's strings.TrimSpace removes (unicode.IsSpace).
_GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"


class QuantityError(ValueError):
    """A string that is not a Quantity; the message is the real server's."""


@dataclass(frozen=True)
class Quantity:
    """An exact ``unscaled * 10**exponent`` with the format its suffix gave it."""

    unscaled: int
    exponent: int
    format: str
    text: str | None = None  # the input, where Kubernetes keeps it as its canonical form

    @property
    def value(self) -> Fraction:
        if self.exponent >= 0:
            return Fraction(self.unscaled * 10**self.exponent)
        return Fraction(self.unscaled, 10**-self.exponent)

    def __str__(self) -> str:
        if self.unscaled == 0:
            return "0"
        if self.text is not None:
            return self.text
        form = self.format
        if form == BINARY_SI:
            value = self.value
            if -1024 < value < 1024 or value.denominator != 1:
                form = DECIMAL_SI  # never rounded, never a fraction of Ki
            else:
                return _binary(int(value))
        return _decimal(self.unscaled, self.exponent, form)


def _decimal(unscaled: int, exponent: int, form: str) -> str:
    sign, mantissa = ("-" if unscaled < 0 else ""), abs(unscaled)
    while mantissa >= 10 and mantissa % 10 == 0:
        mantissa //= 10
        exponent += 1
    down = exponent % 3  # to the multiple of 3 at or below, as amount.go does for either sign
    mantissa *= 10**down
    exponent -= down
    if form == DECIMAL_SI and exponent in _DECIMAL_NAMES:
        suffix = _DECIMAL_NAMES[exponent]
    else:
        suffix = f"e{exponent}" if exponent else ""
    return f"{sign}{mantissa}{suffix}"


def _binary(value: int) -> str:
    sign, mantissa, times = ("-" if value < 0 else ""), abs(value), 0
    while mantissa >= 1024 and mantissa % 1024 == 0:
        mantissa //= 1024
        times += 1
    return f"{sign}{mantissa}{_BINARY_NAMES.get(times, '')}"


def _scan(text: str) -> tuple[bool, str, str, str, str]:
    """parseQuantityString: (positive, value, numerator, denominator, suffix)."""
    positive, pos, end = True, 0, len(text)
    if pos < end and text[0] in "+-":
        positive = text[0] == "+"
        pos += 1
    while True:  # leading zeros
        if pos >= end:
            return positive, "0", "0", "", ""
        if text[pos] != "0":
            break
        pos += 1
    i = pos
    while i < end and text[i] in _DIGITS:
        i += 1
    if i >= end:
        return positive, text, text[pos:end] or "0", "", ""
    num, pos = text[pos:i] or "0", i
    denom = ""
    if text[pos] == ".":
        pos += 1
        i = pos
        while i < end and text[i] in _DIGITS:
            i += 1
        if i >= end:
            return positive, text, num, text[pos:end], ""
        denom, pos = text[pos:i], i
    value = text[:pos]
    start = pos
    while pos < end and text[pos] in _SUFFIX_LETTERS:
        pos += 1
    if pos >= end:
        return positive, value, num, denom, text[start:]
    if text[pos] in "+-":
        pos += 1
    while pos < end:
        if text[pos] not in _DIGITS:
            raise QuantityError(FORMAT_WRONG)
        pos += 1
    return positive, value, num, denom, text[start:]


def _interpret(suffix: str) -> tuple[int, int, str]:
    """suffixer.interpret: (base, exponent, format)."""
    if suffix in _DECIMAL_SUFFIXES:
        return 10, _DECIMAL_SUFFIXES[suffix], DECIMAL_SI
    if suffix in _BINARY_SUFFIXES:
        return 2, _BINARY_SUFFIXES[suffix], BINARY_SI
    if len(suffix) > 1 and suffix[0] in "eE":
        digits = suffix[1:]
        body = digits[1:] if digits[:1] in ("+", "-") else digits
        if not body or not set(body) <= _DIGITS:
            raise QuantityError(SUFFIX)
        parsed = int(digits)
        if not -(2**63) <= parsed < 2**63:  # strconv.ParseInt(..., 64)
            raise QuantityError(SUFFIX)
        return 10, (parsed + 2**31) % 2**32 - 2**31, DECIMAL_EXPONENT  # then int32(parsed), as Go does
    raise QuantityError(SUFFIX)


def parse(text: str) -> Quantity:
    """ParseQuantity: the Quantity ``text`` is, or QuantityError with the real server's words."""
    if not text:
        raise QuantityError(FORMAT_WRONG)
    if text == "0":
        return Quantity(0, 0, DECIMAL_SI, "0")
    positive, value, num, denom, suffix = _scan(text)
    base, exponent, form = _interpret(suffix)
    precision, scale, mantissa = 0, 0, 1
    if form == BINARY_SI:
        if exponent >= 0 and not denom:
            mantissa = 1 << exponent
            # 1Mi (2^20) has about 6 digits of decimal precision: exponent*3/10 - 1, as quantity.go guesses
            precision = 15 - len(num) - exponent * 3 // 10 - 1
        else:
            precision = -1
    else:
        scale = exponent
        precision = _MAX_INT64_FACTORS - (len(num) + len(denom))
    if precision >= 0:
        scale -= len(denom)
        if scale >= _NANO:
            shifted = num + denom
            number = int(shifted)
            result = number * mantissa
            if result <= _MAX_INT64:  # int64Multiply did not overflow
                if not positive:
                    result = -result
                if form == BINARY_SI:
                    keep = exponent % 10 == 0 and number & 0x07 != 0
                else:
                    keep = scale % 3 == 0 and not shifted.endswith("000") and shifted[0] != "0"
                return Quantity(result, scale, form, text if keep else None)
    return _parse_slow(value, base, exponent, form)


def _parse_slow(value: str, base: int, exponent: int, form: str) -> Quantity:
    """The inf.Dec path: too many digits, finer than nano, or a fraction of a binary suffix."""
    sign = -1 if value[:1] == "-" else 1
    whole, _, fraction = value.lstrip("+-").partition(".")
    if not (whole + fraction):
        raise QuantityError(NUMERIC)
    unscaled, scale = int(whole + fraction), -len(fraction)
    if base == 10:
        scale += exponent
    else:
        unscaled <<= exponent
    if unscaled and scale < _NANO:
        # Rounded away from zero to nano: "if you want some resources, you should get some".
        shift = _NANO - scale
        if shift > len(str(unscaled)):
            unscaled = 1
        else:
            quotient, remainder = divmod(unscaled, 10**shift)
            unscaled = quotient + (1 if remainder else 0)
        scale = _NANO
    if form == BINARY_SI:
        amount = Quantity(unscaled, scale, form).value
        if amount > _MAX_INT64:
            unscaled, scale = _MAX_INT64, 0
        elif 0 < amount < 1:
            form = DECIMAL_SI
    return Quantity(sign * unscaled, scale, form)


def from_json(value: Any) -> Quantity:
    """A Quantity as the server decodes it from JSON: a string (whitespace trimmed), a number, or null."""
    if value is None:
        return Quantity(0, 0, DECIMAL_SI)
    if isinstance(value, bool):
        raise QuantityError(FORMAT_WRONG)
    if isinstance(value, int):
        return parse(str(value))
    if isinstance(value, float):
        return parse(repr(value))
    if isinstance(value, str):
        return parse(value.strip(_GO_SPACE))
    raise QuantityError(FORMAT_WRONG)


def canonical(value: Any) -> str:
    """What a real server stores and answers for a Quantity a client sent."""
    return str(from_json(value))
