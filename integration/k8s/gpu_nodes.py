"""GPU node pools as the NVIDIA GPU Operator presents them: extended resources and GFD labels.

This module owns the pure part of the node simulator: a pool spec (`GpuPool`), the slice of the
device plugin's config file that the simulator honours (`SharingConfig`), and the function that
turns the two into what a node advertises (`node_devices`) and the Node object a simulated kubelet
registers (`node_manifest`). Nothing here talks to an API server.

What the real components do, and where the simulator follows them:

- Allocatable/capacity. The device plugin advertises every whole GPU ``replicas`` times under
  time-slicing or MPS (``nvidia.com/gpu`` = physical GPUs x replicas; with ``renameByDefault`` the
  resource becomes ``nvidia.com/gpu.shared``). Under ``migStrategy: mixed`` every MIG device is a
  ``nvidia.com/mig-<profile>`` resource and MIG-enabled GPUs are not counted as ``nvidia.com/gpu``;
  under ``single`` the MIG devices are advertised as ``nvidia.com/gpu``. MIG resources can be
  time-sliced too (a ``resources`` entry named ``nvidia.com/mig-<profile>``).
- Labels, from NVIDIA/k8s-device-plugin ``internal/lm/resource.go`` and ``mig-strategy.go`` (GFD
  lives there since v0.15): ``nvidia.com/gpu.product`` (model, spaces as dashes, ``-SHARED``
  appended when replicas > 1 and the resource is not renamed), ``nvidia.com/gpu.count`` (physical
  GPUs, not replicas), ``nvidia.com/gpu.replicas`` (1 without sharing, 0 for MIG-enabled GPUs, which
  are labelled without sharing), ``nvidia.com/gpu.sharing-strategy`` (``none`` unless replicas > 1,
  then ``time-slicing`` or ``mps``), ``nvidia.com/gpu.memory`` (MiB), ``nvidia.com/gpu.family`` and
  ``compute.major/minor``; ``nvidia.com/mig.strategy`` only when the strategy is not ``none``;
  under ``mixed`` ``nvidia.com/mig-<profile>.{product,count,replicas,sharing-strategy,memory,
  multiprocessors,slices.gi,slices.ci,engines.*}``; under ``single`` the same attributes on
  ``nvidia.com/gpu.*`` with product ``<model>-MIG-<profile>``. When MIG-enabled and whole GPUs of
  one model share a node, the whole GPUs' labels win (so ``gpu.count`` counts the whole ones).
  ``nvidia.com/mig.capable`` and ``nvidia.com/mps.capable`` as GFD sets them;
  ``nvidia.com/gpu.present=true`` as the GPU Operator sets it; ``nvidia.com/mig.config`` (and
  ``mig.config.state=success``) as the operator's MIG manager leaves them.
- The device-plugin config (GPU Operator "Time-Slicing GPUs in Kubernetes"): a ConfigMap in the
  operator namespace named by ClusterPolicy ``spec.devicePlugin.config.name``; each data key is one
  config file (``version: v1``, ``flags.migStrategy``, ``sharing.timeSlicing.resources[].{name,
  replicas}``, ``renameByDefault``, ``failRequestsGreaterThanOne``; ``sharing.mps`` alike). A node's
  label ``nvidia.com/device-plugin.config`` picks the key, else ``spec.devicePlugin.config.default``.

- The MIG manager's configs (GPU Operator "GPU Operator with MIG"): a ConfigMap in the operator
  namespace named by ClusterPolicy ``spec.migManager.config.name`` (``default-mig-parted-config``
  unless it says otherwise), key ``config.yaml``, in mig-parted's format (``version: v1``,
  ``mig-configs: {name: [{devices: all | [0, 1], mig-enabled, mig-devices: {profile: count}}]}``);
  ``mig_parted_layouts`` reads one config as per-GPU layouts and ``reconfigured`` gives the pool a
  node of it becomes, refusing profiles the product does not offer (``MIG_PROFILES``).

- Network topology: a pool's ``topology`` gives each node its domain under label keys of the
  test's choosing (``cloud.provider.com/topology-block``: ``b1``), as a cloud provider or
  NVIDIA's Topograph labels real nodes; a node may lack one. ``kubernetes.io/hostname`` is the
  node's name, as the kubelet sets it.

Approximated: GPU memory and compute capability come from a small product table (unknown products
need ``gpu_memory_mib``); MIG device memory is exact for the A100-40GB profiles of the GPU
Operator's MIG example output and the profile's GB x 1024 MiB otherwise; multiprocessor and engine
counts follow the A100/H100 pattern, not a per-product table; driver and CUDA versions
are fixed strings; ``flags.migStrategy`` in a config file is ignored (the pool's strategy rules).
"""

from __future__ import annotations

import datetime
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import yaml

GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
POOL_LABEL = "sim.gpush.io/pool"
SIMULATED_LABEL = "sim.gpush.io/simulated"
DEVICE_PLUGIN_CONFIG_LABEL = "nvidia.com/device-plugin.config"
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_CONFIG_STATE_LABEL = "nvidia.com/mig.config.state"
MIG_PARTED_KEY = "config.yaml"  # the data key of the MIG manager's ConfigMap
DEFAULT_MIG_PARTED_CONFIG = "default-mig-parted-config"

SHARING_STRATEGIES = ("none", "time-slicing", "mps")
MIG_STRATEGIES = ("none", "single", "mixed")

# product label -> (memory MiB as GFD reports it, CUDA compute capability)
PRODUCTS: dict[str, tuple[int, tuple[int, int]]] = {
    "Tesla-T4": (15360, (7, 5)),
    "Tesla-V100-SXM2-16GB": (16384, (7, 0)),
    "Tesla-V100-SXM2-32GB": (32768, (7, 0)),
    "NVIDIA-A10G": (23028, (8, 6)),
    "NVIDIA-L4": (23034, (8, 9)),
    "NVIDIA-A30": (24576, (8, 0)),
    "NVIDIA-A100-PCIE-40GB": (40960, (8, 0)),
    "NVIDIA-A100-SXM4-40GB": (40960, (8, 0)),
    "NVIDIA-A100-80GB-PCIe": (81920, (8, 0)),
    "NVIDIA-A100-SXM4-80GB": (81920, (8, 0)),
    "NVIDIA-H100-80GB-HBM3": (81559, (9, 0)),
    "NVIDIA-H100-NVL": (95830, (9, 0)),
    "NVIDIA-H200": (143771, (9, 0)),
}
MIG_CAPABLE = ("A100", "A30", "H100", "H200", "GH200", "B200")

# MIG device memory in MiB as GFD labels it on an A100-40GB (GPU Operator MIG docs' example output);
# other profiles get their name's GB x 1024.
MIG_MEMORY_MIB = {"1g.5gb": 4864, "2g.10gb": 9984, "3g.20gb": 20096, "4g.20gb": 20096, "7g.40gb": 40192}

_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?\Z")
_MIG_PROFILE = re.compile(r"^(?P<g>[1-7])g\.(?P<gb>\d+)gb(?P<me>\+me)?$")


def gpu_family(major: int, minor: int) -> str:
    """The ``nvidia.com/gpu.family`` value GFD derives from a compute capability."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return {3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell"}.get(major, "undefined")


@dataclass(frozen=True)
class MigProfile:
    """One MIG device type, parsed from its name (``3g.20gb``)."""

    name: str
    slices: int
    memory_gb: int
    media_extensions: bool

    @classmethod
    def parse(cls, name: str) -> MigProfile:
        m = _MIG_PROFILE.match(name)
        if not m:
            raise ValueError(f"MIG profile {name!r} is not of the form <N>g.<M>gb (for example 3g.20gb or 1g.5gb+me)")
        return cls(name, int(m["g"]), int(m["gb"]), bool(m["me"]))

    @property
    def memory_mib(self) -> int:
        return MIG_MEMORY_MIB.get(self.name.removesuffix("+me"), self.memory_gb * 1024)

    def attributes(self, major: int) -> dict[str, int]:
        """The MIG attribute labels GFD writes (multiprocessors, slices, engines)."""
        g = self.slices
        sm_per_slice = 16 if major >= 9 else 14
        decoders = {1: 0, 2: 1, 3: 2, 4: 2, 7: 5}.get(g, g // 2)
        media = 1 if (g == 7 or self.media_extensions) else 0
        return {
            "multiprocessors": (132 if major >= 9 else 98) if g == 7 else g * sm_per_slice,
            "slices.gi": g,
            "slices.ci": g,
            "engines.copy": g,
            "engines.decoder": max(decoders, 1 if self.media_extensions else 0),
            "engines.encoder": 0,
            "engines.jpeg": media,
            "engines.ofa": media,
        }


@dataclass(frozen=True)
class SharingConfig:
    """The part of one device-plugin config file the simulator honours."""

    strategy: str = "none"
    replicas: Mapping[str, int] = field(default_factory=dict)
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False

    def replicas_for(self, resource: str) -> int:
        return max(int(self.replicas.get(resource, 1)), 1) if self.strategy != "none" else 1

    def advertised_name(self, resource: str) -> str:
        """``renameByDefault`` advertises a shared resource as ``<name>.shared``."""
        if self.rename_by_default and self.replicas_for(resource) > 1:
            return f"{resource}.shared"
        return resource

    @classmethod
    def parse(cls, text: str) -> SharingConfig:
        """Parses one data key of the time-slicing ConfigMap; raises ValueError on a malformed file."""
        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"device-plugin config is not YAML: {exc}") from exc
        if not isinstance(doc, dict):
            raise ValueError("device-plugin config must be a mapping with version: v1")
        if str(doc.get("version", "v1")) != "v1":
            raise ValueError(f"device-plugin config version {doc.get('version')!r} is not v1")
        sharing = doc.get("sharing") or {}
        for strategy, key in (("time-slicing", "timeSlicing"), ("mps", "mps")):
            section = sharing.get(key)
            if not section:
                continue
            replicas = {}
            for entry in section.get("resources") or []:
                name, count = entry.get("name"), entry.get("replicas")
                if not name or not isinstance(count, int) or count < 1:
                    raise ValueError(f"sharing.{key}.resources entry {entry!r} needs a name and replicas >= 1")
                replicas[str(name)] = count
            return cls(
                strategy=strategy,
                replicas=replicas,
                rename_by_default=bool(section.get("renameByDefault", False)),
                fail_requests_greater_than_one=bool(section.get("failRequestsGreaterThanOne", False)),
            )
        return cls()

    def render(self) -> str:
        """The config file text, as a ConfigMap data value carries it."""
        doc: dict = {"version": "v1"}
        if self.strategy != "none":
            key = "timeSlicing" if self.strategy == "time-slicing" else "mps"
            section: dict = {"resources": [{"name": n, "replicas": r} for n, r in self.replicas.items()]}
            if self.rename_by_default:
                section["renameByDefault"] = True
            if self.fail_requests_greater_than_one:
                section["failRequestsGreaterThanOne"] = True
            doc["sharing"] = {key: section}
        return yaml.safe_dump(doc, sort_keys=False)


def time_slicing(replicas: int, resource: str = GPU) -> SharingConfig:
    return SharingConfig("time-slicing", {resource: replicas}) if replicas > 1 else SharingConfig()


@dataclass(frozen=True)
class GpuPool:
    """A set of identical simulated GPU nodes named ``<name>-<i>``.

    ``mig_layout`` is either one layout applied to every GPU (``("3g.20gb", "2g.10gb", "1g.5gb")``)
    or one layout per GPU (a tuple of tuples; an empty tuple leaves that GPU whole). ``replicas`` and
    ``sharing`` are the node's device-plugin config until a ConfigMap selected for it says otherwise.
    """

    name: str
    count: int = 1
    product: str = "NVIDIA-A100-SXM4-40GB"
    gpus_per_node: int = 8
    gpu_memory_mib: int | None = None
    replicas: int = 1
    sharing: str = "time-slicing"
    mig_strategy: str = "none"
    mig_layout: tuple = ()
    mig_config: str | None = None
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    ephemeral_storage: str = "1Ti"
    labels: Mapping[str, str] = field(default_factory=dict)
    # Network topology as node labels (what a cloud provider or Topograph writes, what Kueue's
    # Topology and gpush's topology_levels name): label key -> one domain per node, None where that
    # node lacks the label; or one domain for every node of the pool.
    topology: Mapping[str, str | None | tuple[str | None, ...]] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()
    device_plugin_config: str | None = None
    # The nodes' names, one per node; default <name>-0, <name>-1... (names a Slurm cluster shares)
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.name):
            raise ValueError(f"pool name {self.name!r} must be a DNS label (lower-case letters, digits, '-')")
        if self.names and len(self.names) != self.count:
            raise ValueError(f"pool {self.name}: {len(self.names)} names for {self.count} nodes")
        if self.count < 0 or self.gpus_per_node < 0:
            raise ValueError(f"pool {self.name}: count and gpus_per_node must be >= 0")
        object.__setattr__(self, "topology", self._per_node_topology())
        if self.replicas < 1:
            raise ValueError(f"pool {self.name}: replicas must be >= 1 (1 means no sharing)")
        if self.sharing not in ("time-slicing", "mps"):
            raise ValueError(f"pool {self.name}: sharing must be time-slicing or mps, not {self.sharing!r}")
        if self.mig_strategy not in MIG_STRATEGIES:
            raise ValueError(f"pool {self.name}: mig_strategy must be one of {MIG_STRATEGIES}")
        if self.gpu_memory_mib is None and self.product not in PRODUCTS:
            raise ValueError(
                f"pool {self.name}: product {self.product!r} is not in the table; give gpu_memory_mib "
                f"(known: {', '.join(sorted(PRODUCTS))})"
            )
        layouts = self.layouts()
        if any(layouts) and self.mig_strategy == "none":
            raise ValueError(f"pool {self.name}: a mig_layout needs mig_strategy single or mixed")
        if any(layouts) and not self.mig_capable:
            raise ValueError(f"pool {self.name}: {self.product} is not MIG-capable")
        for i, layout in enumerate(layouts):
            profiles = [MigProfile.parse(p) for p in layout]
            if sum(p.slices for p in profiles) > 7:
                raise ValueError(f"pool {self.name}: GPU {i} layout {layout} uses more than 7 compute slices")
            if sum(p.memory_mib for p in profiles) > self.memory_mib_per_gpu * 1.05:
                raise ValueError(f"pool {self.name}: GPU {i} layout {layout} needs more memory than the GPU has")
        if self.mig_strategy == "single" and any(layouts):
            kinds = {p for layout in layouts for p in layout}
            if len(kinds) != 1 or not all(layouts):
                raise ValueError(
                    f"pool {self.name}: mig_strategy single needs every GPU split into one profile; "
                    "use mixed for other layouts"
                )

    def _per_node_topology(self) -> dict[str, tuple[str | None, ...]]:
        out = {}
        for key, domains in dict(self.topology).items():
            values = (domains,) * self.count if domains is None or isinstance(domains, str) else tuple(domains)
            if len(values) != self.count:
                raise ValueError(f"pool {self.name}: topology {key} has {len(values)} domains for {self.count} nodes")
            bad = [v for v in values if v is not None and not _LABEL_VALUE.match(v)]
            if bad:
                raise ValueError(f"pool {self.name}: topology label {key}: {bad[0]!r} is not a label value")
            if key in self.labels:
                raise ValueError(f"pool {self.name}: {key} is in both labels and topology; give it in one")
            out[key] = values
        return out

    def node_topology(self, index: int) -> dict[str, str]:
        """The topology labels of the pool's ``index``-th node (those it has)."""
        return {key: values[index] for key, values in self.topology.items() if values[index] is not None}

    @classmethod
    def from_dict(cls, data: Mapping) -> GpuPool:
        """A pool from plain data (YAML or JSON), with ``mig_layout`` and ``taints`` as lists."""
        data = dict(data)
        layout = data.get("mig_layout") or ()
        if layout and not isinstance(layout[0], str):
            data["mig_layout"] = tuple(tuple(x) for x in layout)
        else:
            data["mig_layout"] = tuple(layout)
        data["taints"] = tuple(dict(t) for t in data.get("taints") or ())
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"pool {data.get('name')}: unknown fields {sorted(unknown)}")
        return cls(**data)

    @property
    def memory_mib_per_gpu(self) -> int:
        return self.gpu_memory_mib if self.gpu_memory_mib is not None else PRODUCTS[self.product][0]

    @property
    def compute_capability(self) -> tuple[int, int]:
        return PRODUCTS.get(self.product, (0, (0, 0)))[1]

    @property
    def mig_capable(self) -> bool:
        return any(tag in self.product for tag in MIG_CAPABLE)

    def layouts(self) -> list[tuple[str, ...]]:
        """One MIG layout per GPU; empty for a whole GPU."""
        layout = self.mig_layout
        if not layout:
            return [()] * self.gpus_per_node
        if isinstance(layout[0], str):
            return [tuple(layout)] * self.gpus_per_node
        if len(layout) != self.gpus_per_node:
            raise ValueError(f"pool {self.name}: {len(layout)} per-GPU MIG layouts for {self.gpus_per_node} GPUs")
        return [tuple(x) for x in layout]

    def default_sharing(self) -> SharingConfig:
        """The device-plugin config the pool's nodes use when no ConfigMap key applies to them."""
        if self.replicas <= 1:
            return SharingConfig()
        return SharingConfig(self.sharing, {GPU: self.replicas})

    def mig_config_label(self) -> str:
        if self.mig_config:
            return self.mig_config
        layouts = self.layouts()
        if not any(layouts):
            return "all-disabled"
        kinds = {p for layout in layouts for p in layout}
        if all(layouts) and len(kinds) == 1:
            return f"all-{next(iter(kinds))}"
        return f"custom-{self.name}"

    def node_names(self) -> list[str]:
        return list(self.names) if self.names else [f"{self.name}-{i}" for i in range(self.count)]


@dataclass(frozen=True)
class Device:
    """One schedulable device behind an extended resource: a whole GPU or a MIG device.

    ``replicas`` pods may share it (time-slicing or MPS); ``gpu`` is the index of the physical GPU.
    ``memory_gb`` is what jobs may use on it, in gpush's GB (MiB / 1024); a MIG device holds at
    least its profile's named GB (a ``3g.20gb`` job asking 20 GB fits, though GFD says 20096 MiB).
    """

    resource: str
    gpu: int
    memory_mib: int
    replicas: int
    sharing: str
    memory_gb: float = 0.0

    def __post_init__(self) -> None:
        if not self.memory_gb:
            object.__setattr__(self, "memory_gb", self.memory_mib / 1024)


@dataclass(frozen=True)
class NodeDevices:
    """What one node advertises: extended resources, GFD labels and the devices behind them."""

    resources: dict[str, int]
    labels: dict[str, str]
    devices: tuple[Device, ...]
    sharing: SharingConfig


def node_devices(pool: GpuPool, sharing: SharingConfig | None = None) -> NodeDevices:
    """The extended resources, labels and devices of one node of ``pool`` under ``sharing``."""
    sharing = sharing if sharing is not None else pool.default_sharing()
    model = pool.product.replace(" ", "-")
    major, minor = pool.compute_capability
    layouts = pool.layouts()
    whole = [i for i, layout in enumerate(layouts) if not layout]
    migged = [i for i, layout in enumerate(layouts) if layout]
    strategy = pool.mig_strategy

    resources: dict[str, int] = {}
    devices: list[Device] = []
    labels: dict[str, str] = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/mig.capable": str(pool.mig_capable).lower(),
        "nvidia.com/mps.capable": str(sharing.strategy == "mps" and not migged).lower(),
        "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/gpu.mode": "compute",
    }
    if pool.mig_capable:
        labels[MIG_CONFIG_LABEL] = pool.mig_config_label()
        labels[MIG_CONFIG_STATE_LABEL] = "success"
    if strategy != "none":
        labels["nvidia.com/mig.strategy"] = strategy

    def base(prefix: str, product: str, count: int, replicas: int) -> None:
        shared = replicas > 1
        labels[f"{prefix}.product"] = f"{product}-SHARED" if shared and not sharing.rename_by_default else product
        labels[f"{prefix}.count"] = str(count)
        labels[f"{prefix}.replicas"] = str(replicas)
        labels[f"{prefix}.sharing-strategy"] = sharing.strategy if shared else "none"

    def arch(prefix: str) -> None:
        if major:
            labels[f"{prefix}.family"] = gpu_family(major, minor)
            labels[f"{prefix}.compute.major"] = str(major)
            labels[f"{prefix}.compute.minor"] = str(minor)

    if strategy == "single" and migged:
        profile = MigProfile.parse(layouts[migged[0]][0])
        replicas = sharing.replicas_for(GPU)
        n = sum(len(layouts[i]) for i in migged)
        base("nvidia.com/gpu", f"{model}-MIG-{profile.name}", n, replicas)
        labels["nvidia.com/gpu.memory"] = str(profile.memory_mib)
        for key, value in profile.attributes(major).items():
            labels[f"nvidia.com/gpu.{key}"] = str(value)
        name = sharing.advertised_name(GPU)
        resources[name] = n * replicas
        size = max(profile.memory_gb, profile.memory_mib / 1024)
        devices += [
            Device(name, i, profile.memory_mib, replicas, sharing.strategy, size) for i in migged for _ in layouts[i]
        ]
        return NodeDevices(resources, labels, tuple(devices), sharing)

    if migged:
        # MIG-enabled GPUs are labelled without sharing (replicas 0); whole GPUs override below.
        base("nvidia.com/gpu", model, len(migged), 0)
        labels["nvidia.com/gpu.sharing-strategy"] = "none"
        labels["nvidia.com/gpu.memory"] = str(pool.memory_mib_per_gpu)
        arch("nvidia.com/gpu")
        counts: dict[str, int] = {}
        for i in migged:
            for p in layouts[i]:
                counts[p] = counts.get(p, 0) + 1
        for p, n in sorted(counts.items()):
            profile = MigProfile.parse(p)
            resource = f"{MIG_PREFIX}{p}"
            replicas = sharing.replicas_for(resource)
            base(resource, f"{model}-MIG-{p}", n, replicas)
            labels[f"{resource}.memory"] = str(profile.memory_mib)
            for key, value in profile.attributes(major).items():
                labels[f"{resource}.{key}"] = str(value)
            name = sharing.advertised_name(resource)
            resources[name] = n * replicas
        for i in migged:
            for p in layouts[i]:
                resource = f"{MIG_PREFIX}{p}"
                profile = MigProfile.parse(p)
                devices.append(
                    Device(
                        sharing.advertised_name(resource),
                        i,
                        profile.memory_mib,
                        sharing.replicas_for(resource),
                        sharing.strategy,
                        max(profile.memory_gb, profile.memory_mib / 1024),
                    )
                )
    if whole or not migged:
        replicas = sharing.replicas_for(GPU)
        base("nvidia.com/gpu", model, len(whole), replicas)
        labels["nvidia.com/gpu.memory"] = str(pool.memory_mib_per_gpu)
        arch("nvidia.com/gpu")
        name = sharing.advertised_name(GPU)
        resources[name] = len(whole) * replicas
        devices += [Device(name, i, pool.memory_mib_per_gpu, replicas, sharing.strategy) for i in whole]
    if GPU not in resources:
        # The device plugin still advertises nvidia.com/gpu, at 0, when every GPU is MIG.
        resources[GPU] = 0
    return NodeDevices(resources, labels, tuple(devices), sharing)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_manifest(
    pool: GpuPool, index: int, devices: NodeDevices | None = None, *, kubelet: tuple[str, int] | None = None
) -> dict:
    """The Node a simulated kubelet registers: GFD labels, capacity = allocatable, Ready=True.

    ``kubelet``: the (address, port) where the simulator serves its kubelets' container logs,
    published as the node's ``InternalIP`` and kubelet port so that an API server's ``pods/log``
    reaches it (KWOK's arrangement: every node names the one simulator); None gives the node an
    address of its own in 10.64.0.0/10 and port 10250, where nothing answers.
    """
    devices = devices or node_devices(pool)
    name = pool.names[index] if index < len(pool.names) else f"{pool.name}-{index}"
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": f"sim-{pool.product.lower()}",
        SIMULATED_LABEL: "true",
        POOL_LABEL: pool.name,
        **devices.labels,
        **dict(pool.labels),
        **pool.node_topology(index),
    }
    if pool.device_plugin_config:
        labels[DEVICE_PLUGIN_CONFIG_LABEL] = pool.device_plugin_config
    resources = {
        "cpu": pool.cpu,
        "memory": pool.memory,
        "pods": str(pool.pods),
        "ephemeral-storage": pool.ephemeral_storage,
        **{k: str(v) for k, v in devices.resources.items()},
    }
    now = _now()
    ready = [
        ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
    ]
    serial = zlib.crc32(name.encode()) % (1 << 20)
    address, port = kubelet or (f"10.{64 + serial // 65536}.{serial // 256 % 256}.{serial % 256}", 10250)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
        },
        "spec": {"taints": [dict(t) for t in pool.taints]} if pool.taints else {},
        "status": {
            "capacity": resources,
            "allocatable": dict(resources),
            "conditions": [
                {
                    "type": t,
                    "status": s,
                    "reason": r,
                    "message": m,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
                for t, s, r, m in ready
            ],
            "addresses": [
                {"type": "InternalIP", "address": address},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": port}},
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": "",
                "containerRuntimeVersion": "containerd://1.7.0-sim",
                "kernelVersion": "6.1.0-sim",
                "kubeProxyVersion": "",
                "kubeletVersion": "v1.31.0-sim",
                "machineID": "",
                "operatingSystem": "linux",
                "osImage": "gpush simulated node",
                "systemUUID": "",
            },
        },
    }


def pools_from(spec: Iterable[GpuPool | Mapping]) -> list[GpuPool]:
    """Pools from a spec: GpuPool objects or plain mappings; names must be unique."""
    pools = [p if isinstance(p, GpuPool) else GpuPool.from_dict(p) for p in spec]
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"pool names must be unique: {names}")
    return pools


# ---------------------------------------------------------------- the MIG manager's configs


# The MIG profiles each product offers (NVIDIA MIG user guide, "Supported MIG Profiles"); a product
# not listed here takes any profile its memory holds.
_A100_40 = ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")
_X_80 = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
MIG_PROFILES: dict[str, tuple[str, ...]] = {
    "NVIDIA-A30": ("1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"),
    "NVIDIA-A100-PCIE-40GB": _A100_40,
    "NVIDIA-A100-SXM4-40GB": _A100_40,
    "NVIDIA-A100-80GB-PCIe": _X_80,
    "NVIDIA-A100-SXM4-80GB": _X_80,
    "NVIDIA-H100-80GB-HBM3": _X_80,
    "NVIDIA-H100-NVL": ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
    "NVIDIA-H200": ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
}


def mig_parted_layouts(text: str | None, name: str, gpus: int) -> dict[int, tuple[str, ...]]:
    """What config ``name`` of a mig-parted file (``version: v1``, ``mig-configs``) gives each GPU
    of a node with ``gpus`` GPUs: one profile name per instance, empty for MIG off. GPUs that no
    entry of the config selects are left out (mig-parted leaves them as they are); a later entry
    wins. ValueError, saying why, for a missing config or one mig-parted would refuse.

    Approximated: ``mig-enabled: true`` with no ``mig-devices`` (MIG on, no instance) reads as an
    empty layout, which the simulator advertises as a whole GPU; ``device-filter`` is ignored."""
    try:
        doc = yaml.safe_load(text or "") or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"the mig-parted config is not YAML: {exc}") from exc
    configs = doc.get("mig-configs") if isinstance(doc, dict) else None
    if not isinstance(configs, dict) or name not in configs:
        raise ValueError(f"mig-parted config {name!r} is not in the MIG manager's ConfigMap")
    entries = configs[name]
    if not isinstance(entries, list):
        raise ValueError(f"mig-parted config {name!r} is not a list of entries")
    out: dict[int, tuple[str, ...]] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise ValueError(f"mig-parted config {name!r}: entry {entry!r} is not a mapping")
        devices = entry.get("devices", "all")
        if devices == "all":
            indices = list(range(gpus))
        elif isinstance(devices, list) and all(isinstance(d, int) for d in devices):
            indices = list(devices)
        else:
            raise ValueError(f"mig-parted config {name!r}: devices {devices!r} is neither all nor a list of indices")
        missing = [i for i in indices if not 0 <= i < gpus]
        if missing:
            raise ValueError(f"mig-parted config {name!r} names GPU {missing[0]}; the node has {gpus}")
        layout: tuple[str, ...] = ()
        if entry.get("mig-enabled"):
            counts = entry.get("mig-devices") or {}
            if not isinstance(counts, dict) or not all(isinstance(n, int) and n >= 0 for n in counts.values()):
                raise ValueError(f"mig-parted config {name!r}: mig-devices {counts!r} is not profile: count")
            layout = tuple(str(p) for p, n in counts.items() for _ in range(n))
        for i in indices:
            out[i] = layout
    return out


def reconfigured(
    pool: GpuPool, current: list[tuple[str, ...]], changes: Mapping[int, tuple[str, ...]], config: str
) -> GpuPool:
    """``pool`` as one node of it looks once the MIG manager applied ``changes`` (GPU index ->
    layout) over its ``current`` layouts, labelled with mig-parted config ``config``. ValueError
    when a GPU would get a profile its product does not offer, or a layout it cannot hold."""
    offered = MIG_PROFILES.get(pool.product)
    for i, layout in sorted(changes.items()):
        if layout and not pool.mig_capable:
            raise ValueError(f"GPU {i}: {pool.product} is not MIG-capable")
        for profile in layout:
            if offered is not None and profile not in offered:
                raise ValueError(
                    f"GPU {i}: {pool.product} has no MIG profile {profile} (it offers {', '.join(offered)})"
                )
    layouts = [tuple(changes.get(i, layout)) for i, layout in enumerate(current)]
    return replace(pool, mig_layout=tuple(layouts) if any(layouts) else (), mig_config=config)


# The GPU Operator's ClusterPolicy resource, as its CRD installs it (schema left open): what a
# test creates before it writes a ClusterPolicy to a cluster that has no operator.
CLUSTER_POLICY_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterpolicies.nvidia.com"},
    "spec": {
        "group": "nvidia.com",
        "scope": "Cluster",
        "names": {"plural": "clusterpolicies", "singular": "clusterpolicy", "kind": "ClusterPolicy"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}
