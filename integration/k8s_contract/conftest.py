"""The ``kube`` fixture of the contract suite: one Kubernetes API per session, test server or real.

By default (CI, ``make test``) the session starts the project's Kubernetes API test server
(integration/k8s/apiserver.py) with the node simulator (integration/k8s/simulator.py) over two
time-sliced T4 nodes, because the behaviour gpush relies on includes what a cluster's controllers
do (a Job's Pods, a Deployment's replicas, garbage collection); the simulator plays those, as
KWOK does, through the API only.

With ``GPUSH_K8S_CONTRACT=1`` the session uses the cluster that ``KUBECONFIG`` names instead (its
current context, or ``GPUSH_K8S_CONTRACT_CONTEXT``); every object goes into a namespace
``gpush-contract-<random>`` created for the session and deleted at its end, and Nodes are only
read. The admin's command is ``GPUSH_K8S_CONTRACT=1 KUBECONFIG=~/.kube/config make k8s-contract``;
``GPUSH_K8S_CONTRACT=1`` without ``KUBECONFIG`` is an error, never a silent run on the test server.

``Kube.test_server_only`` skips a test on a real cluster, for conditions only the test server can
force.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

CONTRACT_ENV = "GPUSH_K8S_CONTRACT"
CONTEXT_ENV = "GPUSH_K8S_CONTRACT_CONTEXT"
NAMESPACE_LABEL = "gpush.io/contract"

_targets: list[str] = []  # what the session ran against, for the terminal summary


@dataclass
class Kube:
    """One Kubernetes API for the whole session and what the tests need to know about it."""

    api: client.ApiClient
    namespace: str
    target: str
    # For gpush's own client (adapters.k8s.client.KubeClient): None means $KUBECONFIG.
    kubeconfig: str | None
    context: str | None
    # Seconds to wait for what a cluster does asynchronously (controllers, garbage collection,
    # graceful Pod termination): generous on a real cluster, whose kubelets stop containers.
    timeout: float
    server: Any = None  # the TestApiServer, None on a real cluster
    simulator: Any = None
    _apis: dict[str, Any] = field(default_factory=dict)

    @property
    def real(self) -> bool:
        return self.server is None

    def _typed(self, cls: type) -> Any:
        if cls.__name__ not in self._apis:
            self._apis[cls.__name__] = cls(self.api)
        return self._apis[cls.__name__]

    @property
    def core(self) -> client.CoreV1Api:
        return self._typed(client.CoreV1Api)

    @property
    def apps(self) -> client.AppsV1Api:
        return self._typed(client.AppsV1Api)

    @property
    def batch(self) -> client.BatchV1Api:
        return self._typed(client.BatchV1Api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return self._typed(client.CustomObjectsApi)

    def test_server_only(self, why: str) -> None:
        """Skip on a real cluster: for behaviour a test cannot bring about there (the test is marked
        ``may_skip``, or the skip fails under GPUSH_CI=1: tests/skips.py)."""
        if self.real:
            pytest.skip(f"cannot be forced on a real cluster: {why}")


def _wait_for_default_service_account(core: client.CoreV1Api, namespace: str, timeout: float) -> None:
    # A real cluster's controller-manager creates it a moment after the namespace; until then
    # the ServiceAccount admission plugin refuses every Pod.
    deadline = time.monotonic() + timeout
    while True:
        try:
            core.read_namespaced_service_account("default", namespace)
            return
        except ApiException as exc:
            if exc.status != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


@contextmanager
def _real_cluster() -> Iterator[Kube]:
    raw = os.environ.get("KUBECONFIG", "")
    kubeconfig = os.pathsep.join(str(Path(p).expanduser()) for p in raw.split(os.pathsep) if p)
    if not kubeconfig:
        pytest.fail(
            f"{CONTRACT_ENV}=1 asks for a real cluster, but KUBECONFIG is not set: "
            f"run `{CONTRACT_ENV}=1 KUBECONFIG=~/.kube/config make k8s-contract`",
            pytrace=False,
        )
    context = os.environ.get(CONTEXT_ENV) or None
    api = config.new_client_from_config(config_file=kubeconfig, context=context)
    core = client.CoreV1Api(api)
    namespace = f"gpush-contract-{secrets.token_hex(4)}"
    core.create_namespace({"metadata": {"name": namespace, "labels": {NAMESPACE_LABEL: "true"}}})
    target = f"the cluster at {api.configuration.host} (KUBECONFIG {kubeconfig}, context {context or 'current'})"
    try:
        _wait_for_default_service_account(core, namespace, 60)
        yield Kube(
            api=api,
            namespace=namespace,
            target=target,
            kubeconfig=None if os.pathsep in kubeconfig else kubeconfig,
            context=context,
            timeout=120.0,
        )
    finally:
        try:
            core.delete_namespace(namespace, propagation_policy="Background")
        finally:
            api.close()


@contextmanager
def _test_server() -> Iterator[Kube]:
    from integration.k8s.apiserver import start
    from integration.k8s.gpu_nodes import GpuPool
    from integration.k8s.simulator import Simulator

    server = start()
    workdir = Path(tempfile.mkdtemp(prefix="gpush-k8s-contract-"))
    kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
    api = config.new_client_from_config(config_file=str(kubeconfig))
    pool = GpuPool("contract-t4", count=2, product="Tesla-T4", gpus_per_node=4, replicas=4, cpu="32", memory="128Gi")
    simulator = None
    try:
        simulator = Simulator(api, [pool]).start()
        simulator.create_nodes()
        namespace = f"gpush-contract-{secrets.token_hex(4)}"
        client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace, "labels": {NAMESPACE_LABEL: "true"}}})
        yield Kube(
            api=api,
            namespace=namespace,
            target=f"the Kubernetes API test server at {server.url} with the node simulator",
            kubeconfig=str(kubeconfig),
            context=None,
            timeout=20.0,
            server=server,
            simulator=simulator,
        )
    finally:
        if simulator is not None:
            simulator.stop()
        api.close()
        server.stop()
        kubeconfig.unlink(missing_ok=True)
        workdir.rmdir()


@pytest.fixture(scope="session")
def kube() -> Iterator[Kube]:
    """The API under contract: a real cluster with GPUSH_K8S_CONTRACT=1, else the test server."""
    source = _real_cluster if os.environ.get(CONTRACT_ENV) == "1" else _test_server
    with source() as found:
        _targets.append(found.target)
        yield found


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for target in _targets:
        terminalreporter.write_line(f"Kubernetes contract suite ran against {target}")
