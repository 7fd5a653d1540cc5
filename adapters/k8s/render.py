"""A gpush job rendered as a Kubernetes object: a batch/v1 Job, or an apps/v1 Deployment.

What callers may assume:

- **Which object.** Elastic inference (``spec.elastic``) becomes a Deployment with
  ``placement.replicas`` replicas, scaled later through its scale subresource;
  everything else a Job that runs once (``backoffLimit`` 0, ``restartPolicy: Never``,
  ``activeDeadlineSeconds`` from ``time_limit``, no ``ttlSecondsAfterFinished`` so the
  finished Job stays for ``find``), with ``parallelism = completions = replicas``.
- **Tagged.** The object is named ``<tag>-<gpush id>`` and it and its Pods carry
  :data:`LABEL_BROKER` (the registration's tag) and :data:`LABEL_JOB_ID`, so the
  adapter finds its objects by label after a crash and two brokers sharing a
  namespace never take each other's. Tenant and user travel as labels made valid
  (:func:`label_value`) and, as typed, as annotations. The job's own labels travel to
  the Pods; keys in gpush's or Kubernetes' own domains are refused.
- **GPU requests by sharing mode.** k8s/timeslice: ``nvidia.com/gpu: <units>`` on
  nodes whose GPU Feature Discovery labels say time-slicing
  (``nvidia.com/gpu.sharing-strategy=time-slicing``, or no strategy label and
  ``nvidia.com/gpu.replicas`` > 1 from GFD before v0.15), with the host memory limit
  of the job; k8s/mig: ``nvidia.com/mig-<profile>: <units>`` (the GPU Operator's
  mixed strategy); k8s/exclusive: ``nvidia.com/gpu: <units>`` on nodes that do not
  share (strategy ``none``, or no strategy label and at most one replica). Requests
  equal limits. The GPU model is pinned by ``nvidia.com/gpu.product`` for
  time-slicing and whole GPUs (a MIG profile names its model already).
- **The job's environment** is broker.jobenv.environment's, the same as on Slurm: the
  job's variables and gpush's ``GPUSH_*``, among them the GPU memory budget
  (``GPUSH_GPU_MEMORY_FRACTION``: its ``gpu_memory_gb`` over the GPU's memory under
  time-slicing, which has no memory isolation, so the program must hold itself to it;
  1 on a MIG slice or a whole GPU). Device ids are never set: the device plugin
  chooses them, and a job that sets ``CUDA_VISIBLE_DEVICES`` or
  ``NVIDIA_VISIBLE_DEVICES`` itself is refused.
- **Where it runs.** A one-node Job with a ``placement.node`` may run only on that node
  (required node affinity on ``metadata.name``, as a gang's ranks on the gang's nodes), so
  the cluster and gpush agree on the node gpush counted the job against. An elastic job's
  Deployment only prefers it: ``gpush scale`` adds replicas later, and they may need other
  nodes. Which GPUs of the node a Pod gets is not the Pod's to say: the device plugin picks
  them at allocation (NVIDIA's, for whole GPUs without time-slicing replicas, asks
  go-gpuallocator's best-effort policy, which keeps them on NVLink-joined GPUs where it can;
  replicas it spreads over the GPUs). The device indexes gpush chose (``placement.gpus``, a
  one-node job's) travel only as the annotation :data:`ANNOTATION_GPUS` (``0,1``), for people
  to read: never as ``CUDA_VISIBLE_DEVICES``, which would name devices the plugin did not
  give the container.
- **A multi-node job (a gang, ``placement.nodes``)** is an Indexed Job
  (``completionMode: Indexed``, ``completions = parallelism`` = its nodes, ``backoffLimit``
  0) beside a headless Service of the same name (:func:`headless_service`) that gives each
  rank a stable host name, ``<name>-<rank>.<name>`` (the Job controller names each Pod's
  host ``<name>-<index>``; the template's ``subdomain`` is the Service). Each Pod asks for
  the per-node request (``units`` whole GPUs or MIG instances), may run only on the gang's
  nodes (required node affinity on ``metadata.name``) and never beside another rank of it
  (required Pod anti-affinity on the job's labels, per ``kubernetes.io/hostname``): so the
  gang holds exactly the nodes gpush chose, one rank each. Which rank lands on which of
  them is the scheduler's choice (an Indexed Job's Pods share one template, so a rank
  cannot be pinned to a node by itself); ranks find each other by host name, not node.
  Each container sees ``MASTER_ADDR`` (rank 0's host name), ``MASTER_PORT``
  (:data:`MASTER_PORT`), ``NNODES``, ``NPROC_PER_NODE`` (the job's tasks per node),
  ``WORLD_SIZE`` (nodes x tasks per node) and ``NODE_RANK``, which is
  ``JOB_COMPLETION_INDEX``, the Pod's completion index (both read from its
  ``batch.kubernetes.io/job-completion-index`` annotation), as torchrun reads them. A
  job that sets one of them itself keeps its own value, as on Slurm. A one-node job of
  several tasks (``tasks_per_node`` > 1) gets them too, for its one Pod
  (:func:`one_node_environment`: ``MASTER_ADDR`` 127.0.0.1, ``NODE_RANK`` 0).
- **No shell, no root.** ``command`` is the container's argv (a string command was
  already made ``/bin/sh -c ...`` by the job spec, visibly); Pods run as a non-root
  uid without privilege escalation, and mount no service account token unless the
  cluster names a service account.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.core.adapter import Placement, Rejected, Sharing
from broker.core.gpus import MODELS, gpu_model
from broker.core.schemas import JobSpec
from broker.core.spec_values import parse_memory_mib, parse_time_limit
from broker.jobenv.environment import job_environment

DOMAIN = "gpush.io"
LABEL_BROKER = f"{DOMAIN}/broker"  # the registration's tag: whose objects these are
LABEL_JOB_ID = f"{DOMAIN}/job-id"
LABEL_TENANT = f"{DOMAIN}/tenant"
LABEL_USER = f"{DOMAIN}/user"
LABEL_KIND = f"{DOMAIN}/kind"  # training | inference | batch
LABEL_SHARING = f"{DOMAIN}/sharing"  # timeslice | mig | exclusive
ANNOTATION_NAME = f"{DOMAIN}/name"
ANNOTATION_TENANT = f"{DOMAIN}/tenant"
ANNOTATION_USER = f"{DOMAIN}/user"
ANNOTATION_GPU_MEMORY = f"{DOMAIN}/gpu-memory-gb"
ANNOTATION_GPUS = f"{DOMAIN}/gpus"  # the device indexes gpush chose on the node, for people to read

# Labels GPU Feature Discovery (the GPU Operator's, or the device plugin's) sets on nodes.
GFD_PRODUCT = "nvidia.com/gpu.product"  # "NVIDIA-A100-SXM4-40GB", "Tesla-T4-SHARED" when time-sliced
GFD_COUNT = "nvidia.com/gpu.count"  # physical GPUs (not replicas)
GFD_REPLICAS = "nvidia.com/gpu.replicas"  # time-slicing replicas per GPU (1: not shared)
GFD_MEMORY = "nvidia.com/gpu.memory"  # MiB of one GPU
GFD_SHARING = "nvidia.com/gpu.sharing-strategy"  # none | time-slicing | mps (GFD v0.15 and later)
GFD_MIG_STRATEGY = "nvidia.com/mig.strategy"  # none | single | mixed
DEVICE_PLUGIN_CONFIG = "nvidia.com/device-plugin.config"  # which key of the time-slicing ConfigMap
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
SHARED_SUFFIX = "-SHARED"

# The Job controller's completion index of an Indexed Job's Pod (annotation and label).
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
HOSTNAME_LABEL = "kubernetes.io/hostname"
MASTER_PORT = 29500  # torch.distributed's default rendezvous port

CONTAINER = "job"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_RESERVED_LABEL_DOMAINS = (DOMAIN, "kubernetes.io", "k8s.io")
_TAG = re.compile(r"^[a-z]([a-z0-9-]{0,30}[a-z0-9])?\Z")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?\Z")
_DNS_LABEL_MAX = 63


def mig_resource(profile: str) -> str:
    return f"{MIG_RESOURCE_PREFIX}{profile}"


def check_tag(tag: str) -> str:
    """A registration's tag names Kubernetes objects (``<tag>-<id>``): DNS-1123, short."""
    if not _TAG.match(tag):
        raise ValueError(
            f"tag {tag!r} names Kubernetes objects: use 1 to 32 lowercase letters, digits and -, "
            "starting with a letter and ending with a letter or digit (e.g. gpush or gpush-prod)"
        )
    return tag


def object_name(tag: str, job_id: int) -> str:
    """``<tag>-<id>``: a DNS-1123 label, short enough for the Pod names derived from it."""
    name = f"{tag}-{job_id}"
    if len(name) > _DNS_LABEL_MAX - 16:  # Job and ReplicaSet controllers append -<hash>-<suffix>
        raise Rejected(f"object name {name} is too long for Kubernetes: use a shorter tag")
    return name


def selector(tag: str, job_id: int | None = None) -> str:
    """The label selector of this broker's objects (of one job when ``job_id`` is given)."""
    terms = [f"{LABEL_BROKER}={tag}"]
    if job_id is not None:
        terms.append(f"{LABEL_JOB_ID}={job_id}")
    return ",".join(terms)


def job_id_of(obj: Mapping[str, Any], tag: str) -> int | None:
    """The gpush job id an object carries, if it is this broker's, else None."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if labels.get(LABEL_BROKER) != tag:
        return None
    value = str(labels.get(LABEL_JOB_ID) or "")
    return int(value) if value.isdigit() else None


def label_value(text: str, what: str) -> str:
    """``text`` as a valid label value: characters a label may not hold become ``_``
    (``alice@example.com`` -> ``alice_example.com``), cut to 63 and trimmed to end
    alphanumeric. Refused when nothing valid remains."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:_DNS_LABEL_MAX]
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    if not value or not _LABEL_VALUE.match(value):
        raise Rejected(
            f"{what} {text!r} cannot be a Kubernetes label value: use letters, digits, - _ or ., "
            "starting and ending with a letter or digit"
        )
    return value


def _check_user_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The job's labels (JobSpec checked their syntax), refused if they claim a reserved domain."""
    for key in labels:
        prefix = key.split("/", 1)[0] if "/" in key else ""
        if any(prefix == d or prefix.endswith("." + d) for d in _RESERVED_LABEL_DOMAINS):
            raise Rejected(
                f"label {key} is in a domain that gpush or Kubernetes reserves ({prefix}): "
                "use a key of your own, such as team/model or model"
            )
    return dict(labels)


def quantity_mib(memory: str) -> str:
    """gpush's ``16G`` (GiB, as Slurm counts) as Kubernetes' ``16384Mi``."""
    return f"{parse_memory_mib(memory)}Mi"


def product_names(model: str, gpu_types: Mapping[str, str] = {}, seen: Iterable[str] = ()) -> list[str]:  # noqa: B006
    """The ``nvidia.com/gpu.product`` values that mean GPU model ``model``: configured ones
    (``gpu_types``), those seen on nodes, and GFD's spellings of the model's names
    (``NVIDIA-A100-SXM4-40GB``, ``Tesla-T4``), each also with ``-SHARED``."""
    names = {product for product, mapped in gpu_types.items() if mapped == model}
    names.update(seen)
    try:
        known = gpu_model(model)
        spellings = [known.name, *known.aliases]
    except ValueError:
        spellings = [model]
    for spelling in spellings:
        names.update({spelling, f"NVIDIA-{spelling}", f"Tesla-{spelling}"})
    out = set()
    for name in names:
        base = name.removesuffix(SHARED_SUFFIX)
        out.update({base, base + SHARED_SUFFIX})
    return sorted(n for n in out if len(n) <= _DNS_LABEL_MAX and _LABEL_VALUE.match(n))


def model_of_product(product: str, gpu_types: Mapping[str, str] = {}) -> str | None:  # noqa: B006
    """The gpush GPU model a GFD product label names (``Tesla-T4-SHARED`` -> ``T4``), or None."""
    base = product.removesuffix(SHARED_SUFFIX)
    for candidate in (product, base):
        if candidate in gpu_types:
            return gpu_types[candidate]
        if candidate in GFD_PRODUCTS:
            return GFD_PRODUCTS[candidate]
    for candidate in (base, base.removeprefix("NVIDIA-"), base.removeprefix("Tesla-")):
        try:
            return gpu_model(candidate).name
        except ValueError:
            continue
    return None


# GFD spellings (the driver's device name, spaces as dashes) that are not a gpush name
# with NVIDIA- or Tesla- in front. gpush counts PCIe cards as their SXM model of equal memory.
GFD_PRODUCTS = {
    "NVIDIA-A100-80GB-PCIe": "A100-SXM4-80GB",
    "NVIDIA-H100-PCIe": "H100-SXM5-80GB",
    "NVIDIA-H100-80GB-HBM3": "H100-SXM5-80GB",
    "NVIDIA-H200-141GB-HBM3e": "H200-SXM5-141GB",
    "NVIDIA-L40S": "L40S",
}


def default_gpu_types() -> dict[str, str]:
    """GFD's product spellings of every model gpush knows -> the model (the ``gpu_types`` default)."""
    out: dict[str, str] = dict(GFD_PRODUCTS)
    for model in MODELS:
        for spelling in (model.name, *model.aliases):
            for prefix in ("NVIDIA-", "Tesla-", ""):
                out.setdefault(f"{prefix}{spelling}", model.name)
    return out


@dataclass(frozen=True)
class RenderOptions:
    """What a cluster's settings add to every object (see KubernetesSettings)."""

    tag: str
    namespace: str
    image: str | None = None
    service_account: str | None = None
    run_as_user: int = 1000
    priority_class: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    gpu_types: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    kind: str  # the client's collection: "jobs" or "deployments"
    body: dict[str, Any]
    service: dict[str, Any] | None = None  # a gang's headless Service, created before the Job

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def backend_id(self) -> str:
        """``job/<name>`` or ``deployment/<name>``: what ``kubectl get`` takes."""
        return f"{self.kind.removesuffix('s')}/{self.name}"


def gpu_requests(placement: Placement) -> dict[str, str]:
    """The extended resources one Pod asks for (requests and limits alike)."""
    units = placement.units
    if units < 1:
        raise Rejected(f"a placement of {units} GPU units: the broker must ask for at least one")
    if placement.sharing == Sharing.K8S_MIG:
        if not placement.mig_profile:
            raise Rejected("a k8s/mig placement without a MIG profile: the broker must name one")
        return {mig_resource(placement.mig_profile): str(units)}
    if placement.sharing in (Sharing.K8S_TIMESLICE, Sharing.K8S_EXCLUSIVE):
        return {GPU_RESOURCE: str(units)}
    raise Rejected(
        f"{placement.sharing.value} is not a Kubernetes sharing mode: use k8s/timeslice, k8s/mig or k8s/exclusive"
    )


def _requirement(key: str, operator: str, values: Sequence[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"key": key, "operator": operator}
    if values:
        out["values"] = list(values)
    return out


def node_affinity(placement: Placement, products: Sequence[str], *, pin: bool = True) -> dict[str, Any] | None:
    """Required node terms for the sharing mode and GPU model, and the placement's nodes by name:
    a gang's, or a one-node job's ``node`` (required with ``pin``, else preferred)."""
    if placement.sharing == Sharing.K8S_TIMESLICE:
        terms = [
            [_requirement(GFD_SHARING, "In", ["time-slicing"])],
            [_requirement(GFD_SHARING, "DoesNotExist"), _requirement(GFD_REPLICAS, "Gt", ["1"])],
        ]
    elif placement.sharing == Sharing.K8S_EXCLUSIVE:
        terms = [
            [_requirement(GFD_SHARING, "In", ["none"])],
            [_requirement(GFD_SHARING, "DoesNotExist"), _requirement(GFD_REPLICAS, "DoesNotExist")],
            [_requirement(GFD_SHARING, "DoesNotExist"), _requirement(GFD_REPLICAS, "Lt", ["2"])],
        ]
    else:
        terms = []
    if terms and products:
        terms = [[*term, _requirement(GFD_PRODUCT, "In", products)] for term in terms]
    pinned = placement.nodes if placement.gang else ((placement.node,) if placement.node and pin else ())
    if pinned:
        # Only these nodes, by name (the broker's names are the Nodes' metadata.name).
        nodes = {"matchFields": [_requirement("metadata.name", "In", pinned)]}
        selectors = [{"matchExpressions": term, **nodes} for term in terms] or [nodes]
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": selectors}}}
    affinity: dict[str, Any] = {}
    if terms:
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
            "nodeSelectorTerms": [{"matchExpressions": term} for term in terms]
        }
    if placement.node:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {
                "weight": 100,
                "preference": {"matchExpressions": [_requirement(HOSTNAME_LABEL, "In", [placement.node])]},
            }
        ]
    return {"nodeAffinity": affinity} if affinity else None


def environment(job_id: int, spec: JobSpec, placement: Placement, gpu_memory_gb: float | None) -> list[dict[str, str]]:
    """The container's ``env``: broker.jobenv.environment's variables, sorted by name."""
    env = job_environment(job_id, spec, placement, device_memory_gb=gpu_memory_gb, path=DEFAULT_PATH)
    return [{"name": name, "value": value} for name, value in sorted(env.items())]


def gang_environment(name: str, spec: JobSpec, placement: Placement) -> list[dict[str, Any]]:
    """A gang's rendezvous variables (see the module docstring); the rank is each Pod's own
    completion index, read from its annotation as the Job controller's JOB_COMPLETION_INDEX is."""
    index = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}
    return [
        *_launch_environment(f"{name}-0.{name}", len(placement.nodes), spec.tasks_per_node),
        {"name": "NODE_RANK", "valueFrom": index},
        {"name": "JOB_COMPLETION_INDEX", "valueFrom": index},
    ]


def one_node_environment(spec: JobSpec) -> list[dict[str, Any]]:
    """A one-node job of several tasks (``tasks_per_node`` > 1): what its launcher reads to
    start them in the one Pod (torchrun --nproc-per-node $NPROC_PER_NODE), rank 0 here."""
    return [*_launch_environment("127.0.0.1", 1, spec.tasks_per_node), {"name": "NODE_RANK", "value": "0"}]


def _launch_environment(master_addr: str, nodes: int, tasks_per_node: int) -> list[dict[str, Any]]:
    return [
        {"name": "MASTER_ADDR", "value": master_addr},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        {"name": "NNODES", "value": str(nodes)},
        {"name": "NPROC_PER_NODE", "value": str(tasks_per_node)},
        {"name": "WORLD_SIZE", "value": str(nodes * tasks_per_node)},
    ]


def gang_anti_affinity(job_id: int, tag: str) -> dict[str, Any]:
    """No two ranks of a gang on one node."""
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {
                "labelSelector": {"matchLabels": {LABEL_BROKER: tag, LABEL_JOB_ID: str(job_id)}},
                "topologyKey": HOSTNAME_LABEL,
            }
        ]
    }


def headless_service(name: str, job_id: int, metadata: Mapping[str, Any], options: RenderOptions) -> dict[str, Any]:
    """A gang's headless Service: DNS names for its ranks' Pods, ready or not (a rank resolves
    rank 0 before rank 0 is ready), no virtual IP, no load balancing."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": options.namespace,
            "labels": dict(metadata["labels"]),
            "annotations": dict(metadata["annotations"]),
        },
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_BROKER: options.tag, LABEL_JOB_ID: str(job_id)},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"}],
        },
    }


def labels_for(job_id: int, spec: JobSpec, placement: Placement, tag: str) -> dict[str, str]:
    labels = {
        LABEL_BROKER: tag,
        LABEL_JOB_ID: str(job_id),
        LABEL_KIND: spec.kind.value,
        LABEL_SHARING: placement.sharing.value.split("/", 1)[1],
    }
    if spec.tenant:
        labels[LABEL_TENANT] = label_value(spec.tenant, "tenant")
    if spec.user:
        labels[LABEL_USER] = label_value(spec.user, "user")
    return labels


def annotations_for(spec: JobSpec, placement: Placement) -> dict[str, str]:
    out = {}
    if spec.name:
        out[ANNOTATION_NAME] = spec.name
    if spec.tenant:
        out[ANNOTATION_TENANT] = spec.tenant
    if spec.user:
        out[ANNOTATION_USER] = spec.user
    if placement.gpu_memory_gb:
        out[ANNOTATION_GPU_MEMORY] = f"{placement.gpu_memory_gb:g}"
    if placement.gpus and not placement.gang:  # a gang's ranks share one template: no one node's indexes
        out[ANNOTATION_GPUS] = ",".join(str(i) for i in placement.gpus)
    return out


def pod_template(
    job_id: int,
    spec: JobSpec,
    placement: Placement,
    options: RenderOptions,
    *,
    restart_policy: str,
    gpu_memory_gb: float | None,
    products: Sequence[str],
) -> dict[str, Any]:
    image = spec.image or options.image
    if not image:
        raise Rejected(
            "the job names no image and the Kubernetes cluster has no default: give the job an image, "
            "or set the cluster's image (gpush cluster add ... --config image=REPO/IMAGE:TAG)"
        )
    if options.run_as_user < 1:
        raise Rejected("run_as_user must be a non-root uid (1 or more)")
    gpus = gpu_requests(placement)
    requests: dict[str, str] = {"cpu": str(spec.cpus), **gpus}
    limits: dict[str, str] = dict(gpus)
    if spec.memory:
        requests["memory"] = limits["memory"] = quantity_mib(spec.memory)
    env = environment(job_id, spec, placement, gpu_memory_gb)
    if placement.gang:
        name = object_name(options.tag, job_id)
        env += [v for v in gang_environment(name, spec, placement) if v["name"] not in spec.env]  # the job's own win
    elif spec.tasks_per_node > 1:
        env += [v for v in one_node_environment(spec) if v["name"] not in spec.env]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "env": env,
        "resources": {"requests": requests, "limits": limits},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if spec.command:
        container["command"] = list(spec.command)
    pod: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": options.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": bool(options.service_account),
        "containers": [container],
    }
    if spec.checkpoint is not None:
        # What the kubelet gives the container between SIGTERM and SIGKILL, on a
        # preemption's deletion and on any other: the time the job said it needs to save.
        pod["terminationGracePeriodSeconds"] = spec.checkpoint.grace
    if options.service_account:
        pod["serviceAccountName"] = options.service_account
    if options.priority_class:
        pod["priorityClassName"] = options.priority_class
    if options.node_selector:
        pod["nodeSelector"] = dict(options.node_selector)
    affinity = node_affinity(placement, products, pin=spec.elastic is None)
    if placement.gang:
        affinity = {**(affinity or {}), "podAntiAffinity": gang_anti_affinity(job_id, options.tag)}
        pod["subdomain"] = object_name(options.tag, job_id)  # the headless Service: <name>-<rank>.<name>
    if affinity:
        pod["affinity"] = affinity
    labels = {**_check_user_labels(spec.labels), **labels_for(job_id, spec, placement, options.tag)}
    return {"metadata": {"labels": labels, "annotations": annotations_for(spec, placement)}, "spec": pod}


def render(
    job_id: int,
    spec: JobSpec,
    placement: Placement,
    options: RenderOptions,
    *,
    gpu_memory_gb: float | None = None,
    products: Sequence[str] | None = None,
) -> Manifest:
    """The Job or Deployment for a placed gpush job (see the module docstring).

    ``gpu_memory_gb``: memory of one physical GPU of the placement's model (for the
    time-slicing budget); ``products``: the ``nvidia.com/gpu.product`` values the
    Pods may land on (None: the spellings :func:`product_names` knows for the
    placement's model; empty: any).
    """
    if products is None:
        products = product_names(placement.gpu_model, options.gpu_types) if placement.gpu_model else []
    if placement.replicas < 1:
        raise Rejected(f"a placement of {placement.replicas} replicas: the broker must ask for at least one")
    name = object_name(options.tag, job_id)
    elastic = spec.elastic is not None
    if placement.gang and (elastic or placement.sharing == Sharing.K8S_TIMESLICE):
        raise Rejected(
            f"a job on {len(placement.nodes)} nodes runs whole GPUs or MIG slices on each, as one Indexed Job: "
            "not elastic replicas nor time-sliced GPUs; submit it with nodes 1"
        )
    template = pod_template(
        job_id,
        spec,
        placement,
        options,
        restart_policy="Always" if elastic else "Never",
        gpu_memory_gb=gpu_memory_gb,
        products=products,
    )
    metadata = {
        "name": name,
        "namespace": options.namespace,
        "labels": dict(template["metadata"]["labels"]),
        "annotations": dict(template["metadata"]["annotations"]),
    }
    if elastic:
        body = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": metadata,
            "spec": {
                "replicas": placement.replicas,
                "selector": {"matchLabels": {LABEL_BROKER: options.tag, LABEL_JOB_ID: str(job_id)}},
                # A rolling update would start new GPU Pods before the old ones leave.
                "strategy": {"type": "Recreate"},
                "template": template,
            },
        }
        return Manifest("deployments", body)
    pods = len(placement.nodes) if placement.gang else placement.replicas
    job_spec: dict[str, Any] = {
        # 0 for a gang above all: one rank that fails or is lost fails the Job, whose
        # controller then stops the other ranks; none is ever replaced on its own.
        "backoffLimit": 0,
        "parallelism": pods,
        "completions": pods,
        "template": template,
    }
    if placement.gang:
        job_spec["completionMode"] = "Indexed"
        # A rank disrupted (its node gone, an eviction) fails the Job saying so in its own
        # condition, which the adapter reads as a loss to queue again, not the job's failure.
        job_spec["podFailurePolicy"] = {
            "rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
        }
    if spec.time_limit:
        job_spec["activeDeadlineSeconds"] = parse_time_limit(spec.time_limit)
    body = {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": job_spec}
    service = headless_service(name, job_id, metadata, options) if placement.gang else None
    return Manifest("jobs", body, service)
