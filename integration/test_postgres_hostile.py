"""The hostile names of tests/api/test_hostile_names.py, run against the real PostgreSQL.

The same test functions and the same ``CASES``: integration/conftest.py swaps the
database under them. PostgreSQL is where these failed as 500s (a NUL in any text, a
name longer than its varchar), so this is the run that matters.
"""

from tests.api.test_hostile_names import *  # noqa: F401,F403
