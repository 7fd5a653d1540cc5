"""What a person meets in a browser: ``/`` says what this is and where to go; /docs and
/redoc work with no network beyond the broker (an air-gapped site) and can authorise
with a bearer token; a path or method the API lacks answers in the error envelope."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from broker.api.responses import ErrorBody

README = Path(__file__).resolve().parents[2] / "README.md"
PAGES = ["/docs", "/redoc"]
# The routes anyone may call; every other one takes a token.
PUBLIC = {"/healthz", "/readyz", "/metrics"}


def referenced_urls(html: str) -> list[str]:
    """What a page makes the browser fetch: its src and href attributes, the OpenAPI
    document Swagger UI loads (``url: '...'``) and the one ReDoc loads (``spec-url``)."""
    return re.findall(r"""(?:\bsrc|\bhref|\bspec-url)=["']([^"']+)["']|\burl: ["']([^"']+)["']""", html)


@pytest.mark.parametrize("page", PAGES)
def test_the_docs_load_every_asset_from_this_server(http, page):
    client = http(token=None)
    response = client.get(page)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    # Nothing outside the server: no CDN, no web fonts, no online validator.
    assert re.findall(r"https?://[^\s'\"<>]*", html) == []
    urls = sorted({a or b for a, b in referenced_urls(html)})
    assert any(u.endswith(".js") for u in urls) and "/openapi.json" in urls, urls
    for url in urls:
        assert url.startswith("/"), url
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert len(asset.content) > 0, url
        if url.endswith(".js"):
            assert "javascript" in asset.headers["content-type"], url
        if url.endswith(".css"):
            assert asset.headers["content-type"].startswith("text/css"), url


def test_swagger_ui_asks_no_online_validator(http):
    assert '"validatorUrl": null' in http(token=None).get("/docs").text


def test_the_root_says_what_this_is_and_where_to_go(http):
    client = http(token=None)
    response = client.get("/")
    assert response.status_code == 200
    index = response.json()
    assert index["name"] == "gpush broker" and index["version"]
    assert index["api_prefix"] == "/v1" and "Bearer" in index["authentication"]
    for key in ("docs", "redoc", "openapi", "health"):
        assert client.get(index[key]).status_code == 200, key


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/nothing-here", 404),
        ("GET", "/v1", 404),
        ("GET", "/v1/", 404),
        ("POST", "/", 405),
        ("GET", "/docs/assets/no-such-file.js", 404),
        ("PUT", "/docs", 405),
        ("DELETE", "/openapi.json", 405),
    ],
)
def test_a_path_or_method_the_api_lacks_answers_in_the_error_envelope(http, method, path, status):
    response = http(token=None).request(method, path)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    ErrorBody.model_validate(response.json())
    if status == 405:
        # The Allow header names what the path does take (the docs' own routes included).
        assert "GET" in response.headers["Allow"].split(", ")


def test_the_openapi_document_declares_bearer_auth_on_the_routes_that_take_a_token(app):
    document = app.openapi()
    schemes = document["components"]["securitySchemes"]
    assert list(schemes) == ["bearer"]
    assert schemes["bearer"]["type"] == "http" and schemes["bearer"]["scheme"] == "bearer"
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            if path in PUBLIC:
                assert "security" not in op, (method, path)
            else:
                assert op.get("security") == [{"bearer": []}], (method, path)
                # The token comes through the scheme, not as a header parameter of its own
                # (which Swagger UI would show as a second, ignored field).
                headers = {p["name"].lower() for p in op.get("parameters", []) if p["in"] == "header"}
                assert "authorization" not in headers, (method, path)


def test_what_the_document_says_needs_a_token_does(http, app):
    # The declaration is no promise of its own: every secured operation is a 401 without
    # a token, and no public one is.
    client = http(token=None)
    for path, ops in app.openapi()["paths"].items():
        url = re.sub(r"\{[^}]+\}", "1", path)
        for method, op in ops.items():
            response = client.request(method.upper(), url)
            if "security" in op:
                assert response.status_code == 401, (method, path, response.text)
                assert response.headers["WWW-Authenticate"] == "Bearer"
            else:
                assert response.status_code != 401, (method, path)


def test_the_readme_lists_every_route_and_no_other(app):
    # The table of "## The REST API"; path parameters by position ({id} there, {job_id} here).
    section = README.read_text().split("\n## The REST API\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    listed = {
        (method, re.sub(r"\{[^}]*\}", "{}", path))
        for row in rows
        for method, path in re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`?]*)", row)
    }
    served = {
        (method.upper(), re.sub(r"\{[^}]*\}", "{}", path))
        for path, ops in app.openapi()["paths"].items()
        for method in ops
    }
    assert sorted(served - listed) == [], "routes the README's table lacks"
    assert sorted(listed - served) == [], "rows of the README's table the API does not serve"
