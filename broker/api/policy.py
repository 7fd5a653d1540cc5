"""The routes of the routing policy (broker.routing): its schema, validating,
applying and rolling back versions (admins), showing, listing and diffing them, and
explaining where a job would be routed and placed now.
"""

import contextlib
from typing import Annotated, Any

from fastapi import APIRouter, Query

from broker.api.deps import Adapters, Admin, AppClock, Db, Version, Who
from broker.api.responses import AUTH, BODY, errors
from broker.core import clusters
from broker.core.errors import InvalidRequest
from broker.core.schemas import MAX_POLICY_VERSION, ExplainRequest, JobSpec, PolicyApply, PolicyRollback, PolicyText
from broker.intake import queue
from broker.placement.capacity import CapacityView, Fit
from broker.routing import policy as policy_engine
from broker.routing import versions as policystore

router = APIRouter(tags=["policy"], responses=errors(*AUTH))


@router.get("/v1/policy/schema", responses=errors(403))
def policy_schema(_who: Who) -> dict[str, Any]:
    """JSON Schema of the policy YAML, for editors. It needs a token, as every endpoint
    but /healthz and /readyz does (the README says so, and clients rely on one rule)."""
    return policy_engine.policy_json_schema()


@router.post("/v1/policy:validate", responses=errors(403, *BODY))
def validate_policy(body: PolicyText, session: Db, _who: Who, adapters: Adapters) -> dict[str, Any]:
    """Check a policy against the registered clusters without applying it; ``diff`` is
    what applying it would change in the active version (unified diff)."""
    with session.begin():
        views = policystore.cluster_views(session, adapters)
        diff = policystore.diff_with_active(session, body.text)
    _parsed, report = policystore.check(body.text, views, source=body.source)
    return {**report.to_dict(), "describe": report.describe(), "diff": diff}


@router.post("/v1/policy", status_code=201, responses=errors(403, 409, *BODY))
def apply_policy(body: PolicyApply, session: Db, who: Admin, clock: AppClock, adapters: Adapters) -> dict[str, Any]:
    """Validate and activate a new policy version (refused: the active one stays). The
    active text again stores nothing: ``changed`` is false and the comment is not kept."""
    with session.begin():
        views = policystore.cluster_views(session, adapters)
        before = policystore.active_version(session)
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
    return {
        **info.to_dict(),
        "changed": info.version != before,
        "warnings": [f.to_dict() for f in report.warnings],
        "describe": report.describe(),
    }


@router.post("/v1/policy:rollback", status_code=201, responses=errors(403, 404, 409, *BODY))
def rollback_policy(
    body: PolicyRollback, session: Db, who: Admin, clock: AppClock, adapters: Adapters
) -> dict[str, Any]:
    """Make an earlier version active again (as a new version; ``changed`` is false, and
    nothing is stored, when its text is the active one already)."""
    with session.begin():
        views = policystore.cluster_views(session, adapters)
        before = policystore.active_version(session)
        info, report = policystore.rollback(
            session, body.version, comment=body.comment, author=who.user, now=clock(), views=views
        )
    return {**info.to_dict(), "changed": info.version != before, "describe": report.describe()}


@router.get("/v1/policy", responses=errors(403, 404, 422))
def show_policy(
    session: Db,
    _who: Who,
    version: Annotated[
        int | None, Query(ge=1, le=MAX_POLICY_VERSION, description="a stored version; default the active one")
    ] = None,
) -> dict[str, Any]:
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


@router.get("/v1/policy/history", responses=errors(403))
def policy_history(session: Db, _who: Who) -> list[dict[str, Any]]:
    with session.begin():
        return [v.to_dict() for v in policystore.history(session)]


@router.get("/v1/policy/diff", responses=errors(403, 404, 422))
def policy_diff(a: Version, b: Version, session: Db, _who: Who) -> dict[str, str]:
    with session.begin():
        return {"diff": policystore.diff(session, a, b)}


@router.post("/v1/policy:explain", responses=errors(403, 404, *BODY))
def explain(body: ExplainRequest, session: Db, who: Who, adapters: Adapters) -> dict[str, Any]:
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
        # A cluster that does not answer is left out, so its routes read "reports no
        # capacity" (it may hold the job later), never "offers no GPUs" (never will).
        with contextlib.suppress(Exception):
            inventory[info.name] = adapters.get(info).inventory()
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
