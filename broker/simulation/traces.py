"""The Alibaba GPU cluster trace "openb" (cluster-trace-gpu-v2023) as gpush fleets and workloads.

This module owns reading the trace's CSV files (a node list and a pod list; the
format is in the trace's README) and what they become in gpush:

- **The fleet.** The trace's cluster is one Kubernetes cluster whose GPUs are shared
  by milli-GPU: any GPU takes a whole-GPU pod, or fractional pods up to 1000 milli
  in all. As a :class:`broker.simulation.fleet.Fleet` it is one k8s-flavor cluster (default
  name ``openb``), a node per row with its GPUs, CPU and memory, each GPU time-sliced
  into 1000 replicas (one per milli-GPU). A simfleet GPU has one sharing mode, so that
  fleet cannot also give a GPU to a whole-GPU pod: the replay places trace pods on
  :class:`broker.placement.fragmentation.SharedGpuNodes` (:func:`shared_nodes`) instead.
- **The jobs.** A pod becomes a :class:`broker.core.schemas.JobSpec`, as the README
  suggests: a fractional pod (``num_gpu`` 1, ``gpu_milli`` < 1000) an ``isolation:
  none`` job (inference for LS, Burstable and Guaranteed pods, batch for BE) whose
  ``gpu_memory_gb`` is its share of the reference GPU's memory; a whole- or multi-GPU
  pod an exclusive training job of ``num_gpu`` GPUs. The exact share stays on the
  arrival (``gpu_milli``) so that packing uses the trace's numbers, not a rounding
  of them. CPU-only pods (``num_gpu`` 0) are not jobs (gpush routes GPU work): a
  replay places them as :class:`broker.simulation.shared.CpuWork` (:meth:`OpenbTrace.cpu_work`)
  that holds the nodes' CPU and memory beside the jobs.
- **The policy.** :func:`openb_policy`: fractional pods share GPUs
  (``k8s/timeslice``), the others take whole GPUs (``k8s/exclusive``), on the trace's
  one cluster.

GPU models. The trace names models by Alibaba's codes; gpush's catalog
(:mod:`broker.core.gpus`) knows them as below. ``G1`` is not in the catalog and its memory
is undisclosed: it is taken to be a 16 GB GPU like ``G2`` (the catalog's estimate for
Alibaba's codes). The trace's code stays on each node, so a pod's ``gpu_spec``
(the models it accepts) is matched against the trace's own names.
"""

from __future__ import annotations

import csv
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from broker.core.errors import InvalidRequest
from broker.core.gpus import GpuModel, gpu_model
from broker.core.schemas import Isolation, JobSpec, Kind
from broker.placement.fgd import MILLI, TaskShape
from broker.placement.fragmentation import SharedNode
from broker.routing.policy import Policy
from broker.simulation.fleet import Fleet, FleetCluster, FleetGpu, FleetNode
from broker.simulation.inflation import CpuTask
from broker.simulation.shared import CpuWork
from broker.simulation.workload import Arrival

DEFAULT_CLUSTER = "openb"
DEFAULT_NODES = "openb_node_list_gpu_node.csv"
DEFAULT_PODS = "openb_pod_list_default.csv"
# One time-slice replica per milli-GPU: the finest share the trace describes.
SHARE_REPLICAS = MILLI

# The trace's GPU codes -> gpush's catalog names (see the module docstring for G1).
MODEL_MAP: dict[str, str] = {
    "V100M16": "V100-SXM2-16GB",
    "V100M32": "V100-SXM2-32GB",
    "P100": "P100-PCIE-16GB",
    "T4": "T4",
    "A10": "A10",
    "G1": "G2",
    "G2": "G2",
    "G3": "G3",
}

_NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
_POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str  # the trace's code, "" on CPU-only nodes

    @property
    def gpu_model(self) -> GpuModel | None:
        return trace_model(self.model) if self.gpus else None


@dataclass(frozen=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()  # models it accepts; empty: any
    qos: str = ""
    phase: str = ""
    creation_time: int | None = None
    deletion_time: int | None = None
    scheduled_time: int | None = None

    @property
    def cpu_only(self) -> bool:
        return self.num_gpu == 0

    @property
    def fractional(self) -> bool:
        return self.num_gpu == 1 and 0 < self.gpu_milli < MILLI

    @property
    def demand_milli(self) -> int:
        """GPU demand as the README defines it: gpu_milli for one GPU, else 1000 per GPU."""
        if self.num_gpu == 0:
            return 0
        return self.gpu_milli if self.num_gpu == 1 else MILLI * self.num_gpu

    @property
    def task(self) -> TaskShape:
        """What the pod asks of a node (multi-GPU pods take whole GPUs)."""
        share = self.gpu_milli if self.num_gpu == 1 else MILLI
        return TaskShape(share, self.num_gpu, self.cpu_milli, self.memory_mib, tuple(sorted(self.gpu_spec)))

    @property
    def duration(self) -> float:
        """Seconds it ran: from scheduling (or creation, for pods never scheduled) to deletion."""
        start = self.scheduled_time if self.scheduled_time is not None else self.creation_time
        if self.deletion_time is None or start is None:
            return 0.0
        return float(max(self.deletion_time - start, 0))


def trace_model(code: str) -> GpuModel:
    """gpush's model for a trace GPU code (V100M16, G2, ...); any catalog name passes through."""
    try:
        return gpu_model(MODEL_MAP.get(code, code))
    except ValueError:
        known = ", ".join(sorted(MODEL_MAP))
        raise InvalidRequest(f"GPU model {code!r} of the trace is unknown: the openb codes are {known}") from None


# -- reading the CSV files --------------------------------------------------------------


def _rows(path: str | os.PathLike[str], required: tuple[str, ...]) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in required if c not in (reader.fieldnames or ())]
            if missing:
                raise InvalidRequest(
                    f"{path}: missing column(s) {', '.join(missing)}; expected the openb format "
                    f"({', '.join(required)}, ...)"
                )
            return list(reader)
    except OSError as exc:
        raise InvalidRequest(f"cannot read trace file {str(path)!r}: {exc.strerror or exc}") from None


def _int(row: dict[str, str], column: str, path: str | os.PathLike[str], line: int) -> int:
    try:
        return int(row[column])
    except (TypeError, ValueError):
        raise InvalidRequest(f"{path}, line {line}: {column} {row.get(column)!r} is not a whole number") from None


def _optional_int(row: dict[str, str], column: str, path: str | os.PathLike[str], line: int) -> int | None:
    value = (row.get(column) or "").strip()
    return None if not value else _int(row, column, path, line)


def read_nodes(path: str | os.PathLike[str]) -> list[TraceNode]:
    """The nodes of an openb node list (``sn,cpu_milli,memory_mib,gpu,model``)."""
    nodes = []
    for line, row in enumerate(_rows(path, _NODE_COLUMNS), 2):
        node = TraceNode(
            row["sn"],
            _int(row, "cpu_milli", path, line),
            _int(row, "memory_mib", path, line),
            _int(row, "gpu", path, line),
            (row.get("model") or "").strip(),
        )
        if node.gpus:
            trace_model(node.model)  # an unknown code is an error here, naming the file
        nodes.append(node)
    return nodes


def read_pods(path: str | os.PathLike[str]) -> list[TracePod]:
    """The pods of an openb pod list, in file order (the time columns are optional,
    as in ``openb_pod_list_multigpu20.csv``)."""
    pods = []
    for line, row in enumerate(_rows(path, _POD_COLUMNS), 2):
        spec = (row.get("gpu_spec") or "").strip()
        pod = TracePod(
            row["name"],
            _int(row, "cpu_milli", path, line),
            _int(row, "memory_mib", path, line),
            _int(row, "num_gpu", path, line),
            _int(row, "gpu_milli", path, line),
            tuple(s for s in spec.split("|") if s),
            (row.get("qos") or "").strip(),
            (row.get("pod_phase") or "").strip(),
            _optional_int(row, "creation_time", path, line),
            _optional_int(row, "deletion_time", path, line),
            _optional_int(row, "scheduled_time", path, line),
        )
        if pod.num_gpu and not 0 < pod.gpu_milli <= MILLI:
            raise InvalidRequest(f"{path}, line {line}: gpu_milli {pod.gpu_milli} of a GPU pod is outside 1..1000")
        pods.append(pod)
    return pods


# -- what the trace becomes in gpush -----------------------------------------------------


def openb_fleet(nodes: list[TraceNode], cluster: str = DEFAULT_CLUSTER) -> Fleet:
    """The trace's GPU nodes as a simulated fleet: one k8s cluster, each GPU time-sliced
    into :data:`SHARE_REPLICAS` replicas (CPU-only nodes are left out)."""
    fleet_nodes = []
    for node in nodes:
        if not node.gpus:
            continue
        model = trace_model(node.model)
        gpus = tuple(FleetGpu(i, model, "timeslice", replicas=SHARE_REPLICAS) for i in range(node.gpus))
        fleet_nodes.append(
            FleetNode(
                node.name,
                gpus,
                cpus=max(node.cpu_milli // 1000, 1),
                memory_mib=node.memory_mib,
                pool=node.model,
                labels={"gpush.io/trace-model": node.model},
            )
        )
    if not fleet_nodes:
        raise InvalidRequest("the trace's node list has no GPU nodes")
    return Fleet(
        f"openb trace ({len(fleet_nodes)} GPU nodes)", {cluster: FleetCluster(cluster, "k8s", tuple(fleet_nodes))}
    )


def shared_nodes(nodes: list[TraceNode], *, account_cpu: bool = True) -> list[SharedNode]:
    """The GPU nodes as GPU-sharing nodes for placement (``account_cpu`` False: GPUs only)."""
    return [
        SharedNode(
            node.name,
            node.gpus,
            node.model,
            trace_model(node.model).memory_gb,
            node.cpu_milli if account_cpu else None,
            node.memory_mib if account_cpu else None,
        )
        for node in nodes
        if node.gpus
    ]


def reference_memory_gb(nodes: list[TraceNode]) -> float:
    """The memory of the fleet's most common GPU model: what a fractional pod's share
    is a share of (pods name no model; G2, 16 GB, on openb)."""
    counts = Counter()
    for node in nodes:
        if node.gpus:
            counts[node.model] += node.gpus
    if not counts:
        raise InvalidRequest("the trace's node list has no GPU nodes")
    return trace_model(counts.most_common(1)[0][0]).memory_gb


def pod_job(pod: TracePod, memory_gb: float) -> JobSpec:
    """A GPU pod as a gpush job (see the module docstring); ``memory_gb`` is the
    reference GPU's memory a fractional pod's share is taken of."""
    if pod.cpu_only:
        raise ValueError(f"pod {pod.name} asks for no GPU: gpush schedules GPU jobs only")
    fields: dict = {
        "name": pod.name[:64],
        "cpus": max(math.ceil(pod.cpu_milli / 1000), 1),
        "memory": f"{pod.memory_mib}M" if pod.memory_mib > 0 else None,
        "image": "openb/pod",
        "labels": {"gpush.io/trace": "openb"},
    }
    if pod.qos:
        fields["labels"]["gpush.io/qos"] = pod.qos
    if pod.fractional:
        kind = Kind.BATCH if pod.qos == "BE" else Kind.INFERENCE
        fields.update(
            kind=kind,
            isolation=Isolation.NONE,
            gpus=1,
            gpu_memory_gb=round(pod.gpu_milli / MILLI * memory_gb, 3),
        )
    else:
        fields.update(kind=Kind.TRAINING, isolation=Isolation.EXCLUSIVE, gpus=pod.num_gpu)
    return JobSpec.model_validate(fields)


def openb_workload(pods: list[TracePod], memory_gb: float, *, tenant: str = "openb") -> tuple[list[Arrival], int]:
    """The GPU pods as timed arrivals (``at``: creation time, ``duration``: how long
    the pod ran), and how many CPU-only pods were skipped."""

    arrivals = []
    skipped = 0
    for pod in pods:
        if pod.cpu_only:
            skipped += 1
            continue
        arrivals.append(
            Arrival(
                at=float(pod.creation_time or 0),
                spec=pod_job(pod, memory_gb),
                duration=pod.duration,
                tenant=tenant,
                task=pod.task,
                gpu_models=pod.gpu_spec,
            )
        )
    return arrivals, skipped


OPENB_POLICY = """\
# The trace's cluster: Kubernetes with GPU sharing by milli-GPU.
rules:
  - name: fractional-pods-share-gpus
    why: pods that ask for part of a GPU share GPUs with others, as on Alibaba's cluster
    match: {{isolation: none}}
    route: {{cluster: {cluster}, sharing: k8s/timeslice}}
  - name: whole-gpu-pods
    why: pods that ask for whole GPUs get whole GPUs
    match: {{}}
    route: {{cluster: {cluster}, sharing: k8s/exclusive}}
"""


def openb_policy(cluster: str = DEFAULT_CLUSTER) -> Policy:
    """The routing the trace's cluster applied, as a gpush policy."""
    from broker.routing.policy import load_policy

    return load_policy(OPENB_POLICY.format(cluster=cluster), f"openb policy for {cluster}")


@dataclass(frozen=True)
class OpenbTrace:
    """One pod list on one node list, read and converted."""

    directory: str
    nodes_file: str
    pods_file: str
    nodes: list[TraceNode]
    pods: list[TracePod]
    cluster: str
    reference_memory_gb: float

    @property
    def gpu_pods(self) -> list[TracePod]:
        return [p for p in self.pods if not p.cpu_only]

    @property
    def cpu_only_pods(self) -> int:
        return sum(p.cpu_only for p in self.pods)

    @property
    def gpu_count(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def fleet(self) -> Fleet:
        return openb_fleet(self.nodes, self.cluster)

    def shared_nodes(self, *, account_cpu: bool = True) -> list[SharedNode]:
        return shared_nodes(self.nodes, account_cpu=account_cpu)

    def workload(self) -> list[Arrival]:
        return openb_workload(self.pods, self.reference_memory_gb)[0]

    def cpu_work(self) -> list[CpuWork]:
        """The CPU-only pods as work that holds the nodes' CPU and memory in a replay."""
        return [
            CpuWork(float(p.creation_time or 0), p.duration, p.cpu_milli, p.memory_mib) for p in self.pods if p.cpu_only
        ]

    def tasks(self) -> list[TaskShape]:
        """The GPU pods' shapes (with the GPU models they accept), in file order."""
        return [p.task for p in self.pods if not p.cpu_only]

    def inflation_tasks(self) -> list[TaskShape | CpuTask]:
        """Every pod as the inflation experiment places it, in file order: the GPU pods'
        shapes and the CPU-only pods' CPU and memory (FGD places both)."""
        return [CpuTask(p.cpu_milli, p.memory_mib) if p.cpu_only else p.task for p in self.pods]

    def policy(self) -> Policy:
        return openb_policy(self.cluster)


def load_openb(
    directory: str | os.PathLike[str],
    *,
    pods_file: str = DEFAULT_PODS,
    nodes_file: str = DEFAULT_NODES,
    cluster: str = DEFAULT_CLUSTER,
) -> OpenbTrace:
    """Read ``pods_file`` and ``nodes_file`` from the trace directory."""
    root = Path(directory)
    if not root.is_dir():
        raise InvalidRequest(f"trace directory {str(directory)!r} does not exist")
    nodes = read_nodes(root / nodes_file)
    pods = read_pods(root / pods_file)
    return OpenbTrace(str(root), nodes_file, pods_file, nodes, pods, cluster, reference_memory_gb(nodes))
