"""pytest-xdist's --dist modes that would drop tests sharing a node id are refused (tests/dist.py)."""

from __future__ import annotations

import pytest

pytest_plugins = ("pytester",)

# Two tests under one node id, as schemathesis makes them (one per API operation).
CONFTEST = """
import pytest


class Twice(pytest.Item):
    def runtest(self):
        pass


def pytest_collect_file(file_path, parent):
    if file_path.name == "test_sample.py":
        return Pair.from_parent(parent, path=file_path)


class Pair(pytest.File):
    def collect(self):
        yield Twice.from_parent(self, name="test_op")
        yield Twice.from_parent(self, name="test_op")
"""


@pytest.fixture
def sample(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_sample="")
    return pytester


@pytest.mark.parametrize("dist", ["loadfile", "loadscope", "loadgroup"])
def test_a_dist_mode_that_files_tests_by_node_id_is_refused(sample, dist) -> None:
    result = sample.runpytest("-p", "tests.dist", "-n", "2", "--dist", dist)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"--dist {dist} files tests by node id" in result.stderr.str()


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one process", "two workers"])
def test_load_runs_both_tests_of_one_node_id(sample, workers) -> None:
    result = sample.runpytest("-p", "tests.dist", *workers)
    result.assert_outcomes(passed=2)
