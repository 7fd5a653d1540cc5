"""GPU-equivalent seconds as a Prometheus counter: the usage ledger (broker.accounting.usage)
read at each scrape, so /metrics, ``gpush usage`` and the dashboard count the same seconds."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from broker.accounting.usage import UsageLedger
from broker.core.clock import utcnow
from broker.core.db import session_factory

log = logging.getLogger("gpush.metrics")


class GpuSeconds(Collector):
    """``gpush_gpu_equivalent_seconds_total``: GPU-equivalent seconds by tenant, cluster and
    sharing mode, from the job events (broker.accounting.usage: a MIG slice counts its
    fraction of the GPU, an MPS share its percentage, a time-sliced job its memory
    budget's fraction, whole GPUs whole), running jobs up to the scrape. Each process
    reads the history once (100,000 events a scrape at most, so a scrape stays short),
    then only the events appended since its last scrape."""

    def __init__(self, engine: Engine):
        self._sessions = session_factory(engine)
        self._ledger = UsageLedger()
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        counter = CounterMetricFamily(
            "gpush_gpu_equivalent_seconds",
            "GPU-equivalent seconds used by jobs, by tenant, cluster and sharing mode (from the job events).",
            labels=["tenant", "cluster", "sharing"],
        )
        try:
            with self._lock, self._sessions() as session:
                # At most 5 pages of 20,000 events a scrape: on a long history the first
                # scrapes stay short and the counter catches up over a few of them.
                totals = self._ledger.update(session, utcnow(), max_pages=5)
        except SQLAlchemyError as exc:
            log.warning("metrics: GPU usage unavailable: %s", exc)
            return
        for labels, seconds in sorted(totals.items()):
            counter.add_metric(list(labels), seconds)
        yield counter
