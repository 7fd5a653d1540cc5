"""The NVML seam: recordings replay what NVML answered, errors included, and record() writes them back."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from broker.nodeagent.agent import record
from broker.nodeagent.nvml import RECORDING_FORMAT, RecordedLibrary, RecordingMissing, _encode

RECORDINGS = sorted((Path(__file__).parents[1] / "data" / "nvml").glob("*.json"))


def test_there_are_recordings():
    names = {p.stem for p in RECORDINGS}
    assert {"a100-40gb-dgx", "a100-80gb", "h100-80gb-dgx", "h200", "mig-pending", "mps01", "gpu-lost", "t4"} <= names
    assert {"mig01", "gpu01", "no-driver"} <= names


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_recording_round_trip(path):
    """Walking a replayed machine with the agent's calls records exactly the same answers:
    the agent asks every question the recording holds, and nothing else."""
    original = json.loads(path.read_text())
    again = record(RecordedLibrary(path))
    assert again["format"] == RECORDING_FORMAT
    assert again["calls"] == original["calls"]


def test_errors_are_real_nvml_errors():
    t4 = RecordedLibrary(Path(__file__).parents[1] / "data" / "nvml" / "t4.json")
    with pytest.raises(pynvml.NVMLError) as caught:
        t4.nvmlDeviceGetMigMode("gpu0")
    assert caught.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert isinstance(caught.value, pynvml.NVMLError_NotSupported)

    lost = RecordedLibrary(Path(__file__).parents[1] / "data" / "nvml" / "gpu-lost.json")
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        lost.nvmlDeviceGetHandleByIndex(2)


def test_structures_replay_with_their_fields():
    mig01 = RecordedLibrary(Path(__file__).parents[1] / "data" / "nvml" / "mig01.json")
    info = mig01.nvmlGpuInstanceGetInfo("gpu1/p9gi0")
    assert (info.profileId, info.placement.start, info.placement.size) == (9, 0, 4)
    assert mig01.nvmlDeviceGetMemoryInfo("gpu0").total == 40960 * 1024 * 1024
    assert mig01.nvmlDeviceGetMigMode("gpu0") == [1, 1]


def test_a_call_the_recording_lacks_is_not_answered():
    mig01 = RecordedLibrary(Path(__file__).parents[1] / "data" / "nvml" / "mig01.json")
    with pytest.raises(RecordingMissing, match=r"nvmlDeviceGetName\(gpu7\)"):
        mig01.nvmlDeviceGetName("gpu7")


def test_recording_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="format"):
        RecordedLibrary({"format": "something-else", "calls": {}})


def test_pynvml_structures_are_recorded_by_field():
    """What the real bindings return (ctypes structures) becomes plain JSON; handles inside are dropped."""
    info = pynvml.c_nvmlGpuInstanceInfo_t()
    info.id, info.profileId = 1, 9
    info.placement.start, info.placement.size = 4, 4
    assert _encode(info) == {"id": 1, "profileId": 9, "placement": {"start": 4, "size": 4}}

    pci = pynvml.nvmlPciInfo_t()
    pci.busId = b"00000000:07:00.0"
    assert _encode(pci)["busId"] == "00000000:07:00.0"

    profile = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
    profile.name = b"MIG 1g.5gb"
    profile.sliceCount, profile.memorySizeMB = 1, 4864
    encoded = _encode(profile)
    assert (encoded["name"], encoded["sliceCount"], encoded["memorySizeMB"]) == ("MIG 1g.5gb", 1, 4864)
