"""resource.Quantity in the test API server (integration/k8s/apiserver_quantity.py) and in gpush's adapter.

The tables are Kubernetes' own: the cases of k8s.io/apimachinery/pkg/api/resource/quantity_test.go
(TestParseQuantityString, TestQuantityParse, TestQuantityString, TestQuantityParseEmit,
TestJSONWhitespace), so the test server answers a Quantity as a real kube-apiserver does. The
property tests hold gpush's own reader (adapters/k8s/quantity.py) to the server's canonical form: a
quantity means the same before and after a real server rewrote it.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.k8s import quantity as gpush_quantity
from integration.k8s.apiserver_quantity import (
    BINARY_SI,
    DECIMAL_EXPONENT,
    DECIMAL_SI,
    Quantity,
    QuantityError,
    _scan,
    canonical,
    from_json,
    parse,
)

SI, BIN, EXP = DECIMAL_SI, BINARY_SI, DECIMAL_EXPONENT
MAX = 2**63 - 1


def dec(unscaled: int, exponent: int) -> Fraction:
    return Fraction(unscaled) * Fraction(10) ** exponent


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.025Ti", (True, "0.025", "0", "025", "Ti")),
        ("1.025Ti", (True, "1.025", "1", "025", "Ti")),
        ("-1.025Ti", (False, "-1.025", "1", "025", "Ti")),
        (".", (True, ".", "0", "", "")),
        ("-.", (False, "-.", "0", "", "")),
        ("1E-3", (True, "1", "1", "", "E-3")),
    ],
)
def test_the_scanner_splits_as_kubernetes_does(text, expected):
    assert _scan(text) == expected


PARSED = [
    ("0", dec(0, 0), SI),
    ("0n", dec(0, 0), SI),
    ("0u", dec(0, 0), SI),
    ("0m", dec(0, 0), SI),
    ("0Ki", dec(0, 0), BIN),
    ("0k", dec(0, 0), SI),
    ("0Mi", dec(0, 0), BIN),
    ("0M", dec(0, 0), SI),
    ("0Gi", dec(0, 0), BIN),
    ("0G", dec(0, 0), SI),
    ("0Ti", dec(0, 0), BIN),
    ("0T", dec(0, 0), SI),
    ("1", dec(1, 0), SI),
    ("1Ki", dec(1024, 0), BIN),
    ("8Ki", dec(8 * 1024, 0), BIN),
    ("7Mi", dec(7 * 1024**2, 0), BIN),
    ("6Gi", dec(6 * 1024**3, 0), BIN),
    ("5Ti", dec(5 * 1024**4, 0), BIN),
    ("4Pi", dec(4 * 1024**5, 0), BIN),
    ("3Ei", dec(3 * 1024**6, 0), BIN),
    ("10Ti", dec(10 * 1024**4, 0), BIN),
    ("100Ti", dec(100 * 1024**4, 0), BIN),
    ("5n", dec(5, -9), SI),
    ("4u", dec(4, -6), SI),
    ("3m", dec(3, -3), SI),
    ("9", dec(9, 0), SI),
    ("8k", dec(8, 3), SI),
    ("50k", dec(5, 4), SI),
    ("7M", dec(7, 6), SI),
    ("6G", dec(6, 9), SI),
    ("5T", dec(5, 12), SI),
    ("40T", dec(4, 13), SI),
    ("300T", dec(3, 14), SI),
    ("2P", dec(2, 15), SI),
    ("1E", dec(1, 18), SI),
    ("1E-3", dec(1, -3), EXP),
    ("1e3", dec(1, 3), EXP),
    ("1E6", dec(1, 6), EXP),
    ("1e9", dec(1, 9), EXP),
    ("1E12", dec(1, 12), EXP),
    ("1e15", dec(1, 15), EXP),
    ("1E18", dec(1, 18), EXP),
    ("1e14", dec(1, 14), EXP),
    ("1e13", dec(1, 13), EXP),
    ("100.035k", dec(100035, 0), SI),
    ("0.001", dec(1, -3), SI),
    ("0.0005k", dec(5, -1), SI),
    ("0.005", dec(5, -3), SI),
    ("0.05", dec(5, -2), SI),
    ("0.5", dec(5, -1), SI),
    ("0.00050k", dec(5, -1), SI),
    ("0.00500", dec(5, -3), SI),
    ("0.05000", dec(5, -2), SI),
    ("0.50000", dec(5, -1), SI),
    ("0.5e0", dec(5, -1), EXP),
    ("0.5e-1", dec(5, -2), EXP),
    ("0.5e-2", dec(5, -3), EXP),
    ("10.035M", dec(10035, 3), SI),
    ("1.2e3", dec(12, 2), EXP),
    ("1.3E+6", dec(13, 5), EXP),
    ("1.40e9", dec(14, 8), EXP),
    ("1.53E12", dec(153, 10), EXP),
    ("1.6e15", dec(16, 14), EXP),
    ("1.7E18", dec(17, 17), EXP),
    ("9.01", dec(901, -2), SI),
    ("8.1k", dec(81, 2), SI),
    ("7.123456M", dec(7123456, 0), SI),
    ("6.987654321G", dec(6987654321, 0), SI),
    ("5.444T", dec(5444, 9), SI),
    ("40.1T", dec(401, 11), SI),
    ("300.2T", dec(3002, 11), SI),
    ("2.5P", dec(25, 14), SI),
    ("1.01E", dec(101, 16), SI),
    # Things that saturate or round
    ("3.001n", dec(4, -9), SI),
    ("1.1E-9", dec(2, -9), EXP),
    ("0.0000000001", dec(1, -9), SI),
    ("0.0000000005", dec(1, -9), SI),
    ("0.00000000050", dec(1, -9), SI),
    ("0.5e-9", dec(1, -9), EXP),
    ("0.9n", dec(1, -9), SI),
    ("0.00000012345", dec(124, -9), SI),
    ("0.00000012354", dec(124, -9), SI),
    ("9Ei", dec(MAX, 0), BIN),
    ("9223372036854775807Ki", dec(MAX, 0), BIN),
    ("12E", dec(12, 18), SI),
    # Fractional binary
    ("100.035Ki", dec(10243584, -2), BIN),
    ("0.5Mi", dec(512 * 1024, 0), BIN),
    ("0.05Gi", dec(536870912, -1), BIN),
    ("0.025Ti", dec(274877906944, -1), BIN),
    # "Things written by trolls"
    ("0.000000000001Ki", dec(2, -9), SI),
    (".001", dec(1, -3), SI),
    (".0001k", dec(100, -3), SI),
    ("1.", dec(1, 0), SI),
    ("1.G", dec(1, 9), SI),
]


@pytest.mark.parametrize(("text", "value", "form"), PARSED)
def test_a_quantity_parses_to_its_exact_value_and_format(text, value, form):
    for sign, signed in (("", value), ("+", value), ("-", -value)):
        got = parse(sign + text)
        assert (got.value, got.format) == (signed, form), sign + text


@pytest.mark.parametrize(
    "text", ["", "1.1.M", "1+1.0M", "0.1mi", "0.1am", "aoeu", ".5i", "1i", "-3.01i", "-3.01e-", " 1", "1 "]
)
def test_what_is_not_a_quantity_is_refused(text):
    with pytest.raises(QuantityError):
        parse(text)


# (value, format, canonical, an alternate spelling with the same canonical form)
PRINTED = [
    (dec(1024**3, 0), BIN, "1Gi", "1024Mi"),
    (dec(300 * 1024**2, 0), BIN, "300Mi", "307200Ki"),
    (dec(6 * 1024, 0), BIN, "6Ki", ""),
    (dec(1001 * 1024**3, 0), BIN, "1001Gi", "1025024Mi"),
    (dec(1024**4, 0), BIN, "1Ti", "1024Gi"),
    (dec(5, 0), BIN, "5", "5000m"),
    (dec(500, -3), BIN, "500m", "0.5"),
    (dec(1, 9), SI, "1G", "1000M"),
    (dec(1000, 6), SI, "1G", "0.001T"),
    (dec(1000000, 3), SI, "1G", ""),
    (dec(1000000000, 0), SI, "1G", ""),
    (dec(1, -3), SI, "1m", "1000u"),
    (dec(80, -3), SI, "80m", ""),
    (dec(1080, -3), SI, "1080m", "1.08"),
    (dec(108, -2), SI, "1080m", "1080000000n"),
    (dec(10800, -4), SI, "1080m", ""),
    (dec(300, 6), SI, "300M", ""),
    (dec(1, 12), SI, "1T", ""),
    (dec(1, 18), SI, "1E", ""),
    (dec(1, 21), SI, "1e21", "1000E"),
    (dec(5, 21), SI, "5e21", "5000E"),
    (dec(1, 24), SI, "1e24", "1000000E"),
    (dec(1234567, 6), SI, "1234567M", ""),
    (dec(1234567, -3), BIN, "1234567m", ""),
    (dec(3, 3), SI, "3k", ""),
    (dec(1025, 0), BIN, "1025", ""),
    (dec(0, 0), SI, "0", ""),
    (dec(0, 0), BIN, "0", ""),
    (dec(1, 9), EXP, "1e9", ".001e12"),
    (dec(1, -3), EXP, "1e-3", "0.001e0"),
    (dec(1, -9), EXP, "1e-9", "1000e-12"),
    (dec(80, -3), EXP, "80e-3", ""),
    (dec(300, 6), EXP, "300e6", ""),
    (dec(1, 12), EXP, "1e12", ""),
    (dec(1, 3), EXP, "1e3", ""),
    (dec(3, 3), EXP, "3e3", ""),
    (dec(0, 0), EXP, "0", "00"),
    (dec(1, -9), SI, "1n", ""),
    (dec(80, -9), SI, "80n", ""),
    (dec(1080, -9), SI, "1080n", ""),
    (dec(108, -8), SI, "1080n", ""),
    (dec(10800, -10), SI, "1080n", ""),
    (dec(1, -6), SI, "1u", ""),
    (dec(80, -6), SI, "80u", ""),
    (dec(1080, -6), SI, "1080u", ""),
]


def _quantity(value: Fraction, form: str) -> Quantity:
    exponent = -12
    return Quantity(int(value * Fraction(10) ** -exponent), exponent, form)


@pytest.mark.parametrize(("value", "form", "expected", "alternate"), PRINTED)
def test_a_quantity_prints_in_its_canonical_form(value, form, expected, alternate):
    assert str(_quantity(value, form)) == expected
    if value:
        assert str(_quantity(-value, form)) == "-" + expected
    # Parsing the canonical form keeps the string as it is; an alternate spelling is rewritten.
    assert parse(expected).text == expected
    if alternate:
        reparsed = parse(alternate)
        assert reparsed.text is None and str(reparsed) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1Ki", "1Ki"),
        ("1Mi", "1Mi"),
        ("1Gi", "1Gi"),
        ("1024Mi", "1Gi"),
        ("1000M", "1G"),
        (".001Ki", "1024m"),
        (".000001Ki", "1024u"),
        (".000000001Ki", "1024n"),
        (".000000000001Ki", "2n"),
    ],
)
def test_parse_then_emit(text, expected):
    assert canonical(text) == expected
    assert canonical("-" + text) == "-" + expected


@pytest.mark.parametrize(
    ("sent", "stored"),
    [(" 1", "1"), ("1 ", "1"), (1, "1"), (10, "10"), (-1, "-1"), (" -1", "-1"), (None, "0"), (0.5, "500m")],
)
def test_json_strings_are_trimmed_and_numbers_read_as_their_text(sent, stored):
    assert canonical(sent) == stored


@pytest.mark.parametrize(
    ("sent", "stored"),
    [
        # The brief's examples, and what the fast path keeps exactly as sent (quantity.go reuses the
        # input string when its digits look canonical, so a real server answers these unchanged).
        ("0.5", "500m"),
        ("1024Mi", "1Gi"),
        ("1000m", "1"),
        ("2000m", "2"),
        ("1e3", "1e3"),
        ("0.1Gi", "107374182400m"),
        ("1.5Gi", "1536Mi"),
        ("16Gi", "16Gi"),
        ("16384Mi", "16Gi"),
        ("1E6", "1E6"),
        ("1.5E-2", "1.5E-2"),
        ("+1", "+1"),
        ("1.", "1."),
    ],
)
def test_what_a_real_server_stores_for_a_quantity(sent, stored):
    assert canonical(sent) == stored


def test_bools_and_objects_are_not_quantities():
    for value in (True, {"a": 1}, [1]):
        with pytest.raises(QuantityError):
            from_json(value)


# --- gpush's reader against the server's canonical form ------------------------------------------------

_SUFFIXES = ["", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]


@st.composite
def quantities(draw: st.DrawFn) -> str:
    """Quantity strings of every form a client may send: signs, fractions, every suffix, exponents."""
    sign = draw(st.sampled_from(["", "+", "-"]))
    whole = draw(st.integers(0, 10 ** draw(st.integers(0, 12))))
    fraction = draw(st.one_of(st.just(""), st.from_regex(r"\.[0-9]{0,8}", fullmatch=True)))
    if draw(st.booleans()):
        suffix = draw(st.sampled_from(_SUFFIXES))
    else:
        suffix = draw(st.sampled_from("eE")) + draw(st.sampled_from(["", "+", "-"])) + str(draw(st.integers(0, 24)))
    return f"{sign}{whole}{fraction}{suffix}"


@given(quantities())
def test_gpush_reads_a_quantity_the_same_before_and_after_the_server_rewrote_it(text):
    assert gpush_quantity.parse_quantity(canonical(text)) == gpush_quantity.parse_quantity(text)


@given(quantities())
def test_gpush_reads_every_form_to_the_value_kubernetes_parses(text):
    assert gpush_quantity.parse_quantity(text) == parse(text).value


@given(st.integers(0, 2**40), st.sampled_from(["", "k", "M", "Ki", "Mi", "m", "e0", "e3", "E-3"]))
def test_a_count_reads_right_in_every_spelling(number, suffix):
    value = parse(f"{number}{suffix}").value
    assert gpush_quantity.count(canonical(f"{number}{suffix}")) == -(-value // 1)


@pytest.mark.parametrize(
    ("served", "expected"), [("2", 2), ("2000m", 2), ("1k", 1000), ("2e0", 2), ("1500m", 2), ("8", 8), ("0", 0)]
)
def test_an_extended_resource_count_as_a_server_may_write_it(served, expected):
    assert gpush_quantity.count(served) == expected


def test_what_is_no_quantity_counts_as_the_default():
    assert gpush_quantity.count(None) == 0 and gpush_quantity.count("") == 0
    assert gpush_quantity.count("16GB", default=-1) == -1 and gpush_quantity.count("1e999999999") == 0


@pytest.mark.parametrize(
    ("resource", "text", "units"),
    [
        ("cpu", "500m", 500),
        ("cpu", "1.5E-2", 15),
        ("cpu", "0.5n", 1),
        ("memory", "107374182400m", 107374183),
        ("memory", "1536Mi", 1536 * 2**20),
        ("nvidia.com/gpu", "1k", 1000),
        ("memory", "9Ei", 2**63 - 1),
    ],
)
def test_the_simulator_reads_quantities_with_the_servers_parser(resource, text, units):
    from integration.k8s.simulator import _quantity

    assert _quantity(resource, text) == units
