"""The GPU memory budget a job applies to itself (broker.jobenv.budget)."""

from __future__ import annotations

import sys
import types

import pytest

from broker.jobenv.budget import apply_gpu_memory_budget, budget_fraction


class FakeCuda:
    """torch.cuda as a machine with ``devices`` GPUs presents it (this machine has none)."""

    def __init__(self, devices: int):
        self.devices, self.limits = devices, {}

    def is_available(self) -> bool:
        return self.devices > 0

    def device_count(self) -> int:
        return self.devices

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        if not 0 <= fraction <= 1 or not 0 <= device < self.devices:
            raise ValueError("invalid fraction or device")  # as torch refuses them
        self.limits[device] = fraction


@pytest.fixture
def torch(monkeypatch):
    def install(devices: int) -> FakeCuda:
        cuda = FakeCuda(devices)
        monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
        return cuda

    return install


def test_the_budget_caps_every_visible_device(torch):
    cuda = torch(2)
    assert apply_gpu_memory_budget({"GPUSH_GPU_MEMORY_FRACTION": "0.25"}) == "limited 2 devices to 25% of their memory"
    assert cuda.limits == {0: 0.25, 1: 0.25}


def test_nothing_to_apply_says_why(torch, monkeypatch):
    assert apply_gpu_memory_budget({}).startswith("no budget: GPUSH_GPU_MEMORY_FRACTION is not set")
    torch(0)
    assert "no CUDA device" in apply_gpu_memory_budget({"GPUSH_GPU_MEMORY_FRACTION": "0.5"})
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert "torch is not installed" in apply_gpu_memory_budget({"GPUSH_GPU_MEMORY_FRACTION": "0.5"})


@pytest.mark.parametrize("value", ["half", "0", "1.5", "-0.1"])
def test_a_malformed_budget_is_an_error(value):
    with pytest.raises(ValueError, match="GPUSH_GPU_MEMORY_FRACTION"):
        budget_fraction({"GPUSH_GPU_MEMORY_FRACTION": value})
