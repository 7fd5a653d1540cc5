"""The REST API of the broker (FastAPI).

Routes own the transaction: each opens ``with session.begin()`` around the model
functions of ``broker.intake.queue`` and ``broker.core.auth``, which only flush. Errors leave
as ``{"error": {"code", "message", "details"}}`` with the status of their type.
"""

# No `from __future__ import annotations`: FastAPI resolves the route signatures,
# whose dependency aliases are local to create_app.

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

import broker
from broker.core import auth, metrics
from broker.core.db import check_schema, session_factory
from broker.core.errors import GpushError, InvalidRequest, NotAllowed, NotFound, Unavailable
from broker.core.models import ApiToken, Cluster
from broker.core.schemas import (
    ClusterCreate,
    ExplainRequest,
    JobBatch,
    JobEventOut,
    JobOut,
    JobPage,
    JobSpec,
    Kind,
    PolicyApply,
    PolicyRollback,
    PolicyText,
    Role,
    TenantSet,
    TokenCreate,
    TokenCreated,
    TokenOut,
    Whoami,
)
from broker.core.states import JobState
from broker.core.validation import describe_details, validation_details
from broker.intake import queue
from broker.inventory import report_store as nodereports
from broker.inventory.agent_report import NodeReport
from broker.inventory.reconcile import Inventory
from broker.mig import queue as migqueue
from broker.mig.config import GRES_STYLES, render_gres_conf
from broker.placement import tenants
from broker.placement.capacity import CapacityView, Fit
from broker.routing import policy as policy_engine
from broker.routing import versions as policystore
from broker.scheduling import clusters, scaling
from broker.scheduling.clusters import AdapterPool

Clock = Callable[[], datetime]


def utcnow() -> datetime:
    return datetime.now(UTC)


class TimesliceRequest(BaseModel):
    replicas: int = Field(ge=1, le=64, description="time-slices per physical GPU")
    node_label: str | None = Field(None, description="KEY=VALUE: only the nodes with this label")


class ScaleRequest(BaseModel):
    replicas: int = Field(ge=1, le=10_000, description="the number of replicas the job should run")


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


class JSONBytes(Response):
    """A JSON response rendered by orjson from plain dicts (job rows), without
    re-validating them against the response model: the hot path of submit and list."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_UTC_Z)


def _error_response(exc: GpushError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.http_status == 401 else None
    return JSONResponse({"error": exc.to_dict()}, status_code=exc.http_status, headers=headers)


def create_app(engine: Engine, *, clock: Clock = utcnow, token_cache_ttl: float = 5.0) -> FastAPI:
    """The broker's ASGI application on ``engine`` (schema must be at head)."""
    app = FastAPI(
        title="gpush broker",
        version=broker.__version__,
        description="One global queue of GPU jobs above Slurm and Kubernetes.",
    )
    sessions: sessionmaker[Session] = session_factory(engine)
    cache = auth.TokenCache(ttl=token_cache_ttl)
    app.state.engine = engine
    app.state.token_cache = cache

    @app.exception_handler(GpushError)
    async def _gpush_error(_request: Request, exc: GpushError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # The route's body model, so an unknown field is named against its own fields
        # (a node report's, a token's), not a job's.
        body_field = getattr(request.scope.get("route"), "body_field", None)
        body = getattr(getattr(body_field, "field_info", None), "annotation", None)
        body = body if isinstance(body, type) and issubclass(body, BaseModel) else None
        details = validation_details(list(exc.errors()), skip=1, body=body)
        return _error_response(InvalidRequest(describe_details(details), details=details))

    # Dependencies are async so that FastAPI runs them on the event loop: a sync
    # dependency costs a hop to the thread pool and back on every request.
    async def db() -> AsyncIterator[Session]:
        with sessions() as session:
            yield session

    def lookup_token(token: str | None) -> auth.Principal:
        with sessions() as session:
            return auth.authenticate(session, token, cache)

    async def any_principal(authorization: Annotated[str | None, Header()] = None) -> auth.Principal:
        token = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            token = value.strip() if scheme.lower() == "bearer" else None
        if token and (hit := cache.get(auth.hash_token(token))) is not None:
            return hit
        return await run_in_threadpool(lookup_token, token)

    async def principal(who: Annotated[auth.Principal, Depends(any_principal)]) -> auth.Principal:
        if who.role == Role.AGENT:
            raise NotAllowed(
                f"{who.user!r} has an agent token, which may only report its node's GPUs (gpush agent); "
                "use a user or admin token for this"
            )
        return who

    async def agent(who: Annotated[auth.Principal, Depends(any_principal)]) -> auth.Principal:
        if who.role not in (Role.AGENT, Role.ADMIN):
            raise NotAllowed(
                f"only a node agent may report GPUs; {who.user!r} has role {who.role.value} "
                "(create one with: gpush admin token create --role agent --user <node> --tenant agents)"
            )
        return who

    async def admin(who: Annotated[auth.Principal, Depends(principal)]) -> auth.Principal:
        if not who.is_admin:
            raise NotAllowed(f"only an admin may do this; {who.user!r} has role {who.role.value}")
        return who

    Db = Annotated[Session, Depends(db)]
    Who = Annotated[auth.Principal, Depends(principal)]
    Admin = Annotated[auth.Principal, Depends(admin)]
    Agent = Annotated[auth.Principal, Depends(agent)]

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        """The process is up (no database check: that is /readyz)."""
        return {"status": "ok", "version": broker.__version__}

    @app.get("/readyz", tags=["health"])
    def readyz() -> JSONResponse:
        """The database answers and its schema is the one this broker needs."""
        try:
            check_schema(engine)
        except Unavailable as exc:
            return _error_response(exc)
        return JSONResponse({"status": "ready"})

    # -- Prometheus metrics (broker.core.metrics) -------------------------------------------

    exported = metrics.app_registry(engine)

    @app.get("/metrics", tags=["health"], response_class=Response)
    def prometheus_metrics(
        authorization: Annotated[str | None, Header()] = None, accept: Annotated[str | None, Header()] = None
    ) -> Response:
        """Prometheus metrics: queue depth, GPU-equivalents, cycles, adapter calls, drift.
        No token needed unless GPUSH_METRICS_TOKEN is set (then ``Bearer`` that value)."""
        metrics.check_scrape_token(authorization)
        body, content_type = metrics.exposition(exported, accept)
        return Response(body, media_type=content_type)

    @app.get("/v1/whoami", response_model=Whoami, tags=["auth"])
    def whoami(who: Annotated[auth.Principal, Depends(any_principal)]) -> Whoami:
        return Whoami(user=who.user, tenant=who.tenant, role=who.role)

    @app.post("/v1/jobs", response_model=JobOut, status_code=201, response_class=JSONBytes, tags=["jobs"])
    async def submit(
        spec: JobSpec,
        session: Db,
        who: Who,
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
        return JSONBytes(result.job, status_code=201 if result.created else 200)

    @app.post("/v1/jobs:batch", response_model=BatchResult, status_code=201, response_class=JSONBytes, tags=["jobs"])
    def submit_batch(batch: JobBatch, session: Db, who: Who) -> JSONBytes:
        """Queue many jobs in one transaction: all of them, or none when one is refused."""
        with session.begin():
            results = queue.submit_jobs(session, batch.jobs, who, now=clock())
        created = sum(r.created for r in results)
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

    @app.get("/v1/jobs", response_model=JobPage, response_class=JSONBytes, tags=["jobs"])
    def list_jobs(
        session: Db,
        who: Who,
        state: Annotated[list[str] | None, Query(description="repeat or comma-separate")] = None,
        tenant: str | None = None,
        user: str | None = None,
        kind: Kind | None = None,
        label: Annotated[list[str] | None, Query(description="KEY=VALUE, repeat for several (all must match)")] = None,
        limit: Annotated[int, Query(ge=1, le=queue.MAX_PAGE)] = 50,
        cursor: str | None = None,
    ) -> JSONBytes:
        """Jobs newest first, one page at a time (``next_cursor`` until the last page)."""
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
                labels=labels,
                limit=limit,
                cursor=cursor,
            )
            return JSONBytes({"jobs": [queue.job_row(j) for j in jobs], "next_cursor": next_cursor})

    @app.get("/v1/jobs/{job_id}", response_model=JobOut, response_class=JSONBytes, tags=["jobs"])
    def get_job(job_id: int, session: Db, who: Who) -> JSONBytes:
        with session.begin():
            return JSONBytes(queue.job_row(queue.get_job(session, job_id, who)))

    @app.get("/v1/jobs/{job_id}/events", response_model=list[JobEventOut], tags=["jobs"])
    def job_events(job_id: int, session: Db, who: Who) -> list[JobEventOut]:
        """Every state change of the job, oldest first, with time, reason and actor."""
        with session.begin():
            events = queue.job_events(session, job_id, who)
            return [JobEventOut.model_validate(e, from_attributes=True) for e in events]

    @app.post("/v1/jobs/{job_id}/cancel", response_model=CancelResult, tags=["jobs"])
    def cancel(job_id: int, session: Db, who: Who) -> CancelResult:
        """End a job that no cluster has yet, or record the intent for the adapter to act on."""
        with session.begin():
            job, outcome = queue.cancel_job(session, job_id, who, now=clock())
            return CancelResult(job=JobOut.model_validate(queue.job_row(job)), outcome=outcome)

    @app.post("/v1/admin/tokens", response_model=TokenCreated, status_code=201, tags=["admin"])
    def create_token(body: TokenCreate, session: Db, _who: Admin) -> TokenCreated:
        """Create an API token; its secret is in this response only."""
        with session.begin():
            row, secret = auth.create_token(
                session,
                user=body.user,
                tenant=body.tenant,
                role=body.role,
                description=body.description,
                now=clock(),
            )
            return TokenCreated(**TokenOut.model_validate(row, from_attributes=True).model_dump(), token=secret)

    @app.get("/v1/admin/tokens", response_model=list[TokenOut], tags=["admin"])
    def list_tokens(session: Db, _who: Admin) -> list[TokenOut]:
        with session.begin():
            rows = session.execute(select(ApiToken).order_by(ApiToken.id)).scalars()
            return [TokenOut.model_validate(r, from_attributes=True) for r in rows]

    @app.post("/v1/admin/tokens/{token_id}/revoke", response_model=TokenOut, tags=["admin"])
    def revoke_token(token_id: int, session: Db, _who: Admin) -> TokenOut:
        with session.begin():
            row = auth.revoke_token(session, token_id, now=clock())
            out = TokenOut.model_validate(row, from_attributes=True)
        cache.clear()
        return out

    # -- clusters and tenants (admins change them; everyone may look) -------------------

    adapters = AdapterPool(clock)
    app.state.adapters = adapters

    @app.post("/v1/jobs/{job_id}/scale", response_model=JobOut, tags=["jobs"])
    def scale(job_id: int, body: ScaleRequest, session: Db, who: Who) -> JobOut:
        """Change a running elastic job's replicas within its range, under its tenant's quota
        (broker.scheduling.scaling). Ray's autoscaler and Ray Serve call this."""

        def adapter_for(name: str):
            row = session.get(Cluster, name)
            if row is None:
                raise NotFound(f"the job's cluster {name} is no longer registered")
            return adapters.get(clusters.ClusterInfo.of(row))

        with session.begin():
            job = scaling.scale_job(session, job_id, body.replicas, who, now=clock(), adapter_for=adapter_for)
            return JobOut.model_validate(queue.job_row(job))

    @app.post("/v1/clusters", status_code=201, tags=["clusters"])
    def add_cluster(body: ClusterCreate, session: Db, who: Admin) -> dict[str, Any]:
        """Register a cluster; its adapter must accept the config and the cluster must answer."""

        def answers(adapter) -> None:
            health = adapter.health()
            if not health.ok:
                raise InvalidRequest(f"cluster {body.name} does not answer: {health.detail}")

        with session.begin():
            info = clusters.add_cluster(
                session,
                name=body.name,
                kind=body.kind,
                config=body.config,
                actor=who.user,
                now=clock(),
                replace=body.replace,
                check=answers,
            )
            queue.release_held(session, reason=f"cluster {info.name} registered", now=clock())
        return clusters.summarize(info, adapters.get(info))

    @app.get("/v1/clusters", tags=["clusters"])
    def list_clusters(session: Db, _who: Who) -> list[dict[str, Any]]:
        """Registered clusters with their health and capacity (GPU-equivalents by sharing mode)."""
        with session.begin():
            infos = clusters.list_clusters(session)
        return [clusters.summarize(info, adapters.get(info)) for info in infos]

    # -- the reconciled inventory (broker.inventory.reconcile, broker.inventory.report_store) ----------------

    @app.post("/v1/agent/reports", status_code=202, tags=["inventory"])
    def agent_report(report: NodeReport, session: Db, who: Agent) -> dict[str, Any]:
        """A node agent's view of its GPUs (gpush agent); the newest per node is kept."""
        with session.begin():
            row = nodereports.save_report(session, report, by=who.user, now=clock())
            return {"node": row.node, "collected_at": row.collected_at, "received_at": row.received_at}

    def inventory_of(session: Session, cluster: str | None) -> Inventory:
        with session.begin():
            if cluster is not None and session.get(Cluster, cluster) is None:
                raise NotFound(f"no cluster {cluster!r} is registered (gpush cluster list shows them)")
            infos, reports = nodereports.read_sources(session, cluster)
        return nodereports.reconciled(infos, reports, adapters, now=clock())

    @app.get("/v1/inventory", response_class=JSONBytes, tags=["inventory"])
    def inventory(session: Db, _who: Who, cluster: str | None = None) -> JSONBytes:
        """Clusters, nodes, physical GPUs and their slices from the clusters and the node
        agents, in physical GPU-equivalents; with the drift findings."""
        return JSONBytes(inventory_of(session, cluster).to_dict())

    @app.get("/v1/inventory/drift", tags=["inventory"])
    def inventory_drift(session: Db, _who: Who, cluster: str | None = None) -> list[dict[str, Any]]:
        """Every disagreement between the clusters and the GPUs, worst first, with its fix."""
        return [f.to_dict() for f in inventory_of(session, cluster).findings]

    @app.get("/v1/nodes/{node}/gres-conf", tags=["inventory"])
    def gres_conf(node: str, session: Db, _who: Who, style: str = "multiple-files") -> dict[str, Any]:
        """The gres.conf block and slurm.conf Gres= field matching what the node's agent sees."""
        if style not in GRES_STYLES:
            raise InvalidRequest(f"style {style!r} is not one of {', '.join(GRES_STYLES)}")
        with session.begin():
            report = nodereports.load_reports(session).get(node)
        if report is None:
            raise NotFound(
                f"no agent reports node {node!r}, so gpush does not know its GPUs: run `gpush agent` on it "
                "(gpush inventory lists the nodes agents report)"
            )
        conf = render_gres_conf(node, report.gpus, style=style)
        return {"node": node, "text": conf.text, "gres": conf.gres, "lines": list(conf.lines), "style": style}

    @app.get("/v1/mig/plan", tags=["inventory"])
    def mig_plan(
        session: Db,
        _who: Who,
        cluster: str | None = None,
        repartition_busy: bool = False,
        enable_mig: bool = False,
    ) -> dict[str, Any]:
        """MIG layouts, per GPU, that place the most waiting MIG work (broker.mig.queue)."""
        with session.begin():
            info = None
            if cluster is not None:
                row = session.get(Cluster, cluster)
                if row is None:
                    raise NotFound(f"no cluster {cluster!r} is registered (gpush cluster list shows them)")
                info = clusters.ClusterInfo.of(row)
            infos, reports = nodereports.read_sources(session, cluster)
        inventory = nodereports.reconciled(infos, reports, adapters, now=clock()) if info is not None else None
        with session.begin():
            result = migqueue.plan_for(
                session, reports, inventory, cluster=info, repartition_busy=repartition_busy, enable_mig=enable_mig
            )
        return result.to_dict()

    @app.post("/v1/clusters/{name}/timeslice", tags=["clusters"])
    def apply_timeslice(name: str, body: TimesliceRequest, session: Db, _who: Admin) -> dict[str, Any]:
        """Render and apply a Kubernetes cluster's time-slicing config (the GPU Operator's
        device-plugin ConfigMap and ClusterPolicy patch); returns what changed."""
        with session.begin():
            row = session.get(Cluster, name)
            if row is None:
                raise NotFound(f"no cluster {name}: `gpush cluster list` shows them")
            info = clusters.ClusterInfo.of(row)
        adapter = adapters.get(info)
        if not hasattr(adapter, "apply_timeslice"):
            raise InvalidRequest(f"cluster {name} is a {info.kind} cluster: time-slicing is configured on Kubernetes")
        plan = adapter.timeslice(body.replicas, node_label=body.node_label)
        return {"cluster": name, "changes": adapter.apply_timeslice(plan), "rendered": plan.to_yaml()}

    @app.delete("/v1/clusters/{name}", status_code=204, tags=["clusters"])
    def remove_cluster(name: str, session: Db, _who: Admin) -> Response:
        with session.begin():
            clusters.remove_cluster(session, name)
        return Response(status_code=204)

    @app.put("/v1/tenants/{name}", tags=["tenants"])
    def set_tenant(name: str, body: TenantSet, session: Db, _who: Admin) -> dict[str, Any]:
        """Set a tenant's fair-share weight and GPU quota (physical GPU-equivalents)."""
        with session.begin():
            tenants.set_tenant(
                session,
                name,
                weight=body.weight,
                gpu_quota=body.gpu_quota,
                clear_quota=body.clear_quota,
                now=clock(),
            )
            usage = {u.name: u for u in tenants.tenant_usage(session)}
        return usage[name].__dict__

    @app.get("/v1/tenants", tags=["tenants"])
    def list_tenants(session: Db, who: Who) -> list[dict[str, Any]]:
        """Tenants with weight, quota and the GPU-equivalents they hold now."""
        with session.begin():
            rows = tenants.tenant_usage(session)
        return [u.__dict__ for u in rows if who.can_see_tenant(u.name)]

    # -- routing policy ---------------------------------------------------------------

    def cluster_views(session: Session) -> dict[str, Any]:
        return clusters.cluster_views(session, adapters)

    @app.get("/v1/policy/schema", tags=["policy"])
    def policy_schema() -> dict[str, Any]:
        """JSON Schema of the policy YAML, for editors."""
        return policy_engine.policy_json_schema()

    @app.post("/v1/policy:validate", tags=["policy"])
    def validate_policy(body: PolicyText, session: Db, _who: Who) -> dict[str, Any]:
        """Check a policy against the registered clusters without applying it."""
        with session.begin():
            views = cluster_views(session)
        _parsed, report = policystore.check(body.text, views, source=body.source)
        return {**report.to_dict(), "describe": report.describe()}

    @app.post("/v1/policy", status_code=201, tags=["policy"])
    def apply_policy(body: PolicyApply, session: Db, who: Admin) -> dict[str, Any]:
        """Validate and activate a new policy version (refused: the active one stays)."""
        with session.begin():
            views = cluster_views(session)
            info, report = policystore.apply(
                session,
                body.text,
                comment=body.comment,
                author=who.user,
                now=clock(),
                views=views,
                base_version=body.base_version,
                source=body.source,
            )
        return {**info.to_dict(), "warnings": [f.to_dict() for f in report.warnings], "describe": report.describe()}

    @app.post("/v1/policy:rollback", status_code=201, tags=["policy"])
    def rollback_policy(body: PolicyRollback, session: Db, who: Admin) -> dict[str, Any]:
        """Make an earlier version active again (as a new version)."""
        with session.begin():
            views = cluster_views(session)
            info, report = policystore.rollback(
                session, body.version, comment=body.comment, author=who.user, now=clock(), views=views
            )
        return {**info.to_dict(), "describe": report.describe()}

    @app.get("/v1/policy", tags=["policy"])
    def show_policy(session: Db, _who: Who, version: int | None = None) -> dict[str, Any]:
        """The active policy, or a stored version, with its text."""
        with session.begin():
            row, active = policystore.get_version(session, version)
            return {
                "version": row.version,
                "author": row.author,
                "comment": row.comment,
                "created_at": row.created_at.isoformat(),
                "active": active,
                "text": row.text,
            }

    @app.get("/v1/policy/history", tags=["policy"])
    def policy_history(session: Db, _who: Who) -> list[dict[str, Any]]:
        with session.begin():
            return [v.to_dict() for v in policystore.history(session)]

    @app.get("/v1/policy/diff", tags=["policy"])
    def policy_diff(a: int, b: int, session: Db, _who: Who) -> dict[str, str]:
        with session.begin():
            return {"diff": policystore.diff(session, a, b)}

    @app.post("/v1/policy:explain", tags=["policy"])
    def explain(body: ExplainRequest, session: Db, who: Who) -> dict[str, Any]:
        """Every rule tried for a job, in order, and why; then where it would be placed now."""
        with session.begin():
            if body.job_id is not None:
                job = queue.get_job(session, body.job_id, who)
                spec, tenant = JobSpec.model_validate(job.spec), job.tenant
            elif body.spec is not None:
                spec, tenant = body.spec, body.spec.tenant or who.tenant
            else:
                raise InvalidRequest("give job_id or spec", details=[{"field": "job_id", "value": None}])
            row, _active = policystore.get_version(session, body.version)
            parsed = policystore.parsed(row.version, row.text)
            infos = clusters.list_clusters(session, enabled_only=True)
        decision = policy_engine.evaluate(parsed, spec, tenant)
        inventory = {}
        for info in infos:
            try:
                inventory[info.name] = adapters.get(info).inventory()
            except Exception:
                inventory[info.name] = []
        view = CapacityView.build(inventory)
        placements = []
        for route in decision.routes:
            fit = view.fit(spec, route.cluster, route.sharing, partition=route.partition, gpu_model=route.gpu_model)
            if isinstance(fit, Fit):
                placements.append({"route": str(route), "fits": True, "placement": fit.placement.to_dict()})
                break
            placements.append({"route": str(route), "fits": False, "reason": fit.reason, "never": fit.never})
        return {
            **decision.to_dict(),
            "policy_version": row.version,
            "explain": decision.explain(),
            "placement": placements,
        }

    return app


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
    labels = {}
    for value in values:
        key, sep, wanted = value.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"label {value!r} is not KEY=VALUE", details=[{"field": "label", "value": value}])
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
