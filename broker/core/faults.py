"""Crash points a test arms through the environment, so a crash test kills a real process.

``GPUSH_FAULT=<point>`` makes the process that reaches ``reach(point)`` kill itself with
SIGKILL there: no ``finally``, no rollback, no flush, as a machine that loses power or an
OOM killer would leave it. Unset (always, outside tests) a point costs one dictionary
lookup. The points:

- ``submitted-before-record``: the scheduler's submission has the clusters' answers (sbatch
  returned a job id) and has not yet written them to the database
  (``broker/scheduling/submission.py``).
"""

from __future__ import annotations

import os
import signal

ENV = "GPUSH_FAULT"
POINTS = frozenset({"submitted-before-record"})


def reach(point: str) -> None:
    """Die here, by SIGKILL, if ``GPUSH_FAULT`` names ``point``."""
    if os.environ.get(ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)
