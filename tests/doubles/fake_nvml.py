"""A stateful NVML for tests: MIG GPUs whose layout can change.

:class:`FakeNvml` implements the agent's read calls (:class:`broker.nodeagent.nvml.NvmlLibrary`)
and the calls that change a MIG layout, with pynvml's names, arguments and errors, over
GPUs held in memory. It refuses what a real GPU refuses (NVIDIA's NVML API reference,
"Multi Instance GPU Management"), so code that changes layouts meets here the errors it
would meet on a node:

- ``nvmlDeviceCreateGpuInstanceWithPlacement(device, profile_id, placement)``: MIG mode
  off -> ``NVML_ERROR_NOT_SUPPORTED``; a profile id the GPU lacks, or a placement whose
  start is not one of the profile's (``nvmlDeviceGetGpuInstancePossiblePlacements``) or
  whose size is not the profile's -> ``NVML_ERROR_INVALID_ARGUMENT``; memory slots taken
  by another GPU instance, or no compute slices left -> ``NVML_ERROR_INSUFFICIENT_RESOURCES``.
- ``nvmlGpuInstanceDestroy``: a GPU instance that still has compute instances ->
  ``NVML_ERROR_IN_USE``.
- ``nvmlGpuInstanceCreateComputeInstance(gpu_instance, profile)``: one compute instance
  spanning the GPU instance (the profile of its slice count; others ->
  ``NVML_ERROR_INVALID_ARGUMENT``, a second -> ``NVML_ERROR_INSUFFICIENT_RESOURCES``).
- ``nvmlComputeInstanceDestroy``: processes running on it -> ``NVML_ERROR_IN_USE``.
- A handle of an instance that was destroyed -> ``NVML_ERROR_INVALID_ARGUMENT``.

Not modelled: changing MIG mode (gpush never does), compute instances smaller than their
GPU instance, media extensions (``+me`` profiles). Profile indexes and ids are NVML's:
``NVML_GPU_INSTANCE_PROFILE_1_SLICE`` (0) is id 19 on every MIG GPU, 3g (index 2) id 9,
7g (index 4) id 0, the two-slot 1g (index 9) id 15, and so on by shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from broker.core.gpus import GpuModel, MigProfile, gpu_model
from broker.mig.layouts import MigSlot
from broker.nodeagent.nvml import COMPUTE_PROFILES, PROFILE_SHAPES, nvml_error

MIB = 1024 * 1024


@dataclass
class _ComputeInstance:
    id: int
    uuid: str


@dataclass
class _GpuInstance:
    id: int
    profile: MigProfile
    start: int
    cis: dict[int, _ComputeInstance] = field(default_factory=dict)


@dataclass
class FakeGpu:
    """One physical GPU: its model, whether MIG mode is on, its instances, and the
    processes running on it (``(pid, gpu instance id or None, memory MiB)``)."""

    model: GpuModel
    index: int
    mig: bool = True
    instances: dict[int, _GpuInstance] = field(default_factory=dict)
    processes: list[tuple[int, int | None, int]] = field(default_factory=list)

    @property
    def uuid(self) -> str:
        return f"GPU-fake-{self.index:04d}-0000-0000-0000-000000000000"


@dataclass(frozen=True)
class _Handle:
    gpu: int
    gi: int | None = None
    ci: int | None = None


class FakeNvml:
    """GPUs in memory behind NVML's calls (module docstring). ``FakeNvml.with_layouts(
    "A100-40GB", [["3g.20gb@0", "3g.20gb@4"], []])`` makes one GPU per layout ("[]": MIG
    on, no instances; None: MIG off). ``calls`` lists every layout-changing call made."""

    def __init__(self, gpus: list[FakeGpu], driver: str = "550.54.15"):
        self.gpus = gpus
        self.driver = driver
        self.calls: list[str] = []

    @classmethod
    def with_layouts(cls, model: str, layouts: list[list[str] | None]) -> FakeNvml:
        spec = gpu_model(model)
        gpus = []
        for index, layout in enumerate(layouts):
            gpu = FakeGpu(spec, index, mig=layout is not None)
            for n, text in enumerate(layout or [], 1):
                slot = MigSlot.parse(text)
                profile = spec.profile(slot.profile)
                gpu.instances[n] = _GpuInstance(n, profile, slot.start, {0: _ComputeInstance(0, _mig_uuid(index, n))})
            gpus.append(gpu)
        return cls(gpus)

    # -- lookups ------------------------------------------------------------------------

    def _gpu(self, handle: Any) -> FakeGpu:
        if not isinstance(handle, _Handle) or handle.gpu >= len(self.gpus):
            raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")
        return self.gpus[handle.gpu]

    def _gi(self, handle: Any) -> tuple[FakeGpu, _GpuInstance]:
        gpu = self._gpu(handle)
        gi = gpu.instances.get(handle.gi) if handle.gi is not None else None
        if gi is None:
            raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")
        return gpu, gi

    def _profile_of(self, gpu: FakeGpu, profile_id: int) -> MigProfile:
        for profile in gpu.model.mig_profiles.values():
            if PROFILE_SHAPES.get((profile.compute_slices, profile.memory_slots), (None, None))[1] == profile_id:
                return profile
        raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")

    # -- the agent's reads --------------------------------------------------------------

    def nvmlInit(self) -> None:
        return None

    def nvmlShutdown(self) -> None:
        return None

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        return f"/usr/bin/python3 job-{pid}"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    # Topology is not modelled: NVML answers as on a GPU that cannot say (no NVLink, no affinity).
    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        raise nvml_error("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        raise nvml_error("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetCpuAffinity(self, handle: Any, words: int) -> list[int]:
        raise nvml_error("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetTopologyCommonAncestor(self, a: Any, b: Any) -> int:
        raise nvml_error("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self.gpus):
            raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if handle.gi is not None:
            _gpu, gi = self._gi(handle)
            ci = gi.cis.get(handle.ci)
            if ci is None:
                raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")
            return ci.uuid
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return f"NVIDIA {self._gpu(handle).model.name}"

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle)
        if handle.gi is not None:
            _gpu, gi = self._gi(handle)
            total = int(gi.profile.memory_gb * 1024) * MIB
        else:
            total = int(gpu.model.memory_gb * 1024) * MIB
        used = sum(mem for _, on, mem in gpu.processes if handle.gi is None or on == handle.gi) * MIB
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return SimpleNamespace(busId=f"00000000:{0x07 + self._gpu(handle).index * 8:02X}:00.0")

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        self._gpu(handle)
        return 0  # NVML_COMPUTEMODE_DEFAULT

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle)
        if not gpu.model.mig_capable:
            raise nvml_error("NVML_ERROR_NOT_SUPPORTED")
        return [int(gpu.mig), int(gpu.mig)]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        return gpu.model.compute_slices if gpu.mig else 0

    def _mig_devices(self, gpu: FakeGpu) -> list[_Handle]:
        return [
            _Handle(gpu.index, gi.id, ci.id)
            for gi in sorted(gpu.instances.values(), key=lambda g: (g.start, g.id))
            for ci in sorted(gi.cis.values(), key=lambda c: c.id)
        ]

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> _Handle:
        devices = self._mig_devices(self._gpu(handle))
        if not 0 <= index < len(devices):
            raise nvml_error("NVML_ERROR_NOT_FOUND")
        return devices[index]

    def nvmlDeviceGetGpuInstanceId(self, mig_handle: Any) -> int:
        return self._gi(mig_handle)[1].id

    def nvmlDeviceGetComputeInstanceId(self, mig_handle: Any) -> int:
        _gpu, gi = self._gi(mig_handle)
        if mig_handle.ci not in gi.cis:
            raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")
        return mig_handle.ci

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int) -> Any:
        gpu = self._gpu(handle)
        if not gpu.mig:
            raise nvml_error("NVML_ERROR_NOT_SUPPORTED")
        for p in gpu.model.mig_profiles.values():
            index, profile_id = PROFILE_SHAPES.get((p.compute_slices, p.memory_slots), (None, None))
            if index == profile:
                return SimpleNamespace(
                    id=profile_id,
                    sliceCount=p.compute_slices,
                    memorySizeMB=int(p.memory_gb * 1024),
                    instanceCount=p.max_instances,
                    name=f"MIG {p.name}",
                )
        raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")

    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int) -> list[_Handle]:
        gpu = self._gpu(handle)
        profile = self._profile_of(gpu, profile_id)
        return [_Handle(gpu.index, gi.id) for gi in gpu.instances.values() if gi.profile == profile]

    def nvmlGpuInstanceGetInfo(self, gpu_instance: Any) -> Any:
        _gpu, gi = self._gi(gpu_instance)
        profile_id = PROFILE_SHAPES[(gi.profile.compute_slices, gi.profile.memory_slots)][1]
        placement = SimpleNamespace(start=gi.start, size=gi.profile.memory_slots)
        return SimpleNamespace(id=gi.id, profileId=profile_id, placement=placement)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        gpu = self._gpu(handle)
        none = 0xFFFFFFFF
        return [
            SimpleNamespace(
                pid=pid,
                usedGpuMemory=mem * MIB,
                gpuInstanceId=none if gi is None else gi,
                computeInstanceId=none if gi is None else 0,
            )
            for pid, gi, mem in gpu.processes
        ]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._gpu(handle)
        return []

    # -- changing a layout --------------------------------------------------------------

    def nvmlDeviceGetGpuInstancePossiblePlacements_v2(self, handle: Any, profile_id: int) -> list[Any]:
        gpu = self._gpu(handle)
        if not gpu.mig:
            raise nvml_error("NVML_ERROR_NOT_SUPPORTED")
        profile = self._profile_of(gpu, profile_id)
        return [SimpleNamespace(start=s, size=profile.memory_slots) for s in profile.placements]

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int, placement: Any) -> _Handle:
        gpu = self._gpu(handle)
        self.calls.append(f"gpu {gpu.index}: create GPU instance {profile_id} at {placement.start}")
        if not gpu.mig:
            raise nvml_error("NVML_ERROR_NOT_SUPPORTED")
        profile = self._profile_of(gpu, profile_id)
        if placement.start not in profile.placements or placement.size != profile.memory_slots:
            raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")
        wanted = set(range(placement.start, placement.start + profile.memory_slots))
        taken = {s for gi in gpu.instances.values() for s in range(gi.start, gi.start + gi.profile.memory_slots)}
        compute = sum(gi.profile.compute_slices for gi in gpu.instances.values())
        if wanted & taken or compute + profile.compute_slices > gpu.model.compute_slices:
            raise nvml_error("NVML_ERROR_INSUFFICIENT_RESOURCES")
        # The lowest free id. A real driver picks ids its own way (by profile and
        # placement); what callers may rely on is what holds there too: ids are small
        # (below 15 on an A100: the capability devices' numbering, 3 + 135 * gpu + 9 * id).
        gi_id = next(i for i in range(1, len(gpu.instances) + 2) if i not in gpu.instances)
        gpu.instances[gi_id] = _GpuInstance(gi_id, profile, placement.start)
        return _Handle(gpu.index, gi_id)

    def nvmlGpuInstanceCreateComputeInstance(self, gpu_instance: Any, profile: int) -> _Handle:
        gpu, gi = self._gi(gpu_instance)
        self.calls.append(f"gpu {gpu.index}: create compute instance on GPU instance {gi.id}")
        if profile != COMPUTE_PROFILES.get(gi.profile.compute_slices):
            raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")
        if gi.cis:
            raise nvml_error("NVML_ERROR_INSUFFICIENT_RESOURCES")
        gi.cis[0] = _ComputeInstance(0, _mig_uuid(gpu.index, gi.id))
        return _Handle(gpu.index, gi.id, 0)

    def nvmlGpuInstanceGetComputeInstances(self, gpu_instance: Any, profile: int) -> list[_Handle]:
        gpu, gi = self._gi(gpu_instance)
        return [_Handle(gpu.index, gi.id, ci) for ci in gi.cis]

    def nvmlComputeInstanceDestroy(self, compute_instance: Any) -> None:
        gpu, gi = self._gi(compute_instance)
        self.calls.append(f"gpu {gpu.index}: destroy compute instance {compute_instance.ci} of GPU instance {gi.id}")
        if compute_instance.ci not in gi.cis:
            raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")
        if any(on == gi.id for _, on, _ in gpu.processes):
            raise nvml_error("NVML_ERROR_IN_USE")
        del gi.cis[compute_instance.ci]

    def nvmlGpuInstanceDestroy(self, gpu_instance: Any) -> None:
        gpu, gi = self._gi(gpu_instance)
        self.calls.append(f"gpu {gpu.index}: destroy GPU instance {gi.id}")
        if gi.cis:
            raise nvml_error("NVML_ERROR_IN_USE")
        del gpu.instances[gi.id]


def _mig_uuid(gpu: int, gi: int) -> str:
    return f"MIG-fake-{gpu:04d}-{gi:04d}-0000-0000-000000000000"
