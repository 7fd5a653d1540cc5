"""Hostile input at the HTTP edge (issue 14): oversized bodies, headers and pages,
bodies that are not JSON, ids past the database's integers, values the error body
must still be able to echo, OPTIONS and 405. Each is a 4xx in the error envelope,
never a 500 and never a response larger than the limits allow."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from broker.api.app import create_app
from broker.api.limits import HttpLimits
from conftest import in_process

TRAIN = {"kind": "training", "gpus": 1, "command": ["true"]}
BEYOND_INT64 = 2**63


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()["error"]


# -- limits: body, headers, pages --------------------------------------------------


def test_limits_have_defaults_and_read_gpush_environment_variables(monkeypatch):
    defaults = HttpLimits.from_env()
    assert defaults == HttpLimits()
    monkeypatch.setenv("GPUSH_MAX_BODY_BYTES", "1024")
    monkeypatch.setenv("GPUSH_MAX_HEADER_BYTES", "2048")
    monkeypatch.setenv("GPUSH_MAX_PAGE", "10")
    monkeypatch.setenv("GPUSH_MAX_PAGE_BYTES", "4096")
    assert HttpLimits.from_env() == HttpLimits(
        max_body_bytes=1024, max_header_bytes=2048, max_page=10, max_page_bytes=4096
    )


def test_a_limit_that_is_not_a_positive_integer_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("GPUSH_MAX_BODY_BYTES", "lots")
    with pytest.raises(ValueError, match="GPUSH_MAX_BODY_BYTES"):
        HttpLimits.from_env()


@pytest.fixture
def small(engine, clock, make_token):
    """An app with small limits, and a client to it with a user's token."""
    import httpx

    app = create_app(
        engine,
        clock=clock,
        token_cache_ttl=0,
        limits=HttpLimits(max_body_bytes=2000, max_header_bytes=4000, max_page=3, max_page_bytes=3000),
    )
    with httpx.Client(
        base_url="http://gpush.test",
        transport=in_process(app),
        headers={"Authorization": f"Bearer {make_token()}"},
    ) as client:
        yield client


def test_a_body_over_the_limit_is_413_by_its_content_length(small):
    body = json.dumps({**TRAIN, "name": "x" * 3000}).encode()
    error = error_of(small.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"}), 413)
    assert "2000 bytes" in error["message"] and "GPUSH_MAX_BODY_BYTES" in error["message"]


def test_a_chunked_body_over_the_limit_is_413_without_reading_it_all(engine, clock, make_token):
    # Straight to the ASGI app: an in-process transport would buffer the body first.
    app = create_app(engine, clock=clock, token_cache_ttl=0, limits=HttpLimits(max_body_bytes=2000))
    token = f"Bearer {make_token()}".encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/jobs",
        "raw_path": b"/v1/jobs",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"gpush.test"),
            (b"content-type", b"application/json"),
            (b"transfer-encoding", b"chunked"),
            (b"authorization", token),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("gpush.test", 80),
    }
    chunks_read = 0
    sent = []

    async def receive():
        nonlocal chunks_read
        chunks_read += 1
        return {"type": "http.request", "body": b" " * 500, "more_body": chunks_read < 100}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 413
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]["code"] == "too_large"
    assert chunks_read <= 5


def test_a_body_within_the_limit_is_served(small):
    assert small.post("/v1/jobs", json=TRAIN).status_code == 201


def test_headers_over_the_limit_are_431(small):
    error = error_of(small.get("/v1/whoami", headers={"X-Padding": "p" * 5000}), 431)
    assert "GPUSH_MAX_HEADER_BYTES" in error["message"]


def test_an_authorization_header_longer_than_a_token_is_401_before_any_lookup(http, monkeypatch):
    from broker.core import auth

    def no_hashing(_token):
        raise AssertionError("an oversized token was hashed")

    monkeypatch.setattr(auth, "hash_token", no_hashing)
    client = http(token=None)
    error = error_of(client.get("/v1/whoami", headers={"Authorization": "Bearer " + "x" * 10_000}), 401)
    assert "too long" in error["message"]


def test_a_page_holds_at_most_the_page_limit_and_the_cursor_continues(small):
    ids = [small.post("/v1/jobs", json=TRAIN).json()["id"] for _ in range(5)]
    page = small.get("/v1/jobs", params={"limit": 1000}).json()
    assert [j["id"] for j in page["jobs"]] == ids[::-1][:3]
    rest = small.get("/v1/jobs", params={"cursor": page["next_cursor"]}).json()
    assert [j["id"] for j in rest["jobs"]] == ids[::-1][3:]


def test_a_page_of_large_jobs_stops_at_the_byte_limit_and_the_cursor_continues(small):
    big = {**TRAIN, "command": ["echo", "y" * 1200]}
    ids = [small.post("/v1/jobs", json=big).json()["id"] for _ in range(3)]
    response = small.get("/v1/jobs", params={"limit": 3})
    assert len(response.content) <= 3000
    page = response.json()
    assert [j["id"] for j in page["jobs"]] == ids[::-1][: len(page["jobs"])]
    assert 1 <= len(page["jobs"]) < 3 and page["next_cursor"]
    seen = [j["id"] for j in page["jobs"]]
    while page["next_cursor"]:
        page = small.get("/v1/jobs", params={"limit": 3, "cursor": page["next_cursor"]}).json()
        seen += [j["id"] for j in page["jobs"]]
    assert seen == ids[::-1]


# -- 4xx where a 500 was ----------------------------------------------------------


def test_a_body_that_is_not_json_is_415(http):
    error = error_of(http().post("/v1/jobs", content=b"kind=training", headers={"Content-Type": "text/plain"}), 415)
    assert "application/json" in error["message"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", f"/v1/jobs/{BEYOND_INT64}"),
        ("GET", f"/v1/jobs/{2**64}/events"),
        ("POST", f"/v1/jobs/{BEYOND_INT64}/cancel"),
        ("POST", f"/v1/admin/tokens/{BEYOND_INT64}/revoke"),
        ("GET", f"/v1/policy?version={BEYOND_INT64}"),
        ("GET", f"/v1/policy/diff?a={BEYOND_INT64}&b=1"),
        ("GET", f"/v1/policy/diff?a=1&b={-(2**63) - 1}"),
    ],
)
def test_ids_and_versions_beyond_the_database_integers_are_422(http, method, path):
    error_of(http(role="admin").request(method, path), 422)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/policy:explain", {"job_id": BEYOND_INT64}),
        ("/v1/policy:explain", {"spec": TRAIN, "version": BEYOND_INT64}),
        ("/v1/policy:rollback", {"version": BEYOND_INT64}),
        ("/v1/policy", {"text": "rules: []", "comment": "c", "base_version": BEYOND_INT64}),
    ],
)
def test_ids_and_versions_in_bodies_beyond_the_database_integers_are_422(http, path, body):
    error_of(http(role="admin").post(path, json=body), 422)


def test_a_cursor_beyond_the_database_integers_is_422(http):
    cursor = base64.urlsafe_b64encode(json.dumps({"before": 2**64}).encode()).decode()
    error = error_of(http().get("/v1/jobs", params={"cursor": cursor}), 422)
    assert error["details"][0]["field"] == "cursor"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"kind": "training", "gpus": NaN, "command": ["true"]}',
        b'{"kind": "training", "gpus": Infinity, "command": ["true"]}',
        b'{"kind": "training", "gpus": -Infinity, "command": ["true"]}',
        b'{"kind": "training", "name": "\\ud800", "command": ["true"]}',
        b'{"kind": NaN, "command": ["true"]}',
        b'{"kind": "training", "gpus": "' + b"9" * 100_000 + b'", "command": ["true"]}',
    ],
)
def test_the_validation_error_echoes_any_value_it_was_sent(http, raw):
    error = error_of(http().post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"}), 422)
    assert error["details"]
    assert len(json.dumps(error)) < 5000


@pytest.mark.parametrize("depth", [100, 900, 5000, 100_000])
def test_deeply_nested_json_is_a_4xx(http, depth):
    raw = b'{"kind": "training", "command": ["true"], "labels": ' + b"[" * depth + b"]" * depth + b"}"
    response = http().post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert 400 <= response.status_code < 500, response.text[:300]
    assert "error" in response.json()


# -- the policy schema, OPTIONS and 405 ----------------------------------------------


def test_the_policy_schema_needs_a_token_as_the_readme_says(http):
    assert http(token=None).get("/v1/policy/schema").status_code == 401
    assert http().get("/v1/policy/schema").status_code == 200


def test_options_answers_with_the_methods_of_the_path(http):
    response = http(token=None).options("/v1/jobs")
    assert response.status_code == 204
    assert set(response.headers["Allow"].split(", ")) == {"GET", "HEAD", "POST", "OPTIONS"}


def test_a_method_the_path_does_not_have_is_405_with_allow_in_the_envelope(http):
    response = http().delete("/v1/jobs")
    error = error_of(response, 405)
    assert set(response.headers["Allow"].split(", ")) == {"GET", "HEAD", "POST", "OPTIONS"}
    assert "GET" in error["message"]


def test_an_unknown_path_is_404_in_the_envelope(http):
    assert error_of(http().get("/v1/nothing-here"), 404)["code"] == "not_found"


# -- the OpenAPI document ------------------------------------------------------------


def test_json_endpoints_declare_json_objects_not_strings(app):
    for path, ops in app.openapi()["paths"].items():
        for method, op in ops.items():
            for status, response in op["responses"].items():
                schema = response.get("content", {}).get("application/json", {}).get("schema", {})
                assert schema.get("type") != "string", (method, path, status)


def test_every_route_documents_its_errors_in_the_envelope(app):
    spec = app.openapi()
    for path, ops in spec["paths"].items():
        if path in ("/healthz", "/readyz", "/metrics"):
            continue
        for method, op in ops.items():
            assert "401" in op["responses"], (method, path)
            for status, response in op["responses"].items():
                if status.startswith("4"):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, status)
            if "requestBody" in op:
                assert {"400", "413", "415", "422"} <= set(op["responses"]), (method, path)


@pytest.mark.parametrize("error", ["OperationalError", "InterfaceError"])
def test_a_database_that_drops_its_connections_is_503_to_retry_not_500(http, monkeypatch, error):
    """Found by the PostgreSQL-restart drill (integration/test_failover.py): while the
    database restarted, submissions answered 500, which clients do not retry."""
    import sqlalchemy.exc

    from broker.intake import queue

    def dropped(*_args, **_kwargs):
        raise getattr(sqlalchemy.exc, error)(
            "INSERT ...", {}, Exception("terminating connection due to administrator command")
        )

    monkeypatch.setattr(queue, "submit_jobs", dropped)
    answer = http().post("/v1/jobs", json={"kind": "batch", "command": ["x"]})
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "1"
    assert answer.json()["error"]["code"] == "unavailable"
