"""What the integration tests' embedded brokers share: submitting a job as an admin and
reading it back, on the test's database (each test module adds its own cluster and
scheduler around it)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from broker.core.auth import Principal
from broker.core.models import Job
from broker.core.schemas import JobSpec, Role
from broker.intake import queue

ADMIN = Principal(user="root", tenant="ops", role=Role.ADMIN)


class QueueAccess:
    """Mixin: ``sessions`` (a session factory) and optionally ``clock`` and ``job_defaults``."""

    sessions: Callable[..., Any]
    job_defaults: dict[str, Any] = {}

    def clock(self) -> datetime:
        return datetime.now(UTC)

    def submit(self, tenant: str = "ml", **fields: Any) -> int:
        """Submit one job for ``tenant`` (user alice), as an admin; its id."""
        spec = JobSpec.model_validate({"tenant": tenant, "user": "alice", **self.job_defaults, **fields})
        with self.sessions() as session, session.begin():
            (result,) = queue.submit_jobs(session, [spec], ADMIN, now=self.clock())
        return result.job["id"]

    def job(self, job_id: int) -> Job:
        with self.sessions() as session:
            return session.get(Job, job_id)
