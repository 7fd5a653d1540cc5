"""MIG layouts published through the GPU Operator's MIG manager (MigPublisher).

:class:`MigPublishing` writes gpush's mig-parted config for a node into the MIG manager's
ConfigMap (``mig_config``, or the ClusterPolicy's ``migManager.config.name``) and labels the node
``nvidia.com/mig.config``; the MIG manager's ``nvidia.com/mig.config.state`` and the node's
allocatable say when the layout is offered. What the configs and labels mean, and what follows
from Kubernetes not seeing instance placements, is adapters.k8s.mig's (pure); this module reads
and writes the objects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from adapters.k8s import quantity
from adapters.k8s.capacity import NodesAndPods
from adapters.k8s.client import AlreadyExists, Conflict, NotFound
from adapters.k8s.context import KubeContext, forbidden
from adapters.k8s.inventory import gpu_requests_by_node
from adapters.k8s.mig import (
    MIG_CONFIG_LABEL,
    MIG_PARTED_KEY,
    MIG_STATE_LABEL,
    PUBLISHED_ANNOTATION,
    MigConfigError,
    caught_up,
    config_names,
    counts_of,
    current_layouts,
    instances_of,
    merge_config,
    next_config_name,
    node_gpu_count,
    parse_configs,
    published_record,
    render_entries,
    resolve,
    whole_gpus,
)
from adapters.k8s.render import GFD_PRODUCT, MIG_RESOURCE_PREFIX, model_of_product
from adapters.k8s.timeslice import CLUSTER_POLICY, parse_ref
from broker.core.adapter import Rejected, Unreachable
from broker.core.gpus import GpuModel, gpu_model
from broker.mig.layouts import MigSlot, layout_problem


class MigPublishing:
    """MIG layouts of one cluster's nodes, through the GPU Operator's MIG manager (see the module docstring)."""

    def __init__(self, ctx: KubeContext, cache: NodesAndPods):
        self.ctx = ctx
        self.cache = cache

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        """Have the GPU Operator's MIG manager give GPU ``gpu`` of ``node`` the instances
        ``instances`` (``"3g.20gb@0"``; adapters.k8s.mig says how): gpush's mig-parted config for
        the node is written into the MIG manager's ConfigMap (its other configs kept byte for byte)
        with this GPU's new instance counts and the other GPUs' current layouts, and the node is
        labelled ``nvidia.com/mig.config=<that config>``, ``nvidia.com/mig.config.state=pending``.

        mig-parted counts instances per profile and chooses their placement itself, so the
        ``@start`` of each instance is not sent to the cluster (:meth:`mig_published` answers with
        it while the counts agree). :class:`Rejected` when the instances do not fit the node's GPU
        model, or when the node's Pods hold more of a MIG profile than the node would offer after
        the change (Kubernetes does not say which GPU a Pod's instance is on, so this is checked
        per node). Publishing what is published already, and not failed, changes nothing."""
        try:
            slots = [MigSlot.parse(text) for text in instances]
        except ValueError as exc:
            raise Rejected(str(exc)) from None
        if gpu < 0:
            raise Rejected(f"GPU indices count from 0, not {gpu}")
        found = self.ctx.node(node)
        meta = found.get("metadata") or {}
        labels = meta.get("labels") or {}
        allocatable = (found.get("status") or {}).get("allocatable") or {}
        model = self._node_model(labels)
        if model is not None:
            problem = layout_problem(model, slots)
            if problem:
                raise Rejected(f"GPU {gpu} of node {node} ({model.name}) cannot hold {', '.join(instances)}: {problem}")
        namespace, config_map = self._mig_config_ref()
        where = f"ConfigMap {namespace}/{config_map} key {MIG_PARTED_KEY}"
        own = config_names(node)
        label = labels.get(MIG_CONFIG_LABEL)
        for attempt in range(3):
            existing = self.ctx.client.get("configmaps", namespace, config_map)
            text = ((existing or {}).get("data") or {}).get(MIG_PARTED_KEY)
            try:
                configs = parse_configs(text, where)
                gpus = max(node_gpu_count(labels), gpu + 1)
                now, _ = current_layouts(labels, configs, model, gpus, own)
                wanted = {**now, gpu: counts_of(model, slots)}
                in_flight = label in own and labels.get(MIG_STATE_LABEL) in ("pending", "rebooting", "success")
                if in_flight and label in configs and resolve(configs[label], gpus, label) == wanted:
                    self._record_published(node, meta, label, gpu, instances)
                    return
                self._check_holders(node, allocatable, now.get(gpu), wanted[gpu])
                name = next_config_name(node, label)
                merged = merge_config(text, name, render_entries(wanted), drop=[n for n in own if n != name])
            except MigConfigError as exc:
                raise Rejected(f"{exc}: fix {where}, or point the cluster's mig_config at another") from None
            try:
                if existing is None:
                    self.ctx.client.create("configmaps", namespace, _mig_config_map(namespace, config_map, merged))
                elif merged != text:
                    version = (existing.get("metadata") or {}).get("resourceVersion")
                    body = {"metadata": {"resourceVersion": version}, "data": {MIG_PARTED_KEY: merged}}
                    self.ctx.client.patch("configmaps", namespace, config_map, body)
                break
            except NotFound:
                raise Rejected(
                    f"namespace {namespace} does not exist: is the GPU Operator installed there? (set the "
                    "cluster's mig_config to NAMESPACE/NAME of its mig-parted ConfigMap)"
                ) from None
            except (AlreadyExists, Conflict):
                if attempt == 2:
                    raise Unreachable(f"{where} kept changing while gpush wrote it: try again") from None
        record = published_record(meta.get("annotations") or {})
        gpus_published = {**(record.get("gpus") or {}), str(gpu): list(instances)}
        self.ctx.client.patch(
            "nodes",
            None,
            node,
            {
                "metadata": {
                    "labels": {MIG_CONFIG_LABEL: name, MIG_STATE_LABEL: "pending"},
                    "annotations": {
                        PUBLISHED_ANNOTATION: json.dumps({"config": name, "gpus": gpus_published}, sort_keys=True)
                    },
                }
            },
        )

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        """The instances GPU ``gpu`` of ``node`` offers now, as :meth:`publish_mig` takes them: those
        of the mig-parted config the node's ``nvidia.com/mig.config`` label names, once the MIG
        manager says ``success`` and the node's allocatable ``nvidia.com/mig-<profile>`` counts
        agree with the config (the device plugin has caught up). None while the MIG manager is
        still at it (``pending``, ``rebooting``), while the label names a config other than the
        one gpush last published there, or while the device plugin lags. :class:`Rejected` when
        the MIG manager failed (``failed``: its log on the node says why; publishing again
        retries), or when the config does not set that GPU."""
        found = self.ctx.node(node)
        meta = found.get("metadata") or {}
        labels = meta.get("labels") or {}
        allocatable = (found.get("status") or {}).get("allocatable") or {}
        label, state = labels.get(MIG_CONFIG_LABEL), labels.get(MIG_STATE_LABEL)
        if state == "failed":
            raise Rejected(
                f"the GPU Operator's MIG manager could not apply mig-parted config {label} on node {node} "
                f"({MIG_STATE_LABEL}=failed): the nvidia-mig-manager Pod's log on that node says why"
            )
        record = published_record(meta.get("annotations") or {})
        if state != "success" or not label or record.get("config") not in (None, label):
            return None
        namespace, config_map = self._mig_config_ref()
        where = f"ConfigMap {namespace}/{config_map} key {MIG_PARTED_KEY}"
        existing = self.ctx.client.get("configmaps", namespace, config_map)
        try:
            configs = parse_configs(((existing or {}).get("data") or {}).get(MIG_PARTED_KEY), where)
            if label not in configs:
                raise MigConfigError(f"node {node} is labelled {MIG_CONFIG_LABEL}={label}, which {where} does not hold")
            count = node_gpu_count(labels)
            layouts = resolve(configs[label], max(count, gpu + 1), label)
        except MigConfigError as exc:
            raise Rejected(str(exc)) from None
        if gpu not in layouts:
            raise Rejected(
                f"mig-parted config {label} does not set GPU {gpu} of node {node}, so Kubernetes does not show "
                "its layout"
            )
        every_gpu = set(layouts) >= set(range(count)) and whole_gpus(allocatable) == 0
        if not caught_up(layouts, allocatable, every_gpu):
            return None
        published = (record.get("gpus") or {}).get(str(gpu)) if record.get("config") == label else None
        try:
            return instances_of(self._node_model(labels), layouts[gpu], published)
        except ValueError as exc:
            raise Rejected(f"GPU {gpu} of node {node}: {exc} (name its model in the cluster's gpu_types)") from None

    def _record_published(
        self, node: str, meta: Mapping[str, Any], config: str, gpu: int, instances: Sequence[str]
    ) -> None:
        """Note ``instances`` as published on ``gpu`` when the config in force has them already."""
        record = published_record(meta.get("annotations") or {})
        gpus = record.get("gpus") or {}
        if record.get("config") == config and gpus.get(str(gpu)) == list(instances):
            return
        value = json.dumps({"config": config, "gpus": {**gpus, str(gpu): list(instances)}}, sort_keys=True)
        self.ctx.client.patch("nodes", None, node, {"metadata": {"annotations": {PUBLISHED_ANNOTATION: value}}})

    def _check_holders(
        self, node: str, allocatable: Mapping[str, Any], before: dict[str, int] | None, after: dict[str, int] | None
    ) -> None:
        """Refuse a change that leaves the node fewer instances of a profile than its Pods hold."""
        pods, _ = self.cache.bound_pods()
        held = gpu_requests_by_node(p for p in pods if (p.get("spec") or {}).get("nodeName") == node).get(node, {})
        short = []
        for resource, n in sorted(held.items()):
            if not resource.startswith(MIG_RESOURCE_PREFIX):
                continue
            profile = resource.removeprefix(MIG_RESOURCE_PREFIX)
            offered = quantity.count(allocatable.get(resource))
            left = offered - (before or {}).get(profile, 0) + (after or {}).get(profile, 0)
            if left < n:
                short.append(f"{n} {resource} held, {max(left, 0)} left")
        if short:
            raise Rejected(
                f"the node's Pods hold MIG instances the new layout takes away ({'; '.join(short)}): "
                f"drain node {node} first"
            )

    def _mig_config_ref(self) -> tuple[str, str]:
        """(namespace, name) of the MIG manager's ConfigMap: the cluster's ``mig_config``, its name
        overridden by the ClusterPolicy's ``spec.migManager.config.name`` when that is set."""
        namespace, name = parse_ref(self.ctx.settings.mig_config)
        try:
            policies = self.ctx.client.list_custom(*CLUSTER_POLICY)
        except Rejected as exc:
            if not forbidden(exc):
                raise
            policies = []  # not allowed to read the ClusterPolicy: the setting stands
        for policy in policies:
            configured = (((policy.get("spec") or {}).get("migManager") or {}).get("config") or {}).get("name")
            if configured:
                name = str(configured)
            break
        return namespace, name

    def _node_model(self, labels: Mapping[str, str]) -> GpuModel | None:
        """The node's GPU model from ``nvidia.com/gpu.product`` (a single-strategy ``-MIG-`` suffix
        dropped), through the cluster's gpu_types; None when gpush does not know it."""
        product = (labels.get(GFD_PRODUCT) or "").split("-MIG-", 1)[0]
        name = model_of_product(product, self.ctx.gpu_types) if product else None
        try:
            return gpu_model(name) if name else None
        except ValueError:
            return None


def _mig_config_map(namespace: str, name: str, text: str) -> dict[str, Any]:
    """The MIG manager's ConfigMap as gpush creates it when the cluster has none."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "gpush"}},
        "data": {MIG_PARTED_KEY: text},
    }
