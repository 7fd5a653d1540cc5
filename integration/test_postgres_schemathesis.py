"""The API against its own OpenAPI document (schemathesis), on PostgreSQL: the same tests
as tests/api/test_schemathesis.py (tests/api/openapi_conformance.py), each operation on a
fresh clone of the migrated template (integration/conftest.py swaps ``database_url``).
PostgreSQL refuses what SQLite stores (NUL in text, integers past 64 bits, dates past its
range), so some 500s show only here."""

from tests.api.openapi_conformance import (  # noqa: F401
    test_the_api_keeps_to_its_openapi_document,
    test_the_newer_operations_keep_to_it_over_more_examples,
    tokens,
)
