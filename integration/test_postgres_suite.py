"""The API and state tests of tests/, run against the real PostgreSQL.

The tests are the same functions; integration/conftest.py swaps the database
under them (a fresh clone of a migrated template per test).
"""

from tests.api.test_api import *  # noqa: F401,F403
from tests.core.test_states import *  # noqa: F401,F403
from tests.scheduling.conftest import fleet  # noqa: F401 - the scheduling tests' fixture
from tests.scheduling.test_cycle import *  # noqa: F401,F403
from tests.scheduling.test_preemption import *  # noqa: F401,F403
from tests.scheduling.test_reservations_live import *  # noqa: F401,F403
