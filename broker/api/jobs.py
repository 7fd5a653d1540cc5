"""The routes of jobs: submit (one or a batch), list, show, events, cancel and scale.

Submit and list answer with ``JSONBytes`` (job rows rendered by orjson), the hot
path; the query and header parsing that turns a bad value into a named
``InvalidRequest`` lives here too. A page of jobs holds at most ``GPUSH_MAX_PAGE`` jobs
and ``GPUSH_MAX_PAGE_BYTES`` bytes (broker.api.limits): past either it ends early,
with a ``next_cursor`` that goes on from there.
"""

from typing import Annotated

import orjson
from fastapi import APIRouter, Header, Query
from pydantic import BaseModel, Field, ValidationError

from broker.api.deps import Adapters, AppClock, Db, Limits, RowId, Wake, Who
from broker.api.limits import MAX_LABEL_FILTERS
from broker.api.responses import AUTH, BODY, JSONBytes, errors
from broker.core import clusters
from broker.core.errors import InvalidRequest, NotFound
from broker.core.models import Cluster
from broker.core.schemas import (
    Int,
    JobBatch,
    JobEventOut,
    JobOut,
    JobPage,
    JobSpec,
    Kind,
    Name,
    free_text,
    label_problem,
)
from broker.core.states import JobState
from broker.core.validation import describe_details, validation_details
from broker.intake import queue
from broker.scheduling import output, scaling
from broker.scheduling.leader import notify

router = APIRouter(tags=["jobs"], responses=errors(*AUTH))

LabelFilters = Annotated[
    list[str] | None,
    Query(description=f"KEY=VALUE, repeat for several (all must match); at most {MAX_LABEL_FILTERS}"),
]


class ScaleRequest(BaseModel):
    replicas: Int = Field(ge=1, le=10_000, description="the number of replicas the job should run")


class CancelResult(BaseModel):
    job: JobOut
    outcome: queue.CancelOutcome


class BatchItem(BaseModel):
    id: int
    state: JobState
    created: bool
    idempotency_key: str | None


class BatchResult(BaseModel):
    jobs: list[BatchItem]
    created: int


@router.post(
    "/v1/jobs",
    response_model=JobOut,
    status_code=201,
    response_class=JSONBytes,
    responses={
        200: {"model": JobOut, "description": "the idempotency key was seen with the same spec: the stored job"},
        **errors(403, 409, 507, *BODY),
    },
)
async def submit(
    spec: JobSpec,
    session: Db,
    who: Who,
    clock: AppClock,
    wake: Wake,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> JSONBytes:
    """Queue one job. A replay of its idempotency key returns the stored job with 200."""
    # The hot path runs on the event loop and blocks it for its one short
    # database statement, as a prefork sync worker would; concurrency comes from
    # --workers. Measured: the hand-off to the thread pool and back cost more
    # CPU than the insert (1.4 vs 1.1 ms a job at 8 clients on PostgreSQL).
    if idempotency_key is not None:
        spec = _with_header_key(spec, idempotency_key)
    with session.begin():
        (result,) = queue.submit_jobs(session, [spec], who, now=clock())
        if result.created:
            notify(session.connection())
    if result.created:
        wake.set()
    return JSONBytes(result.job, status_code=201 if result.created else 200)


@router.post(
    "/v1/jobs:batch",
    response_model=BatchResult,
    status_code=201,
    response_class=JSONBytes,
    responses=errors(403, 409, *BODY),
)
def submit_batch(batch: JobBatch, session: Db, who: Who, clock: AppClock, wake: Wake) -> JSONBytes:
    """Queue many jobs in one transaction: all of them, or none when one is refused."""
    with session.begin():
        results = queue.submit_jobs(session, batch.jobs, who, now=clock())
        created = sum(r.created for r in results)
        if created:
            notify(session.connection())
    if created:
        wake.set()
    items = [
        {
            "id": r.job["id"],
            "state": r.job["state"],
            "created": r.created,
            "idempotency_key": r.job["spec"].get("idempotency_key"),
        }
        for r in results
    ]
    return JSONBytes({"jobs": items, "created": created}, status_code=201 if created else 200)


@router.get("/v1/jobs", response_model=JobPage, response_class=JSONBytes, responses=errors(403, 422))
def list_jobs(
    session: Db,
    who: Who,
    limits: Limits,
    state: Annotated[list[str] | None, Query(description="repeat or comma-separate")] = None,
    tenant: Name | None = None,
    user: Name | None = None,
    kind: Kind | None = None,
    cluster: Annotated[Name | None, Query(description="only jobs placed on this cluster")] = None,
    label: LabelFilters = None,
    limit: Annotated[int, Query(ge=1, le=queue.MAX_PAGE)] = 50,
    cursor: str | None = None,
) -> JSONBytes:
    """Jobs newest first, one page at a time (``next_cursor`` until the last page). A
    page ends early at the broker's page limits; its ``next_cursor`` goes on from there."""
    states = _parse_states(state or [])
    labels = _parse_labels(label or [])
    with session.begin():
        jobs, next_cursor = queue.list_jobs(
            session,
            who,
            states=states,
            tenant=tenant,
            user=user,
            kind=kind,
            cluster=cluster,
            labels=labels,
            limit=min(limit, limits.max_page),
            cursor=cursor,
        )
        rows = [orjson.dumps(queue.job_row(j), option=orjson.OPT_UTC_Z) for j in jobs]
    kept, size = 0, len(b'{"jobs":[],"next_cursor":""}') + 64
    # The first job is always sent, or a page could never move past a large one.
    while kept < len(rows) and (kept == 0 or size + len(rows[kept]) + 1 <= limits.max_page_bytes):
        size += len(rows[kept]) + 1
        kept += 1
    if kept < len(rows):
        next_cursor = queue.encode_cursor(jobs[kept - 1].id)
    body = b'{"jobs":[' + b",".join(rows[:kept]) + b'],"next_cursor":' + orjson.dumps(next_cursor) + b"}"
    return JSONBytes(body)


class JobCounts(BaseModel):
    by_state: dict[JobState, int] = Field(description="jobs in each state (states with none left out)")
    total: int


@router.get("/v1/jobs:count", response_model=JobCounts, responses=errors(403, 422))
def count_jobs(
    session: Db,
    who: Who,
    tenant: Name | None = None,
    user: Name | None = None,
    kind: Kind | None = None,
    cluster: Name | None = None,
    label: LabelFilters = None,
) -> JobCounts:
    """How many jobs are in each state, under the filters of ``GET /v1/jobs`` (a user's
    token counts its own tenant's jobs only): the dashboard's queue tabs."""
    with session.begin():
        counts = queue.count_jobs(
            session, who, tenant=tenant, user=user, kind=kind, cluster=cluster, labels=_parse_labels(label or [])
        )
    return JobCounts(by_state=counts, total=sum(counts.values()))


@router.get("/v1/jobs/{job_id}", response_model=JobOut, response_class=JSONBytes, responses=errors(403, 404, 422))
def get_job(job_id: RowId, session: Db, who: Who) -> JSONBytes:
    with session.begin():
        return JSONBytes(queue.job_row(queue.get_job(session, job_id, who)))


@router.get("/v1/jobs/{job_id}/events", response_model=list[JobEventOut], responses=errors(403, 404, 422))
def job_events(job_id: RowId, session: Db, who: Who) -> list[JobEventOut]:
    """Every state change of the job, oldest first, with time, reason and actor."""
    with session.begin():
        events = queue.job_events(session, job_id, who)
        return [JobEventOut.model_validate(e, from_attributes=True) for e in events]


@router.post("/v1/jobs/{job_id}/cancel", response_model=CancelResult, responses=errors(403, 404, 409, 422))
def cancel(job_id: RowId, session: Db, who: Who, clock: AppClock, wake: Wake) -> CancelResult:
    """End a job that no cluster has yet, or record the intent for the adapter to act on."""
    with session.begin():
        job, outcome = queue.cancel_job(session, job_id, who, now=clock())
        result = CancelResult(job=JobOut.model_validate(queue.job_row(job)), outcome=outcome)
        if outcome == "cancel_requested":
            notify(session.connection())
    if outcome == "cancel_requested":
        wake.set()
    return result


class CheckpointRequest(BaseModel):
    note: free_text(queue.MAX_CHECKPOINT_NOTE) | None = Field(None, description="what was saved, where")


@router.post(
    "/v1/jobs/{job_id}/checkpoint", response_model=JobEventOut, status_code=201, responses=errors(403, 404, 409, *BODY)
)
def checkpoint(
    job_id: RowId, session: Db, who: Who, clock: AppClock, body: CheckpointRequest | None = None
) -> JobEventOut:
    """A running job reports that it saved its state: were it preempted, it would lose
    only the work since then (jobs call it from their checkpoint hook, or `gpush checkpoint`)."""
    with session.begin():
        event = queue.record_checkpoint(session, job_id, who, now=clock(), note=body.note if body else None)
        return JobEventOut.model_validate(event, from_attributes=True)


@router.post("/v1/jobs/{job_id}/scale", response_model=JobOut, responses=errors(403, 404, 409, *BODY))
def scale(job_id: RowId, body: ScaleRequest, session: Db, who: Who, clock: AppClock, adapters: Adapters) -> JobOut:
    """Change a running elastic job's replicas within its range, under its tenant's quota
    (broker.scheduling.scaling). Ray's autoscaler and Ray Serve call this."""

    with session.begin():
        job = scaling.scale_job(
            session, job_id, body.replicas, who, now=clock(), adapter_for=lambda name: _adapter(session, adapters, name)
        )
        return JobOut.model_validate(queue.job_row(job))


class JobOutputOut(BaseModel):
    job_id: int
    state: JobState
    final: bool = Field(description="the job has ended: no more output will come")
    location: str = Field(description="where the output is, in the cluster's terms")
    text: str = Field(description="the output from offset on, or its last tail lines")
    next_offset: int = Field(description="pass it as offset to read on (gpush logs -f)")
    readable: bool = Field(description="false: gpush cannot read it from here; location says where it is")
    note: str | None = None


@router.get("/v1/jobs/{job_id}/logs", response_model=JobOutputOut, responses=errors(403, 404, 409, 422, 503))
def job_logs(
    job_id: RowId,
    session: Db,
    who: Who,
    adapters: Adapters,
    stream: Annotated[str, Query(pattern="^(stdout|stderr)$")] = "stdout",
    replica: Annotated[int | None, Query(ge=0, le=10_000)] = None,
    offset: Annotated[int, Query(ge=0, le=2**53)] = 0,
    tail: Annotated[int | None, Query(ge=0, le=output.MAX_TAIL)] = None,
) -> JobOutputOut:
    """What the job printed, read from its cluster (Slurm's output files, the pod log):
    from ``offset`` (at most 1 MiB a call; ``next_offset`` goes on), or its last ``tail``
    lines. 409 when the job has no output (never started)."""
    with session.begin():
        answer = output.read_output(
            session,
            job_id,
            who,
            adapter_for=lambda name: _adapter(session, adapters, name),
            stream=stream,
            replica=replica,
            offset=offset,
            tail=tail,
        )
    return JobOutputOut(**answer)


def _adapter(session, adapters, name: str):
    row = session.get(Cluster, name)
    if row is None:
        raise NotFound(f"the job's cluster {name} is no longer registered")
    return adapters.get(clusters.ClusterInfo.of(row))


def _with_header_key(spec: JobSpec, header_key: str) -> JobSpec:
    if spec.idempotency_key not in (None, header_key):
        raise InvalidRequest(
            "the Idempotency-Key header and the body's idempotency_key differ: send one, or the same in both",
            details=[{"field": "idempotency_key", "value": spec.idempotency_key}],
        )
    try:
        return JobSpec.model_validate({**spec.model_dump(mode="json"), "idempotency_key": header_key})
    except ValidationError as exc:
        details = validation_details(list(exc.errors()))
        raise InvalidRequest(describe_details(details), details=details) from None


def _parse_labels(values: list[str]) -> dict[str, str]:
    """The label filters, each KEY=VALUE under the rules of a job's labels. Counted first:
    each is one more condition of the query, and 900 passed SQLite's expression depth."""
    if len(values) > MAX_LABEL_FILTERS:
        raise InvalidRequest(
            f"{len(values)} label filters, but a query takes at most {MAX_LABEL_FILTERS}: "
            "select by fewer labels, or by one label the jobs share",
            details=[{"field": "label", "value": len(values)}],
        )
    labels = {}
    for value in values:
        key, sep, wanted = value.partition("=")
        problem = label_problem(key, wanted) if sep and key else "use KEY=VALUE, such as team=vision"
        if problem:
            raise InvalidRequest(
                f"label filter {value[:100]!r} is not a label: {problem}", details=[{"field": "label", "value": value}]
            )
        labels[key] = wanted
    return labels


def _parse_states(values: list[str]) -> list[JobState]:
    states = []
    for value in values:
        for name in filter(None, (v.strip() for v in value.split(","))):
            try:
                states.append(JobState(name))
            except ValueError:
                allowed = ", ".join(s.value for s in JobState)
                raise InvalidRequest(
                    f"state {name!r} is not a job state: use one of {allowed}",
                    details=[{"field": "state", "value": name}],
                ) from None
    return states
