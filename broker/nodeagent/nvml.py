"""The seam between the node agent and NVML, and recordings of what NVML answered.

The agent (broker.nodeagent.agent) reads GPUs only through :class:`NvmlLibrary`: the handful
of NVML calls it needs, with pynvml's names, arguments and return values, and
pynvml's errors (``pynvml.NVMLError`` with ``.value`` set to an ``NVML_ERROR_*``
code). Three implementations:

* :class:`PynvmlLibrary` is the real thing: the pynvml module (nvidia-ml-py),
  imported lazily so gpush installs and its tests run without a GPU or a driver.
* :class:`RecordedLibrary` replays a recording (tests/data/nvml/*.json): per call
  and arguments, what real NVML returned or which error it raised. A call the
  recording does not hold raises :class:`RecordingMissing`, never an invented answer.
* :class:`Recorder` wraps any library and notes what it answers;
  broker.nodeagent.agent.record walks it with exactly the agent's calls and returns a
  new recording, so a machine with a real GPU can add one (integration/gpu/run_agent.py).
  The agent imports this module, never the other way round.

One deviation from pynvml: ``nvmlDeviceGetGpuInstances(device, profile_id)`` returns
the GPU instance handles as a list instead of filling a ctypes array the caller
allocated. Handles are opaque: ctypes pointers from pynvml, names like ``"gpu0"``
or ``"gpu0/mig3"`` from a recording.

Recording format (also in tests/data/nvml/README.md)::

    {"format": "gpush-nvml-recording/1",
     "machine": "...", "description": "...", "source": "...",      # free text
     "calls": {"nvmlDeviceGetName(gpu0)": {"return": "NVIDIA A100-SXM4-40GB"},
               "nvmlDeviceGetMigMode(gpu0)": {"error": "NVML_ERROR_NOT_SUPPORTED"},
               "nvmlDeviceGetMemoryInfo(gpu0)": {"return": {"total": 42949672960, ...}}}}

A key is the call's name and its arguments (handles by name, numbers in decimal)
joined by ", ". A structure is a JSON object of its fields and replays as an object
with those attributes (nested structures too: ``info.placement.start``).
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

RECORDING_FORMAT = "gpush-nvml-recording/1"

# NVML_GPU_INSTANCE_PROFILE_1_SLICE (0) .. NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX (0x11):
# the profile indexes the agent asks every MIG-enabled GPU about. Fixed here, not read
# from the installed pynvml, so recordings do not change with the bindings' version.
GPU_INSTANCE_PROFILE_INDEXES = range(0x12)

# (compute slices, memory slots) -> (NVML profile index, profile id); the same on every MIG GPU.
PROFILE_SHAPES: dict[tuple[int, int], tuple[int, int]] = {
    (1, 1): (0, 19),
    (2, 2): (1, 14),
    (3, 4): (2, 9),
    (4, 4): (3, 5),
    (7, 8): (4, 0),
    (1, 2): (9, 15),
}
# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE: the compute instance of a whole n-slice GPU instance.
COMPUTE_PROFILES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}

# NVML reports "not applicable" in an unsigned field as all ones (NVML_VALUE_NOT_AVAILABLE_uint):
# a process's gpuInstanceId on a GPU that is not in MIG mode, for one.
VALUE_NOT_AVAILABLE_UINT = 0xFFFFFFFF


class RecordingMissing(LookupError):
    """The agent made a call the recording holds no answer for (not an NVML error)."""


class NvmlLibrary(Protocol):
    """The NVML calls the agent makes; names and semantics are pynvml's.

    Every method may raise ``pynvml.NVMLError`` (a subclass per code, ``.value`` the
    ``NVML_ERROR_*`` number). Callers may assume nothing else: no caching, no retries,
    and a handle is only good until ``nvmlShutdown``.
    """

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...  # 12040 for CUDA 12.4
    def nvmlSystemGetProcessName(self, pid: int) -> str: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # .total/.free/.used in bytes
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...  # .busId "00000000:07:00.0"
    def nvmlDeviceGetComputeMode(self, handle: Any) -> int: ...  # NVML_COMPUTEMODE_*
    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]: ...  # [current, pending]
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any: ...
    def nvmlDeviceGetGpuInstanceId(self, mig_handle: Any) -> int: ...
    def nvmlDeviceGetComputeInstanceId(self, mig_handle: Any) -> int: ...
    # .id (profile id), .sliceCount, .memorySizeMB, .name ("MIG 1g.5gb") for a profile index
    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int) -> Any: ...
    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int) -> list[Any]: ...
    def nvmlGpuInstanceGetInfo(self, gpu_instance: Any) -> Any: ...  # .id, .profileId, .placement
    # each: .pid, .usedGpuMemory (bytes or None), .gpuInstanceId, .computeInstanceId
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    # Topology (broker.nodeagent.topology)
    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int: ...  # NVML_FEATURE_ENABLED: active
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int: ...  # NVML_NVLINK_DEVICE_TYPE_*
    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any: ...  # .busId (C: ..._v2)
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int: ...
    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpu_set_size: int) -> Any: ...  # 64-bit words
    def nvmlDeviceGetTopologyCommonAncestor(self, handle1: Any, handle2: Any) -> int: ...  # NVML_TOPOLOGY_*


def import_pynvml() -> Any:
    """pynvml (the nvidia-ml-py package); imported here so nothing else has to."""
    import pynvml

    return pynvml


def nvml_error(code: int | str) -> Exception:
    """A real ``pynvml.NVMLError`` for ``code`` (a number or a name like ``NVML_ERROR_GPU_IS_LOST``)."""
    pynvml = import_pynvml()
    value = getattr(pynvml, code) if isinstance(code, str) else code
    return pynvml.NVMLError(value)


def error_name(value: int) -> str | int:
    """``NVML_ERROR_GPU_IS_LOST`` for 15; the number itself when pynvml does not name it."""
    pynvml = import_pynvml()
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == value:
            return name
    return value


class PynvmlLibrary:
    """The real NVML through pynvml. Constructing it imports pynvml (ImportError if absent);
    loading libnvidia-ml.so happens in ``nvmlInit`` (NVML_ERROR_LIBRARY_NOT_FOUND if absent)."""

    # More than any GPU holds of one profile (an A100 holds 7 of its smallest).
    _MAX_GPU_INSTANCES = 32

    def __init__(self) -> None:
        self._nvml = import_pynvml()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvml"):
            return getattr(self._nvml, name)
        raise AttributeError(name)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int) -> Any:
        try:
            return self._nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile)
        except self._nvml.NVMLError as exc:
            # Drivers before R470 lack the v2 call (the one with the profile's name).
            if exc.value != self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            return self._nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile, version=1)

    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int) -> list[Any]:
        nvml = self._nvml
        instances = (nvml.c_nvmlGpuInstance_t * self._MAX_GPU_INSTANCES)()
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstances(handle, profile_id, instances, ctypes.byref(count))
        return [instances[i] for i in range(count.value)]


class RecordedStruct(SimpleNamespace):
    """A structure NVML returned, replayed from a recording (attributes = its fields)."""


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return RecordedStruct(**{k: _decode(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


class RecordedLibrary:
    """Replays a recording: returns what NVML returned, raises the NVMLError it raised.

    ``source`` is a path to a recording file or the recording itself (a dict).
    """

    def __init__(self, source: str | Path | dict[str, Any]) -> None:
        if isinstance(source, dict):
            self.recording = source
            self.name = str(source.get("machine", "recording"))
        else:
            self.recording = json.loads(Path(source).read_text())
            self.name = str(source)
        fmt = self.recording.get("format")
        if fmt != RECORDING_FORMAT:
            raise ValueError(f"{self.name}: format {fmt!r} is not {RECORDING_FORMAT!r}")
        self.calls: dict[str, dict[str, Any]] = self.recording["calls"]

    def _answer(self, name: str, *args: Any) -> Any:
        key = call_key(name, args)
        try:
            answer = self.calls[key]
        except KeyError:
            raise RecordingMissing(
                f"{self.name} holds no answer for {key}: record the machine again "
                "(integration/gpu/run_agent.py --record) or fix the call"
            ) from None
        if "error" in answer:
            raise nvml_error(answer["error"])
        return _decode(answer["return"])

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if not name.startswith("nvml"):
            raise AttributeError(name)
        return lambda *args: self._answer(name, *args)


def call_key(name: str, args: tuple[Any, ...]) -> str:
    return f"{name}({', '.join(str(a) for a in args)})"


def _encode(value: Any) -> Any:
    """A JSON value for what an NVML call returned (structures become objects of their fields)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list | tuple | ctypes.Array):  # an array: nvmlDeviceGetCpuAffinity's bitmask
        return [_encode(v) for v in value]
    if isinstance(value, ctypes.Structure):
        fields = {}
        for field in value._fields_:
            item = getattr(value, field[0])
            if isinstance(item, ctypes._Pointer):  # e.g. the device handle inside nvmlGpuInstanceInfo_t
                continue
            fields[field[0]] = _encode(item)
        return fields
    if hasattr(value, "__dict__"):  # pynvml's nvmlFriendlyObject, a RecordedStruct
        return {k: _encode(v) for k, v in vars(value).items()}
    raise TypeError(f"cannot record a {type(value).__name__} returned by NVML")


class Recorder:
    """Wraps a library, hands the agent named handles and notes every answer: what
    broker.nodeagent.agent.record walks with the agent's calls to make a recording."""

    def __init__(self, library: NvmlLibrary) -> None:
        self._library = library
        self._handles: dict[str, Any] = {}
        self.calls: dict[str, dict[str, Any]] = {}

    def _name_handle(self, name: str, handle: Any) -> str:
        self._handles[name] = handle
        return name

    def _call(self, method: str, *args: Any) -> Any:
        real_args = [self._handles.get(a, a) if isinstance(a, str) else a for a in args]
        key = call_key(method, args)
        pynvml = import_pynvml()
        try:
            result = getattr(self._library, method)(*real_args)
        except pynvml.NVMLError as exc:
            self.calls[key] = {"error": error_name(exc.value)}
            raise
        if method == "nvmlDeviceGetHandleByIndex":
            result = self._name_handle(f"gpu{args[0]}", result)
        elif method == "nvmlDeviceGetMigDeviceHandleByIndex":
            result = self._name_handle(f"{args[0]}/mig{args[1]}", result)
        elif method == "nvmlDeviceGetGpuInstances":
            result = [self._name_handle(f"{args[0]}/p{args[1]}gi{i}", gi) for i, gi in enumerate(result)]
        self.calls[key] = {"return": _encode(result)}
        return result

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if not name.startswith("nvml"):
            raise AttributeError(name)
        return lambda *args: self._call(name, *args)

    def recording(self, **metadata: Any) -> dict[str, Any]:
        """The answers noted so far as a recording, ``metadata`` stored beside them."""
        return {"format": RECORDING_FORMAT, **metadata, "calls": self.calls}


def dump_recording(recording: dict[str, Any]) -> str:
    """The recording as JSON with one call per line, so a diff shows which answer changed."""
    head = json.dumps({k: v for k, v in recording.items() if k != "calls"}, indent=1)[:-2]
    calls = ",\n".join(f"  {json.dumps(key)}: {json.dumps(answer)}" for key, answer in recording["calls"].items())
    return f'{head},\n "calls": {{\n{calls}\n }}\n}}\n'
