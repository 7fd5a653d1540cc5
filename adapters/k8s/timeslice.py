"""The GPU Operator's time-slicing configuration: render it, apply it, read it back.

Time-slicing is configured in two places (NVIDIA GPU Operator, "Time-Slicing GPUs in
Kubernetes"): a ConfigMap in the operator's namespace whose keys are device plugin
configs (``version: v1``, ``sharing.timeSlicing.resources: [{name: nvidia.com/gpu,
replicas: N}]``), and the ClusterPolicy's ``spec.devicePlugin.config`` that names the
ConfigMap and, with ``default``, the key every node uses. A node labelled
``nvidia.com/device-plugin.config=<key>`` uses that key instead.

What callers may assume:

- :func:`render_timeslice` is pure: ``--replicas N`` alone makes key ``any`` the
  cluster's default; with ``--node-label KEY=VALUE`` the config gets its own key
  (``replicas-N``) that only the nodes matching that selector are labelled to use.
  ``replicas`` 1 renders a config without sharing (time-slicing off).
- The rendered config sets no ``flags``, so the ClusterPolicy's MIG strategy stays
  in force on MIG nodes (NVIDIA's examples set ``migStrategy: none``, which would turn
  a mixed-strategy node's slices off).
- :func:`apply_timeslice` merges the key into the ConfigMap (other keys stay), patches
  the ClusterPolicy (merge patch: the rest of the policy stays) and labels the
  selected nodes; it returns what it changed, one line each. The device plugin picks
  the change up on its own (the operator's config-manager sidecar watches the label
  and the ConfigMap); nodes advertise the new replica count once it has.
- :func:`read_timeslice` and :meth:`TimesliceState.replicas_for` tell the inventory
  what each node should advertise, for its drift findings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from adapters.k8s.client import AlreadyExists, KubeClient, NotFound
from adapters.k8s.render import DEVICE_PLUGIN_CONFIG, GPU_RESOURCE
from broker.core.adapter import Rejected
from broker.core.errors import InvalidRequest
from broker.core.yamltext import load_yaml

CLUSTER_POLICY = ("nvidia.com", "v1", "clusterpolicies")
CLUSTER_POLICY_NAME = "cluster-policy"  # the GPU Operator's Helm chart names its one ClusterPolicy so
DEFAULT_CONFIG = "gpu-operator/time-slicing-config"
DEFAULT_KEY = "any"


def parse_ref(ref: str) -> tuple[str, str]:
    """``NAMESPACE/NAME`` of the time-slicing ConfigMap (``NAME`` alone: gpu-operator/NAME)."""
    namespace, _, name = ref.rpartition("/")
    return (namespace or "gpu-operator"), name


def device_plugin_config(replicas: int) -> dict[str, Any]:
    """The device plugin's config for ``replicas`` time-slices of every GPU."""
    if replicas < 1:
        raise ValueError(f"replicas must be 1 (no sharing) or more, not {replicas}")
    config: dict[str, Any] = {"version": "v1"}
    if replicas > 1:
        config["sharing"] = {"timeSlicing": {"resources": [{"name": GPU_RESOURCE, "replicas": replicas}]}}
    return config


def replicas_in(config_text: str) -> int | None:
    """The ``nvidia.com/gpu`` replicas a device plugin config gives (1: not shared); None
    when the text is not a config gpush can read."""
    try:
        # Anyone who may edit the ConfigMap writes this text: read it within the limits
        # of every YAML gpush reads.
        config = load_yaml(config_text, source="the device plugin config")
    except InvalidRequest:
        return None
    if not isinstance(config, dict):
        return None
    sharing = config.get("sharing") or {}
    for strategy in ("timeSlicing", "mps"):
        for resource in (sharing.get(strategy) or {}).get("resources") or []:
            if isinstance(resource, dict) and resource.get("name") == GPU_RESOURCE:
                try:
                    return int(resource.get("replicas") or 1)
                except (TypeError, ValueError):
                    return None
    return 1


def _node_label(node_label: str) -> tuple[str, str]:
    key, sep, value = node_label.partition("=")
    if not sep or not key.strip() or "," in node_label:
        raise ValueError(
            f"--node-label {node_label!r}: give one KEY=VALUE that selects the nodes to time-slice, "
            "e.g. nvidia.com/gpu.product=Tesla-T4"
        )
    return key.strip(), value.strip()


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the config inside the ConfigMap) as ``|`` blocks, as people write them."""


_BlockDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


@dataclass(frozen=True)
class TimeslicePlan:
    """What ``gpush k8s timeslice render`` prints and ``apply`` applies (``cluster_policy_patch``
    is a merge patch of the ClusterPolicy's spec; ``to_yaml`` makes it a whole object)."""

    replicas: int
    namespace: str
    name: str
    key: str
    config_map: dict[str, Any]
    cluster_policy_patch: dict[str, Any]
    node_selector: str | None = None  # nodes to label DEVICE_PLUGIN_CONFIG=key

    def to_yaml(self) -> str:
        """What ``kubectl apply -f -`` takes: the ConfigMap and the ClusterPolicy (only the
        fields gpush sets, which apply merges into the operator's policy), each a whole
        object; the node labels are no object, so they come as the command, in comments."""
        cluster_policy = {
            "apiVersion": "/".join(CLUSTER_POLICY[:2]),
            "kind": "ClusterPolicy",
            "metadata": {"name": CLUSTER_POLICY_NAME},
            **self.cluster_policy_patch,
        }
        slices = f"{self.replicas} slices of every GPU" if self.replicas > 1 else "off (1 slice of every GPU)"
        where = f" on the nodes labelled {self.node_selector}" if self.node_selector else ""
        header = [
            f"# Time-slicing: {slices}{where}.",
            "# Apply with `kubectl apply -f -`: the device plugin's config (a ConfigMap) and the",
            f"# GPU Operator's ClusterPolicy, whose devicePlugin.config apply merges into {CLUSTER_POLICY_NAME}",
            "# (`kubectl get clusterpolicies` shows yours: set its name below if it is another).",
        ]
        if self.node_selector:
            header += [
                "# Then label the nodes, which kubectl cannot apply from a file:",
                f"#   kubectl label nodes -l {self.node_selector} {DEVICE_PLUGIN_CONFIG}={self.key} --overwrite",
            ]
        header.append("# Or let gpush do it all: gpush k8s timeslice apply CLUSTER (same --replicas, --node-label).")
        parts = [
            *header,
            yaml.dump(self.config_map, Dumper=_BlockDumper, sort_keys=False).rstrip(),
            "---",
            yaml.safe_dump(cluster_policy, sort_keys=False).rstrip(),
        ]
        return "\n".join(parts) + "\n"


def render_timeslice(
    replicas: int, *, node_label: str | None = None, config_map: str = DEFAULT_CONFIG
) -> TimeslicePlan:
    """The ConfigMap and ClusterPolicy patch for ``replicas`` time-slices per GPU (see the
    module docstring); ``node_label`` KEY=VALUE limits it to the nodes it selects."""
    namespace, name = parse_ref(config_map)
    selector = None
    if node_label is not None:
        selector = "=".join(_node_label(node_label))
        key = f"replicas-{replicas}"
    else:
        key = DEFAULT_KEY
    text = yaml.safe_dump(device_plugin_config(replicas), sort_keys=False)
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "gpush"}},
        "data": {key: text},
    }
    config: dict[str, Any] = {"name": name}
    if selector is None:
        config["default"] = key
    patch = {"spec": {"devicePlugin": {"config": config}}}
    return TimeslicePlan(replicas, namespace, name, key, body, patch, selector)


def apply_timeslice(client: KubeClient, plan: TimeslicePlan) -> list[str]:
    """Apply a plan through the API; returns what changed, one line each."""
    done: list[str] = []
    existing = client.get("configmaps", plan.namespace, plan.name)
    data = plan.config_map["data"]
    if existing is None:
        try:
            client.create("configmaps", plan.namespace, plan.config_map)
            done.append(f"created ConfigMap {plan.namespace}/{plan.name} with key {plan.key}")
        except AlreadyExists:
            existing = client.get("configmaps", plan.namespace, plan.name)
        except NotFound:
            raise Rejected(
                f"namespace {plan.namespace} does not exist: is the GPU Operator installed there? "
                "(set the cluster's timeslice_config to NAMESPACE/NAME)"
            ) from None
    if existing is not None:
        if (existing.get("data") or {}).get(plan.key) == data[plan.key]:
            done.append(f"ConfigMap {plan.namespace}/{plan.name} already has key {plan.key} as rendered")
        else:
            client.patch("configmaps", plan.namespace, plan.name, {"data": data})
            done.append(f"set key {plan.key} of ConfigMap {plan.namespace}/{plan.name}")
    policies = client.list_custom(*CLUSTER_POLICY)
    if not policies:
        raise Rejected(
            "no ClusterPolicy (clusterpolicies.nvidia.com) found: is the NVIDIA GPU Operator installed? "
            f"The ConfigMap is in place; point the device plugin at {plan.namespace}/{plan.name} yourself"
        )
    for policy in policies:
        policy_name = policy["metadata"]["name"]
        client.patch_custom(*CLUSTER_POLICY, policy_name, plan.cluster_policy_patch)
        config = plan.cluster_policy_patch["spec"]["devicePlugin"]["config"]
        said = ", ".join(f"{k}={v}" for k, v in config.items())
        done.append(f"patched ClusterPolicy {policy_name}: devicePlugin.config {said}")
    if plan.node_selector:
        nodes, _ = client.list("nodes", label_selector=plan.node_selector)
        if not nodes:
            done.append(f"no node matches {plan.node_selector}: nothing labelled")
        for node in nodes:
            node_name = node["metadata"]["name"]
            if ((node["metadata"].get("labels") or {}).get(DEVICE_PLUGIN_CONFIG)) == plan.key:
                continue
            client.patch("nodes", None, node_name, {"metadata": {"labels": {DEVICE_PLUGIN_CONFIG: plan.key}}})
            done.append(f"labelled node {node_name} {DEVICE_PLUGIN_CONFIG}={plan.key}")
    return done


@dataclass(frozen=True)
class TimesliceState:
    """The time-slicing config in force: the ConfigMap's keys and the default key."""

    namespace: str
    name: str
    data: Mapping[str, str] = field(default_factory=dict)
    default_key: str | None = None

    def replicas_for(self, node_labels: Mapping[str, str]) -> tuple[int | None, str]:
        """(replicas the node should advertise, where that comes from); None when unknown
        (the node names a key the ConfigMap lacks, or the config cannot be read)."""
        key = node_labels.get(DEVICE_PLUGIN_CONFIG) or self.default_key
        where = f"ConfigMap {self.namespace}/{self.name}"
        if key is None:
            return 1, f"{where} (no default key, node not labelled {DEVICE_PLUGIN_CONFIG})"
        text = self.data.get(key)
        if text is None:
            return None, f"{where} has no key {key}"
        return replicas_in(text), f"{where} key {key}"


def read_timeslice(client: KubeClient, config_map: str = DEFAULT_CONFIG) -> TimesliceState | None:
    """The time-slicing config in force, or None when there is none to compare against
    (no ConfigMap). The ClusterPolicy, when there is one, names the ConfigMap and the default."""
    namespace, name = parse_ref(config_map)
    default_key = None
    for policy in client.list_custom(*CLUSTER_POLICY):
        config = ((policy.get("spec") or {}).get("devicePlugin") or {}).get("config") or {}
        name = config.get("name") or name
        default_key = config.get("default") or None
        break
    found = client.get("configmaps", namespace, name)
    if found is None:
        return None
    return TimesliceState(namespace, name, dict(found.get("data") or {}), default_key)
