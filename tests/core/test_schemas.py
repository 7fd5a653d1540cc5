"""The job spec at the edge: what is refused (and how the error reads), what is
filled in, how values are normalised, and when two specs count as the same request."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec
from broker.intake.jobfile import validate_spec


def job(**fields: Any) -> JobSpec:
    """A valid training job with ``fields`` laid over it."""
    return validate_spec({"kind": "training", "command": ["python", "train.py"], **fields})


def refused(**fields: Any) -> InvalidRequest:
    """The error a user sees for a training job with ``fields`` laid over it."""
    with pytest.raises(InvalidRequest) as info:
        job(**fields)
    return info.value


# -- what is refused, and how the error reads ----------------------------------------

# (fields, the field the error names, the value it shows, words saying what is allowed)
BAD_FIELDS = [
    pytest.param({"kind": "gpu"}, "kind", "'gpu'", "'training', 'inference' or 'batch'", id="kind"),
    pytest.param(
        {"isolation": "mig"}, "isolation", "'mig'", "'exclusive', 'hardware', 'process' or 'none'", id="isolation"
    ),
    pytest.param({"gpus": 0}, "gpus", "0", "greater than or equal to 1", id="gpus-zero"),
    pytest.param({"gpus": 2000}, "gpus", "2000", "less than or equal to 1024", id="gpus-too-many"),
    pytest.param({"gpu_memory_gb": -1}, "gpu_memory_gb", "-1", "greater than 0", id="gpu-memory-negative"),
    pytest.param(
        {"gpu_memory_gb": 4096}, "gpu_memory_gb", "4096", "less than or equal to 1024", id="gpu-memory-too-big"
    ),
    pytest.param({"gpu_memory_gb": "lots"}, "gpu_memory_gb", "'lots'", "valid number", id="gpu-memory-not-a-number"),
    pytest.param(
        {"kind": "inference", "gpu_memory_gb": 8, "elastic": {"min_replicas": 5, "max_replicas": 2}},
        "elastic",
        "'min_replicas': 5",
        "min_replicas (5) is more than max_replicas (2)",
        id="elastic-min-above-max",
    ),
    pytest.param(
        {"elastic": {"min_replicas": 1, "max_replicas": 4}},
        "elastic",
        "'max_replicas': 4",
        "for kind inference, not training",
        id="elastic-on-training",
    ),
    pytest.param({"env": {"1BAD": "x"}}, "env", "'1BAD'", "letters, digits and _", id="env-name-digit"),
    pytest.param({"env": {"MY-VAR": "x"}}, "env", "'MY-VAR'", "letters, digits and _", id="env-name-dash"),
    pytest.param({"labels": {"bad key!": "x"}}, "labels", "'bad key!'", "[prefix/]name", id="label-key"),
    pytest.param(
        {"labels": {"team": "-vision-"}}, "labels", "'-vision-'", "starts and ends alphanumeric", id="label-value"
    ),
    pytest.param(
        {"labels": {"team": "v" * 64}}, "labels", "'" + "v" * 64 + "'", "at most 63", id="label-value-too-long"
    ),
    pytest.param({"priority": 5000}, "priority", "5000", "less than or equal to 1000", id="priority-high"),
    pytest.param({"priority": -5000}, "priority", "-5000", "greater than or equal to -1000", id="priority-low"),
    pytest.param(
        {"idempotency_key": "k" * 129},
        "idempotency_key",
        "'" + "k" * 129 + "'",
        "at most 128 characters",
        id="idempotency-key-too-long",
    ),
    # The charset is only shown as a regex ("\x21-\x7e": printable ASCII, no space).
    pytest.param(
        {"idempotency_key": "has space"},
        "idempotency_key",
        "'has space'",
        "printable ASCII without spaces",
        id="idempotency-key-space",
    ),
    pytest.param(
        {"idempotency_key": "ключ"},
        "idempotency_key",
        "'ключ'",
        "printable ASCII without spaces",
        id="idempotency-key-non-ascii",
    ),
    pytest.param({"memory": "lots"}, "memory", "'lots'", "such as 16G or 512M", id="memory"),
    pytest.param({"time_limit": "forever"}, "time_limit", "'forever'", "HH:MM:SS", id="time-limit"),
    pytest.param({"time_limit": "0"}, "time_limit", "'0'", "longer than zero", id="time-limit-zero"),
    pytest.param({"gpu": 2}, "gpu", "2", "did you mean 'gpus'", id="unknown-field"),
]


@pytest.mark.parametrize(("fields", "field", "shown_value", "allowed"), BAD_FIELDS)
def test_a_bad_field_is_refused_with_its_name_its_value_and_what_is_allowed(fields, field, shown_value, allowed):
    error = refused(**fields)

    assert f"{field} = " in error.message
    assert shown_value in error.message
    assert allowed in error.message
    assert [d["field"] for d in error.details] == [field]


def test_every_bad_field_is_reported_at_once():
    error = refused(gpus=0, priority=5000, isolation="mig")

    assert {d["field"] for d in error.details} == {"gpus", "priority", "isolation"}


def test_an_unknown_field_is_refused_rather_than_ignored():
    # A typo such as `gpu: 4` must not quietly give a 1-GPU job.
    with pytest.raises(InvalidRequest, match="gpu = 4"):
        validate_spec({"kind": "training", "command": "python train.py", "gpu": 4})


def test_a_missing_kind_is_named():
    with pytest.raises(InvalidRequest) as info:
        validate_spec({"command": "python train.py"})

    assert "kind" in [d["field"] for d in info.value.details]


# -- defaults and cross-field rules --------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "isolation"), [("training", "exclusive"), ("batch", "exclusive"), ("inference", "none")]
)
def test_isolation_defaults_by_kind(kind, isolation):
    assert job(kind=kind, gpu_memory_gb=8).isolation == isolation


def test_an_explicit_isolation_wins_over_the_default():
    assert job(kind="inference", isolation="hardware", gpu_memory_gb=10).isolation == "hardware"
    assert job(kind="training", isolation="process", gpu_memory_gb=10).isolation == "process"


@pytest.mark.parametrize("isolation", ["hardware", "process", "none"])
def test_gpu_memory_is_required_when_a_gpu_is_shared(isolation):
    error = refused(isolation=isolation)

    assert error.details[0]["field"] == "gpu_memory_gb"
    assert f"isolation {isolation} shares a GPU" in error.message
    assert job(isolation=isolation, gpu_memory_gb=10).gpu_memory_gb == 10


def test_inference_by_default_shares_a_gpu_so_needs_gpu_memory():
    error = refused(kind="inference")

    assert "gpu_memory_gb" in error.message and "isolation none" in error.message


def test_whole_gpus_need_no_gpu_memory():
    assert job(isolation="exclusive").gpu_memory_gb is None


def test_elastic_replicas_are_accepted_for_inference():
    spec = job(kind="inference", gpu_memory_gb=8, elastic={"min_replicas": 0, "max_replicas": 4})

    assert (spec.elastic.min_replicas, spec.elastic.max_replicas) == (0, 4)


def test_a_job_needs_a_command_or_an_image():
    with pytest.raises(InvalidRequest, match="needs a command, an image, or both"):
        validate_spec({"kind": "training"})

    assert validate_spec({"kind": "training", "image": "nvcr.io/nvidia/pytorch:24.01-py3"}).command is None
    assert validate_spec({"kind": "training", "command": "nvidia-smi"}).image is None


@pytest.mark.parametrize("command", [[], [""], "   "])
def test_an_empty_command_is_refused(command):
    error = refused(command=command)

    assert error.details[0]["field"] == "command"


# -- normalisation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("16GiB", "16G"),
        ("16G", "16G"),
        ("16g", "16G"),
        ("16 GB", "16G"),
        (16384, "16G"),  # a plain number is MiB, as in Slurm's --mem
        ("16384M", "16G"),
        ("0.5T", "512G"),
        ("1536M", "1536M"),
        ("2T", "2T"),
    ],
)
def test_memory_is_normalised_to_a_slurm_size(given, stored):
    assert job(memory=given).memory == stored


@pytest.mark.parametrize("given", ["512K", "0", 0, "65T", True])
def test_memory_out_of_range_is_refused(given):
    assert refused(memory=given).details[0]["field"] == "memory"


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("90", "01:30:00"),  # a bare number is minutes, as in Slurm
        (90, "01:30:00"),
        ("2h", "02:00:00"),
        ("90m", "01:30:00"),
        ("1h30m", "01:30:00"),
        ("1d", "1-00:00:00"),
        ("01:30:00", "01:30:00"),
        ("2-00:00:00", "2-00:00:00"),
        ("2-12", "2-12:00:00"),  # Slurm's D-HH
        ("1-02:30", "1-02:30:00"),  # Slurm's D-HH:MM
        ("10:00", "00:10:00"),  # Slurm's MM:SS: ten minutes, not ten hours
        ("00:45", "00:00:45"),
    ],
)
def test_time_limit_is_normalised_to_slurm_d_hh_mm_ss(given, stored):
    assert job(time_limit=given).time_limit == stored


@pytest.mark.parametrize("given", ["1:2:3:4", "1-", "90.5", "366d", True])
def test_a_time_limit_that_is_no_duration_or_over_a_year_is_refused(given):
    assert refused(time_limit=given).details[0]["field"] == "time_limit"


def test_a_command_string_runs_under_the_shell():
    assert job(command="python train.py --lr 3e-4 && echo done").command == [
        "/bin/sh",
        "-c",
        "python train.py --lr 3e-4 && echo done",
    ]


def test_an_argv_list_is_kept_byte_for_byte():
    argv = [
        "python",
        "-c",
        'import sys\nprint("it\'s", sys.argv)\n# end',
        "$(rm -rf /)",
        "`id`",
        "a;b",
        "x && y",
        "'single'",
        '"double"',
        "*",
        "~",
        "$HOME",
        "é😀",
    ]

    assert job(command=argv).command == argv


def test_whitespace_at_the_ends_of_an_argv_element_is_kept():
    argv = ["printf", "%s", "  indented", "trailing newline\n", "\t"]

    assert job(command=argv).command == argv


def test_an_env_value_is_kept_byte_for_byte():
    assert job(env={"PS1": "$ ", "SEP": "\n"}).env == {"PS1": "$ ", "SEP": "\n"}


SPECS = [
    pytest.param({"kind": "training", "command": "python train.py"}, id="minimal"),
    pytest.param({"kind": "batch", "image": "busybox", "memory": "0.5T", "time_limit": "2-12"}, id="batch"),
    pytest.param(
        {
            "name": "llm-serve",
            "kind": "inference",
            "isolation": "hardware",
            "gpus": 2,
            "gpu_memory_gb": 19.5,
            "elastic": {"min_replicas": 1, "max_replicas": 8},
            "cpus": 8,
            "memory": 24576,
            "time_limit": "1h30m",
            "command": ["vllm", "serve", "--port", "8000"],
            "image": "vllm/vllm-openai:latest",
            "env": {"HF_HOME": "/cache", "_X1": ""},
            "labels": {"team": "vision", "example.com/stage": "dev"},
            "tenant": "vision",
            "user": "bob",
            "priority": -10,
            "idempotency_key": "deploy-42",
        },
        id="everything",
    ),
]


@pytest.mark.parametrize("fields", SPECS)
def test_normalising_a_normalised_spec_changes_nothing(fields):
    spec = validate_spec(fields)

    again = JobSpec.model_validate(spec.model_dump(mode="json"))

    assert again == spec
    assert again.fingerprint() == spec.fingerprint()


# -- fingerprint: the same request hashes the same -----------------------------------


@pytest.mark.parametrize(
    "variants",
    [
        pytest.param(
            [
                {"time_limit": "2h"},
                {"time_limit": "120"},
                {"time_limit": 120},
                {"time_limit": "02:00:00"},
                {"time_limit": "2:00:00"},
            ],
            id="time-limit",
        ),
        pytest.param([{"memory": "16G"}, {"memory": 16384}, {"memory": "16GiB"}, {"memory": "16384M"}], id="memory"),
        pytest.param([{"command": "nvidia-smi"}, {"command": ["/bin/sh", "-c", "nvidia-smi"]}], id="shell-command"),
        pytest.param([{}, {"isolation": "exclusive"}, {"gpus": 1}, {"priority": 0}], id="defaults-spelled-out"),
        pytest.param([{"gpu_memory_gb": 16}, {"gpu_memory_gb": 16.0}, {"gpu_memory_gb": "16"}], id="gpu-memory"),
    ],
)
def test_equivalent_specs_have_the_same_fingerprint(variants):
    fingerprints = {job(**fields).fingerprint() for fields in variants}

    assert len(fingerprints) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"gpus": 2},
        {"command": ["python", "train.py", "--resume"]},
        {"time_limit": "2h01m"},
        {"memory": "16G"},
        {"priority": 1},
        {"env": {"SEED": "1"}},
        {"labels": {"team": "vision"}},
        {"isolation": "hardware", "gpu_memory_gb": 10},
        {"kind": "batch"},
    ],
)
def test_a_different_spec_has_a_different_fingerprint(change):
    assert job(**change).fingerprint() != job().fingerprint()


def test_the_fingerprint_ignores_the_idempotency_key():
    assert job(idempotency_key="a").fingerprint() == job(idempotency_key="b").fingerprint() == job().fingerprint()
