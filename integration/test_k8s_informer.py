"""The k8s adapter's informer (adapters/k8s/informer.py) against the test API server's own compaction.

The test API server now compacts its history on a timer as kube-apiserver does, so a client that
lists once and watches forever meets 410 Gone as it would on a cluster. The informer must keep
its cache equal to the objects across compactions, and list again when its resourceVersion is
gone (here after a restart, which forgets all history).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters.k8s.client import KubeClient
from adapters.k8s.informer import Informer
from integration.k8s.apiserver import TestApiServer, start


def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[TestApiServer]:
    server = start(state_file=tmp_path / "state.json", compaction_interval=0.2, bookmark_interval=0.1)
    yield server
    server.stop()


@pytest.fixture
def kube(server: TestApiServer, tmp_path: Path) -> KubeClient:
    return KubeClient(kubeconfig=str(server.write_kubeconfig(tmp_path / "kubeconfig")), timeout=10.0)


def cached(informer: Informer) -> dict[str, dict[str, str]]:
    return {obj["metadata"]["name"]: obj.get("data") or {} for obj in informer.snapshot()}


def stored(kube: KubeClient) -> dict[str, dict[str, str]]:
    items, _ = kube.list("configmaps", "default")
    return {obj["metadata"]["name"]: obj.get("data") or {} for obj in items}


def test_the_cache_keeps_up_across_compactions(server, kube):
    informer = Informer(kube, "configmaps", "default", watch_seconds=0.5)
    try:
        assert cached(informer) == {}
        for i in range(8):  # writes spread over several compactions of 0.2 s
            kube.create("configmaps", "default", {"metadata": {"name": f"cm-{i}"}, "data": {"v": "0"}})
            if i % 2:
                kube.patch("configmaps", "default", f"cm-{i - 1}", {"data": {"v": "1"}})
            time.sleep(0.1)
        kube.delete("configmaps", "default", "cm-7")
        assert server.store.compacted_revision > 0
        assert eventually(lambda: cached(informer) == stored(kube)), (cached(informer), stored(kube))
        assert informer.error is None
    finally:
        informer.stop()


def test_a_resource_version_the_server_no_longer_has_makes_the_informer_list_again(server, kube):
    informer = Informer(kube, "configmaps", "default", watch_seconds=0.5)
    try:
        kube.create("configmaps", "default", {"metadata": {"name": "before"}, "data": {"v": "0"}})
        assert eventually(lambda: "before" in cached(informer))
        server.restart()  # no history survives: the informer's next watch is 410 Gone
        kube.create("configmaps", "default", {"metadata": {"name": "after"}, "data": {"v": "0"}})
        assert eventually(lambda: set(cached(informer)) == {"before", "after"})
        kube.patch("configmaps", "default", "after", {"data": {"v": "1"}})
        assert eventually(lambda: cached(informer).get("after") == {"v": "1"})
    finally:
        informer.stop()
