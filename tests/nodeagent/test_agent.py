"""The node agent over recordings of real GPU models, and its reporting loop against a local HTTP broker."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from broker.core.gpus import mig_layout_problem, model_of_nvml_product
from broker.inventory.agent_report import NodeReport
from broker.nodeagent.agent import AgentTokenRejected, collect, mps_control_pipe, proc_comm, run_agent
from broker.nodeagent.nvml import RecordedLibrary

DATA = Path(__file__).parents[1] / "data" / "nvml"
RECORDINGS = sorted(DATA.glob("*.json"))
GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def report_of(name: str, **kwargs) -> NodeReport:
    return collect(RecordedLibrary(DATA / f"{name}.json"), name, **kwargs)


# recording -> (driver, CUDA, [(product, MiB, MIG current, MIG pending, profiles in placement order, mps)])
A40, A80, H100, H200, T4 = (
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H200",
    "Tesla T4",
)
WHOLE = (False, False, [], False)
EXPECTED = {
    "a100-40gb-dgx": (
        "550.54.15",
        "12.4",
        [
            (A40, 40960, True, True, ["2g.10gb", "1g.5gb", "1g.5gb", "3g.20gb"], False),
            (A40, 40960, True, True, ["1g.5gb"] * 7, False),
            (A40, 40960, True, True, ["7g.40gb"], False),
            (A40, 40960, True, True, [], False),
            *[(A40, 40960, *WHOLE)] * 4,
        ],
    ),
    "a100-80gb": (
        "535.129.03",
        "12.2",
        [
            (A80, 81920, True, True, ["3g.40gb", "3g.40gb"], False),
            (A80, 81920, True, True, ["4g.40gb", "2g.20gb", "1g.10gb"], False),
            *[(A80, 81920, *WHOLE)] * 2,
        ],
    ),
    "h100-80gb-dgx": (
        "535.183.01",
        "12.2",
        [(H100, 81559, True, True, ["1g.10gb"] * 7, False), *[(H100, 81559, *WHOLE)] * 7],
    ),
    "h200": (
        "550.90.07",
        "12.4",
        [
            (H200, 143771, True, True, ["2g.35gb", "1g.18gb", "1g.18gb", "3g.71gb"], False),
            (H200, 143771, True, True, ["1g.18gb"] * 7, False),
            *[(H200, 143771, *WHOLE)] * 6,
        ],
    ),
    "mig-pending": (
        "535.129.03",
        "12.2",
        [(A80, 81920, False, True, [], False), (A80, 81920, True, False, ["7g.80gb"], False)],
    ),
    "mps01": ("550.54.15", "12.4", [(A40, 40960, False, False, [], True)]),
    "t4": ("535.161.08", "12.2", [(T4, 15360, None, None, [], False)] * 4),
    "mig01": (
        "550.54.15",
        "12.4",
        [(A40, 40960, True, True, ["1g.5gb"] * 7, False), (A40, 40960, True, True, ["3g.20gb"] * 2, False)],
    ),
    "gpu01": ("550.54.15", "12.4", [(A40, 40960, *WHOLE)] * 2),
    "a100-pcie-nvlink-pairs": ("550.54.15", "12.4", [("NVIDIA A100 80GB PCIe", 81920, *WHOLE)] * 8),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_collect_reports_what_the_recording_shows(name):
    driver, cuda, gpus = EXPECTED[name]
    report = report_of(name)
    assert (report.node, report.error, report.driver_version, report.cuda_version) == (name, None, driver, cuda)
    seen = [
        (g.product, g.memory_mb, g.mig_mode_current, g.mig_mode_pending, [m.profile for m in g.mig_instances], g.mps)
        for g in report.gpus
    ]
    assert seen == gpus
    assert [g.index for g in report.gpus] == list(range(len(gpus)))
    for gpu in report.gpus:
        assert GPU_UUID.match(gpu.uuid) and re.match(r"^00000000:[0-9A-F]{2}:00\.0$", gpu.pci_bus_id)
        assert gpu.error is None
    assert len({g.uuid for g in report.gpus}) == len(report.gpus)


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_mig_instances_are_valid_layouts(path):
    """Every reported layout is one NVIDIA allows: known profiles, documented placements, no overlap."""
    report = collect(RecordedLibrary(path), path.stem)
    for gpu in report.gpus:
        if not gpu.mig_instances:
            continue
        model = model_of_nvml_product(gpu.product)
        assert model is not None, gpu.product
        assert mig_layout_problem(model, [m.profile for m in gpu.mig_instances]) is None
        taken: set[int] = set()
        for inst in gpu.mig_instances:
            profile = model.profile(inst.profile)
            assert inst.placement_start in profile.placements
            assert inst.placement_size == profile.memory_slots
            slots = set(range(inst.placement_start, inst.placement_start + inst.placement_size))
            assert not slots & taken
            taken |= slots
            assert inst.memory_mb and inst.memory_mb <= profile.memory_gb * 1024
            if inst.ci_id is not None:
                assert MIG_UUID.match(inst.uuid)
        assert len({m.gi_id for m in gpu.mig_instances}) == len(gpu.mig_instances)


def test_a100_mixed_layout_in_detail():
    gpu0 = report_of("a100-40gb-dgx").gpus[0]
    assert [(m.profile, m.gi_id, m.placement_start, m.placement_size, m.memory_mb) for m in gpu0.mig_instances] == [
        ("2g.10gb", 5, 0, 2, 9856),
        ("1g.5gb", 9, 2, 1, 4864),
        ("1g.5gb", 10, 3, 1, 4864),
        ("3g.20gb", 1, 4, 4, 19968),
    ]
    by_gi = {m.gi_id: m.uuid for m in gpu0.mig_instances}
    assert [(p.pid, p.name, p.used_memory_mb, p.mig_uuid) for p in gpu0.processes] == [
        (41022, "python3", 12034, by_gi[1]),  # NVML named it /usr/bin/python3
        (41187, "python3", 3012, by_gi[9]),
    ]


def test_h100_seven_1g_10gb_are_gpu_instances_7_to_13():
    gpu0 = report_of("h100-80gb-dgx").gpus[0]
    assert [(m.gi_id, m.placement_start) for m in gpu0.mig_instances] == [(7 + s, s) for s in range(7)]
    assert all(m.ci_id == 0 and m.memory_mb == 9984 for m in gpu0.mig_instances)


def test_gpu_instance_without_compute_instance():
    first = report_of("a100-80gb").gpus[1].mig_instances[0]
    assert (first.profile, first.ci_id, first.uuid, first.memory_mb) == ("4g.40gb", None, None, 40192)


def test_mig_pending_reset_has_no_instances_until_reset():
    off_pending_on, on_pending_off = report_of("mig-pending").gpus
    assert (off_pending_on.mig_mode_current, off_pending_on.mig_mode_pending, off_pending_on.mig_instances) == (
        False,
        True,
        [],
    )
    assert [m.profile for m in on_pending_off.mig_instances] == ["7g.80gb"]


def test_gpu_lost_is_that_gpus_error_and_the_rest_still_count():
    report = report_of("gpu-lost")
    assert report.error is None
    lost = report.gpus[2]
    assert lost.index == 2 and "GPU is lost" in lost.error and "NVML_ERROR_GPU_IS_LOST" in lost.error
    assert lost.uuid is None and lost.product is None
    others = [g for g in report.gpus if g.index != 2]
    assert [g.error for g in others] == [None, None, None]
    assert [g.product for g in others] == [H100] * 3
    assert [p.pid for p in others[1].processes] == [4410]


def test_not_mig_capable_leaves_mig_mode_unknown():
    report = report_of("t4")
    assert all(g.mig_mode_current is None and g.mig_mode_pending is None for g in report.gpus)
    assert report.gpus[0].processes[0].used_memory_mb == 7800


def test_mps_server_among_compute_processes_marks_the_gpu():
    gpu = report_of("mps01").gpus[0]
    assert gpu.mps is True
    assert [(p.pid, p.name) for p in gpu.processes] == [
        (2201, "nvidia-cuda-mps-server"),
        (2240, "python3"),
        (2251, "python3"),
    ]


def test_idle_mps_daemon_counts_only_for_exclusive_process_gpus():
    assert [g.mps for g in report_of("t4").gpus] == [False] * 4
    assert [g.mps for g in report_of("t4", mps_control=lambda: True).gpus] == [False, False, False, True]
    # Whole-GPU A100s in DEFAULT compute mode stay unshared even with a daemon up.
    assert [g.mps for g in report_of("gpu01", mps_control=lambda: True).gpus] == [False, False]


def test_process_nvml_cannot_name_is_asked_of_the_injected_reader():
    assert report_of("a100-40gb-dgx").gpus[6].processes[0].name is None
    named = report_of("a100-40gb-dgx", process_name=lambda pid: f"pid{pid}").gpus[6].processes[0]
    assert (named.pid, named.name, named.used_memory_mb) == (1733, "pid1733", 20480)


def test_no_driver_is_the_reports_error():
    report = report_of("no-driver")
    assert report.gpus == [] and "NVML_ERROR_DRIVER_NOT_LOADED" in report.error


@pytest.mark.may_skip("a machine with a GPU and its driver has a working NVML, so no error to report")
def test_real_nvml_without_a_gpu_is_the_reports_error():
    """This machine has pynvml but no libnvidia-ml: the real library fails to load, the report says so."""
    report = collect(None, "here")
    if report.error is None:  # pragma: no cover - a machine with a GPU
        pytest.skip("this machine has a working NVML")
    assert report.gpus == [] and "NVML" in report.error


def test_no_pynvml_is_the_reports_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    report = collect(None, "here")
    assert report.error == "pynvml is not installed: pip install nvidia-ml-py"


def test_products_map_to_gpush_models():
    assert model_of_nvml_product("NVIDIA H100 80GB HBM3").name == "H100-SXM5-80GB"
    assert model_of_nvml_product("NVIDIA A100-SXM4-40GB").name == "A100-SXM4-40GB"
    assert model_of_nvml_product("NVIDIA H200").name == "H200-SXM5-141GB"
    assert model_of_nvml_product("Tesla T4").name == "T4"
    assert model_of_nvml_product("NVIDIA RTX 6000 Ada Generation") is None


def test_proc_comm_and_mps_pipe(tmp_path):
    assert proc_comm(os.getpid())
    assert proc_comm(2**22 + 12345) is None
    assert mps_control_pipe(tmp_path) is False
    (tmp_path / "control").touch()
    assert mps_control_pipe(tmp_path) is True


def test_report_is_json_the_broker_can_read_back():
    report = report_of("a100-40gb-dgx")
    payload = json.loads(json.dumps(report.model_dump(mode="json")))
    assert NodeReport.model_validate(payload) == report


# --------------------------------------------------------------------------- run_agent


class Broker:
    """A tiny HTTP broker on localhost: answers POSTs with the next scripted status (then 202)."""

    def __init__(self, port: int, statuses: list[int] | None = None) -> None:
        self.port = port
        self.statuses = list(statuses or [])
        self.received: list[dict] = []
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        broker = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                broker.received.append(
                    {"path": self.path, "authorization": self.headers.get("Authorization"), "body": body}
                )
                status = broker.statuses.pop(0) if broker.statuses else 202
                answer = json.dumps({"error": {"code": "x", "message": f"scripted {status}", "details": []}})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def broker():
    b = Broker(free_port())
    yield b
    b.stop()


def agent(broker: Broker, sleeps: list[float], **kwargs):
    kwargs.setdefault("library", RecordedLibrary(DATA / "mig01.json"))
    kwargs.setdefault("once", True)
    kwargs.setdefault("sleep", sleeps.append)
    return run_agent(
        broker.url, "s3cret", "mig01", kwargs.pop("interval", 30), process_name=None, mps_control=None, **kwargs
    )


def test_report_arrives_with_the_agent_token(broker):
    broker.start()
    sleeps: list[float] = []
    assert agent(broker, sleeps) == 1
    (post,) = broker.received
    assert post["path"] == "/v1/agent/reports" and post["authorization"] == "Bearer s3cret"
    report = NodeReport.model_validate(post["body"])
    assert report.node == "mig01" and [len(g.mig_instances) for g in report.gpus] == [7, 2]
    assert sleeps == []


def test_broker_down_then_up_report_arrives_after_retries(broker):
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:  # the broker comes up during the third wait
            broker.start()

    assert agent(broker, sleeps, sleep=sleep) == 1
    assert sleeps == [1.0, 2.0, 4.0]
    assert len(broker.received) == 1


def test_5xx_is_retried_with_backoff(broker):
    broker.statuses = [503, 500, 502]
    broker.start()
    sleeps: list[float] = []
    assert agent(broker, sleeps) == 1
    assert sleeps == [1.0, 2.0, 4.0]
    assert len(broker.received) == 4


def test_backoff_is_capped_and_a_report_is_dropped_after_one_interval(broker, caplog):
    broker.statuses = [503] * 10
    broker.start()
    sleeps: list[float] = []
    with caplog.at_level(logging.ERROR, logger="gpush.agent"):
        assert agent(broker, sleeps, interval=10, max_backoff=3) == 0
    assert sleeps == [1.0, 2.0, 3.0, 3.0, 3.0]
    assert "giving up on this report" in caplog.text and "scripted 503" in caplog.text


@pytest.mark.parametrize("status", [401, 403])
def test_rejected_token_stops_the_agent_with_what_to_do(broker, status):
    broker.statuses = [status]
    broker.start()
    with pytest.raises(AgentTokenRejected) as caught:
        agent(broker, [], once=False)
    assert "gpush admin token create --role agent" in caught.value.message
    assert str(status) in caught.value.message and "scripted" in caught.value.message
    assert len(broker.received) == 1


def test_other_4xx_logs_the_brokers_message_and_goes_on(broker, caplog):
    broker.statuses = [422]
    broker.start()
    sleeps: list[float] = []
    stop_after_two = lambda: len(broker.received) >= 2  # noqa: E731
    with caplog.at_level(logging.ERROR, logger="gpush.agent"):
        assert agent(broker, sleeps, once=False, should_stop=stop_after_two, interval=15) == 1
    assert "scripted 422" in caplog.text
    assert sleeps == [15]  # no retry of the rejected report: the next round's report went out


def test_timer_loop_reports_every_interval_until_stopped(broker):
    broker.start()
    sleeps: list[float] = []
    stop = threading.Event()

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            stop.set()

    assert agent(broker, sleeps, once=False, sleep=sleep, should_stop=stop.is_set, interval=20) == 2
    assert sleeps == [20, 20] and len(broker.received) == 2


def test_agent_without_nvml_still_reports_the_error(broker):
    broker.start()
    assert agent(broker, [], library=RecordedLibrary(DATA / "no-driver.json")) == 1
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in broker.received[0]["body"]["error"]
