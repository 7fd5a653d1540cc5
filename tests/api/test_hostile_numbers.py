"""Numbers and dates no column or clock can hold (issue 32): ids past their column's
integers, dates whose conversion to UTC leaves Python's years, weights and quotas that
are not finite or beyond any fleet, and a bool where a count belongs. Each is a 4xx that
names the field, on SQLite here and on PostgreSQL (integration/test_postgres_hostile_numbers.py
runs the same cases), never a 500 and never a value stored."""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import pytest

from broker.core.errors import InvalidRequest
from broker.placement import tenants

BEYOND_INT64 = 2**63
BEYOND_INT32 = 2**31  # policy versions are INTEGER columns: 32-bit on PostgreSQL
TRAIN = {"kind": "training", "gpus": 1, "command": ["true"]}
INFER = {"kind": "inference", "isolation": "none", "gpu_memory_gb": 8, "command": ["true"]}
EARLIEST = "0001-01-01T00:00:00+14:00"  # before year 1 in UTC
LATEST = "9999-12-31T23:59:59-14:00"  # after year 9999 in UTC
REPORT = {"node": "gpu-01", "agent_version": "1", "collected_at": "2026-01-05T09:00:00Z"}


class Case(NamedTuple):
    """One hostile request: ``body`` is JSON text (bytes) so that 1e400 reaches the server as sent."""

    id: str
    method: str
    path: str
    field: str
    body: bytes | None = None
    params: dict[str, Any] | None = None


def raw(value: Any, **fields: str) -> bytes:
    """``value`` as JSON, with each named field's value replaced by the literal text given."""
    value = {**value, **{name: f"@{name}@" for name in fields}}
    text = json.dumps(value)
    for name, literal in fields.items():
        text = text.replace(f'"@{name}@"', literal)
    return text.encode()


CASES = [
    # -- ids and versions past their columns -------------------------------------------
    Case("mig change id past int64", "GET", f"/v1/mig/changes/{BEYOND_INT64}", "change_id"),
    Case("mig change clear id past int64", "POST", f"/v1/mig/changes/{BEYOND_INT64}:clear", "change_id"),
    Case("mig change id 0", "GET", "/v1/mig/changes/0", "change_id"),
    Case("policy version past int32", "GET", "/v1/policy", "version", params={"version": BEYOND_INT32}),
    Case("policy diff a past int32", "GET", "/v1/policy/diff", "a", params={"a": BEYOND_INT32, "b": 1}),
    Case("policy diff b past int32", "GET", "/v1/policy/diff", "b", params={"a": 1, "b": BEYOND_INT32}),
    Case(
        "explain version past int32",
        "POST",
        "/v1/policy:explain",
        "version",
        raw({"spec": TRAIN}, version="2147483648"),
    ),
    Case("rollback version past int32", "POST", "/v1/policy:rollback", "version", raw({}, version="2147483648")),
    Case(
        "apply base_version past int32",
        "POST",
        "/v1/policy",
        "base_version",
        raw({"text": "rules: []", "comment": "c"}, base_version="2147483648"),
    ),
    Case(
        "agent report refusal of a change past int64",
        "POST",
        "/v1/agent/reports",
        "mig_refused.0.change",
        json.dumps({**REPORT, "mig_refused": [{"change": BEYOND_INT64, "gpu": 0, "why": "x"}]}).encode(),
    ),
    # -- dates whose UTC is outside years 1970..9999 -----------------------------------
    Case("usage since year 0 in UTC", "GET", "/v1/usage", "since", params={"since": EARLIEST}),
    Case("usage until year 10000 in UTC", "GET", "/v1/usage", "until", params={"until": LATEST}),
    Case("usage since before 1970", "GET", "/v1/usage", "since", params={"since": "1969-12-31T23:59:59Z"}),
    Case("events since year 0 in UTC", "GET", "/v1/events", "since", params={"since": EARLIEST}),
    Case("events since year 10000 in UTC", "GET", "/v1/events", "since", params={"since": LATEST}),
    Case(
        "agent report collected year 0",
        "POST",
        "/v1/agent/reports",
        "collected_at",
        raw(REPORT, collected_at=f'"{EARLIEST}"'),
    ),
    Case(
        "agent report collected year 10000",
        "POST",
        "/v1/agent/reports",
        "collected_at",
        raw(REPORT, collected_at=f'"{LATEST}"'),
    ),
    # -- tenant weights and quotas -----------------------------------------------------
    Case("weight 1e400", "PUT", "/v1/tenants/ml", "weight", raw({}, weight="1e400")),
    Case("weight Infinity", "PUT", "/v1/tenants/ml", "weight", raw({}, weight="Infinity")),
    Case("weight NaN", "PUT", "/v1/tenants/ml", "weight", raw({}, weight="NaN")),
    Case("weight text 1e400", "PUT", "/v1/tenants/ml", "weight", raw({}, weight='"1e400"')),
    Case("weight 10**400", "PUT", "/v1/tenants/ml", "weight", raw({}, weight="1" + "0" * 400)),
    Case("weight over a million", "PUT", "/v1/tenants/ml", "weight", raw({}, weight="1000001")),
    Case("weight true", "PUT", "/v1/tenants/ml", "weight", raw({}, weight="true")),
    Case("quota 1e400", "PUT", "/v1/tenants/ml", "gpu_quota", raw({}, gpu_quota="1e400")),
    Case("quota NaN", "PUT", "/v1/tenants/ml", "gpu_quota", raw({}, gpu_quota="NaN")),
    Case("quota over a million", "PUT", "/v1/tenants/ml", "gpu_quota", raw({}, gpu_quota="1e7")),
    Case("quota false", "PUT", "/v1/tenants/ml", "gpu_quota", raw({}, gpu_quota="false")),
    # -- a bool where a number belongs -------------------------------------------------
    Case("job gpus true", "POST", "/v1/jobs", "gpus", raw(TRAIN, gpus="true")),
    Case("job cpus true", "POST", "/v1/jobs", "cpus", raw(TRAIN, cpus="true")),
    Case("job priority false", "POST", "/v1/jobs", "priority", raw(TRAIN, priority="false")),
    Case("job gpu_memory_gb true", "POST", "/v1/jobs", "gpu_memory_gb", raw(INFER, gpu_memory_gb="true")),
    Case("job elastic true", "POST", "/v1/jobs", "elastic.max_replicas", raw(INFER, elastic='{"max_replicas": true}')),
    Case(
        "batch job gpus true", "POST", "/v1/jobs:batch", "jobs.0.gpus", b'{"jobs": [' + raw(TRAIN, gpus="true") + b"]}"
    ),
    Case("scale replicas true", "POST", "/v1/jobs/1/scale", "replicas", raw({}, replicas="true")),
    Case("timeslice replicas true", "POST", "/v1/clusters/sim/timeslice", "replicas", raw({}, replicas="true")),
    Case("rollback version true", "POST", "/v1/policy:rollback", "version", raw({}, version="true")),
    Case("explain job_id true", "POST", "/v1/policy:explain", "job_id", raw({}, job_id="true")),
    Case(
        "agent report gpu index true",
        "POST",
        "/v1/agent/reports",
        "gpus.0.index",
        raw(REPORT, gpus='[{"index": true}]'),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_number_or_date_past_what_is_stored_is_a_4xx_naming_the_field(http, case):
    response = http(role="admin").request(
        case.method,
        case.path,
        params=case.params,
        content=case.body,
        headers={"Content-Type": "application/json"} if case.body is not None else {},
    )
    assert response.status_code == 422, f"{response.status_code}: {response.text[:500]}"
    error = response.json()["error"]
    assert case.field in [d["field"] for d in error["details"]], error


def test_a_refused_weight_or_quota_leaves_the_tenant_as_it_was(http):
    admin = http(role="admin")
    assert admin.put("/v1/tenants/ml", json={"weight": 2, "gpu_quota": 8}).status_code == 200
    for body in (b'{"weight": 1e400}', b'{"gpu_quota": 1e400}', b'{"gpu_quota": false}'):
        admin.put("/v1/tenants/ml", content=body, headers={"Content-Type": "application/json"})
    [ml] = [t for t in admin.get("/v1/tenants").json() if t["name"] == "ml"]
    assert (ml["weight"], ml["gpu_quota"]) == (2, 8)


@pytest.mark.parametrize(
    ("path", "body", "field", "stored"),
    [
        ("/v1/jobs", {**TRAIN, "gpus": "2"}, "gpus", 2),  # text from YAML or a form is still a number
        ("/v1/jobs", {**TRAIN, "gpus": 2.0}, "gpus", 2),
        ("/v1/jobs", {**TRAIN, "priority": "-5"}, "priority", -5),
        ("/v1/tenants/ml", {"weight": 1_000_000}, "weight", 1_000_000),
        ("/v1/tenants/ml", {"weight": "0.5", "gpu_quota": 0}, "gpu_quota", 0),
    ],
)
def test_numbers_within_the_bounds_are_taken_as_before(http, path, body, field, stored):
    response = http(role="admin").request("PUT" if "tenants" in path else "POST", path, json=body)
    assert response.status_code in (200, 201), response.text
    answer = response.json()
    assert (answer["spec"][field] if "spec" in answer else answer[field]) == stored


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/v1/usage", {"since": "1970-01-01T00:00:00Z", "until": "9999-12-31T23:59:59Z"}),
        ("/v1/usage", {"since": "1970-01-01T09:00:00+09:00", "until": "9999-12-31T23:59:59"}),
        ("/v1/events", {"since": "1970-01-01T00:00:00Z"}),
        ("/v1/events", {"since": "9999-12-31T23:59:59Z"}),
    ],
)
def test_dates_within_1970_to_9999_are_answered(http, path, params):
    assert http(role="admin").get(path, params=params).status_code == 200


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"weight": math.inf}, "weight"),
        ({"weight": math.nan}, "weight"),
        ({"weight": 1e7}, "weight"),
        ({"gpu_quota": math.inf}, "gpu_quota"),
        ({"gpu_quota": math.nan}, "gpu_quota"),
    ],
)
def test_the_tenant_store_refuses_them_too_whoever_calls_it(sessions, clock, fields, field):
    # Not only the API's schema: the scheduler's tests, replays and scripts call set_tenant.
    with sessions() as session, session.begin():
        with pytest.raises(InvalidRequest) as refused:
            tenants.set_tenant(
                session,
                "ml",
                weight=fields.get("weight"),
                gpu_quota=fields.get("gpu_quota"),
                clear_quota=False,
                now=clock(),
            )
    assert refused.value.details[0]["field"] == field
