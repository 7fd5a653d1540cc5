"""The hostile numbers and dates of tests/api/test_hostile_numbers.py against the real
PostgreSQL, whose INTEGER is 32-bit where SQLite's is 64 (integration/conftest.py swaps
the database under the same tests and cases)."""

from tests.api.test_hostile_numbers import *  # noqa: F401,F403
