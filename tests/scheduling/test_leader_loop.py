"""The scheduling loop: it outlives a database that stops answering, and a wake-up cuts
its pause short."""

from __future__ import annotations

import threading
import time

from sqlalchemy.exc import OperationalError

from broker.scheduling import leader
from broker.scheduling.leader import Wakeup, run_scheduler_loop


class CountingScheduler:
    def __init__(self, stop: threading.Event, cycles: int):
        self.cycles, self.stop, self.want = 0, stop, cycles

    def run_cycle(self):
        self.cycles += 1
        if self.cycles >= self.want:
            self.stop.set()

        class Report:
            placed = submitted = held = waiting = synced = failed = recovered = 0
            errors: list[str] = []

        return Report()


def test_the_loop_outlives_a_database_that_does_not_answer(engine, monkeypatch):
    calls = []
    real = leader.Leadership.try_acquire

    def flaky(self):
        calls.append(1)
        if len(calls) <= 2:  # a PostgreSQL restart: the first tries cannot connect
            raise OperationalError("SELECT 1", {}, Exception("connection refused"))
        return real(self)

    monkeypatch.setattr(leader.Leadership, "try_acquire", flaky)
    stop = threading.Event()
    scheduler = CountingScheduler(stop, cycles=2)
    thread = threading.Thread(
        target=run_scheduler_loop, args=(engine, lambda: scheduler, stop), kwargs={"interval": 0.01}
    )
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and scheduler.cycles == 2 and len(calls) >= 3


def test_a_wakeup_ends_the_pause_and_one_that_comes_late_is_kept():
    wakeup = Wakeup()
    begin = time.monotonic()
    threading.Timer(0.1, wakeup.set).start()
    assert wakeup.wait(30) and time.monotonic() - begin < 10
    assert not wakeup.wait(0)  # consumed
    wakeup.set()  # set while nobody waits: the next wait returns at once
    assert wakeup.wait(0)
