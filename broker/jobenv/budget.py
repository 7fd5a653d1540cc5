"""The job's side of GPU sharing: apply the GPU memory budget gpush gives a job.

Time-slicing (and MPS without a pinned memory limit) does not isolate GPU memory: a
job that allocates more than its share makes its neighbours fail with out-of-memory
errors. gpush tells each job its budget in ``GPUSH_GPU_MEMORY_FRACTION`` (the share of
each visible device's memory it may use; 1 on a MIG slice or a whole GPU) and
``GPUSH_GPU_MEMORY_GB``. A PyTorch program applies it with one call, before it
allocates anything::

    from broker.jobenv.budget import apply_gpu_memory_budget
    apply_gpu_memory_budget()

It caps PyTorch's caching allocator on every visible device
(``torch.cuda.set_per_process_memory_fraction``), so an allocation past the budget
raises in this job instead of killing another. Without the variable, without torch,
or without a GPU it does nothing and says why in its return value.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

from broker.jobenv.environment import GPU_MEMORY_FRACTION

ENV = GPU_MEMORY_FRACTION  # the name gpush sets it under (broker.jobenv.environment)


def budget_fraction(environ: Mapping[str, str] | None = None) -> float | None:
    """The fraction gpush gave this job, or None when it gave none. A malformed value is
    an error: a job must not silently run without the budget it was placed with."""
    text = (os.environ if environ is None else environ).get(ENV)
    if text is None or text == "":
        return None
    try:
        fraction = float(text)
    except ValueError:
        raise ValueError(f"{ENV}={text!r} is not a number between 0 and 1") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"{ENV}={text!r} must be more than 0 and at most 1")
    return fraction


def apply_gpu_memory_budget(environ: Mapping[str, str] | None = None) -> str:
    """Cap PyTorch's GPU memory on every visible device at the job's budget; returns what
    it did ("limited 2 devices to 25% of their memory", or why it did nothing)."""
    fraction = budget_fraction(environ)
    if fraction is None:
        return f"no budget: {ENV} is not set (gpush sets it for every job it places)"
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return f"no budget applied: torch is not installed (budget {fraction:.0%})"
    if not torch.cuda.is_available():
        return f"no budget applied: no CUDA device is visible (budget {fraction:.0%})"
    devices = torch.cuda.device_count()
    for device in range(devices):  # indexes within CUDA_VISIBLE_DEVICES, as Slurm or Kubernetes set it
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    return f"limited {devices} device{'s' if devices != 1 else ''} to {fraction:.0%} of their memory"
