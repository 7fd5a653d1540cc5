"""The API against its own OpenAPI document (schemathesis), shared by the SQLite run
(tests/api/test_schemathesis.py) and the PostgreSQL run
(integration/test_postgres_schemathesis.py): the same tests, on whichever database the
``database_url`` fixture gives.

For every operation, generated requests, valid and invalid, sent with an admin's and a
user's token, must never get a 5xx, a status the operation does not declare, or a body or
content type unlike the declared one; a crash anywhere fails the test too.

Every operation of the document is named below with the number of examples it gets, or
in NOT_IN_THE_RUN with the reason; a route added without that decision fails
``test_every_operation_of_the_document_is_in_the_run``. Bounded so the SQLite run takes
about a minute on two cores: a fixed number of examples per operation, a deadline per
example, no example database (each run is derandomized, so a failure repeats).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import create_engine

from broker.api.app import create_app

# Crashes schemathesis found in code other engineers own, each tolerated only with its own
# message, so any other failure of the operation still fails. Delete an entry once its fix
# lands.
# operation -> the error its known crash raises, until fixed
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# The operations of the first round (issue 14) and the small ones added next to them since
# (jobs:count, checkpoint, revoke, occupancy), each run with the same derandomized examples
# every time: 12 each keeps the SQLite run near a minute on two cores.
USUAL = frozenset(
    {
        "GET /healthz",
        "GET /readyz",
        "GET /metrics",
        "GET /v1/whoami",
        "GET /v1/admin/tokens",
        "POST /v1/admin/tokens",
        "POST /v1/admin/tokens/{token_id}/revoke",
        "POST /v1/jobs",
        "GET /v1/jobs",
        "POST /v1/jobs:batch",
        "GET /v1/jobs:count",
        "GET /v1/jobs/{job_id}",
        "GET /v1/jobs/{job_id}/events",
        "POST /v1/jobs/{job_id}/cancel",
        "POST /v1/jobs/{job_id}/checkpoint",
        "POST /v1/jobs/{job_id}/scale",
        "GET /v1/clusters",
        "POST /v1/clusters",
        "POST /v1/clusters/{name}/timeslice",
        "DELETE /v1/clusters/{name}",
        "POST /v1/agent/reports",
        "GET /v1/inventory",
        "GET /v1/inventory/occupancy",
        "GET /v1/inventory/drift",
        "GET /v1/nodes/{node}/gres-conf",
        "GET /v1/mig/plan",
        "GET /v1/policy/schema",
        "POST /v1/policy:validate",
        "POST /v1/policy",
        "GET /v1/policy",
        "POST /v1/policy:rollback",
        "GET /v1/policy/history",
        "GET /v1/policy/diff",
        "POST /v1/policy:explain",
    }
)
EXAMPLES_USUAL = 12

# Logs, MIG changes, lending, usage, events and tenants: added or reworked after the first
# round, with more inputs to get wrong, so they get more examples (issue 32 finding 8).
MORE = frozenset(
    {
        "GET /v1/jobs/{job_id}/logs",
        "POST /v1/mig/changes",
        "GET /v1/mig/changes",
        "GET /v1/mig/changes/{change_id}",
        "POST /v1/mig/changes/{change_id}:clear",
        "GET /v1/lending/moves",
        "GET /v1/usage",
        "GET /v1/events",
        "PUT /v1/tenants/{name}",
        "GET /v1/tenants",
        "GET /v1/clusters/{name}/tenant-quotas",
    }
)
EXAMPLES_MORE = 40

NOT_IN_THE_RUN: dict[str, str] = {}  # operation -> why schemathesis does not exercise it


@pytest.fixture
def tokens(make_token):
    return [make_token(user="root", tenant="ops", role="admin"), make_token(user="alice", tenant="ml")]


# The document does not depend on the database: read it from an app on none. Each test
# calls the ``app`` fixture's, on its own fresh database.
schema = schemathesis.openapi.from_dict(create_app(create_engine("sqlite://")).openapi())


def _one_of(labels: frozenset[str]) -> Callable:
    def matches(ctx) -> bool:
        return ctx.operation.label in labels

    return matches


RUN = [(schema.include(_one_of(USUAL)), EXAMPLES_USUAL), (schema.include(_one_of(MORE)), EXAMPLES_MORE)]


def conformance_test(part, examples: int) -> Callable:
    """The schemathesis test of ``part``'s operations, ``examples`` examples each."""

    @part.parametrize()
    @settings(
        max_examples=examples,
        deadline=2000,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    def test(case, app, tokens):
        for token in tokens:
            case.call_and_validate(app=app, headers={"Authorization": f"Bearer {token}"}, checks=CHECKS)

    return test


test_the_api_keeps_to_its_openapi_document = conformance_test(*RUN[0])
test_the_newer_operations_keep_to_it_over_more_examples = conformance_test(*RUN[1])


def operations_of(app) -> set[str]:
    """``METHOD /path`` of every operation in the app's OpenAPI document."""
    methods = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
    return {
        f"{method.upper()} {path}"
        for path, item in app.openapi()["paths"].items()
        for method in item
        if method in methods
    }


def what_the_run_misses(app) -> list[str]:
    """Why the run does not cover ``app``'s document exactly: an operation in no list, one in
    two, or a listed one the document lacks (a renamed route). Empty when it does."""
    listed = [*USUAL, *MORE, *NOT_IN_THE_RUN]
    run = [result.ok().label for part, _examples in RUN for result in part.get_all_operations()]
    document = operations_of(app)
    problems = [
        f"{label} is in no list of tests/api/openapi_conformance.py: give it examples "
        "(USUAL or MORE) or say in NOT_IN_THE_RUN why schemathesis leaves it out"
        for label in sorted(document - set(listed))
    ]
    problems += [f"{label} is listed twice" for label in sorted({x for x in listed if listed.count(x) > 1})]
    problems += [f"{label} is listed but not in the document" for label in sorted(set(listed) - document)]
    problems += [
        f"{label} is listed for examples but schemathesis does not run it"
        for label in sorted((document & (USUAL | MORE)) - set(run))
    ]
    return problems


# (pytest rewrites no assert outside test modules: each says what it found itself.)
def test_every_operation_of_the_document_is_in_the_run(app):
    problems = what_the_run_misses(app)
    assert not problems, "\n".join(problems)


def test_a_route_added_without_examples_fails_the_coverage_check(app):
    @app.get("/v1/not-in-the-run")
    def not_in_the_run() -> dict:
        return {}

    app.openapi_schema = None  # FastAPI caches the document; the route must show in it

    problems = what_the_run_misses(app)
    assert problems == [
        "GET /v1/not-in-the-run is in no list of tests/api/openapi_conformance.py: give it examples "
        "(USUAL or MORE) or say in NOT_IN_THE_RUN why schemathesis leaves it out"
    ], problems
