"""Values the client cannot put in a request (issue 32, finding 7): bytes a shell passed
that are no UTF-8 text, and a value too long for a URL. Each is a clear error and exit 2,
never a traceback; the SDK, which scripts use without the CLI, says the same."""

from __future__ import annotations

import pytest

from broker.core.errors import InvalidRequest

NOT_UTF8 = b"\xff".decode("utf-8", "surrogateescape")  # what Python makes of `gpush list -u $'\xff'`


def refused(done, *words: str) -> None:
    assert done.code == 2, done
    assert "Traceback" not in done.err and done.out == ""
    for word in words:
        assert word in done.err, done.err


def test_a_user_that_is_not_utf8_is_a_clear_error(gpush):
    refused(gpush("list", "-u", NOT_UTF8), "user", r"'\xff'", "not UTF-8")


def test_a_label_that_is_not_utf8_is_a_clear_error(gpush):
    refused(gpush("list", "-l", f"team={NOT_UTF8}"), "not UTF-8")


def test_a_cursor_of_100000_characters_is_refused_before_anything_is_sent(gpush):
    refused(gpush("list", "--cursor", "A" * 100_000), "--cursor", "100,000 characters", "not a cursor gpush printed")


def test_a_cursor_gpush_cannot_have_printed_is_refused(gpush):
    refused(gpush("list", "--cursor", "abc/def"), "--cursor", "not a cursor gpush printed")
    refused(gpush("list", "--cursor", NOT_UTF8), "--cursor", "not a cursor gpush printed")


def test_a_cursor_gpush_printed_still_goes_on(gpush):
    for n in range(3):
        assert gpush("submit", "--kind", "training", "--name", f"j{n}", "--", "true").code == 0
    first = gpush("list", "--json", "--limit", "2")
    cursor = first.json["next_cursor"]
    assert cursor
    rest = gpush("list", "--json", "--limit", "2", "--cursor", cursor)
    assert rest.code == 0, rest.err
    assert len(rest.json["jobs"]) == 1


def test_the_sdk_names_the_value_it_cannot_send(sdk):
    client = sdk()
    with pytest.raises(InvalidRequest, match=r"user '\\xff' is not UTF-8"):
        client.list(user=NOT_UTF8)
    with pytest.raises(InvalidRequest, match="label is 100,00[0-9] characters long"):
        client.list(labels={"team": "x" * 100_000})
