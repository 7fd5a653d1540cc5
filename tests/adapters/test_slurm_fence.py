"""Draining and resuming a node through slurmrestd (the command line is tested on the real
cluster, integration/test_slurm_adapter.py): the body each version takes, and what is refused."""

from __future__ import annotations

import json

import httpx
import pytest

from adapters.slurm.client import RestBackend
from broker.core.adapter import Rejected


def restd(version: str, asked: list):
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/openapi/v3", "/openapi"):
            return httpx.Response(
                200, json={"paths": {f"/slurm/{version}/ping": {}, f"/slurm/{version}/node/{{n}}": {}}}
            )
        asked.append((request.method, request.url.path, json.loads(request.content or b"null")))
        if request.url.path.endswith("/node/nosuch"):
            return httpx.Response(
                400, json={"errors": [{"error": "Invalid node name specified", "error_number": 2009}]}
            )
        return httpx.Response(200, json={"errors": []})

    return RestBackend(url="http://slurm-head:6820", user="gpush", token="jwt", transport=httpx.MockTransport(answer))


def test_drain_and_resume_post_the_node_state_and_reason():
    asked: list = []
    backend = restd("v0.0.41", asked)
    backend.drain("mig01", "gpush: MIG change 1")
    backend.resume("mig01")
    assert asked == [
        ("POST", "/slurm/v0.0.41/node/mig01", {"state": ["DRAIN"], "reason": "gpush: MIG change 1"}),
        ("POST", "/slurm/v0.0.41/node/mig01", {"state": ["RESUME"]}),
    ]
    with pytest.raises(Rejected, match="Slurm has no node nosuch"):
        backend.drain("nosuch", "gpush: x")


def test_slurm_2205s_restd_cannot_drain_and_says_what_to_do():
    asked: list = []
    with pytest.raises(Rejected, match="command-line backend"):
        restd("v0.0.38", asked).drain("mig01", "gpush: MIG change 1")
    assert asked == []
