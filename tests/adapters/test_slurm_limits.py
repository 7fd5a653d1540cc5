"""Slurm's limit reasons (AssocGrpGRES and the like) read in a user's words."""

from __future__ import annotations

import pytest

from adapters.slurm.limits import limit_reason


def said(reason: str) -> str | None:
    return limit_reason(reason, cluster="slurm-a", account="nlp", qos="normal")


def test_an_accounts_gpu_limit_names_the_account_the_setting_and_when_it_starts():
    text = said("AssocGrpGRES")
    assert text == (
        "waiting on slurm-a for account nlp's limit on GPUs in use at once "
        "(GrpTRES=gres/gpu=N; Slurm: AssocGrpGRES): it starts when the account's other jobs free some"
    )


@pytest.mark.parametrize(
    ("reason", "words"),
    [
        ("QOSMaxGRESPerUser", "QOS normal's limit on GPUs per user (MaxTRESPU=gres/gpu=N"),
        ("QOSMaxGRESPerAccount", "QOS normal's limit on GPUs per account (MaxTRESPA=gres/gpu=N"),
        ("AssocGrpGRESMinutes", "account nlp's limit on GPU-minutes used (GrpTRESMins=gres/gpu=N"),
        ("AssocGrpGRESRunMinutes", "GPU-minutes of its running jobs (GrpTRESRunMins=gres/gpu=N"),
        ("QOSGrpCpuLimit", "QOS normal's limit on CPUs in use at once (GrpTRES=cpu=N"),
        ("AssocGrpMemLimit", "limit on memory in use at once (GrpTRES=mem=N"),
        ("AssocMaxJobsLimit", "account nlp's limit on running jobs (Slurm: AssocMaxJobsLimit)"),
        ("AssocGrpSubmitJobsLimit", "limit on queued and running jobs"),
        ("QOSUsageThreshold", "the usage threshold of QOS normal"),
    ],
)
def test_each_kind_of_limit_reads_by_its_parts(reason, words):
    text = said(reason)
    assert text is not None and words in text, text
    assert f"Slurm: {reason}" in text  # Slurm's own word stays, for the admin


@pytest.mark.parametrize("reason", ["QOSMaxGRESPerJob", "AssocMaxCpuPerJobLimit", "QOSMaxWallDurationPerJobLimit"])
def test_a_per_job_limit_says_the_job_will_not_start_as_it_is(reason):
    assert "will not start until the job asks for less or an admin raises the limit" in said(reason)


def test_a_minimum_says_to_ask_for_more():
    assert said("QOSMinGRES").endswith("ask for more")


@pytest.mark.parametrize("reason", ["Resources", "Priority", "None", "Dependency", "ReqNodeNotAvail", "Assoc", "QOS"])
def test_what_is_not_a_limit_is_left_to_the_other_reasons(reason):
    assert said(reason) is None


def test_without_an_account_or_qos_the_job_s_own_is_named():
    assert "the account's limit" in limit_reason("AssocGrpGRES", cluster="c")
