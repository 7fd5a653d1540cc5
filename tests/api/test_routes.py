"""The API's surface as its OpenAPI document publishes it: every route, with its
method, tag and success status, as clients and generated SDKs rely on them."""

from __future__ import annotations

from datetime import datetime, timedelta

import httpx
from a2wsgi import ASGIMiddleware

from broker.api.app import create_app

# Taken from the OpenAPI document before the routes moved out of create_app into one
# router per resource (broker.api.*): a route lost or renamed there breaks clients.
ROUTES = {
    ("GET", "/healthz"): ("health", "200"),
    ("GET", "/metrics"): ("health", "200"),
    ("GET", "/readyz"): ("health", "200"),
    ("GET", "/v1/admin/tokens"): ("admin", "200"),
    ("POST", "/v1/admin/tokens"): ("admin", "201"),
    ("POST", "/v1/admin/tokens/{token_id}/revoke"): ("admin", "200"),
    ("POST", "/v1/agent/reports"): ("inventory", "202"),
    ("GET", "/v1/clusters"): ("clusters", "200"),
    ("POST", "/v1/clusters"): ("clusters", "201"),
    ("DELETE", "/v1/clusters/{name}"): ("clusters", "204"),
    ("POST", "/v1/clusters/{name}/timeslice"): ("clusters", "200"),
    ("GET", "/v1/clusters/{name}/tenant-quotas"): ("clusters", "200"),
    ("GET", "/v1/inventory"): ("inventory", "200"),
    ("GET", "/v1/inventory/drift"): ("inventory", "200"),
    ("GET", "/v1/inventory/occupancy"): ("inventory", "200"),
    ("GET", "/v1/jobs"): ("jobs", "200"),
    ("POST", "/v1/jobs"): ("jobs", "201"),
    ("GET", "/v1/jobs/{job_id}"): ("jobs", "200"),
    ("POST", "/v1/jobs/{job_id}/cancel"): ("jobs", "200"),
    ("POST", "/v1/jobs/{job_id}/checkpoint"): ("jobs", "201"),
    ("GET", "/v1/jobs/{job_id}/events"): ("jobs", "200"),
    ("GET", "/v1/jobs/{job_id}/logs"): ("jobs", "200"),
    ("POST", "/v1/jobs/{job_id}/scale"): ("jobs", "200"),
    ("POST", "/v1/jobs:batch"): ("jobs", "201"),
    ("GET", "/v1/jobs:count"): ("jobs", "200"),
    ("GET", "/v1/mig/plan"): ("inventory", "200"),
    ("POST", "/v1/mig/changes"): ("inventory", "201"),
    ("GET", "/v1/mig/changes"): ("inventory", "200"),
    ("GET", "/v1/mig/changes/{change_id}"): ("inventory", "200"),
    ("POST", "/v1/mig/changes/{change_id}:clear"): ("inventory", "200"),
    ("GET", "/v1/lending/moves"): ("inventory", "200"),
    ("GET", "/v1/events"): ("inventory", "200"),
    ("GET", "/v1/nodes/{node}/gres-conf"): ("inventory", "200"),
    ("GET", "/v1/policy"): ("policy", "200"),
    ("POST", "/v1/policy"): ("policy", "201"),
    ("GET", "/v1/policy/diff"): ("policy", "200"),
    ("GET", "/v1/policy/history"): ("policy", "200"),
    ("GET", "/v1/policy/schema"): ("policy", "200"),
    ("POST", "/v1/policy:explain"): ("policy", "200"),
    ("POST", "/v1/policy:rollback"): ("policy", "201"),
    ("POST", "/v1/policy:validate"): ("policy", "200"),
    ("GET", "/v1/tenants"): ("tenants", "200"),
    ("PUT", "/v1/tenants/{name}"): ("tenants", "200"),
    ("GET", "/v1/usage"): ("accounting", "200"),
    ("GET", "/v1/whoami"): ("auth", "200"),
}


def test_every_route_is_in_the_openapi_document_with_its_method_tag_and_status(app):
    published = {
        (method.upper(), path): (op["tags"][0], next(code for code in op["responses"] if code.startswith("2")))
        for path, ops in app.openapi()["paths"].items()
        for method, op in ops.items()
    }
    assert published == ROUTES


def test_each_app_stamps_jobs_with_its_own_clock(engine, app, clock, make_token):
    # The routes read the clock from their app's state, not from a module global, so
    # two apps in one process (the embedded broker beside a test's) do not share it.
    tomorrow = clock.now + timedelta(days=1)
    other = create_app(engine, clock=lambda: tomorrow, token_cache_ttl=0)
    token = {"Authorization": f"Bearer {make_token()}"}
    job = {"kind": "training", "gpus": 1, "command": ["true"]}
    created = []
    for each in (app, other):
        transport = httpx.WSGITransport(app=ASGIMiddleware(each))
        with httpx.Client(base_url="http://gpush.test", transport=transport, headers=token) as client:
            response = client.post("/v1/jobs", json=job)
            assert response.status_code == 201
            created.append(datetime.fromisoformat(response.json()["created_at"]))
    assert created == [clock.now, tomorrow]
