"""The environment a job sees is the same on Slurm and on Kubernetes (broker.jobenv.environment)."""

from __future__ import annotations

import pytest

from adapters.k8s.render import RenderOptions
from adapters.k8s.render import render as render_k8s
from adapters.slurm.render import render as render_slurm
from broker.core.adapter import Placement, Rejected, Sharing
from broker.core.schemas import JobSpec
from broker.jobenv import budget
from broker.jobenv.environment import GPU_MEMORY_FRACTION, GPU_MEMORY_GB, JOB_ID, TENANT

OPTIONS = RenderOptions(tag="gpush", namespace="gpush", image="python:3.11-slim")
A100_40 = "A100-SXM4-40GB"


def job(**fields) -> JobSpec:
    base = {"kind": "training", "tenant": "ml", "user": "alice", "command": ["python", "train.py"]}
    return JobSpec.model_validate({**base, **fields})


def on_slurm(spec: JobSpec, placement: Placement, device_memory_gb: float | None = None) -> dict[str, str]:
    submission = render_slurm(7, spec, placement, tag="gpush", gres_type="a100", gpu_memory_gb=device_memory_gb)
    return dict(submission.environment)


def on_k8s(spec: JobSpec, placement: Placement, device_memory_gb: float | None = None) -> dict[str, str]:
    manifest = render_k8s(7, spec, placement, OPTIONS, gpu_memory_gb=device_memory_gb)
    return {e["name"]: e["value"] for e in manifest.body["spec"]["template"]["spec"]["containers"][0]["env"]}


# The same job on each pair of sharing modes that give it the same kind of GPU: whole
# GPUs, a MIG slice, a part of a shared GPU (MPS share / time-slice replica).
PAIRS = [
    pytest.param(
        Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 1, 1.0, gpu_model=A100_40),
        Placement("k8s-a", Sharing.K8S_EXCLUSIVE, 1, 1.0, gpu_model=A100_40),
        id="whole",
    ),
    pytest.param(
        Placement("slurm-a", Sharing.SLURM_MIG, 1, 3 / 7, mig_profile="3g.20gb", gpu_model=A100_40),
        Placement("k8s-a", Sharing.K8S_MIG, 1, 3 / 7, mig_profile="3g.20gb", gpu_model=A100_40),
        id="mig",
    ),
    pytest.param(
        Placement("slurm-a", Sharing.SLURM_MPS, 25, 0.25, gpu_model=A100_40, gpu_memory_gb=10),
        Placement("k8s-a", Sharing.K8S_TIMESLICE, 1, 0.25, gpu_model=A100_40, gpu_memory_gb=10),
        id="shared",
    ),
]


@pytest.mark.parametrize(("slurm", "k8s"), PAIRS)
def test_both_renderers_give_a_job_the_same_environment(slurm, k8s):
    spec = job(
        gpu_memory_gb=10,
        env={"HF_HOME": "/data/hf", "QUOTED": "it's $(not) run", "GPUSH_JOB_ID": "999", "GPUSH_MINE": "x"},
    )
    slurm_env, k8s_env = on_slurm(spec, slurm, 40), on_k8s(spec, k8s, 40)
    # PATH is the cluster's default (a host's on Slurm, a container's on Kubernetes).
    assert {k: v for k, v in slurm_env.items() if k != "PATH"} == {k: v for k, v in k8s_env.items() if k != "PATH"}
    assert slurm_env["HF_HOME"] == "/data/hf" and slurm_env["QUOTED"] == "it's $(not) run"
    assert slurm_env[JOB_ID] == "7" and slurm_env[TENANT] == "ml"
    assert "GPUSH_MINE" not in slurm_env  # GPUSH_* are gpush's on both
    shared = slurm.sharing is Sharing.SLURM_MPS
    assert slurm_env[GPU_MEMORY_FRACTION] == ("0.25" if shared else "1") and slurm_env[GPU_MEMORY_GB] == "10"
    assert budget.budget_fraction(slurm_env) == budget.budget_fraction(k8s_env)


def test_a_job_that_asked_no_gpu_memory_gets_no_nominal_gigabytes_anywhere():
    whole = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 1, 1.0, gpu_model=A100_40)
    for env in (on_slurm(job(), whole, 40), on_k8s(job(), Placement("k8s-a", Sharing.K8S_EXCLUSIVE, 1, 1.0), 40)):
        assert env[GPU_MEMORY_FRACTION] == "1" and GPU_MEMORY_GB not in env
    # An MPS share without a GB still says its part of the GPU.
    share = on_slurm(job(), Placement("slurm-a", Sharing.SLURM_MPS, 30, 0.3, gpu_model=A100_40))
    assert share[GPU_MEMORY_FRACTION] == "0.3" and GPU_MEMORY_GB not in share


@pytest.mark.parametrize("variable", ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"])
def test_both_renderers_refuse_a_job_that_names_its_own_devices(variable):
    spec = job(env={variable: "0"})
    with pytest.raises(Rejected, match=f"the job sets {variable}: the cluster chooses the GPUs"):
        on_slurm(spec, Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 1, 1.0, gpu_model=A100_40))
    with pytest.raises(Rejected, match=f"the job sets {variable}: the cluster chooses the GPUs"):
        on_k8s(spec, Placement("k8s-a", Sharing.K8S_EXCLUSIVE, 1, 1.0))


def test_the_job_side_reads_the_name_gpush_sets():
    assert budget.ENV == GPU_MEMORY_FRACTION
