"""Changing a GPU's MIG layout through the stateful NVML fake: what a real GPU refuses is
refused, busy slices are never destroyed, and the agent reads back the new layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from broker.mig.layouts import MigSlot
from broker.nodeagent.agent import collect
from broker.nodeagent.mig_apply import LayoutRefused, apply_layout_change, layout_change
from broker.nodeagent.nvml import import_pynvml
from tests.doubles.fake_nvml import FakeNvml

SEVEN_SMALL = [f"1g.5gb@{i}" for i in range(7)]


def read(nvml: FakeNvml, index: int = 0):
    report = collect(nvml, "mig-01")
    assert report.error is None
    return report.gpus[index]


def layout(gpu) -> list[str]:
    return [f"{m.profile}@{m.placement_start}" for m in gpu.mig_instances]


def nvml_code(exc: Exception) -> str:
    pynvml = import_pynvml()
    return next(n for n in dir(pynvml) if n.startswith("NVML_ERROR_") and getattr(pynvml, n) == exc.value)


def test_the_agent_reads_the_fake_as_a_real_gpu():
    nvml = FakeNvml.with_layouts("A100-40GB", [SEVEN_SMALL, ["3g.20gb@0", "3g.20gb@4"], None])
    report = collect(nvml, "mig-01")
    first, second, whole = report.gpus
    assert layout(first) == SEVEN_SMALL and all(m.uuid and m.ci_id == 0 for m in first.mig_instances)
    assert layout(second) == ["3g.20gb@0", "3g.20gb@4"]
    assert second.mig_instances[1].memory_mb == 20 * 1024
    assert whole.mig_mode_current is False and whole.mig_instances == []


def test_a_layout_changes_and_the_agent_reads_it_back():
    nvml = FakeNvml.with_layouts("A100-40GB", [SEVEN_SMALL])
    change = layout_change(read(nvml), [MigSlot("3g.20gb", 0), MigSlot("2g.10gb", 4), MigSlot("1g.5gb", 6)])
    assert [s for _, s in change.destroy] == [MigSlot("1g.5gb", i) for i in range(6)]
    assert change.keep == (MigSlot("1g.5gb", 6),) and len(change.create) == 2
    planned = apply_layout_change(nvml, change, dry_run=True)
    assert nvml.calls == [] and layout(read(nvml)) == SEVEN_SMALL  # a dry run calls nothing that changes
    assert planned[0] == "GPU 0: destroy 1g.5gb at slot 0 (GPU instance 1)"
    assert planned[-2:] == ["GPU 0: create 3g.20gb at slot 0", "GPU 0: create 2g.10gb at slot 4"]
    assert apply_layout_change(nvml, change) == planned
    assert layout(read(nvml)) == ["3g.20gb@0", "2g.10gb@4", "1g.5gb@6"]
    assert nvml.calls[:2] == ["gpu 0: destroy compute instance 0 of GPU instance 1", "gpu 0: destroy GPU instance 1"]
    # Asked again, nothing is left to change.
    assert layout_change(read(nvml), change.keep + change.create).empty


def test_a_slice_that_runs_work_is_never_destroyed():
    nvml = FakeNvml.with_layouts("A100-40GB", [SEVEN_SMALL])
    nvml.gpus[0].processes.append((4242, 3, 1200))  # a job on the third 1g.5gb
    gpu = read(nvml)
    with pytest.raises(LayoutRefused, match="1g.5gb at slot 2 runs work"):
        layout_change(gpu, [MigSlot("7g.40gb", 0)])
    # A target that keeps it is fine: only the others change.
    change = layout_change(gpu, [MigSlot("2g.10gb", 0), MigSlot("1g.5gb", 2), MigSlot("3g.20gb", 4)])
    apply_layout_change(nvml, change)
    assert layout(read(nvml)) == ["2g.10gb@0", "1g.5gb@2", "3g.20gb@4"]


def test_targets_that_are_no_layout_are_refused_before_any_call():
    nvml = FakeNvml.with_layouts("A100-40GB", [[], None])
    with pytest.raises(LayoutRefused, match="cannot start at memory slot 2"):
        layout_change(read(nvml), [MigSlot("3g.20gb", 2)])
    with pytest.raises(LayoutRefused, match="overlap"):
        layout_change(read(nvml), [MigSlot("3g.20gb", 0), MigSlot("2g.10gb", 2)])
    with pytest.raises(LayoutRefused, match="not in MIG mode"):
        layout_change(read(nvml, 1), [MigSlot("7g.40gb", 0)])
    assert nvml.calls == []


def test_the_fake_refuses_what_nvml_refuses():
    nvml = FakeNvml.with_layouts("A100-40GB", [["3g.20gb@0"], None])
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)

    def refused(call, *args) -> str:
        with pytest.raises(Exception) as caught:
            call(*args)
        return nvml_code(caught.value)

    at = lambda start, size: SimpleNamespace(start=start, size=size)  # noqa: E731
    create = nvml.nvmlDeviceCreateGpuInstanceWithPlacement
    assert refused(create, gpu, 9, at(0, 4)) == "NVML_ERROR_INSUFFICIENT_RESOURCES"  # slots taken
    assert refused(create, gpu, 9, at(2, 4)) == "NVML_ERROR_INVALID_ARGUMENT"  # 3g starts at 0 or 4 only
    assert refused(create, gpu, 9, at(4, 2)) == "NVML_ERROR_INVALID_ARGUMENT"  # not the profile's size
    assert refused(create, gpu, 123, at(4, 4)) == "NVML_ERROR_INVALID_ARGUMENT"  # no such profile
    assert refused(create, nvml.nvmlDeviceGetHandleByIndex(1), 9, at(0, 4)) == "NVML_ERROR_NOT_SUPPORTED"  # MIG off
    (instance,) = nvml.nvmlDeviceGetGpuInstances(gpu, 9)
    assert refused(nvml.nvmlGpuInstanceDestroy, instance) == "NVML_ERROR_IN_USE"  # its compute instance first
    nvml.gpus[0].processes.append((7, instance.gi, 100))
    (compute,) = nvml.nvmlGpuInstanceGetComputeInstances(instance, 2)
    assert refused(nvml.nvmlComputeInstanceDestroy, compute) == "NVML_ERROR_IN_USE"  # a process runs on it
    nvml.gpus[0].processes.clear()
    nvml.nvmlComputeInstanceDestroy(compute)
    assert refused(nvml.nvmlGpuInstanceCreateComputeInstance, instance, 0) == "NVML_ERROR_INVALID_ARGUMENT"
    nvml.nvmlGpuInstanceDestroy(instance)
    assert refused(nvml.nvmlGpuInstanceGetInfo, instance) == "NVML_ERROR_INVALID_ARGUMENT"  # gone
    # Seven 1g slices use every compute slice: an eighth 1g has no slot. Each of 1g's
    # placements (0-6) is taken; the eighth memory slot (7) has no compute slice of its
    # own, so no 1g starts there (NVML names it a bad argument, as on an empty GPU).
    full = FakeNvml.with_layouts("A100-40GB", [SEVEN_SMALL])
    handle = full.nvmlDeviceGetHandleByIndex(0)
    assert [p.start for p in full.nvmlDeviceGetGpuInstancePossiblePlacements_v2(handle, 19)] == list(range(7))
    for start in range(7):
        assert refused(full.nvmlDeviceCreateGpuInstanceWithPlacement, handle, 19, at(start, 1)) == (
            "NVML_ERROR_INSUFFICIENT_RESOURCES"
        ), start
    assert refused(full.nvmlDeviceCreateGpuInstanceWithPlacement, handle, 19, at(7, 1)) == "NVML_ERROR_INVALID_ARGUMENT"


def test_the_real_gpu_dry_run_only_reads(tmp_path, capsys):
    """integration/gpu/mig_dry_run.py, for a lent GPU machine: on a recording it prints
    the calls it would make and refuses any call that changes a GPU."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("mig_dry_run", root / "integration" / "gpu" / "mig_dry_run.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    recording = str(root / "tests" / "data" / "nvml" / "mig01.json")
    assert script.main(["--recording", recording, "--gpu", "0", "--layout", "3g.20gb@0,2g.10gb@4,1g.5gb@6"]) == 0
    out = capsys.readouterr().out
    assert "keep:    1g.5gb@6" in out and "would create 2g.10gb at slot 4" in out
    assert script.main(["--recording", recording, "--gpu", "1", "--layout", "3g.20gb@2"]) == 2
    assert "cannot start at memory slot 2" in capsys.readouterr().out
    guarded = script.ReadOnly(FakeNvml.with_layouts("A100-40GB", [[]]))
    with pytest.raises(PermissionError, match="only reads"):
        guarded.nvmlDeviceCreateGpuInstanceWithPlacement(None, 9, None)
