"""Leader election on the real PostgreSQL: one scheduler at a time, and a dead leader is replaced."""

from __future__ import annotations

import time

from broker.scheduling.leader import Leadership


def test_one_leader_and_takeover_when_it_dies(engine):
    leader, standby = Leadership(engine), Leadership(engine)
    assert leader.try_acquire() is True
    assert standby.try_acquire() is False
    # The leader's process dies: PostgreSQL drops its connection, and the lock with it.
    leader._conn.invalidate()
    leader._conn = None
    # PostgreSQL ends the dead session's backend, and frees its lock, a moment after the
    # connection closes (later on a loaded machine): the standby takes over at a later try.
    deadline = time.monotonic() + 10
    while not standby.try_acquire():
        assert time.monotonic() < deadline, "the standby never took over"
        time.sleep(0.05)
    assert standby.still_held() is True
    assert Leadership(engine).try_acquire() is False
    standby.release()


def test_a_leader_that_lost_its_connection_knows_it(engine):
    leader = Leadership(engine)
    assert leader.try_acquire()
    leader._conn.connection.dbapi_connection.close()  # the database went away under it
    assert leader.still_held() is False
    leader.release()
