"""A Kubernetes node pool's GPUs as inventory records, from Node objects and Pod requests.

What callers may assume of :func:`node_units`:

- **Time-slicing counts physical GPUs.** A node whose GPU Feature Discovery labels say
  time-slicing (``nvidia.com/gpu.sharing-strategy=time-slicing``, or no strategy label
  and ``nvidia.com/gpu.replicas`` > 1) gets one k8s/timeslice record per physical GPU
  (``nvidia.com/gpu.count``): ``gpus=(i,)``, ``capacity`` its replicas,
  ``gpu_equivalent`` 1/replicas. A node advertising 8 ``nvidia.com/gpu`` on 2 GPUs is
  2 GPUs of 4 replicas. The allocatable replicas are dealt to the GPUs in index order
  (fewer than count × replicas when the device plugin holds some back as unhealthy).
- **Which GPU holds a replica is not known on Kubernetes** (the device plugin does not
  publish it): the replicas the node's Pods request are counted against its GPUs in
  index order, filling GPU 0 first, and ``memory_allocated_gb`` is left None (the
  broker counts its own jobs' memory per node).
- **MIG** (the GPU Operator's mixed strategy): one k8s/mig record per
  ``nvidia.com/mig-<profile>`` resource, worth its compute share of the parent GPU
  (broker.core.gpus). A node under the single strategy advertises its slices as
  ``nvidia.com/gpu``, which gpush cannot ask for by profile: its record is ``broken``.
- **Whole GPUs**: nodes that do not share get one k8s/exclusive record. MPS nodes
  (``sharing-strategy=mps``) offer nothing to gpush.
- **Unavailable nodes** (not Ready, or cordoned) offer nothing free: their units show
  as all allocated, with ``labels["unavailable"]`` saying why.
- **Drift**: a node whose advertised replicas differ from what the time-slicing
  ConfigMap says for it (``expected``) carries ``labels["drift"]``, as does one whose
  allocatable replicas disagree with its own labels (a device plugin not yet restarted).
- **Topology** (broker.core.topology): every record of a node carries its ``topology``, the
  node's domain at each of the cluster's ``topology_levels`` (adapters.k8s.topology), widest
  first; a node without one of those labels has domain None at that level (the broker calls
  that drift; these records only say it). ``free_gpus`` and ``gpu_topology`` stay None:
  Kubernetes says through its API how many ``nvidia.com/gpu`` a node has free, not which
  device indexes (the device plugin keeps that to itself, and picks them for each Pod), nor how
  a node's GPUs are joined by NVLink (GPU Feature Discovery labels neither), so gpush does
  not choose devices on Kubernetes.
- **GPU models** come from ``nvidia.com/gpu.product`` (``-SHARED`` dropped), through
  the cluster's ``gpu_types`` and then gpush's own names; an unknown product keeps its
  label as the model, with the memory from ``nvidia.com/gpu.memory``.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from adapters.k8s import quantity
from adapters.k8s.render import (
    GFD_COUNT,
    GFD_MEMORY,
    GFD_MIG_STRATEGY,
    GFD_PRODUCT,
    GFD_REPLICAS,
    GFD_SHARING,
    GPU_RESOURCE,
    MIG_RESOURCE_PREFIX,
    model_of_product,
)
from adapters.k8s.topology import TopologyLevel, node_position
from broker.core.adapter import CapacityUnit, Sharing
from broker.core.gpus import MODELS, GpuModel, gpu_model

_MIG_PRODUCT = re.compile(r"^(?P<parent>.+)-MIG-(?P<profile>\d+g\.\d+gb)\Z")
_FINISHED = ("Succeeded", "Failed")


def gpu_requests_by_node(pods: Iterable[Mapping[str, Any]]) -> dict[str, Counter[str]]:
    """Extended GPU resources (``nvidia.com/gpu``, ``nvidia.com/mig-*``) held per node by
    bound Pods that have not finished (requests; limits where no request is given)."""
    held: dict[str, Counter[str]] = defaultdict(Counter)
    for pod in pods:
        spec = pod.get("spec") or {}
        node = spec.get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in _FINISHED:
            continue
        for container in spec.get("containers") or []:
            resources = container.get("resources") or {}
            asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            for name, value in asked.items():
                if name == GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX):
                    held[node][name] += quantity.count(value)
    return held


def node_unavailable(node: Mapping[str, Any]) -> str | None:
    """Why nothing may start on a node now (not Ready, cordoned), or None."""
    if (node.get("spec") or {}).get("unschedulable"):
        return "cordoned (unschedulable)"
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            if str(cond.get("status")) != "True":
                return f"not Ready ({cond.get('reason') or cond.get('status')})"
            return None
    return "not Ready (no Ready condition)"


def _model(product: str | None, gpu_types: Mapping[str, str]) -> GpuModel | None:
    if not product:
        return None
    name = model_of_product(product, gpu_types)
    try:
        return gpu_model(name) if name else None
    except ValueError:
        return None


def _profile_parent(profile: str, product: str | None, gpu_types: Mapping[str, str]) -> GpuModel | None:
    model = _model(product, gpu_types)
    if model is not None and profile in model.mig_profiles:
        return model
    return next((m for m in MODELS if profile in m.mig_profiles), None)


def node_units(
    cluster: str,
    node: Mapping[str, Any],
    held: Mapping[str, int],
    *,
    gpu_types: Mapping[str, str] = {},  # noqa: B006 - read only
    expected_replicas: int | None = None,
    expected_from: str = "",
    levels: Sequence[TopologyLevel] = (),
) -> list[CapacityUnit]:
    """The node's GPU units (see the module docstring). ``held``: GPU resources its Pods
    hold; ``expected_replicas``: time-slicing replicas the ConfigMap gives it (None: unknown);
    ``levels``: the cluster's network levels, widest first."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name") or "?")
    labels: Mapping[str, str] = meta.get("labels") or {}
    status = node.get("status") or {}
    allocatable = status.get("allocatable") or status.get("capacity") or {}
    unavailable = node_unavailable(node)
    position = node_position(labels, levels)
    product = labels.get(GFD_PRODUCT)
    model = _model(product, gpu_types)
    memory_gb = float(model.memory_gb) if model else quantity.count(labels.get(GFD_MEMORY)) / 1024 or None
    model_name = model.name if model else (product.removesuffix("-SHARED") if product else "unknown")
    strategy = labels.get(GFD_SHARING)
    replicas = quantity.count(labels.get(GFD_REPLICAS)) or 1
    advertised = quantity.count(allocatable.get(GPU_RESOURCE))
    count = quantity.count(labels.get(GFD_COUNT))
    base = {"node": name}
    if product:
        base["product"] = product
    if strategy:
        base["sharing-strategy"] = strategy
    if unavailable:
        base["unavailable"] = unavailable
    units: list[CapacityUnit] = []

    def unit(sharing: Sharing, capacity: int, allocated: int, **fields: Any) -> CapacityUnit:
        extra = fields.pop("labels", {})
        return CapacityUnit(
            cluster=cluster,
            node=name,
            sharing=sharing,
            capacity=capacity,
            allocated=capacity if unavailable else min(max(allocated, 0), capacity),
            labels={**base, **extra},
            topology=position,
            **fields,
        )

    time_sliced = strategy == "time-slicing" or (strategy is None and replicas > 1)
    single_mig = labels.get(GFD_MIG_STRATEGY) == "single" and bool(product and _MIG_PRODUCT.match(product))
    if advertised > 0 and single_mig:
        profile = _MIG_PRODUCT.match(product).group("profile")  # type: ignore[union-attr]
        parent = _profile_parent(profile, _MIG_PRODUCT.match(product).group("parent"), gpu_types)  # type: ignore[union-attr]
        units.append(
            unit(
                Sharing.K8S_MIG,
                advertised,
                held.get(GPU_RESOURCE, 0),
                gpu_model=parent.name if parent else model_name,
                unit_memory_gb=float(parent.profile(profile).memory_gb) if parent else 0.0,
                gpu_equivalent=parent.gpu_equivalent(profile) if parent else 1 / 7,
                mig_profile=profile,
                gpu_memory_gb=float(parent.memory_gb) if parent else None,
                in_mig_mode=True,
                broken=(
                    "the GPU Operator's MIG strategy is single here (slices advertised as nvidia.com/gpu); "
                    "gpush asks for nvidia.com/mig-<profile>: use the mixed strategy"
                ),
            )
        )
    elif advertised > 0 and time_sliced:
        gpus = count or max(1, math.ceil(advertised / replicas))
        per_gpu = replicas if labels.get(GFD_REPLICAS) else max(1, advertised // gpus)
        drift = []
        if advertised != gpus * per_gpu:
            drift.append(
                f"advertises {advertised} {GPU_RESOURCE} on {gpus} GPUs, not {gpus} x {per_gpu} replicas "
                "(devices held back as unhealthy, or a device plugin not restarted since the config changed)"
            )
        if expected_replicas is not None and expected_replicas != per_gpu:
            drift.append(
                f"advertises {per_gpu} time-slicing replicas per GPU; {expected_from or 'the time-slicing config'} "
                f"says {expected_replicas}"
            )
        extra = {"replicas": str(per_gpu)} | ({"drift": "; ".join(drift)} if drift else {})
        left = advertised
        used = held.get(GPU_RESOURCE, 0)
        for index in range(gpus):
            capacity = min(per_gpu, left)
            left -= capacity
            if capacity <= 0:
                continue
            taken = min(used, capacity)
            used -= taken
            units.append(
                unit(
                    Sharing.K8S_TIMESLICE,
                    capacity,
                    taken,
                    gpu_model=model_name,
                    # No memory isolation: a replica may touch the whole GPU's memory; the
                    # guard is the jobs' gpu_memory_gb, summed by the broker.
                    unit_memory_gb=memory_gb or 0.0,
                    gpu_equivalent=1 / per_gpu,
                    gpus=(index,),
                    gpu_memory_gb=memory_gb,
                    labels=extra,
                )
            )
    elif advertised > 0 and strategy in (None, "none"):
        extra = {}
        if expected_replicas is not None and expected_replicas > 1:
            extra["drift"] = (
                f"does not time-slice its GPUs; {expected_from or 'the time-slicing config'} "
                f"says {expected_replicas} replicas"
            )
        units.append(
            unit(
                Sharing.K8S_EXCLUSIVE,
                advertised,
                held.get(GPU_RESOURCE, 0),
                gpu_model=model_name,
                unit_memory_gb=memory_gb or 0.0,
                gpu_equivalent=1.0,
                gpu_memory_gb=memory_gb,
                labels=extra,
            )
        )
    for resource, value in sorted(allocatable.items()):
        if not resource.startswith(MIG_RESOURCE_PREFIX):
            continue
        capacity = quantity.count(value)
        profile = resource.removeprefix(MIG_RESOURCE_PREFIX)
        if capacity <= 0 or not re.match(r"^\d+g\.\d+gb\Z", profile):
            continue
        mig_product = labels.get(f"{resource}.product", "")
        match = _MIG_PRODUCT.match(mig_product)
        parent = _profile_parent(profile, match.group("parent") if match else product, gpu_types)
        slice_replicas = quantity.count(labels.get(f"{resource}.replicas")) or 1  # time-sliced MIG slices
        units.append(
            unit(
                Sharing.K8S_MIG,
                capacity,
                held.get(resource, 0),
                gpu_model=parent.name if parent else model_name,
                unit_memory_gb=float(parent.profile(profile).memory_gb)
                if parent
                else float(profile.split(".")[1][:-2]),
                gpu_equivalent=(parent.gpu_equivalent(profile) if parent else int(profile.split("g")[0]) / 7)
                / slice_replicas,
                mig_profile=profile,
                gpu_memory_gb=float(parent.memory_gb) if parent else None,
                in_mig_mode=True,
                labels={"resource": resource} | ({"replicas": str(slice_replicas)} if slice_replicas > 1 else {}),
            )
        )
    return units
