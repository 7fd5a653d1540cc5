"""Which pytest-xdist ``--dist`` modes the suites run under: ``load`` (the default, what
``make test`` uses) or none.

schemathesis makes one test per API operation, all under one node id
(tests/api/openapi_conformance.py, run by tests/ and integration/ alike). ``--dist loadfile``,
``loadscope`` and ``loadgroup`` file their work by node id: they run one test of each such
id and drop the others without a word (measured: 2 of the 45 schemathesis tests of
integration/, the run still green). ``load`` hands tests out by their place in the collection
and runs every one.

Loaded by the root conftest.py.
"""

from __future__ import annotations

import pytest

RUNS_EVERY_TEST = ("no", "load")


def pytest_configure(config: pytest.Config) -> None:
    dist = getattr(config.option, "dist", "no")
    if dist not in RUNS_EVERY_TEST:
        raise pytest.UsageError(
            f"--dist {dist} files tests by node id, and the schemathesis tests share one per operation: "
            "it would run one of each and drop the rest (tests/dist.py). Use -n N alone (--dist load)."
        )
