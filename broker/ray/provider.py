"""Ray's autoscaler node provider backed by gpush (``provider: {type: external, module:
broker.ray.provider.GpushNodeProvider}`` in the cluster YAML).

The shim between Ray's v1 ``NodeProvider`` interface and :mod:`broker.ray.workers`,
which does the work and states what callers may assume. This is the one gpush module
that imports Ray; gpush installs and runs without it (``pip install gpush[ray]``).

The provider never reaches the nodes itself (``disable_node_updaters: true``): a
worker's gpush job runs ``ray start`` on whatever node its cluster picks. The head is
started by hand (``ray start --head --autoscaling-config=cluster.yaml``) and is listed
as node ``head`` so the autoscaler keeps its load metrics.

Cancelling queued workers that no demand wants needs two things the provider is not
given: the cluster's demand and the cluster YAML beyond its provider section. It runs in
the autoscaler's monitor process on the head (``ray/autoscaler/_private/monitor.py``),
which reads both: :class:`RayDemand` asks the GCS what the monitor asks it each update
(``get_all_resource_usage()``: task and actor shapes, pending placement groups; the
internal KV: ``request_resources``), through the monitor's own GCS client; and the YAML
is the file the monitor was started with (``--autoscaling-config``), read for
``idle_timeout_minutes`` and each node type's ``min_workers``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    STATUS_UP_TO_DATE,
    TAG_RAY_LAUNCH_CONFIG,
    TAG_RAY_LAUNCH_REQUEST,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from broker.core.errors import InvalidRequest
from broker.core.yamltext import load_yaml
from broker.ray.workers import (
    HEAD_NODE_ID,
    RAY_DEFAULT_IDLE_TIMEOUT_MINUTES,
    GpushWorkers,
    ProviderSettings,
)

logger = logging.getLogger(__name__)


def _monitor_arg(name: str, argv: Sequence[str] | None = None) -> str | None:
    """``--name=value`` (or ``--name value``) from the monitor's command line."""
    argv = sys.argv if argv is None else argv
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def monitor_cluster_config(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """The cluster YAML the autoscaler's monitor was started with, or None outside one."""
    path = _monitor_arg("autoscaling-config", argv)
    if not path:
        return None
    try:
        with open(os.path.expanduser(path)) as f:
            config = load_yaml(f.read(), source=path)
    except (OSError, InvalidRequest) as exc:
        logger.warning("gpush: could not read the cluster config %s: %s", path, exc)
        return None
    return config if isinstance(config, dict) else None


class Gcs:
    """The GCS client of the monitor the provider runs in (or one of its own)."""

    def __init__(self, gcs_address: str | None) -> None:
        self._gcs_address = gcs_address
        self._client = None

    def __call__(self):
        if self._client is None:
            from ray.experimental.internal_kv import internal_kv_get_gcs_client

            # The monitor sets its GCS client up for the internal KV before it creates us.
            self._client = internal_kv_get_gcs_client()
            if self._client is None:
                from ray._raylet import GcsClient

                self._client = GcsClient(address=self._gcs_address)
        return self._client


class RayDemand:
    """What the Ray cluster waits for, read from the GCS as the v1 monitor reads it:
    waiting and infeasible task/actor shapes, the bundles of pending placement groups,
    and the bundles of ``request_resources``. None when the GCS does not answer."""

    def __init__(self, gcs: Gcs) -> None:
        self._gcs = gcs
        self._failing = False

    def __call__(self) -> list[dict[str, float]] | None:
        from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
        from ray.autoscaler._private.monitor import parse_resource_demands

        try:
            gcs = self._gcs()
            data = gcs.get_all_resource_usage(timeout=10).resource_usage_data
            waiting, infeasible = parse_resource_demands(data.resource_load_by_shape)
            shapes = [dict(s) for s in waiting + infeasible]
            for group in data.placement_group_load.placement_group_data:
                shapes += [dict(bundle.unit_resources) for bundle in group.bundles]
            requested = gcs.internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL, None, timeout=10)
            if requested:
                shapes += [dict(b) for b in json.loads(requested) if isinstance(b, dict)]
        except Exception as exc:  # any failure: unknown demand, which keeps every queued worker
            if not self._failing:
                logger.warning("gpush: could not read the Ray cluster's demand (queued workers are kept): %s", exc)
            self._failing = True
            return None
        self._failing = False
        return shapes


class JoinedRaylets:
    """The raylets alive in the Ray cluster, keyed as the v1 monitor keys its load metrics
    (``monitor.py``'s ``update_load_metrics``): the node's IP, or with ``use_node_id_as_ip``
    its ``NODE_ID_AS_RESOURCE``. None when the GCS does not answer."""

    def __init__(self, gcs: Gcs, use_node_id_as_ip: bool) -> None:
        self._gcs = gcs
        self._by_node_id = use_node_id_as_ip
        self._failing = False

    def __call__(self) -> set[str] | None:
        from ray.autoscaler.v2.sdk import get_cluster_resource_state
        from ray.core.generated.autoscaler_pb2 import NodeStatus

        try:
            nodes = [n for n in get_cluster_resource_state(self._gcs()).node_states if n.status != NodeStatus.DEAD]
        except Exception as exc:  # any failure: unknown, and every running worker is up-to-date
            if not self._failing:
                logger.warning("gpush: could not read which raylets joined (running workers taken as joined): %s", exc)
            self._failing = True
            return None
        self._failing = False
        if not self._by_node_id:
            return {n.node_ip_address for n in nodes}
        numbers = (n.total_resources.get("NODE_ID_AS_RESOURCE") for n in nodes)
        return {str(int(number)) for number in numbers if number is not None}


class GpushNodeProvider(NodeProvider):
    """Each Ray worker node is one gpush job (see broker.ray.workers)."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        settings = ProviderSettings.from_provider_config(provider_config)
        cluster = monitor_cluster_config() or {}
        node_types = cluster.get("available_node_types") or {}
        gcs = Gcs(_monitor_arg("gcs-address") or settings.head_address)
        self.workers = GpushWorkers(
            settings,
            cluster_name,
            demand=RayDemand(gcs),
            raylets=JoinedRaylets(gcs, bool(provider_config.get("use_node_id_as_ip"))),
            idle_timeout_minutes=float(cluster.get("idle_timeout_minutes", RAY_DEFAULT_IDLE_TIMEOUT_MINUTES)),
            min_workers={name: int(t.get("min_workers", 0) or 0) for name, t in node_types.items()},
        )
        logger.info(
            "gpush: queued workers no demand wants are cancelled after %g s%s",
            self.workers.queued_idle_timeout_s,
            "" if cluster else " (the cluster YAML was not found: min_workers unknown, taken as 0)",
        )
        self._head_type = provider_config.get("head_node_type", "ray.head.default")

    # -- what exists ------------------------------------------------------------------

    def _head_tags(self) -> dict[str, str]:
        return {
            TAG_RAY_NODE_KIND: NODE_KIND_HEAD,
            TAG_RAY_NODE_NAME: f"ray-{self.cluster_name}-head",
            TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
            TAG_RAY_USER_NODE_TYPE: self._head_type,
        }

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        nodes = {HEAD_NODE_ID: self._head_tags()}
        nodes.update({node_id: node.tags for node_id, node in self.workers.reap().items()})
        return [node_id for node_id, tags in nodes.items() if all(tags.get(k) == v for k, v in tag_filters.items())]

    def is_running(self, node_id: str) -> bool:
        if node_id == HEAD_NODE_ID:
            return True
        node = self.workers.node(node_id)
        return node is not None and node.running

    def is_terminated(self, node_id: str) -> bool:
        return node_id != HEAD_NODE_ID and self.workers.node(node_id) is None

    def node_tags(self, node_id: str) -> dict[str, str]:
        if node_id == HEAD_NODE_ID:
            return self._head_tags()
        node = self.workers.node(node_id)
        return dict(node.tags) if node else {}

    def internal_ip(self, node_id: str) -> str:
        if node_id == HEAD_NODE_ID:
            return self.workers.head_ip()
        node = self.workers.node(node_id)
        return node.internal_ip if node else ""

    def external_ip(self, node_id: str) -> str:
        return self.internal_ip(node_id)

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        self.workers.set_tags(node_id, tags)

    # -- launching and terminating ------------------------------------------------------

    def create_node(self, node_config: dict[str, Any], tags: dict[str, str], count: int) -> dict[str, Any]:
        return self.create_node_with_resources_and_labels(node_config, tags, count, {}, {})

    def create_node_with_resources_and_labels(
        self,
        node_config: dict[str, Any],
        tags: dict[str, str],
        count: int,
        resources: dict[str, float],
        labels: dict[str, str],
    ) -> dict[str, Any]:
        node_type = tags.get(TAG_RAY_USER_NODE_TYPE, "")
        nodes = self.workers.launch(
            node_type,
            node_config,
            resources,
            count,
            launch_config=tags.get(TAG_RAY_LAUNCH_CONFIG, ""),
            request_id=tags.get(TAG_RAY_LAUNCH_REQUEST),
            labels=labels,
        )
        logger.info("gpush: launched %s %s worker(s) as jobs %s", count, node_type, [n.node_id for n in nodes])
        return {node.node_id: node.job for node in nodes}

    def terminate_node(self, node_id: str) -> None:
        self.workers.terminate([node_id])

    def terminate_nodes(self, node_ids: list[str]) -> None:
        logger.info("gpush: terminating workers %s", node_ids)
        self.workers.terminate(node_ids)

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        provider = cluster_config.setdefault("provider", {})
        # gpush's clusters start the nodes; the autoscaler must not try to SSH into them.
        provider.setdefault("disable_node_updaters", True)
        provider.setdefault("disable_launch_config_check", False)
        provider.setdefault("head_node_type", cluster_config.get("head_node_type", "ray.head.default"))
        return cluster_config
