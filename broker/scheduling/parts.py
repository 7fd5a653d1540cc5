"""The scheduling cycle's collaborators, built in one place and handed to the cycle.

:func:`cycle_parts` builds each step's collaborator and hands it only what it needs: the
database sessions, the clock, the adapters of the clusters enabled this cycle
(:class:`CycleClusters`), the parsed specs (:class:`SpecCache`). None of them creates
another, and none knows the :class:`broker.scheduling.cycle.Scheduler` that calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from broker.core.adapter import ClusterAdapter, Unreachable
from broker.core.clock import Clock
from broker.core.clusters import AdapterPool, ClusterInfo
from broker.core.schemas import JobSpec
from broker.fleet.lending import NodeLending
from broker.fleet.mig_steps import Reconfigurations
from broker.inventory.report_store import DriftWatch, load_reports, reconciled
from broker.inventory.view import Finding
from broker.scheduling.claim import Candidate
from broker.scheduling.preemption import Preemptions
from broker.scheduling.sync import StatusSync

# Parsed job specs a scheduler keeps (a few MB).
_SPECS_KEPT = 4096


class CycleClusters:
    """The clusters enabled this cycle (set at its start) and their adapters, from the pool."""

    def __init__(self, pool: AdapterPool, clock: Clock):
        self.pool = pool
        self.clock = clock
        self.enabled: dict[str, ClusterInfo] = {}

    def of(self, info: ClusterInfo) -> ClusterAdapter:
        return self.pool.get(info)

    def named(self, name: str) -> ClusterAdapter:
        info = self.enabled.get(name)
        if info is None:
            raise Unreachable(f"cluster {name} is not registered or is disabled")
        return self.of(info)

    def findings_on(self, session: Session, cluster: str, node: str) -> list[Finding]:
        """The inventory's findings on ``node`` now (a MIG change's drift check)."""
        info = self.enabled.get(cluster)
        if info is None:
            return []
        reports = load_reports(session)
        inventory = reconciled({cluster: info}, reports, self.pool, now=self.clock())
        return [f for f in inventory.findings if f.node == node]


@dataclass
class SpecCache:
    """Parsed specs by their fingerprint (jobs.spec_hash: the spec without its idempotency
    key). Queues are full of copies of one spec (arrays, sweeps, retries), and validating a
    stored spec again costs more than deciding it."""

    kept: int = _SPECS_KEPT
    _specs: dict[str, JobSpec] = field(default_factory=dict)

    def parse(self, spec_hash: str, document: str | dict) -> JobSpec:
        """A stored spec parsed (its JSON text, or the dict the database gave), once per fingerprint."""
        spec = self._specs.get(spec_hash)
        if spec is None:
            if isinstance(document, str):
                spec = JobSpec.model_validate_json(document)
            else:
                spec = JobSpec.model_validate(document)
            if len(self._specs) >= self.kept:
                self._specs.clear()
            self._specs[spec_hash] = spec
        return spec

    def of(self, job: Candidate) -> JobSpec:
        """A claimed job's spec, with its own idempotency key."""
        spec = self.parse(job.spec_hash, job.document)
        if spec.idempotency_key != job.idempotency_key:
            spec = spec.model_copy(update={"idempotency_key": job.idempotency_key})
        return spec


@dataclass
class CycleParts:
    """What each step of the cycle calls (the step numbers of
    :class:`broker.scheduling.cycle.Scheduler`)."""

    clusters: CycleClusters
    specs: SpecCache
    reconfigurations: Reconfigurations  # 1: MIG layout changes moved on; the nodes they fence
    status_sync: StatusSync  # 2: status changes read, then written beside steps 3 to 7
    preemptions: Preemptions  # 3: victims told and stopped; 8: victims chosen
    drift: DriftWatch  # 4: units that drift findings break, never placed on
    node_lending: NodeLending  # 9: nodes lent between two clusters as their queues call for it


def cycle_parts(sessions: Callable[[], Session], pool: AdapterPool, clock: Clock) -> CycleParts:
    """The collaborators of a scheduler over ``pool``, each handed what it needs."""
    clusters = CycleClusters(pool, clock)
    specs = SpecCache()
    return CycleParts(
        clusters=clusters,
        specs=specs,
        reconfigurations=Reconfigurations(sessions, clock, clusters.named, findings_of=clusters.findings_on),
        status_sync=StatusSync(sessions, clock, clusters.of),
        preemptions=Preemptions(sessions, clock, clusters.of, specs.parse),
        drift=DriftWatch(),
        node_lending=NodeLending(sessions, clock, clusters.named),
    )
