"""The API against its own OpenAPI document (schemathesis): for every operation,
generated requests, valid and invalid, sent with an admin's and a user's token, must
never get a 5xx, a status the operation does not declare, or a body or content type
unlike the declared one; a crash anywhere fails the test too.

Bounded so the whole file takes about a minute on two cores: a fixed number of
examples per operation, a deadline per example, no shrinking beyond Hypothesis'
default and no example database (each run is derandomized, so a failure repeats).
"""

from __future__ import annotations

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

# Crashes schemathesis found in code other engineers own (reported in issue 14), each
# tolerated only with its own message, so any other failure of the operation still
# fails. Delete an entry once its fix lands.
KNOWN_CRASHES: dict[str, str] = {}  # operation -> the error its known crash raises, until fixed

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_OPERATION = 15


@pytest.fixture
def tokens(make_token):
    return [make_token(user="root", tenant="ops", role="admin"), make_token(user="alice", tenant="ml")]


# The document does not depend on the database: read it from an app on none. Each test
# calls the ``app`` fixture's, on its own fresh database.
schema = schemathesis.openapi.from_dict(create_app(create_engine("sqlite://")).openapi())


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=2000,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
def test_the_api_keeps_to_its_openapi_document(case, app, tokens):
    for token in tokens:
        try:
            case.call_and_validate(app=app, headers={"Authorization": f"Bearer {token}"}, checks=CHECKS)
        except Exception as exc:
            known = KNOWN_CRASHES.get(case.operation.label)
            if known is None or known not in str(exc):
                raise
