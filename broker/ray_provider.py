"""Ray's autoscaler node provider backed by gpush (``provider: {type: external, module:
broker.ray_provider.GpushNodeProvider}`` in the cluster YAML).

The shim between Ray's v1 ``NodeProvider`` interface and :mod:`broker.ray_workers`,
which does the work and states what callers may assume. This is the one gpush module
that imports Ray; gpush installs and runs without it (``pip install gpush[ray]``).

The provider never reaches the nodes itself (``disable_node_updaters: true``): a
worker's gpush job runs ``ray start`` on whatever node its cluster picks. The head is
started by hand (``ray start --head --autoscaling-config=cluster.yaml``) and is listed
as node ``head`` so the autoscaler keeps its load metrics.
"""

from __future__ import annotations

import logging
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

from broker.ray_workers import HEAD_NODE_ID, GpushWorkers, ProviderSettings

logger = logging.getLogger(__name__)


class GpushNodeProvider(NodeProvider):
    """Each Ray worker node is one gpush job (see broker.ray_workers)."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self.workers = GpushWorkers(ProviderSettings.from_provider_config(provider_config), cluster_name)
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
        nodes.update({node_id: node.tags for node_id, node in self.workers.refresh().items()})
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
