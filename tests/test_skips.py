"""Under GPUSH_CI=1 a skip is a failure unless the test is marked may_skip (tests/skips.py),
played on small test files in a pytest run of their own."""

from __future__ import annotations

import pytest

pytest_plugins = ("pytester",)

TESTS = """
import pytest

def test_runs():
    pass

def test_skips_itself():
    pytest.skip("the trace is not on this machine")

@pytest.mark.skipif(True, reason="GPUSH_SLURM_SUITES=none")
def test_skipped_by_a_marker():
    pass

@pytest.mark.may_skip("a machine with a working NVML")
def test_may_skip():
    pytest.skip("this machine has a working NVML")

@pytest.mark.may_skip("a machine with a working NVML")
def test_may_skip_but_runs():
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_to_fail():
    assert False

@pytest.fixture
def service():
    pytest.skip("PostgreSQL does not answer")

def test_needs_a_service(service):
    pass
"""


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: bool, source: str = TESTS, *args: str):
    if ci:
        monkeypatch.setenv("GPUSH_CI", "1")
    else:
        monkeypatch.delenv("GPUSH_CI", raising=False)
    pytester.makepyfile(test_sample=source)
    return pytester.runpytest("-p", "tests.skips", "--strict-markers", "-rA", *args)


# make test runs the suites on pytest-xdist's workers too, whose reports the main process counts.
@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one process", "two workers"])
def test_in_ci_every_skip_of_an_unmarked_test_fails_and_the_note_counts_the_rest(
    pytester, monkeypatch, workers
) -> None:
    result = run(pytester, monkeypatch, True, TESTS, *workers)
    result.assert_outcomes(passed=2, failed=1, errors=2, skipped=1, xfailed=1)  # setup-time skips: errors
    text = result.stdout.str()
    # A skip in the test's body fails its call; one at setup (a skipif marker, a fixture) errors its setup.
    assert "FAILED test_sample.py::test_skips_itself" in text
    assert "ERROR test_sample.py::test_skipped_by_a_marker" in text
    assert "ERROR test_sample.py::test_needs_a_service" in text
    assert "SKIPPED [1] test_sample.py" in text and "working NVML" in text
    assert "skipped under GPUSH_CI=1" in text and "the trace is not on this machine" in text
    assert "mark it @pytest.mark.may_skip(reason)" in text
    assert "gpush: 1 skipped (GPUSH_CI=1" in text
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_outside_ci_a_skip_stays_a_skip_and_the_note_counts_them(pytester, monkeypatch) -> None:
    result = run(pytester, monkeypatch, ci=False)
    result.assert_outcomes(passed=2, skipped=4, xfailed=1)
    assert "gpush: 4 skipped (GPUSH_CI not set)" in result.stdout.str()
    assert result.ret == pytest.ExitCode.OK


def test_in_ci_a_module_that_skips_while_collecting_fails(pytester, monkeypatch) -> None:
    source = 'import pytest\n\npytest.importorskip("gpush_no_such_module")\n\ndef test_never():\n    pass\n'
    result = run(pytester, monkeypatch, ci=True, source=source)
    text = result.stdout.str()
    assert "skipped while collecting under GPUSH_CI=1" in text and "gpush_no_such_module" in text
    assert result.ret == pytest.ExitCode.INTERRUPTED  # errors during collection
    assert "gpush: 0 skipped" in text


def test_may_skip_without_a_reason_is_refused_in_ci(pytester, monkeypatch) -> None:
    source = 'import pytest\n\n@pytest.mark.may_skip\ndef test_vague():\n    pytest.skip("why not")\n'
    result = run(pytester, monkeypatch, ci=True, source=source)
    result.assert_outcomes(failed=1)
    assert "may_skip needs a reason" in result.stdout.str()
