"""The node agent: read this node's GPUs through NVML and report them to the broker.

:func:`collect` turns what NVML answers into one :class:`~broker.inventory.agent_report.NodeReport`;
:func:`run_agent` collects on a timer and posts each report to the broker
(``POST {broker_url}/v1/agent/reports``, bearer token of role ``agent``); :func:`record`
makes a recording of an NVML library (broker.nodeagent.nvml) with the same calls.

Reading a GPU stops at its first NVML error, which becomes that GPU's ``error``; the
other GPUs are still reported. A call NVML answers with NOT_SUPPORTED (MIG mode on a
T4) or NO_PERMISSION (another user's process name) only leaves its field unknown.

MPS. NVML has no "MPS daemon serves this GPU" flag, so the agent infers it:

1. A GPU is served by MPS when ``nvidia-cuda-mps-server`` is among its compute
   processes. The control daemon starts that server when the first client connects
   and it stays until the daemon stops, so this is per GPU and needs no guessing.
2. An idle control daemon (no client yet, so no server) shows only as its pipe
   directory: ``$CUDA_MPS_PIPE_DIRECTORY`` (default /tmp/nvidia-mps) holding a
   ``control`` pipe. The pipe does not say which GPUs the daemon serves, so the agent
   counts it only for GPUs in EXCLUSIVE_PROCESS compute mode, the mode NVIDIA's MPS
   guide (and Slurm's MPS setup) puts MPS GPUs in. This check is passed in
   (``mps_control``): run_agent uses :func:`mps_control_pipe`; tests pass their own.

Topology (broker.nodeagent.topology): after the GPUs, how close they are (NVLink peers,
PCIe, NUMA node and CPUs) for the GPUs NVML could read; errors there leave it unknown.

Process names come from NVML (``nvmlSystemGetProcessName``, so recordings carry them);
when NVML cannot name a process (another PID namespace) the injected
``process_name`` reader is asked; run_agent reads ``/proc/<pid>/comm``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from broker import __version__
from broker.core.clock import Clock, utcnow
from broker.core.errors import EXIT_NOT_ALLOWED, GpushError
from broker.core.gpus import GpuModel, model_of_nvml_product
from broker.inventory.agent_report import GpuProcess, GpuReport, MigInstance, MigRefusal, NodeReport
from broker.nodeagent.nvml import (
    GPU_INSTANCE_PROFILE_INDEXES,
    VALUE_NOT_AVAILABLE_UINT,
    NvmlLibrary,
    PynvmlLibrary,
    Recorder,
    error_name,
    import_pynvml,
)
from broker.nodeagent.topology import read_topology

log = logging.getLogger("gpush.agent")

MIB = 1024 * 1024
MPS_SERVER = "nvidia-cuda-mps-server"
REPORTS_PATH = "/v1/agent/reports"

# pynvml's constants, spelled out so reading a recording needs no NVML.
_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE
_COMPUTEMODE_EXCLUSIVE_PROCESS = 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
_ERROR_INVALID_ARGUMENT = 2
_ERROR_NOT_SUPPORTED = 3
_ERROR_NO_PERMISSION = 4
_ERROR_NOT_FOUND = 6
_UNKNOWN = (_ERROR_NOT_SUPPORTED, _ERROR_NO_PERMISSION)  # the field stays None; the GPU is fine


# --------------------------------------------------------------------------- collect


def proc_comm(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The command name of ``pid`` from /proc, or None when it is gone or not ours to read."""
    try:
        return (proc / str(pid) / "comm").read_text().strip() or None
    except OSError:
        return None


def mps_control_pipe(pipe_directory: str | Path | None = None) -> bool:
    """Whether an MPS control daemon listens on this node (its ``control`` pipe exists)."""
    directory = pipe_directory or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return (Path(directory) / "control").exists()


def _describe(exc: Exception) -> str:
    value = getattr(exc, "value", None)
    return f"{exc} ({error_name(value)})" if isinstance(value, int) else str(exc)


def _cuda_version(value: int) -> str:
    return f"{value // 1000}.{value % 1000 // 10}"  # NVML gives 12040 for CUDA 12.4


def _command_name(name: str) -> str:
    """NVML names a process by its executable path ("/usr/bin/python3"); the report keeps the name."""
    return os.path.basename(name.split(" ")[0]) or name


def collect(
    library: NvmlLibrary | None,
    node_name: str,
    *,
    process_name: Callable[[int], str | None] | None = None,
    mps_control: Callable[[], bool] | None = None,
    now: Clock | None = None,
) -> NodeReport:
    """What NVML says about this node's GPUs, as one report. Never raises for NVML's sake.

    ``library`` None means the real NVML (:class:`PynvmlLibrary`). ``process_name`` names
    a process NVML could not name; ``mps_control`` says whether an MPS control daemon
    listens on the node (see the module docstring). Both default to "don't know".
    """
    collected_at = (now or utcnow)()
    base: dict[str, Any] = {"node": node_name, "agent_version": __version__, "collected_at": collected_at}
    try:
        pynvml = import_pynvml()
    except ImportError:
        return NodeReport(**base, error="pynvml is not installed: pip install nvidia-ml-py")
    if library is None:
        library = PynvmlLibrary()
    try:
        library.nvmlInit()
    except pynvml.NVMLError as exc:
        return NodeReport(
            **base,
            error=f"NVML could not be initialised: {_describe(exc)}; is the NVIDIA driver installed and loaded?",
        )
    try:
        try:
            count = library.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            return NodeReport(**base, error=f"NVML could not count the GPUs: {_describe(exc)}")
        reader = _GpuReader(library, pynvml.NVMLError, process_name, mps_control)
        driver = reader.optional(library.nvmlSystemGetDriverVersion)
        cuda = _maybe(reader.optional(library.nvmlSystemGetCudaDriverVersion), _cuda_version)
        gpus = [reader.read(index) for index in range(count)]
        readable = [g for g in gpus if g.error is None]
        found = read_topology(
            library, [g.index for g in readable], {g.index: g.pci_bus_id for g in readable}, pynvml.NVMLError
        )
        gpus = [
            g.model_copy(
                update={
                    "numa_node": found.numa_node.get(g.index),
                    "cpu_affinity": found.cpu_affinity.get(g.index),
                    "nvlinks": found.nvlinks.get(g.index, []),
                }
            )
            for g in gpus
        ]
        return NodeReport(**base, driver_version=driver, cuda_version=cuda, gpus=gpus, topology=found.groups)
    finally:
        try:
            library.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", _describe(exc))


def _maybe(value: Any, convert: Callable[[Any], Any]) -> Any:
    return None if value is None else convert(value)


@dataclass
class _MigDevice:
    gi_id: int
    ci_id: int
    uuid: str
    memory_mb: int


@dataclass
class _GpuReader:
    library: NvmlLibrary
    nvml_error: type[Exception]
    process_name: Callable[[int], str | None] | None
    mps_control: Callable[[], bool] | None
    fields: dict[str, Any] = field(default_factory=dict)

    def optional(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, or None when NVML says the GPU does not support it or we may not ask."""
        try:
            return call(*args)
        except self.nvml_error as exc:
            if getattr(exc, "value", None) in _UNKNOWN:
                return None
            raise

    def read(self, index: int) -> GpuReport:
        """GPU ``index``: everything read before an NVML error, and the error."""
        self.fields = {"index": index}
        try:
            self._read(index)
        except self.nvml_error as exc:
            self.fields["error"] = _describe(exc)
        return GpuReport(**self.fields)

    def _read(self, index: int) -> None:
        lib, f = self.library, self.fields
        handle = lib.nvmlDeviceGetHandleByIndex(index)
        f["uuid"] = lib.nvmlDeviceGetUUID(handle)
        f["product"] = lib.nvmlDeviceGetName(handle)
        f["memory_mb"] = lib.nvmlDeviceGetMemoryInfo(handle).total // MIB
        f["pci_bus_id"] = lib.nvmlDeviceGetPciInfo(handle).busId
        compute_mode = self.optional(lib.nvmlDeviceGetComputeMode, handle)
        mig_mode = self.optional(lib.nvmlDeviceGetMigMode, handle)
        mig_devices: list[_MigDevice] = []
        if mig_mode is not None:
            current, pending = mig_mode
            f["mig_mode_current"], f["mig_mode_pending"] = current == _MIG_ENABLED, pending == _MIG_ENABLED
            if current == _MIG_ENABLED:
                mig_devices = self._mig_devices(handle)
                f["mig_instances"] = self._mig_instances(handle, model_of_nvml_product(f["product"]), mig_devices)
        f["processes"] = self._processes(handle, mig_devices)
        f["mps"] = any(p.name == MPS_SERVER for p in f["processes"]) or (
            compute_mode == _COMPUTEMODE_EXCLUSIVE_PROCESS and self.mps_control is not None and self.mps_control()
        )

    def _mig_devices(self, handle: Any) -> list[_MigDevice]:
        """The MIG devices (one per compute instance) that CUDA can see on this GPU."""
        lib = self.library
        devices = []
        for i in range(lib.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except self.nvml_error as exc:
                if getattr(exc, "value", None) == _ERROR_NOT_FOUND:  # no MIG device at this index
                    continue
                raise
            devices.append(
                _MigDevice(
                    gi_id=lib.nvmlDeviceGetGpuInstanceId(mig),
                    ci_id=lib.nvmlDeviceGetComputeInstanceId(mig),
                    uuid=lib.nvmlDeviceGetUUID(mig),
                    memory_mb=lib.nvmlDeviceGetMemoryInfo(mig).total // MIB,
                )
            )
        return devices

    def _mig_instances(self, handle: Any, model: GpuModel | None, devices: list[_MigDevice]) -> list[MigInstance]:
        """Every GPU instance, with or without a compute instance, in placement order.

        A GPU instance split into several compute instances is reported once, with its
        first compute instance: the scheduler places GPU instances, not compute ones.
        """
        lib = self.library
        profiles = {}  # profile id -> profile info
        for index in GPU_INSTANCE_PROFILE_INDEXES:
            try:
                info = lib.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
            except self.nvml_error as exc:
                if getattr(exc, "value", None) in (_ERROR_NOT_SUPPORTED, _ERROR_INVALID_ARGUMENT):
                    continue  # this GPU has no profile at that index
                raise
            profiles[info.id] = info
        instances = []
        for profile_id, profile in profiles.items():
            for gpu_instance in lib.nvmlDeviceGetGpuInstances(handle, profile_id):
                info = lib.nvmlGpuInstanceGetInfo(gpu_instance)
                cis = sorted((d for d in devices if d.gi_id == info.id), key=lambda d: d.ci_id)
                first = cis[0] if cis else None
                instances.append(
                    MigInstance(
                        profile=mig_profile_name(model, profile, info.placement.size),
                        gi_id=info.id,
                        ci_id=first.ci_id if first else None,
                        uuid=first.uuid if first else None,
                        placement_start=info.placement.start,
                        placement_size=info.placement.size,
                        memory_mb=first.memory_mb if first else profile.memorySizeMB,
                    )
                )
        return sorted(instances, key=lambda m: (m.placement_start, m.gi_id))

    def _processes(self, handle: Any, mig_devices: list[_MigDevice]) -> list[GpuProcess]:
        lib = self.library
        seen: dict[int, Any] = {}
        for call in (lib.nvmlDeviceGetComputeRunningProcesses, lib.nvmlDeviceGetMPSComputeRunningProcesses):
            for proc in self.optional(call, handle) or []:
                seen.setdefault(proc.pid, proc)
        by_instance = {(d.gi_id, d.ci_id): d.uuid for d in mig_devices}
        processes = []
        for pid, proc in sorted(seen.items()):
            used = getattr(proc, "usedGpuMemory", None)
            gi = getattr(proc, "gpuInstanceId", VALUE_NOT_AVAILABLE_UINT)
            ci = getattr(proc, "computeInstanceId", VALUE_NOT_AVAILABLE_UINT)
            processes.append(
                GpuProcess(
                    pid=pid,
                    used_memory_mb=None if used is None else used // MIB,
                    name=self._process_name(pid),
                    mig_uuid=by_instance.get((gi, ci)),
                )
            )
        return processes

    def _process_name(self, pid: int) -> str | None:
        try:
            name = self.library.nvmlSystemGetProcessName(pid)
        except self.nvml_error as exc:
            if getattr(exc, "value", None) not in (*_UNKNOWN, _ERROR_NOT_FOUND):
                raise
            name = None
        if name:
            return _command_name(name)
        return self.process_name(pid) if self.process_name else None


def mig_profile_name(model: GpuModel | None, profile: Any, memory_slots: int) -> str:
    """The profile's name as gpush and NVIDIA write it ("3g.20gb").

    gpush's table for the model decides (same compute slices, same memory slots):
    NVIDIA's "<n>gb" is the nominal share of the product's memory, which no rounding
    of NVML's memorySizeMB reproduces (39.25 GiB is "40gb", 78.75 GiB "80gb"). Without
    a table, NVML's own name ("MIG 1g.5gb+me") less its "+me" media-extension suffix.
    """
    if model is not None:
        for candidate in model.mig_profiles.values():
            if (candidate.compute_slices, candidate.memory_slots) == (profile.sliceCount, memory_slots):
                return candidate.name
    name = str(getattr(profile, "name", "") or "")
    if name:
        return name.removeprefix("MIG ").split("+")[0]
    return f"{profile.sliceCount}g.{-(-profile.memorySizeMB // 1024)}gb"


def record(library: NvmlLibrary, **metadata: Any) -> dict[str, Any]:
    """A recording of ``library`` (broker.nodeagent.nvml's format): the answers to exactly
    the calls :func:`collect` makes.

    ``metadata`` (machine, description, source...) is stored beside the calls. NVML
    errors are recorded, not raised; a library that cannot be initialised gives a
    recording of that one failed ``nvmlInit``.
    """
    recorder = Recorder(library)
    collect(recorder, "recording")
    return recorder.recording(**metadata)


# --------------------------------------------------------------------------- report


class AgentTokenRejected(GpushError):
    """The broker refused the agent's token (401/403): retrying will not help."""

    code = "agent_token_rejected"
    http_status = 401
    exit_code = EXIT_NOT_ALLOWED


def _broker_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("detail"):
            return str(body["detail"])
    return str(body)[:500]


def run_agent(
    broker_url: str,
    token: str,
    node: str,
    interval: float,
    library: NvmlLibrary | None = None,
    once: bool = False,
    *,
    client: httpx.Client | None = None,
    sleep: Callable[[float], Any] = time.sleep,
    should_stop: Callable[[], bool] = lambda: False,
    first_backoff: float = 1.0,
    max_backoff: float = 60.0,
    process_name: Callable[[int], str | None] | None = proc_comm,
    mps_control: Callable[[], bool] | None = mps_control_pipe,
    allow_mig_changes: bool = False,
) -> int:
    """Collect and post a report every ``interval`` seconds until ``should_stop()`` (or once).

    Returns the number of reports the broker accepted. Steps of one round:

    1. collect() the node's GPUs (NVML errors end up in the report, never here);
    2. POST it to ``{broker_url}/v1/agent/reports``; while the broker is unreachable or
       answers 5xx, retry with exponential backoff (``first_backoff`` doubling up to
       ``max_backoff``) for at most ``interval`` seconds (at least one retry), then drop
       the report: the next round's report supersedes it;
    3. 401/403: raise :class:`AgentTokenRejected` (stops the agent); any other 4xx: log
       the broker's message and carry on;
    4. the broker's answer may carry MIG layouts it wants on this node's GPUs (a ``gpush
       mig apply`` under way, broker.fleet.mig_changes): with ``allow_mig_changes`` the agent
       makes them (:func:`change_mig_layouts`) and reports again at once; without, it logs
       that it leaves them (the change then rolls back when its step runs out of time);
    5. sleep ``interval`` (or stop after one round when ``once``).

    ``sleep`` and ``should_stop`` are injectable (a ``threading.Event``'s ``wait`` and
    ``is_set`` make a stoppable agent); so is the HTTP ``client``.
    """
    url = broker_url.rstrip("/") + REPORTS_PATH
    headers = {"Authorization": f"Bearer {token}"}
    own_client = client is None
    http = client or httpx.Client(timeout=httpx.Timeout(10.0))
    delivered = 0

    def post(report: NodeReport) -> dict[str, Any] | None:
        return _deliver(http, url, headers, report, interval, sleep, should_stop, first_backoff, max_backoff)

    try:
        while not should_stop():
            report = collect(library, node, process_name=process_name, mps_control=mps_control)
            if report.error:
                log.warning("node %s: %s", node, report.error)
            answer = post(report)
            if answer is not None:
                delivered += 1
                wanted = answer.get("mig") or []
                if wanted and not allow_mig_changes:
                    log.warning(
                        "the broker wants MIG layouts changed on %s (GPUs %s); this agent does not change them: "
                        "start it with --allow-mig-changes",
                        node,
                        ", ".join(str(w.get("gpu")) for w in wanted),
                    )
                elif wanted:
                    made = change_mig_layouts(library, report, wanted)
                    if made or made.refused:  # what is now, and what it did not make
                        report = collect(library, node, process_name=process_name, mps_control=mps_control)
                        report = report.model_copy(update={"mig_refused": made.refused})
                        again = _deliver(
                            http, url, headers, report, interval, sleep, should_stop, first_backoff, max_backoff
                        )
                        delivered += again is not None
            if once or should_stop():
                break
            sleep(interval)
    finally:
        if own_client:
            http.close()
    return delivered


@dataclass
class MigChangesMade:
    """What :func:`change_mig_layouts` did: true when some GPU changed; ``refused`` the asks it
    did not make, with why (the next report carries them to the broker)."""

    changed: bool = False
    refused: list[MigRefusal] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.changed


def change_mig_layouts(library: NvmlLibrary | None, report: NodeReport, wanted: list[dict[str, Any]]) -> MigChangesMade:
    """Make the MIG layouts the broker asked for (``[{"change", "gpu", "layout"}]``, layout
    as ``"3g.20gb@0"``) through NVML (broker.nodeagent.mig_apply): instances in both layouts
    stay, a busy one is never destroyed. Refusals and NVML errors are logged and returned,
    for the next report to tell the broker (which then rolls the change back at once rather
    than waiting for its step to run out); the broker sees the layout that report shows."""
    from broker.mig.layouts import MigSlot
    from broker.nodeagent.mig_apply import LayoutRefused, apply_layout_change, layout_change

    pynvml = import_pynvml()
    library = library if library is not None else PynvmlLibrary()
    gpus = {gpu.index: gpu for gpu in report.gpus}
    made = MigChangesMade()

    def refuse(item: dict[str, Any], index: Any, why: str) -> None:
        log.error("MIG change %s on GPU %s: %s", item.get("change"), index, why)
        if isinstance(item.get("change"), int) and isinstance(index, int) and item["change"] >= 1 and index >= 0:
            made.refused.append(MigRefusal(change=item["change"], gpu=index, why=why[:4096]))

    library.nvmlInit()
    try:
        for item in wanted:
            index, layout = item.get("gpu"), item.get("layout") or []
            gpu = gpus.get(index)
            if gpu is None:
                refuse(item, index, "this node has no such GPU")
                continue
            try:
                target = [MigSlot.parse(text) for text in layout]
                change = layout_change(gpu, target)
                for line in apply_layout_change(library, change):
                    log.info("MIG change %s: %s", item.get("change"), line)
                made.changed = made.changed or not change.empty
            except (LayoutRefused, ValueError) as exc:
                refuse(item, index, f"refused: {exc}")
            except pynvml.NVMLError as exc:
                refuse(item, index, f"NVML failed: {_describe(exc)}")
                made.changed = True  # part of it may be done: report what is
    finally:
        library.nvmlShutdown()
    return made


def _deliver(
    http: httpx.Client,
    url: str,
    headers: dict[str, str],
    report: NodeReport,
    interval: float,
    sleep: Callable[[float], Any],
    should_stop: Callable[[], bool],
    first_backoff: float,
    max_backoff: float,
) -> dict[str, Any] | None:
    """Post one report; the broker's answer when it took it, else None (see run_agent for the rules)."""
    payload = report.model_dump(mode="json")
    backoff, waited = first_backoff, 0.0
    while True:
        try:
            response = http.post(url, json=payload, headers=headers)
        except httpx.TransportError as exc:
            problem = f"broker unreachable at {url}: {exc.__class__.__name__}: {exc}"
        else:
            status = response.status_code
            if status < 300:
                try:
                    answer = response.json()
                except ValueError:
                    answer = None
                return answer if isinstance(answer, dict) else {}
            if status in (401, 403):
                raise AgentTokenRejected(
                    f"the broker at {url} refused the agent's token ({status}: {_broker_message(response)}); "
                    f"create an agent token with `gpush admin token create --role agent --nodes {report.node}` "
                    "and start the agent with it"
                )
            if status < 500:
                log.error(
                    "the broker rejected the report of %s (%s): %s", report.node, status, _broker_message(response)
                )
                return None
            problem = f"the broker answered {status}: {_broker_message(response)}"
        if should_stop() or (waited >= interval and waited > 0):
            log.error("giving up on this report after %.0f s: %s", waited, problem)
            return None
        log.warning("%s; retrying in %.1f s", problem, backoff)
        sleep(backoff)
        waited += backoff
        backoff = min(backoff * 2, max_backoff)
