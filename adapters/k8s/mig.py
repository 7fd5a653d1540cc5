"""Node fencing and MIG layouts on Kubernetes, through cordons and the GPU Operator's MIG manager.

This module owns the pure part of :class:`broker.core.adapter.NodeFencer` and
:class:`broker.core.adapter.MigPublisher` on Kubernetes: which labels and annotations say what,
the nvidia-mig-parted config gpush keeps per node, and how it is merged into the MIG manager's
ConfigMap. adapters.k8s.nodes and adapters.k8s.mig_publish read and write the objects.

- **Fencing** is a cordon (``spec.unschedulable``, as ``kubectl cordon``) with the reason in the
  annotation ``gpush.io/fenced``, so gpush tells its own cordons from an admin's. A node cordoned
  before gpush fenced it also gets ``gpush.io/fenced-over-cordon``: unfencing it drops gpush's
  annotations and leaves the admin's cordon in place.
- **MIG layouts.** The GPU Operator's MIG manager applies the named mig-parted config that the
  node label ``nvidia.com/mig.config`` picks, from the ConfigMap that the ClusterPolicy's
  ``spec.migManager.config.name`` names (``default-mig-parted-config`` in the operator's
  namespace unless it says otherwise; key ``config.yaml``), and reports in
  ``nvidia.com/mig.config.state`` (``pending``, ``rebooting``, ``success``, ``failed``). gpush
  keeps one config per node for every GPU whose layout it knows, and changes the one GPU
  asked for. The MIG manager acts when the label *changes*, not when the ConfigMap does, so
  the node's config alternates between two names (:func:`config_names`): each publish writes
  the name the label does not hold, removes the other, and moves the label.
- **What Kubernetes cannot say.** mig-parted counts instances per profile; it does not take
  placements, so the ``@start`` of an instance is not sent to the cluster. gpush records what
  it published in the annotation ``gpush.io/mig-published`` and answers with those strings as
  long as the profile counts agree, else with the placement :func:`broker.mig.layouts.place_instances`
  picks. Per-GPU layouts are not visible either: the node's other GPUs keep the layout of the
  config its label names (gpush's own, or any config of the ConfigMap once applied); failing
  that, the node's ``nvidia.com/mig-<profile>.count`` labels are dealt round-robin over its MIG
  GPUs (:func:`spread_counts`), exact for nodes whose GPUs share one layout and a guess
  otherwise. GPUs gpush cannot attribute are left out of the config, and mig-parted leaves
  unlisted GPUs as they are.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from adapters.k8s import quantity
from adapters.k8s.render import GFD_COUNT, GFD_MIG_STRATEGY, GFD_PRODUCT, GPU_RESOURCE, MIG_RESOURCE_PREFIX
from broker.core.errors import InvalidRequest
from broker.core.gpus import GpuModel
from broker.core.yamltext import load_yaml
from broker.mig.config import mig_parted_name
from broker.mig.layouts import MigSlot, layout_counts, place_instances

FENCED_ANNOTATION = "gpush.io/fenced"  # the reason gpush fenced the node
FENCED_OVER_CORDON = "gpush.io/fenced-over-cordon"  # "true": the node was cordoned before gpush fenced it
PUBLISHED_ANNOTATION = "gpush.io/mig-published"  # JSON: {"config": name, "gpus": {"0": ["3g.20gb@0"]}}
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
MIG_PARTED_KEY = "config.yaml"
DEFAULT_MIG_CONFIG = "gpu-operator/default-mig-parted-config"
_LABEL_VALUE_MAX = 63

# Per GPU: instances per profile in mig-parted's ``mig-devices``; None: MIG mode off.
GpuCounts = dict[str, int] | None


class MigConfigError(ValueError):
    """A mig-parted config gpush cannot read or use; the message says where and why."""


# -- names -------------------------------------------------------------------------------


def config_names(node: str) -> tuple[str, str]:
    """The two names of ``node``'s gpush config: ``gpush-<node>`` and ``gpush-<node>_2``. A node
    name holds no ``_``, so neither is another node's; both are valid label values (a long
    node name is shortened with a hash of it to fit 63 characters)."""
    base = mig_parted_name(node)
    if len(base) + 2 > _LABEL_VALUE_MAX:
        digest = hashlib.sha256(node.encode()).hexdigest()[:10]
        base = f"{base[: _LABEL_VALUE_MAX - 2 - 11].rstrip('-.')}-{digest}"
    return base, f"{base}_2"


def next_config_name(node: str, current_label: str | None) -> str:
    """The name a publish writes: the one of ``node``'s two that the label does not hold now."""
    first, second = config_names(node)
    return second if current_label == first else first


# -- reading mig-parted configs ----------------------------------------------------------


def parse_configs(text: str | None, source: str) -> dict[str, Any]:
    """The ``mig-configs`` mapping of a mig-parted config file (empty for no text)."""
    if not text or not text.strip():
        return {}
    try:
        # Anyone who may edit the ConfigMap writes this text: read it within gpush's YAML limits.
        doc = load_yaml(text, source=source)
    except InvalidRequest as exc:
        raise MigConfigError(str(exc)) from None
    if doc is None:
        return {}
    if not isinstance(doc, dict) or str(doc.get("version", "v1")) != "v1":
        raise MigConfigError(f"{source} is not a mig-parted config (version: v1 with mig-configs)")
    configs = doc.get("mig-configs") or {}
    if not isinstance(configs, dict):
        raise MigConfigError(f"{source}: mig-configs is not a mapping of config names")
    return configs


def resolve(entries: Any, gpus: int, name: str = "") -> dict[int, GpuCounts]:
    """Per GPU index, what a named config's entries give it (``devices: all`` being GPUs
    0..gpus-1); GPUs no entry names are not in the answer. A later entry wins, as in mig-parted."""
    where = f"mig-parted config {name}" if name else "mig-parted config"
    if not isinstance(entries, list):
        raise MigConfigError(f"{where} is not a list of entries")
    out: dict[int, GpuCounts] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise MigConfigError(f"{where}: entry {entry!r} is not a mapping")
        devices = entry.get("devices", "all")
        if devices == "all":
            indices = list(range(gpus))
        elif isinstance(devices, list) and all(isinstance(d, int) and d >= 0 for d in devices):
            indices = list(devices)
        else:
            raise MigConfigError(f"{where}: devices {devices!r} is neither all nor a list of GPU indices")
        enabled = entry.get("mig-enabled", False)
        counts: GpuCounts = None
        if enabled:
            raw = entry.get("mig-devices") or {}
            if not isinstance(raw, dict) or not all(isinstance(n, int) and n >= 0 for n in raw.values()):
                raise MigConfigError(f"{where}: mig-devices {raw!r} is not profile: count")
            counts = {str(p): n for p, n in raw.items() if n}
        for index in indices:
            out[index] = counts
    return out


# -- writing -------------------------------------------------------------------------------


def counts_of(model: GpuModel | None, slots: Iterable[MigSlot]) -> dict[str, int]:
    """Instances per profile, in NVIDIA's profile order when the model is known."""
    slots = list(slots)
    if model is not None:
        return layout_counts(model, slots)
    return dict(Counter(s.profile for s in slots))


def render_entries(layouts: Mapping[int, GpuCounts]) -> list[dict[str, Any]]:
    """A mig-parted config's entries for ``layouts``: GPUs of equal layout share one entry,
    in index order of their first GPU (as broker.mig.config.mig_parted_config groups them)."""
    groups: dict[str, dict[str, Any]] = {}
    for index in sorted(layouts):
        counts = layouts[index]
        key = json.dumps(counts, sort_keys=True)
        if key not in groups:
            entry: dict[str, Any] = {"devices": [], "mig-enabled": counts is not None}
            if counts is not None:
                entry["mig-devices"] = dict(counts)
            groups[key] = entry
        groups[key]["devices"].append(index)
    return list(groups.values())


def _dump(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)


def _content_end(node: yaml.Node) -> int:
    """Where the text of ``node`` ends: the end of its last scalar or flow collection (a block
    collection's own end mark lies at the next token, past comments that belong to what follows)."""
    while isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and not node.flow_style and node.value:
        last = node.value[-1]
        node = last[1] if isinstance(node, yaml.MappingNode) else last
    return node.end_mark.index


def _line_start(text: str, index: int) -> int:
    return text.rfind("\n", 0, index) + 1


def _line_end(text: str, index: int) -> int:
    end = text.find("\n", index)
    return len(text) if end < 0 else end + 1


def merge_config(text: str | None, name: str, entries: list[dict[str, Any]], drop: Sequence[str] = ()) -> str:
    """``text`` (a mig-parted config file, or None) with config ``name`` set to ``entries`` and
    the configs named in ``drop`` removed. Every other config keeps its text byte for byte,
    comments and all, when ``mig-configs`` is a block mapping (as people and the GPU Operator
    write it); a file written otherwise is dumped anew."""
    configs = parse_configs(text, "the mig-parted config")  # checks it first, within gpush's limits
    if text is None or not configs:
        base = yaml.safe_load(text) if text and text.strip() else None
        doc = base if isinstance(base, dict) else {"version": "v1"}
        doc = {**doc, "mig-configs": {name: entries}}
        return _dump(doc)
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    section = next(
        (v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "mig-configs"),
        None,
    )
    if not isinstance(section, yaml.MappingNode) or section.flow_style:
        doc = yaml.safe_load(text)
        kept = {k: v for k, v in doc["mig-configs"].items() if k != name and k not in drop}
        return _dump({**doc, "mig-configs": {**kept, name: entries}})
    column = section.value[0][0].start_mark.column
    rendered = "".join(" " * column + line + "\n" for line in _dump({name: entries}).splitlines())
    spans = [  # (start, end, key) of each config's text, in whole lines
        (_line_start(text, key.start_mark.index), _line_end(text, _content_end(value)), key.value)
        for key, value in section.value
    ]
    out = text[: spans[0][0]]
    insert_at = len(out)  # after the last config kept: where a new one goes
    replaced = False
    previous_end = spans[0][0]
    for start, end, key in spans:
        out += text[previous_end:start]  # blank lines and comments between configs stay
        previous_end = end
        if key == name and not replaced:
            out += rendered
            replaced = True
        elif key == name or key in drop:
            continue
        else:
            out += text[start:end]
        insert_at = len(out)
    if not replaced:
        head = out[:insert_at]
        out = head + ("" if not head or head.endswith("\n") else "\n") + rendered + out[insert_at:]
    return out + text[previous_end:]


# -- the node's layout as Kubernetes shows it ----------------------------------------------


def label_totals(labels: Mapping[str, str]) -> dict[str, int]:
    """MIG instances per profile on the node, from GFD's labels (mixed strategy:
    ``nvidia.com/mig-<profile>.count``; single: the product ``<model>-MIG-<profile>`` and
    ``nvidia.com/gpu.count``)."""
    totals: dict[str, int] = {}
    for key, value in labels.items():
        if key.startswith(MIG_RESOURCE_PREFIX) and key.endswith(".count"):
            profile = key.removeprefix(MIG_RESOURCE_PREFIX).removesuffix(".count")
            count = quantity.count(value)
            if count > 0:
                totals[profile] = count
    product = labels.get(GFD_PRODUCT) or ""
    if labels.get(GFD_MIG_STRATEGY) == "single" and "-MIG-" in product:
        profile = product.split("-MIG-", 1)[1].removesuffix("-SHARED")
        totals[profile] = quantity.count(labels.get(GFD_COUNT))
    return totals


def node_gpu_count(labels: Mapping[str, str]) -> int:
    """How many GPUs the node has, as far as GFD's labels tell: ``nvidia.com/gpu.count``,
    which counts the MIG-enabled GPUs of a node that has only those, and only the whole GPUs
    of a node that has both (whose MIG GPUs Kubernetes then does not count anywhere)."""
    return quantity.count(labels.get(GFD_COUNT))


def spread_counts(model: GpuModel | None, totals: Mapping[str, int], gpus: int) -> dict[int, dict[str, int]]:
    """``totals`` (instances per profile on a node) dealt round-robin over GPUs 0..gpus-1,
    largest profiles first: the layout of a node whose GPUs share one, and otherwise a guess
    that keeps the node's totals. A GPU the deal overfills gets its instances placed on the
    first GPU they fit (when the model is known)."""
    gpus = max(gpus, 1)
    order = list(totals)
    if model is not None:
        order.sort(key=lambda p: -model.profile(p).memory_slots if p in model.mig_profiles else 0)
    dealt: dict[int, list[str]] = {i: [] for i in range(gpus)}
    turn = 0
    for profile in order:
        for _ in range(totals[profile]):
            dealt[turn % gpus].append(profile)
            turn += 1
    if model is not None and any(not _fits(model, ps) for ps in dealt.values()):
        dealt = {i: [] for i in range(gpus)}
        for profile in order:
            for _ in range(totals[profile]):
                spot = next((i for i in range(gpus) if _fits(model, [*dealt[i], profile])), gpus - 1)
                dealt[spot].append(profile)
    return {i: dict(Counter(ps)) for i, ps in dealt.items()}


def _fits(model: GpuModel, profiles: Sequence[str]) -> bool:
    try:
        place_instances(model, [MigSlot(p) for p in profiles])
    except ValueError:
        return False
    return True


def current_layouts(
    labels: Mapping[str, str],
    configs: Mapping[str, Any],
    model: GpuModel | None,
    gpus: int,
    own: Sequence[str],
) -> tuple[dict[int, GpuCounts], str]:
    """The node's layout per GPU as far as Kubernetes shows it, and where it comes from: the
    config the label names when it is one of ``own`` (gpush's names for the node, whatever its
    state: it is what gpush asked for the other GPUs) or an applied config of the ConfigMap,
    else the GFD labels' totals spread over the GPUs (see the module docstring)."""
    label = labels.get(MIG_CONFIG_LABEL)
    state = labels.get(MIG_STATE_LABEL)
    if label and label in configs and (label in own or state == "success"):
        return resolve(configs[label], gpus, label), f"mig-parted config {label}"
    totals = label_totals(labels)
    if not totals:
        return {}, "no MIG instance on the node's labels"
    return dict(spread_counts(model, totals, gpus)), "the node's nvidia.com/mig-<profile>.count labels"


def config_totals(layouts: Mapping[int, GpuCounts]) -> Counter[str]:
    totals: Counter[str] = Counter()
    for counts in layouts.values():
        totals.update(counts or {})
    return totals


def caught_up(layouts: Mapping[int, GpuCounts], allocatable: Mapping[str, Any], every_gpu: bool) -> bool:
    """Whether the node's allocatable ``nvidia.com/mig-<profile>`` counts agree with the config
    (the device plugin has re-registered): equal when the config holds every GPU of the node,
    else at least the config's (other GPUs may offer more)."""
    want = config_totals(layouts)
    have = {
        r.removeprefix(MIG_RESOURCE_PREFIX): quantity.count(v)
        for r, v in allocatable.items()
        if r.startswith(MIG_RESOURCE_PREFIX)
    }
    if every_gpu:
        return all(have.get(p, 0) == want.get(p, 0) for p in set(want) | {p for p, n in have.items() if n})
    return all(have.get(p, 0) >= n for p, n in want.items())


def whole_gpus(allocatable: Mapping[str, Any]) -> int:
    return quantity.count(allocatable.get(GPU_RESOURCE))


def published_record(annotations: Mapping[str, str]) -> dict[str, Any]:
    """What gpush last published on the node (``gpush.io/mig-published``), or empty."""
    try:
        data = json.loads(annotations.get(PUBLISHED_ANNOTATION) or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def instances_of(model: GpuModel | None, counts: GpuCounts, published: Sequence[str] | None) -> tuple[str, ...]:
    """A GPU's instances as ``publish_mig`` takes them: what gpush published when its profile
    counts are the config's (mig-parted keeps no placement), else placed by place_instances."""
    counts = counts or {}
    if published is not None and Counter(s.split("@", 1)[0] for s in published) == Counter(counts):
        return tuple(published)
    if not counts:
        return ()
    if model is None:
        raise ValueError("gpush does not know this GPU model, so it cannot say where its instances start")
    slots = [MigSlot(p) for p, n in counts.items() for _ in range(n)]
    return tuple(str(s) for s in place_instances(model, slots))
