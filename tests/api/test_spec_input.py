"""Hostile job specs through the API (issue 14): values no cluster can take and specs
over their limits are a 4xx in the error envelope, never a 500, and the error body
echoes a value it can write."""

from __future__ import annotations

import json

import pytest

TRAIN = b'{"kind": "training", "command": ["true"]'


def post_raw(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


def refusal(response) -> dict:
    assert 400 <= response.status_code < 500, response.text[:500]
    error = response.json()["error"]
    assert error["details"]
    assert len(response.content) < 5000  # the error does not echo a whole field back
    return error


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(b', "command": ["python", "\\ud800"]', id="argv-surrogate"),
        pytest.param(b', "command": "echo \\udc00"', id="shell-surrogate"),
        pytest.param(b', "env": {"A": "\\ud83d"}', id="env-value-surrogate"),
        pytest.param(b', "env": {"\\ud800": "x"}', id="env-name-surrogate"),
        pytest.param(b', "labels": {"a": "\\ud800"}', id="label-surrogate"),
        pytest.param(b', "image": "\\ud800"', id="image-surrogate"),
        pytest.param(b', "\\ud800": 1', id="unknown-field-surrogate"),
        pytest.param(b', "gpu_memory_gb": NaN', id="gpu-memory-nan"),
        pytest.param(b', "gpu_memory_gb": Infinity', id="gpu-memory-inf"),
        pytest.param(b', "gpu_memory_gb": 1e400', id="gpu-memory-1e400"),
        pytest.param(b', "memory": NaN', id="memory-nan"),
        pytest.param(b', "memory": 1e400', id="memory-1e400"),
        pytest.param(b', "time_limit": NaN', id="time-limit-nan"),
        pytest.param(b', "time_limit": -Infinity', id="time-limit-inf"),
        pytest.param(b', "cpus": 1e400', id="cpus-1e400"),
        pytest.param(b', "priority": NaN', id="priority-nan"),
        pytest.param(b', "env": {"A": NaN}', id="env-nan"),
        pytest.param(b', "labels": {"a": 1e400}', id="label-1e400"),
        pytest.param(b', "elastic": {"max_replicas": Infinity}', id="elastic-inf"),
        pytest.param(b', "command": ["python", "a\\u0000b"]', id="argv-nul"),
        pytest.param(b', "env": {"A": "1\\r"}', id="env-cr"),
        pytest.param(b', "env": {"X\\n": "1"}', id="env-name-newline"),
        pytest.param(b', "labels": {"app\\n": "x"}', id="label-newline"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/jobs:batch"])
def test_a_value_no_cluster_can_take_is_a_4xx_that_can_echo_it(http, sessions, path, extra):
    job = TRAIN + extra + b"}"
    raw = job if path == "/v1/jobs" else b'{"jobs": [' + job + b"]}"

    error = refusal(post_raw(http(), path, raw))

    assert error["code"] == "invalid"
    json.dumps(error, allow_nan=False)  # what was sent back is plain JSON


def test_a_10_mb_command_is_refused_naming_its_limit(http):
    response = http().post("/v1/jobs", json={"kind": "training", "command": ["echo", "y" * 10_000_000]})

    error = refusal(response)
    assert "GPUSH_MAX_ARG_CHARS" in error["message"]


@pytest.mark.parametrize(
    ("fields", "setting"),
    [
        ({"command": ["true"] * 100_000}, "GPUSH_MAX_COMMAND_ITEMS"),
        ({"env": {f"V{i}": "1" for i in range(100_000)}}, "GPUSH_MAX_ENV_VARS"),
        ({"labels": {f"l{i}": "x" for i in range(100_000)}}, "GPUSH_MAX_LABELS"),
    ],
)
def test_100_000_items_are_refused_naming_the_limit(http, fields, setting):
    response = http().post("/v1/jobs", json={"kind": "training", "command": ["true"], **fields})

    error = refusal(response)
    assert setting in error["message"]


def test_a_batch_over_its_limit_is_refused_naming_the_limit(http, monkeypatch, sessions):
    from broker.core.spec_values import spec_limits

    monkeypatch.setenv("GPUSH_MAX_BATCH_JOBS", "2")
    spec_limits.cache_clear()
    try:
        jobs = [{"kind": "training", "command": ["true"]}] * 3
        error = refusal(http().post("/v1/jobs:batch", json={"jobs": jobs}))
        assert "GPUSH_MAX_BATCH_JOBS" in error["message"] and error["details"][0]["field"] == "jobs"
        assert http().post("/v1/jobs:batch", json={"jobs": jobs[:2]}).status_code == 201
    finally:
        spec_limits.cache_clear()
