"""The API against its own OpenAPI document (schemathesis), on SQLite; the tests and the
list of operations with their examples are in tests/api/openapi_conformance.py, shared
with the PostgreSQL run (integration/test_postgres_schemathesis.py)."""

from tests.api.openapi_conformance import (  # noqa: F401
    test_a_route_added_without_examples_fails_the_coverage_check,
    test_every_operation_of_the_document_is_in_the_run,
    test_the_api_keeps_to_its_openapi_document,
    test_the_newer_operations_keep_to_it_over_more_examples,
    tokens,
)
