"""Ray jobs on a Ray cluster whose workers come from gpush: submit one and follow it to its end.

``gpush submit --ray ADDRESS -- python app.py`` and :func:`run_ray_job` hand the
entrypoint to the head's job server (Ray's ``JobSubmissionClient``, the dashboard
address, ``http://head:8265``); the tasks it starts make the head's autoscaler ask
gpush for workers (broker.ray.provider), so the job's GPUs come through gpush's queue,
policy and quotas. What callers may assume:

- **Followed to its end.** Logs are printed as they come; the call returns Ray's final
  status (``SUCCEEDED``, ``FAILED``, ``STOPPED``).
- **Retry-safe.** With a ``submission_id``, a second call for the same id follows the
  job the first one submitted instead of starting another.

Ray is imported here only, when called.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")


def run_ray_job(
    address: str,
    entrypoint: str,
    *,
    runtime_env: dict[str, Any] | None = None,
    submission_id: str | None = None,
    write: Callable[[str], None] = print,
    poll: float = 1.0,
    timeout: float | None = None,
) -> str:
    """Submit ``entrypoint`` to the Ray cluster at ``address`` (its dashboard URL) and
    follow it; returns the final status."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise RuntimeError("Ray jobs need Ray: pip install 'gpush[ray]'") from None

    client = JobSubmissionClient(address)
    known = {job.submission_id for job in client.list_jobs()} if submission_id else set()
    if submission_id not in known:
        submission_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id)
    printed = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = str(client.get_job_status(submission_id).value)
        logs = client.get_job_logs(submission_id)
        if len(logs) > printed:
            write(logs[printed:].rstrip("\n"))
            printed = len(logs)
        if status in TERMINAL_STATUSES:
            return status
        if deadline is not None and time.monotonic() > deadline:
            client.stop_job(submission_id)
            raise TimeoutError(f"Ray job {submission_id} still {status} after {timeout:g} s: stopped it")
        time.sleep(poll)
