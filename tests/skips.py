"""What a skip means in CI: under ``GPUSH_CI=1`` (the Makefile's test targets set it) a test
that skips fails, unless it is marked ``@pytest.mark.may_skip("why")``.

A skip in CI is a test nobody ran that reads as green: a missing trace, a module that does not
import, a service that is not there. Only a condition of the machine the test cannot bring
about (a working NVML where the test needs none, a real cluster where only the test server can
force the case) may skip, and the marker says which. A skip while collecting a module
(``pytest.importorskip`` at module level) fails too; there is no marker for it.

Loaded by the root conftest.py, so tests/ and integration/ alike; every run's closing note
counts the skips.
"""

from __future__ import annotations

import os

import pytest

CI_ENV = "GPUSH_CI"
MARKER = "may_skip"


def in_ci() -> bool:
    return os.environ.get(CI_ENV) == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(reason): this test may skip under {CI_ENV}=1; the reason names the machine's condition",
    )


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if not (in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return report
    marker = item.get_closest_marker(MARKER)
    if marker is not None:
        if not (marker.args and isinstance(marker.args[0], str) and marker.args[0].strip()):
            report.outcome = "failed"
            report.longrepr = f"@pytest.mark.{MARKER} needs a reason: the condition of the machine that lets it skip"
        return report
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under {CI_ENV}=1, which counts a skip as a failure ({_skip_reason(report)}). "
        f"Make the test run here, or mark it @pytest.mark.{MARKER}(reason) if only another machine can run it."
    )
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    report = yield
    if in_ci() and report.skipped:
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skipped while collecting under {CI_ENV}=1, which counts a skip as a "
            f"failure ({_skip_reason(report)}): import what the tests need plainly and declare it in "
            "pyproject.toml's test extras."
        )
    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    skipped = len(terminalreporter.stats.get("skipped", []))
    where = f"{CI_ENV}=1: a skip of a test not marked {MARKER} fails" if in_ci() else f"{CI_ENV} not set"
    terminalreporter.write_line(f"gpush: {skipped} skipped ({where})")
