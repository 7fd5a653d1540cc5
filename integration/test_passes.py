"""make test-integration's passes: which tests are Slurm tests (integration/conftest.py),
played on a small test file in a pytest run of its own."""

from __future__ import annotations

import pytest

pytest_plugins = ("pytester",)

CONFTEST = """
from integration.conftest import (
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_protocol,
    slurm_chroots,
    slurm_cluster,
    slurm_site,
)
"""

TESTS = """
import pytest

from integration.slurm.cluster import start


@pytest.fixture
def on_slurm(slurm_cluster):
    return slurm_cluster


def test_through_a_fixture(on_slurm):
    pass


def test_on_the_site(slurm_site):
    pass


@pytest.mark.slurm
def test_marked_by_hand():
    pass


def test_plain():
    pass


def test_starts_a_cluster_of_its_own(tmp_path):
    start(tmp_path)
"""


@pytest.fixture
def sample(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_sample=TESTS)
    return pytester


def test_a_test_that_uses_a_slurm_fixture_through_another_is_a_slurm_test(sample) -> None:
    result = sample.runpytest("-m", "slurm", "--collect-only", "-q")
    selected = {line.split("::")[-1] for line in result.stdout.lines if "::" in line}
    assert selected == {"test_through_a_fixture", "test_on_the_site", "test_marked_by_hand"}
    result = sample.runpytest("-m", "not slurm", "--collect-only", "-q")
    selected = {line.split("::")[-1] for line in result.stdout.lines if "::" in line}
    assert selected == {"test_plain", "test_starts_a_cluster_of_its_own"}


def test_a_test_not_marked_slurm_that_starts_a_cluster_fails_saying_so(sample) -> None:
    result = sample.runpytest("-k", "starts_a_cluster_of_its_own")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_sample.py::test_starts_a_cluster_of_its_own starts a Slurm test cluster*"])
    assert "mark the test @pytest.mark.slurm" in result.stdout.str()
