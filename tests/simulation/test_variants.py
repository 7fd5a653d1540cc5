"""Pod-list variants of the openb trace (broker.simulation.variants) and the script that
writes them (integration/bench/variants.py)."""

from __future__ import annotations

import filecmp
import importlib.util
import io
import random
from dataclasses import replace
from pathlib import Path

import pytest

from broker.core.errors import InvalidRequest
from broker.simulation.traces import DEFAULT_NODES, DEFAULT_PODS, TraceNode, TracePod, read_nodes, read_pods
from broker.simulation.variants import (
    FAMILIES,
    SHARE_TOLERANCE,
    SIBLINGS,
    cpu_heavy,
    generate,
    gpushare,
    gpuspec,
    multigpu,
    pod_list_stats,
    variant_file,
    write_pods,
)

ROOT = Path(__file__).resolve().parents[2]
# The openb trace lists the tests read, in the repository (data/traces/alibaba-openb-2023/README.md
# says where they come from and on what terms).
SHIPPED_TRACE = ROOT / "data" / "traces" / "alibaba-openb-2023"

VARIANTS = [(family, label, share) for family, items in FAMILIES.items() for label, share in items]
VARIANT_IDS = [label for _, label, _ in VARIANTS]


def _synthetic_pods(count: int = 4000, seed: int = 7) -> list[TracePod]:
    """A pod list with openb's mix (13% CPU-only, 38% fractional, 2% multi-GPU, the
    rest one whole GPU) and its QoS, phases and times, so tests run without the trace."""
    rng = random.Random(seed)
    pods = []
    for i in range(count):
        kind = rng.random()
        if kind < 0.13:
            num_gpu, milli = 0, 0
        elif kind < 0.51:
            num_gpu, milli = 1, rng.choice((810, 470, 320, 650, 230, 460, 50))
        elif kind < 0.53:
            num_gpu, milli = rng.choice((2, 4, 8)), 1000
        else:
            num_gpu, milli = 1, 1000
        cpu = rng.choice((4000, 8000, 12000, 16000)) * max(num_gpu, 1)
        created = 1000 * i
        scheduled = None if rng.random() < 0.1 else created + rng.randrange(5)
        pods.append(
            TracePod(
                f"openb-pod-{i:04d}",
                cpu,
                cpu * 4,
                num_gpu,
                milli,
                (),
                rng.choice(("LS", "BE", "Burstable")),
                "Pending" if scheduled is None else "Running",
                created,
                created + rng.randrange(10, 5000),
                scheduled,
            )
        )
    return pods


# openb's node shapes, a few of each (model, GPUs, CPU milli, memory MiB).
SYNTHETIC_NODES = [
    TraceNode(f"openb-node-{i:04d}", cpu, memory, gpus, model)
    for i, (model, gpus, cpu, memory) in enumerate(
        [("G2", 8, 96000, 393216)] * 20
        + [("T4", 2, 104000, 524288)] * 15
        + [("T4", 4, 96000, 393216)] * 2
        + [("G3", 8, 128000, 786432)] * 2
        + [("P100", 2, 16000, 122880)] * 6
        + [("V100M32", 8, 96000, 786432)] * 2
        + [("V100M16", 4, 32000, 131072)] * 2
        + [("V100M16", 1, 8000, 32768)] * 2
    )
]

PODS = _synthetic_pods()


def _target(family: str, pods: list[TracePod]) -> float:
    stats = pod_list_stats(pods)
    return {"gpushare": stats.fractional, "multigpu": stats.multi_gpu, "gpuspec": stats.pinned, "cpu": stats.cpu_only}[
        family
    ]


def _holds(node: TraceNode, pod: TracePod) -> bool:
    return node.gpus >= pod.num_gpu and node.cpu_milli >= pod.cpu_milli and node.memory_mib >= pod.memory_mib


# -- every family ------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "label", "share"), VARIANTS, ids=VARIANT_IDS)
def test_a_variant_is_the_same_for_a_seed_and_differs_between_seeds(family: str, label: str, share: float) -> None:
    first = generate(family, share, PODS, SYNTHETIC_NODES, seed=42)
    assert generate(family, share, PODS, SYNTHETIC_NODES, seed=42) == first
    assert generate(family, share, PODS, SYNTHETIC_NODES, seed=43) != first


@pytest.mark.parametrize(("family", "label", "share"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("seed", [1, 42])
def test_a_variant_meets_its_share_with_unique_names_and_leaves_its_input_alone(
    family: str, label: str, share: float, seed: int
) -> None:
    pods = list(PODS)
    before = list(pods)
    listed = generate(family, share, pods, SYNTHETIC_NODES, seed=seed)
    assert pods == before and all(a is b for a, b in zip(pods, before))
    assert abs(_target(family, listed) - share) <= SHARE_TOLERANCE, label
    names = [p.name for p in listed]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(("family", "label", "share"), VARIANTS, ids=VARIANT_IDS)
def test_a_written_variant_reads_back_as_generated(tmp_path: Path, family: str, label: str, share: float) -> None:
    listed = generate(family, share, PODS, SYNTHETIC_NODES, seed=5)
    path = tmp_path / variant_file(label)
    write_pods(listed, path)
    assert read_pods(path) == listed


# -- what each family keeps ----------------------------------------------------------------


def test_gpushare_keeps_the_pod_count_and_the_cpu_only_pods() -> None:
    listed = gpushare(PODS, 0.6, seed=3)
    assert len(listed) == len(PODS)

    def strip(pod: TracePod) -> TracePod:  # the pod's content, without its name
        return replace(pod, name="")

    assert [strip(p) for p in listed if p.cpu_only] == [strip(p) for p in PODS if p.cpu_only]
    assert sum(not p.cpu_only for p in listed) == sum(not p.cpu_only for p in PODS)
    originals = {strip(p) for p in PODS}
    assert all(strip(p) in originals for p in listed)  # every pod is a copy of one of the list


def test_gpushare_at_one_makes_every_gpu_pod_fractional() -> None:
    listed = gpushare(PODS, 1.0, seed=3)
    assert all(p.fractional for p in listed if not p.cpu_only)
    assert pod_list_stats(listed).fractional == 1.0


def test_multigpu_appends_multi_gpu_pods_under_new_names() -> None:
    listed = multigpu(PODS, 0.3, seed=3)
    assert listed[: len(PODS)] == PODS
    added = listed[len(PODS) :]
    assert added and all(p.num_gpu > 1 for p in added)
    assert added[0].name == f"openb-pod-{len(PODS):04d}"


def test_cpu_heavy_drops_or_adds_cpu_only_pods_and_leaves_gpu_pods_alone() -> None:
    gpu_pods = [p for p in PODS if not p.cpu_only]
    fewer = cpu_heavy(PODS, 0.05, seed=3)
    more = cpu_heavy(PODS, 0.25, seed=3)
    assert [p for p in fewer if not p.cpu_only] == gpu_pods
    assert [p for p in more if not p.cpu_only] == gpu_pods
    assert set(fewer) < set(PODS)  # dropped ones: the rest keep their names and order
    assert more[: len(PODS)] == PODS and all(p.cpu_only for p in more[len(PODS) :])


@pytest.mark.parametrize("share", [0.05, 0.33])
def test_gpuspec_pins_only_to_models_a_node_can_hold(share: float) -> None:
    listed = gpuspec(PODS, SYNTHETIC_NODES, share, seed=11)
    pinned = [p for p in listed if p.gpu_spec]
    assert pinned
    for pod in pinned:
        for model in pod.gpu_spec:
            assert any(n.model == model and _holds(n, pod) for n in SYNTHETIC_NODES), (pod, model)
        if len(pod.gpu_spec) > 1:
            assert len(pod.gpu_spec) == 2 and SIBLINGS[pod.gpu_spec[0]] == pod.gpu_spec[1]
    # Nothing but gpu_spec changes.
    assert [replace(p, gpu_spec=()) for p in listed] == PODS


def test_gpuspec_leaves_out_models_no_node_of_which_holds_the_pod() -> None:
    big = [TracePod(f"openb-pod-{i:04d}", 8000, 32768, 8, 1000) for i in range(40)]
    listed = gpuspec(big, SYNTHETIC_NODES, 0.33, seed=2)
    models = {m for p in listed for m in p.gpu_spec}
    assert models and models <= {"G2", "G3", "V100M32"}  # only these have 8-GPU nodes


# -- bad parameters --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "share", "words"),
    [
        ("gpushare", 0.1, "outside 0.2..1"),
        ("gpushare", 40, "0.4 for 40%"),
        ("multigpu", 0.6, "outside 0.2..0.5"),
        ("gpuspec", 0.5, "outside 0.05..0.33"),
        ("cpu", 0.3, "outside 0.05..0.25"),
        ("cpu", float("nan"), "must be a number"),
        ("cpu", True, "must be a number"),
        ("cpu", "0.1", "must be a number"),
    ],
)
def test_a_share_out_of_range_is_refused_naming_the_range(family: str, share: object, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        generate(family, share, PODS, SYNTHETIC_NODES, seed=1)  # type: ignore[arg-type]


def test_an_unknown_family_a_missing_node_list_and_an_empty_list_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="families are gpushare, multigpu, gpuspec, cpu"):
        generate("mig", 0.2, PODS, SYNTHETIC_NODES, seed=1)
    with pytest.raises(InvalidRequest, match="node list"):
        generate("gpuspec", 0.2, PODS, None, seed=1)
    with pytest.raises(InvalidRequest, match="empty"):
        generate("cpu", 0.2, [], SYNTHETIC_NODES, seed=1)
    with pytest.raises(InvalidRequest, match="no multi-GPU pods"):
        multigpu([p for p in PODS if p.num_gpu <= 1], 0.2, seed=1)


# -- the script -----------------------------------------------------------------------------


def _script():
    spec = importlib.util.spec_from_file_location("variants_script", ROOT / "integration" / "bench" / "variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_writes_one_csv_per_variant_and_a_table_within_80_columns(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    write_pods(PODS, trace / DEFAULT_PODS)
    (trace / DEFAULT_NODES).write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n"
        + "".join(f"{n.name},{n.cpu_milli},{n.memory_mib},{n.gpus},{n.model}\n" for n in SYNTHETIC_NODES)
    )
    out = io.StringIO()
    code = _script().main(["--trace", str(trace), "--out", str(tmp_path / "out"), "--seed", "3"], out)
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(variant_file(label) for label in VARIANT_IDS)
    assert read_pods(tmp_path / "out" / variant_file("cpu200")) == generate("cpu", 0.2, PODS, SYNTHETIC_NODES, 3)
    lines = out.getvalue().splitlines()
    table = lines[1:]  # under the line that names the output directory
    assert table[0].split() == ["list", "pods", "GPUs", "frac", "multi", "pinned", "CPU-only"]
    assert len(table) == 3 + 1 + len(VARIANTS) and all(len(line) <= 80 for line in table)
    assert any(line.startswith("gpuspec33 ") and "33.0%" in line for line in table)


def test_the_script_refuses_an_unknown_family_as_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        _script().main(["--out", str(tmp_path), "--family", "mig"], io.StringIO())
    assert exit_.value.code == 2


# -- on the trace itself ------------------------------------------------------------------


def test_the_default_list_written_back_is_the_trace_file_byte_for_byte(tmp_path: Path) -> None:
    write_pods(read_pods(SHIPPED_TRACE / DEFAULT_PODS), tmp_path / "default.csv")
    assert filecmp.cmp(tmp_path / "default.csv", SHIPPED_TRACE / DEFAULT_PODS, shallow=False)


def test_on_the_trace_every_variant_meets_its_share_and_matches_upstream_lists() -> None:
    pods = read_pods(SHIPPED_TRACE / DEFAULT_PODS)
    nodes = read_nodes(SHIPPED_TRACE / DEFAULT_NODES)
    listed = {label: generate(family, share, pods, nodes, seed=42) for family, label, share in VARIANTS}
    for family, label, share in VARIANTS:
        assert abs(_target(family, listed[label]) - share) <= SHARE_TOLERANCE, label
    upstream = pod_list_stats(read_pods(SHIPPED_TRACE / variant_file("gpushare40")))
    ours = pod_list_stats(listed["gpushare40"])
    assert ours.pods == upstream.pods == 8152
    assert abs(ours.gpu_demand - upstream.gpu_demand) < 0.03 * upstream.gpu_demand
    upstream = pod_list_stats(read_pods(SHIPPED_TRACE / variant_file("multigpu20")))
    ours = pod_list_stats(listed["multigpu20"])
    assert abs(ours.pods - upstream.pods) < 0.01 * upstream.pods  # upstream: 8324
