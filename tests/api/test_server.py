"""What ``gpush server`` adds around the API (broker.api.server), on a real server process
where it matters (issue 32, finding 7): a deadline on a request's head, an access log
without the tokens a client put in a URL, and no /metrics open beyond loopback; and the
replay of an idempotency key, documented."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from uvicorn.logging import AccessFormatter

from broker.api.server import RedactSecrets, check_metrics_exposure, listens_beyond_loopback, redact
from broker.core.errors import InvalidRequest

ROOT = Path(__file__).resolve().parents[2]
GPUSH = [sys.executable, "-c", "import sys; from broker.cli.main import main; main(sys.argv[1:])"]
TOKEN = "gpush_" + "S3cr3t" * 7 + "x"  # shaped as gpush's tokens are


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSH_")}
    return env | {
        "GPUSH_DATA_DIR": str(tmp_path / "data"),
        "GPUSH_CONFIG_DIR": str(tmp_path / "config"),
        "GPUSH_DATABASE_URL": f"sqlite:///{tmp_path / 'gpush.db'}",
        "PYTHONPATH": str(ROOT),
        **extra,
    }


def start(env: dict[str, str], log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [*GPUSH, "server", "--port", str(port), "--no-scheduler", *args],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"gpush server did not start:\n{log.read_text()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory, _migrated_sqlite):
    """A real server on every address, with a metrics token, whose clients have 1 s to
    send a request's head."""
    tmp = tmp_path_factory.mktemp("server")
    shutil.copyfile(_migrated_sqlite, tmp / "gpush.db")
    log = tmp / "server.log"
    env = server_env(tmp, GPUSH_HEADER_TIMEOUT_SECONDS="1", GPUSH_METRICS_TOKEN="s3cret")
    process, url = start(env, log, "--host", "0.0.0.0")
    yield url, log
    process.terminate()
    process.wait(timeout=30)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def closed_after(sock: socket.socket, send_every: float, data: bytes = b"") -> float:
    """Seconds until the server closes ``sock``, sending one byte of ``data`` every
    ``send_every`` seconds meanwhile (nothing when ``data`` is empty)."""
    began = time.monotonic()
    sock.settimeout(send_every)
    for i in range(int(10 / send_every)):
        if data:
            try:
                sock.sendall(data[i % len(data) : i % len(data) + 1])
            except OSError:
                return time.monotonic() - began
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - began
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - began
    return time.monotonic() - began


# -- a deadline on a request's head -----------------------------------------------------


def test_a_client_that_dribbles_its_headers_is_cut_off_at_the_header_timeout(server):
    url, _log = server
    sock = connect(url)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gpush\r\n")
    took = closed_after(sock, 0.2, b"X-Slow: aaaaaaaa\r\n")
    assert 0.8 < took < 3, took


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(server):
    url, _log = server
    took = closed_after(connect(url), 0.2)
    assert 0.8 < took < 3, took


def test_a_kept_alive_connection_idle_past_the_header_timeout_still_serves_its_next_request(server):
    # Idle between requests is uvicorn's keep-alive (5 s), not the head's deadline (1 s).
    url, _log = server
    sock = connect(url)
    for _ in range(2):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gpush\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(4096)
            assert chunk, f"closed after {answer!r}"
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        time.sleep(1.5)  # idle past the 1 s header timeout: the time under test, not a wait
    sock.close()


# -- the access log ----------------------------------------------------------------------


def test_a_token_in_the_query_never_reaches_the_access_log(server):
    url, log = server
    before = log.read_text().count('"GET /v1/jobs')
    answer = httpx.get(f"{url}/v1/jobs", params={"state": "queued", "token": TOKEN, "access_token": "hunter2"})
    assert answer.status_code == 401
    httpx.get(f"{url}/v1/jobs/{TOKEN}")
    # uvicorn writes the access line after the answer: wait for both lines.
    deadline = time.monotonic() + 10
    while (text := log.read_text()).count('"GET /v1/jobs') < before + 2:
        assert time.monotonic() < deadline, f"the two requests not logged after 10 s: {text[-2000:]}"
        time.sleep(0.05)
    assert "GET /v1/jobs?state=queued&token=REDACTED&access_token=REDACTED HTTP/1.1" in text, text[-2000:]
    assert "GET /v1/jobs/gpush_REDACTED HTTP/1.1" in text
    assert TOKEN not in text and "S3cr3t" not in text and "hunter2" not in text


@pytest.mark.parametrize(
    ("path", "logged"),
    [
        ("/v1/jobs?token=abc", "/v1/jobs?token=REDACTED"),
        ("/v1/jobs?state=queued&api_key=k&cursor=eyJ", "/v1/jobs?state=queued&api_key=REDACTED&cursor=eyJ"),
        ("/v1/jobs?TOKEN=abc&x=1", "/v1/jobs?TOKEN=REDACTED&x=1"),
        ("/v1/auth/thing?user=alice", "/v1/auth/thing?user=alice"),  # only a query's secrets
        ("/v1/jobs?label=password%3Dx", "/v1/jobs?label=password%3Dx"),
        ("/v1/jobs?user=" + TOKEN, "/v1/jobs?user=gpush_REDACTED"),
        ("/v1/jobs?state=queued", "/v1/jobs?state=queued"),
    ],
)
def test_redact_takes_secrets_out_of_a_path_and_leaves_the_rest(path, logged):
    assert redact(path) == logged


def test_the_access_filter_redacts_uvicorns_own_line():
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", f"/v1/jobs?token={TOKEN}", "1.1", 401), None,
    )  # fmt: skip
    assert RedactSecrets().filter(record)
    line = AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False).format(record)
    assert line == '127.0.0.1:5000 - "GET /v1/jobs?token=REDACTED HTTP/1.1" 401 Unauthorized'


# -- /metrics beyond loopback ----------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_addresses_are_loopback(host):
    assert not listens_beyond_loopback(host)
    check_metrics_exposure(host, {})


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.5", "broker.example.com", ""])
def test_beyond_loopback_needs_the_metrics_token(host):
    assert listens_beyond_loopback(host)
    with pytest.raises(InvalidRequest, match="GPUSH_METRICS_TOKEN") as refused:
        check_metrics_exposure(host, {})
    assert "tenant" in refused.value.message
    check_metrics_exposure(host, {"GPUSH_METRICS_TOKEN": "s3cret"})


def test_gpush_server_beyond_loopback_without_a_metrics_token_refuses_to_start(tmp_path):
    done = subprocess.run(
        [*GPUSH, "server", "--host", "0.0.0.0", "--port", str(free_port())],
        env=server_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "GPUSH_METRICS_TOKEN" in done.stderr and "0.0.0.0" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "gpush.db").exists()  # refused before anything was made


def test_gpush_server_beyond_loopback_with_a_metrics_token_serves_metrics_to_its_holder(server):
    url, _log = server
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_server_help_says_what_metrics_show_beside_the_bind_address(gpush):
    done = gpush("server", "--help")
    assert done.code == 0
    assert "GPUSH_METRICS_TOKEN" in done.out and "tenant" in done.out


# -- the OpenAPI document -------------------------------------------------------------------


def test_submit_documents_the_200_of_a_replayed_idempotency_key_beside_its_201(app, http):
    responses = app.openapi()["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"200", "201"} <= set(responses)
    assert "idempotency key" in responses["200"]["description"]
    assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/JobOut"}
    client = http()
    job = {"kind": "training", "gpus": 1, "command": ["true"], "idempotency_key": "once"}
    assert [client.post("/v1/jobs", json=job).status_code for _ in range(2)] == [201, 200]
