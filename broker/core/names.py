"""The job vocabulary's names: kinds, isolation classes and job states, as plain enums.

They live apart from the models that use them (broker.core.schemas, pydantic) and the
state machine (broker.core.states, SQLAlchemy) so that what only needs the names, such
as the command line's option choices, imports neither: `gpush --help` starts fast.
broker.core.schemas and broker.core.states re-export them; import from there.
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"
    BATCH = "batch"


class Isolation(StrEnum):
    """How much a job must be kept apart from others on a GPU (DESIGN.md, "The job")."""

    EXCLUSIVE = "exclusive"  # whole GPUs
    HARDWARE = "hardware"  # MIG: memory and fault isolation
    PROCESS = "process"  # MPS: shared memory, low interference
    NONE = "none"  # time-slicing: no memory isolation


class JobState(StrEnum):
    QUEUED = "queued"
    HELD = "held"
    ROUTED = "routed"
    SUBMITTING = "submitting"
    SUBMITTED = "submitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REQUEUED = "requeued"
