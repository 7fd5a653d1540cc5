"""MIG plans from the queue (broker.mig.plan) and what an admin applies (broker.mig.config)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import yaml

from broker.core.gpus import MODELS, GpuModel, gpu_model, mig_layout_problem, model_of_nvml_product
from broker.inventory.agent_report import GpuProcess, GpuReport, MigInstance
from broker.mig.config import (
    layout_text,
    mig_parted_config,
    render_gres_conf,
    render_mig_parted,
    render_planned_gres,
    render_summary,
)
from broker.mig.layouts import MigSlot, layout_counts, layout_problem, maximal_layouts, valid_layouts
from broker.mig.matching import SliceDemand
from broker.mig.plan import MigGpu, gpu_from_report, plan_mig

MIG_MODELS = [m for m in MODELS if m.mig_capable]
A100 = gpu_model("A100-SXM4-40GB")
A30 = gpu_model("A30")
H100 = gpu_model("H100")


def by_profile(model: GpuModel, *sizes: tuple[int, int]) -> str:
    """The profile with ``compute`` slices and ``slots`` memory slots."""
    return next(p.name for p in model.mig_profiles.values() if (p.compute_slices, p.memory_slots) in sizes)


def assert_valid(model: GpuModel, layout) -> None:
    assert mig_layout_problem(model, [s.profile for s in layout]) is None
    assert layout_problem(model, layout) is None
    taken = Counter()
    for s in layout:
        profile = model.profile(s.profile)
        assert s.start in profile.placements
        taken.update(range(s.start, s.start + profile.memory_slots))
    assert all(n == 1 for n in taken.values())
    assert max(taken, default=0) < model.memory_slots


def a100(node: str, index: int, *profiles: str, busy: tuple[int, ...] = ()) -> MigGpu:
    slots = tuple(MigSlot(p, busy=i in busy) for i, p in enumerate(profiles))
    return MigGpu(node, index, A100, True, slots)


def jobs(profile: str, n: int, prefix: str | None = None, **kw) -> list[SliceDemand]:
    return [SliceDemand(f"{prefix or profile}-{i}", profile, **kw) for i in range(n)]


# --- enumeration, every MIG-capable model -------------------------------------------------


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
def test_every_enumerated_layout_is_valid(model):
    assert MIG_MODELS, "no MIG-capable model to test"
    layouts = valid_layouts(model)
    assert layouts and set(maximal_layouts(model)) <= set(layouts)
    for layout in layouts:
        assert_valid(model, layout)
    assert len(set(layouts)) == len(layouts)


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
def test_every_single_profile_maximum_is_found(model):
    counts = [layout_counts(model, layout) for layout in maximal_layouts(model)]
    every = [layout_counts(model, layout) for layout in valid_layouts(model)]
    for profile in model.mig_profiles.values():
        # as many as there are placements, unless compute runs out first (3g: 2, 2g: 3)
        most = min(profile.max_instances, model.compute_slices // profile.compute_slices)
        assert {profile.name: most} in every, profile.name
        assert max(c.get(profile.name, 0) for c in counts) == most, profile.name
    if model.memory_slots == 8:
        assert {by_profile(model, (1, 1)): 7} in counts
        assert {by_profile(model, (1, 2)): 4} in counts
        assert {by_profile(model, (4, 4)): 1, by_profile(model, (3, 4)): 1} in counts
    else:
        assert {"1g.6gb": 4} in counts and {"2g.12gb": 2} in counts


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
def test_maximal_layouts_take_no_further_instance(model):
    for layout in maximal_layouts(model):
        for profile in model.mig_profiles.values():
            for start in profile.placements:
                assert layout_problem(model, (*layout, MigSlot(profile.name, start))) is not None


def test_an_a100_has_a_few_dozen_maximal_configurations():
    distinct = {tuple(sorted(layout_counts(A100, layout).items())) for layout in maximal_layouts(A100)}
    assert 20 <= len(distinct) <= 60


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
def test_a_queue_of_small_slices_cuts_each_gpu_into_the_most(model):
    small = by_profile(model, (1, 1))
    most = model.compute_slices if model.memory_slots == 8 else 4
    gpus = [MigGpu("n1", i, model, True, (MigSlot(next(reversed(model.mig_profiles)), 0),)) for i in range(2)]
    plan = plan_mig(gpus, jobs(small, 20))
    assert plan.planned.jobs == 2 * most
    for g in plan.gpus:
        assert layout_counts(model, g.planned) == {small: most}
        assert_valid(model, g.planned)
        assert g.action == "repartition"
    assert plan.today.jobs == 0
    assert len(plan.unplaced) == 20 - 2 * most


def test_a_queue_of_1g_jobs_yields_seven_per_a100():
    plan = plan_mig([a100("n", i, "7g.40gb") for i in range(3)], jobs("1g.5gb", 21))
    assert plan.planned.jobs == 21 and plan.planned.per_profile == {"1g.5gb": 21}
    assert all(layout_counts(A100, g.planned) == {"1g.5gb": 7} for g in plan.gpus)
    assert plan.planned.gpu_equivalents == pytest.approx(3.0)


def test_mixed_demand_yields_mixed_layouts():
    demand = jobs("3g.20gb", 1) + jobs("2g.10gb", 1) + jobs("1g.5gb", 2)
    plan = plan_mig([a100("n", 0, "7g.40gb")], demand)
    assert plan.planned.jobs == 4
    assert layout_counts(A100, plan.gpus[0].planned) == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    assert_valid(A100, plan.gpus[0].planned)


def test_mixed_demand_over_gpus_splits_them():
    demand = jobs("3g.20gb", 2) + jobs("1g.5gb", 7)
    plan = plan_mig([a100("n", 0, "7g.40gb"), a100("n", 1, "7g.40gb")], demand)
    assert plan.planned.jobs == 9
    layouts = sorted(tuple(sorted(layout_counts(A100, g.planned).items())) for g in plan.gpus)
    assert layouts == [(("1g.5gb", 7),), (("3g.20gb", 2),)]


def test_memory_demand_takes_the_smallest_profile_that_covers_it():
    plan = plan_mig([MigGpu("n", 0, A100, True, ())], [SliceDemand("m", memory_gb=8)])
    assert [(p.job, p.profile) for p in plan.planned.placements] == [("m", "1g.10gb")]
    # a 7g instance that already takes the job is no reason to re-cut the GPU
    plan = plan_mig([a100("n", 0, "7g.40gb")], [SliceDemand("m", memory_gb=8)])
    assert plan.planned.placements[0].profile == "7g.40gb" and not plan.changed
    plan = plan_mig(
        [MigGpu("n", 0, A100, True, (MigSlot("3g.20gb"), MigSlot("1g.10gb")))], [SliceDemand("m", memory_gb=8)]
    )
    assert plan.planned.placements[0].profile == "1g.10gb" and not plan.changed


def test_weights_decide_when_not_all_fit():
    demand = jobs("7g.40gb", 1, weight=5.0) + jobs("1g.5gb", 3)
    plan = plan_mig([a100("n", 0, "1g.5gb")], demand)
    assert [p.job for p in plan.planned.placements] == ["7g.40gb-0"]
    plan = plan_mig([a100("n", 0, "1g.5gb")], jobs("7g.40gb", 1, weight=2.0) + jobs("1g.5gb", 3))
    assert plan.planned.jobs == 3


def test_model_restriction_is_honoured():
    demand = jobs("1g.10gb", 4, models=("H100",))
    gpus = [MigGpu("a", 0, gpu_model("A100-80GB"), True, (MigSlot("7g.80gb"),)), MigGpu("h", 0, H100, True, ())]
    plan = plan_mig(gpus, demand)
    assert {(p.node) for p in plan.planned.placements} == {"h"} and plan.planned.jobs == 4
    assert not plan.gpu("a", 0).changed


# --- keeping what works ------------------------------------------------------------------


def test_busy_instances_keep_the_gpu_unless_allowed():
    gpu = MigGpu("n", 0, A100, True, (MigSlot("3g.20gb", 0, busy=True), MigSlot("3g.20gb", 4)))
    plan = plan_mig([gpu], jobs("1g.5gb", 7))
    assert not plan.changed and "3g.20gb@0" in plan.gpus[0].reason
    assert plan.planned.jobs == 0 and "keep their layout" in plan.unplaced[0].reason

    plan = plan_mig([gpu], jobs("1g.5gb", 7), repartition_busy=True)
    g = plan.gpus[0]
    assert g.action == "repartition" and MigSlot("3g.20gb", 0) in g.planned
    assert [s for s in g.planned if s.busy] == [MigSlot("3g.20gb", 0)]
    # 3g.20gb stays at slot 0, so 1g.5gb fit only at slots 4-6 (none starts at 7)
    assert layout_counts(A100, g.planned) == {"1g.5gb": 3, "3g.20gb": 1}
    assert_valid(A100, g.planned)
    assert plan.planned.jobs == 3
    assert "by hand" in render_mig_parted(plan)
    # idle, the 3g.20gb may move to slot 4 and leave four 1g.5gb
    idle = MigGpu("n", 0, A100, True, (MigSlot("3g.20gb", 0), MigSlot("3g.20gb", 4)))
    plan = plan_mig([idle], jobs("1g.5gb", 4) + jobs("3g.20gb", 1))
    assert plan.planned.jobs == 5 and layout_counts(A100, plan.gpus[0].planned) == {"1g.5gb": 4, "3g.20gb": 1}


def test_busy_instances_are_no_capacity():
    gpu = MigGpu("n", 0, A100, True, (MigSlot("3g.20gb", 0, busy=True), MigSlot("3g.20gb", 4)))
    plan = plan_mig([gpu], jobs("3g.20gb", 2))
    assert plan.today.jobs == plan.planned.jobs == 1
    assert plan.planned.placements[0].start == 4


def test_gpus_that_already_fit_the_demand_are_not_changed():
    gpus = [a100("n", 0, *["1g.5gb"] * 7), a100("n", 1, "3g.20gb", "3g.20gb")]
    plan = plan_mig(gpus, jobs("3g.20gb", 2))
    assert not plan.changed and plan.today.jobs == plan.planned.jobs == 2
    assert plan.gpus[1].reason.startswith("today's layout already serves")
    plan = plan_mig(gpus, jobs("1g.5gb", 3) + jobs("3g.20gb", 1))
    assert not plan.changed and plan.planned.jobs == 4
    assert plan.nodes_to_drain == ()


def test_only_the_gpus_needed_change():
    gpus = [a100("n", i, "7g.40gb") for i in range(4)]
    plan = plan_mig(gpus, jobs("1g.5gb", 7))
    assert len(plan.changed) == 1 and plan.planned.jobs == 7


def test_adding_instances_beside_todays_is_a_create():
    plan = plan_mig([MigGpu("n", 0, A100, True, (MigSlot("3g.20gb", 4),))], jobs("3g.20gb", 1) + jobs("1g.5gb", 4))
    g = plan.gpus[0]
    assert g.action == "create" and MigSlot("3g.20gb", 4) in g.planned
    assert plan.planned.jobs == 5


def test_mig_off_gpus_stay_whole_unless_enabling_is_allowed():
    gpu = MigGpu("n", 0, A100, False)
    plan = plan_mig([gpu], jobs("1g.5gb", 2))
    assert not plan.changed and "MIG mode is off" in plan.unplaced[0].reason
    plan = plan_mig([gpu], jobs("1g.5gb", 2), enable_mig=True)
    assert plan.gpus[0].action == "enable-mig" and plan.planned.jobs == 2
    assert plan_mig([MigGpu("n", 0, A100, False, busy=True)], jobs("1g.5gb", 1), enable_mig=True).changed == ()


# --- what cannot be placed -----------------------------------------------------------------


def test_demand_no_model_offers_is_unplaceable_with_the_reason():
    gpus = [a100("n", 0, "7g.40gb")]
    demand = [
        SliceDemand("a", "5g.30gb"),
        SliceDemand("b", "1g.6gb"),
        SliceDemand("c", memory_gb=500),
        SliceDemand("d", "1g.5gb", models=("H100",)),
        SliceDemand("e", "1g.5gb", models=("B300",)),
    ]
    plan = plan_mig(gpus, demand)
    reasons = {u.job: u.reason for u in plan.unplaced}
    assert "no GPU model offers MIG profile 5g.30gb" in reasons["a"]
    assert reasons["b"] == "1g.6gb is a profile of A30-24GB, and no GPU here is one"
    assert "needs a whole GPU" in reasons["c"]
    assert "H100-SXM5-80GB, which do not offer 1g.5gb" in reasons["d"]
    assert "B300" in reasons["e"]
    assert plan.planned.jobs == 0 and not plan.changed


def test_demand_validation():
    with pytest.raises(ValueError, match="exactly one"):
        SliceDemand("x")
    with pytest.raises(ValueError, match="weight"):
        SliceDemand("x", "1g.5gb", weight=0)
    with pytest.raises(ValueError, match="not valid"):
        plan_mig([MigGpu("n", 0, A100, True, (MigSlot("4g.20gb", 0), MigSlot("3g.20gb", 0)))], [])


# --- property: random fleets and queues ---------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_plans_are_valid_and_never_place_more_than_demand(seed):
    rng = random.Random(seed)
    gpus = []
    for node in range(rng.randint(1, 3)):
        for index in range(rng.randint(1, 4)):
            model = rng.choice(MIG_MODELS)
            layout = rng.choice(valid_layouts(model)) if rng.random() < 0.8 else ()
            busy = rng.random() < 0.3
            slots = tuple(MigSlot(s.profile, s.start, busy=busy and k == 0) for k, s in enumerate(layout))
            gpus.append(MigGpu(f"n{node}", index, model, rng.random() < 0.9, slots if layout else ()))
    gpus = [g if g.mig_enabled else MigGpu(g.node, g.index, g.model, False) for g in gpus]
    profiles = sorted({p for m in MIG_MODELS for p in m.mig_profiles}) + ["9g.99gb"]
    demand = []
    for i in range(rng.randint(0, 25)):
        weight = rng.choice([1.0, 0.5, 2.0])
        if rng.random() < 0.7:
            demand.append(SliceDemand(f"j{i}", rng.choice(profiles), weight=weight))
        else:
            models = (rng.choice(MIG_MODELS).name,) if rng.random() < 0.3 else ()
            demand.append(SliceDemand(f"j{i}", memory_gb=rng.choice([5, 10, 20, 40, 100]), models=models))
    flags = {"repartition_busy": rng.random() < 0.5, "enable_mig": rng.random() < 0.5}
    plan = plan_mig(gpus, demand, **flags)
    again = plan_mig(list(reversed(gpus)), demand, **flags)
    assert plan == again  # deterministic, whatever the input order of GPUs

    placed = [p.job for p in plan.planned.placements]
    assert len(placed) == len(set(placed)) <= len(demand)
    assert set(placed) | {u.job for u in plan.unplaced} == {d.job for d in demand}
    assert plan.planned.weight >= plan.today.weight - 1e-9
    per_instance = Counter((p.node, p.index, p.start) for p in plan.planned.placements)
    assert all(n == 1 for n in per_instance.values())
    wanted = {d.job: d for d in demand}
    for g in plan.gpus:
        if g.planned:
            assert_valid(g.model, g.planned)
        today_busy = {(s.profile, s.start) for s in g.today if s.busy}
        assert today_busy <= {(s.profile, s.start) for s in g.planned}
        if today_busy and not flags["repartition_busy"]:
            assert not g.changed
    for p in plan.planned.placements:
        d = wanted[p.job]
        g = plan.gpu(p.node, p.index)
        assert any(s.profile == p.profile and s.start == p.start and not s.busy for s in g.planned)
        if d.profile:
            assert p.profile == d.profile
        else:
            assert g.model.profile(p.profile).memory_gb >= d.memory_gb
    check_mig_parted(plan)


# --- renderers ---------------------------------------------------------------------------


def check_mig_parted(plan) -> None:
    doc = yaml.safe_load(render_mig_parted(plan))
    assert doc == mig_parted_config(plan) and doc["version"] == "v1"
    for node in {g.node for g in plan.gpus if g.model.mig_capable}:
        seen = set()
        for entry in doc["mig-configs"][f"gpush-{node}"]:
            for index in entry["devices"]:
                g = plan.gpu(node, index)
                seen.add(index)
                assert entry["mig-enabled"] == g.mig_enabled_planned
                if g.mig_enabled_planned:
                    assert entry["mig-devices"] == layout_counts(g.model, g.planned)
        assert seen == {g.index for g in plan.gpus if g.node == node and g.model.mig_capable}


def test_mig_parted_yaml_parses_and_counts_equal_the_plan():
    gpus = [a100("mig01", 0, "7g.40gb"), a100("mig01", 1, "7g.40gb"), MigGpu("mig01", 2, A100, False)]
    gpus.append(MigGpu("mig02", 0, A30, True, (MigSlot("4g.24gb", 0),)))
    plan = plan_mig(gpus, jobs("1g.5gb", 14) + jobs("2g.12gb", 2))
    check_mig_parted(plan)
    doc = yaml.safe_load(render_mig_parted(plan))
    assert doc["mig-configs"]["gpush-mig01"] == [
        {"devices": [0, 1], "mig-enabled": True, "mig-devices": {"1g.5gb": 7}},
        {"devices": [2], "mig-enabled": False},
    ]
    assert doc["mig-configs"]["gpush-mig02"] == [{"devices": [0], "mig-enabled": True, "mig-devices": {"2g.12gb": 2}}]


def report(index: int, layout: list[tuple[str, int, int]], **kw) -> GpuReport:
    instances = [
        MigInstance(profile=p, gi_id=gi, ci_id=0, uuid=f"MIG-{index}-{gi}", placement_start=start, placement_size=1)
        for p, start, gi in layout
    ]
    return GpuReport(
        index=index, product="NVIDIA A100-SXM4-40GB", mig_mode_current=bool(layout), mig_instances=instances, **kw
    )


def test_gres_conf_lines_count_the_instances():
    gpus = [
        report(0, [("1g.5gb", s, 7 + s) for s in range(7)]),
        report(1, [("3g.20gb", 0, 1), ("3g.20gb", 4, 2)]),
        report(2, [], mps=True),
        report(3, []),
    ]
    conf = render_gres_conf("mig01", gpus)
    assert conf.gres == "gpu:1g.5gb:7,gpu:3g.20gb:2,gpu:a100:2,mps:100"
    gpu_lines = [line for line in conf.device_lines if "Name=gpu" in line]
    assert len(gpu_lines) == 7 + 2 + 2
    assert sum("Type=1g.5gb" in line for line in gpu_lines) == 7
    # the integration cluster's numbering: gpu0/gi7 -> cap66, gpu1/gi1 -> cap141
    assert "MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap66,/dev/nvidia-caps/nvidia-cap67" in conf.text
    assert "nvidia-cap147" in conf.text and "NodeName=mig01 Name=mps Count=100 File=/dev/nvidia2" in conf.text
    assert "AutoDetect=nvml" in conf.text and "NodeName=mig01 AutoDetect=off" in conf.lines

    files = render_gres_conf("mig01", gpus, style="file", dev="/tmp/dev/mig01")
    assert "NodeName=mig01 Name=gpu Type=3g.20gb File=/tmp/dev/mig01/nvidia-caps/nvidia-cap147" in files.lines
    nvml = render_gres_conf("mig01", gpus, style="nvml")
    assert nvml.gres == conf.gres
    assert [line for line in nvml.device_lines] == ["NodeName=mig01 Name=mps Count=100 File=/dev/nvidia2"]


def test_planned_gres_and_agent_reports_round_trip():
    gpu = report(0, [("3g.20gb", 0, 1)], processes=[GpuProcess(pid=1, mig_uuid="MIG-0-1")])
    seen = gpu_from_report("n", gpu)
    assert seen.instances == (MigSlot("3g.20gb", 0, busy=True),) and not seen.busy
    plan = plan_mig([seen, gpu_from_report("n", report(1, []))], jobs("1g.5gb", 3))
    assert render_planned_gres(plan, "n").gres.startswith("gpu:3g.20gb:1,")
    assert model_of_nvml_product("NVIDIA A100 80GB PCIe").name == "A100-SXM4-80GB"
    assert model_of_nvml_product("NVIDIA H100 80GB HBM3").name == "H100-SXM5-80GB"
    assert gpu_from_report("n", GpuReport(index=0, product="NVIDIA Quadro X")) is None


def test_summary_reads_today_against_the_plan():
    gpus = [a100("mig01", 0, "3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb")]
    plan = plan_mig(gpus, jobs("1g.5gb", 7) + jobs("3g.20gb", 2))
    lines = render_summary(plan)
    assert lines[0] == (
        "mig01 GPU 0 (A100-SXM4-40GB): today 3g.20gb+2g.10gb+1g.5gb+1g.5gb → plan 7×1g.5gb "
        "[repartition: places 7 waiting jobs (today 3)]"
    )
    assert lines[1] == (
        "today places 3 of 9 waiting jobs (0.71 GPU-eq), the plan places 7 (1.00 GPU-eq), 1 GPU to re-partition"
    )
    assert lines[2] == "drain first: mig01"
    assert sum(line.startswith("not placed: job 3g.20gb-") for line in lines) == 2
    assert layout_text(A100, (), False) == "whole GPU (MIG off)"


def test_instances_the_schedulers_jobs_hold_are_busy_though_no_process_shows():
    from broker.mig.plan import MigGpu, mark_held

    model = gpu_model("A100-SXM4-40GB")
    three = (MigSlot("3g.20gb", 0), MigSlot("3g.20gb", 4))
    gpus = [
        MigGpu("mig-01", 0, model, True, three),
        MigGpu("mig-01", 1, model, True, (MigSlot("3g.20gb", 0, busy=True),)),
    ]
    marked = mark_held(gpus, {("mig-01", "3g.20gb"): 2})  # one already shows a process: one more is marked
    assert [[s.busy for s in g.instances] for g in marked] == [[True, False], [True]]
