"""The command line as people type it: a broker URL without its scheme, a submit line
click would read another way than its author meant, and errors that all read alike."""

from __future__ import annotations

import pytest

from broker.cli.main import broker_url

# -- --url ---------------------------------------------------------------------------


def test_a_url_without_a_scheme_is_http_and_an_empty_one_is_unset():
    assert broker_url("127.0.0.1:8642") == "http://127.0.0.1:8642"
    assert broker_url("broker.example:8642") == "http://broker.example:8642"
    assert broker_url("[::1]:8642") == "http://[::1]:8642"
    assert broker_url("https://broker.example/gpush") == "https://broker.example/gpush"
    assert broker_url("") is None and broker_url(None) is None


def test_host_and_port_alone_reach_the_broker_over_http(gpush):
    # Nothing listens on port 9: the error is about reaching it, not about the URL's form.
    result = gpush("--url", "127.0.0.1:9", "whoami")
    assert result.code == 1
    assert "cannot reach the gpush broker at http://127.0.0.1:9" in result.err
    assert "missing an 'http://'" not in result.err


@pytest.mark.parametrize("url", ["ftp://broker:8642", "http://:8642", "broker:99999", "broker:port", "http://b/?x=1"])
def test_a_url_that_is_no_broker_url_is_refused_naming_the_form(gpush, url):
    result = gpush("--url", url, "whoami")
    assert result.code == 2
    assert "is not a broker URL: write http://HOST:PORT" in result.err and "HOST:PORT alone means http://" in result.err


# -- errors read alike ---------------------------------------------------------------


def test_cancel_of_a_missing_job_says_gpush_error_as_every_other_error(gpush):
    cancelled = gpush("cancel", "999")
    assert cancelled.code == 3
    assert cancelled.err.startswith("gpush: error: no job 999")
    assert gpush("status", "999").err.startswith("gpush: error: ")


# -- gpush submit: lines click would read otherwise -------------------------------------


def test_a_unit_after_the_time_limit_is_refused_with_the_fix(gpush):
    result = gpush("submit", "--kind", "training", "--time-limit", "2", "hours", "--", "python", "x.py")
    assert result.code == 2
    assert "--time-limit 2 hours" in result.err and "Write --time-limit 2h" in result.err
    assert "gpush submit --kind training --time-limit 2h -- python x.py" in result.err
    # Nothing was queued: the next job is the first.
    assert gpush("submit", "--kind", "training", "--time-limit", "2h", "--", "python", "x.py").out.strip() == "1"
    job = gpush("status", "1", "--json").json
    assert job["spec"]["time_limit"] == "02:00:00" and job["spec"]["command"] == ["python", "x.py"]


@pytest.mark.parametrize(
    ("typed", "fix"),
    [
        (["-t", "90", "minutes"], "-t 90m"),
        (["--time-limit=1.5", "hours"], "--time-limit=90m"),
        (["-t2", "d"], "-t2d"),
        (["--memory", "16", "GB"], "--memory 16G"),
        (["--mem", "512", "Mi"], "--mem 512M"),
        (["--gpu-memory-gb", "8", "GB"], "--gpu-memory-gb 8"),
    ],
)
def test_a_number_and_its_unit_as_two_words_is_refused_with_the_one_word_form(gpush, typed, fix):
    result = gpush("submit", "--kind", "inference", "--gpu-memory-gb", "4", *typed, "python", "serve.py")
    assert result.code == 2, result.out
    assert f"Write {fix}" in result.err


def test_a_unit_after_another_option_is_refused_too(gpush):
    result = gpush("submit", "--kind", "training", "--gpus", "2", "hours", "--", "x")
    assert result.code == 2 and "--gpus takes one word, so 'hours' would start the command" in result.err


def test_a_command_given_both_before_and_after_the_separator_is_refused(gpush):
    result = gpush("submit", "--kind", "training", "python", "train.py", "--", "--lr", "3")
    assert result.code == 2
    assert "the command is given both before and after --" in result.err
    assert "gpush submit [OPTIONS] -- python train.py" in result.err


@pytest.mark.parametrize(
    ("typed", "command"),
    [
        # The command's own --, after gpush's.
        (["--", "python", "train.py", "--", "--lr", "3"], ["python", "train.py", "--", "--lr", "3"]),
        # No separator: the command starts at its first word.
        (["python", "train.py", "--lr", "3"], ["python", "train.py", "--lr", "3"]),
        # The user said so: the command is `hours`.
        (["--time-limit", "2", "--", "hours"], ["hours"]),
    ],
)
def test_a_line_that_says_where_the_command_starts_is_taken(gpush, typed, command):
    result = gpush("submit", "--kind", "training", *typed)
    assert result.code == 0, result.err
    assert gpush("status", result.out.strip(), "--json").json["spec"]["command"] == command
