"""The job spec at the edge: what is refused (and how the error reads), what is
filled in, how values are normalised, and when two specs count as the same request."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from broker.core.errors import GpushError, InvalidRequest
from broker.core.schemas import JobBatch, JobSpec
from broker.core.spec_values import spec_limits
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
    with pytest.raises(InvalidRequest, match="command: missing: give the job a command"):
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


# -- hostile input (issue 14): what a spec may hold, and how much ---------------------


@pytest.fixture
def limits_from_env(monkeypatch):
    """Set ``GPUSH_MAX_*`` overrides for one test; the limits are read again after."""

    def set_limits(**values: int | str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(f"GPUSH_MAX_{name.upper()}", str(value))
        spec_limits.cache_clear()

    yield set_limits
    spec_limits.cache_clear()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        pytest.param({"env": {"X\n": "1"}}, "env", id="env-name"),
        pytest.param({"labels": {"app\n": "x"}}, "labels", id="label-key"),
        pytest.param({"labels": {"app": "x\n"}}, "labels", id="label-value"),
        pytest.param({"labels": {"example.com/app\n": "x"}}, "labels", id="prefixed-label-key"),
    ],
)
def test_a_trailing_newline_is_not_part_of_a_name(fields, field):
    # `$` in a Python regex also matches before a final newline: "X\n" passed as a
    # variable name and broke the Slurm script's export line.
    error = refused(**fields)

    assert [d["field"] for d in error.details] == [field]


@pytest.mark.parametrize(
    ("fields", "field", "what"),
    [
        pytest.param({"command": ["python", "a\rb"]}, "command", "carriage return", id="argv-cr"),
        pytest.param({"command": ["python", "a\x00b"]}, "command", "NUL", id="argv-nul"),
        pytest.param({"command": "python train.py\r\n"}, "command", "carriage return", id="shell-crlf"),
        pytest.param({"env": {"A": "1\r"}}, "env", "carriage return", id="env-cr"),
        pytest.param({"env": {"A": "\x00"}}, "env", "NUL", id="env-nul"),
        pytest.param({"labels": {"team": "a\x00"}}, "labels", "", id="label-nul"),
        pytest.param({"labels": {"team\r": "a"}}, "labels", "", id="label-cr"),
        pytest.param({"image": "busybox\x00"}, "image", "NUL", id="image-nul"),
        pytest.param({"command": ["python", "\ud800"]}, "command", "surrogate", id="argv-surrogate"),
        pytest.param({"command": "echo \udfff"}, "command", "surrogate", id="shell-surrogate"),
        pytest.param({"env": {"A": "x\ud83d"}}, "env", "surrogate", id="env-surrogate"),
        pytest.param({"image": "\ud800"}, "image", "", id="image-surrogate"),
        pytest.param({"name": "a\ud800"}, "name", "", id="name-surrogate"),
    ],
)
def test_text_no_cluster_can_take_is_refused_at_the_edge(fields, field, what):
    # sbatch refuses CR and NUL, and a lone surrogate cannot be written as UTF-8:
    # accepted, each failed later as "cluster unreachable" and was retried for ever.
    error = refused(**fields)

    assert [d["field"] for d in error.details] == [field]
    assert what in error.message


def test_a_newline_inside_an_argv_item_or_env_value_is_still_kept():
    spec = job(command=["python", "-c", "a\nb"], env={"SEP": "\n", "SMILE": "é😀"})

    assert spec.command == ["python", "-c", "a\nb"]
    assert spec.env == {"SEP": "\n", "SMILE": "é😀"}


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        pytest.param({"gpu_memory_gb": float("nan")}, "should be a finite number", id="gpu-memory-nan"),
        pytest.param({"gpu_memory_gb": float("inf")}, "should be a finite number", id="gpu-memory-inf"),
        pytest.param({"memory": float("nan")}, "nan is not a finite number", id="memory-nan"),
        pytest.param({"memory": float("inf")}, "inf is not a finite number", id="memory-inf"),
        # A duration is read as text (1h30m, HH:MM:SS): it says what a duration looks like.
        pytest.param({"time_limit": float("nan")}, "nan is not a duration", id="time-limit-nan"),
        pytest.param({"time_limit": float("-inf")}, "-inf is not a duration", id="time-limit-inf"),
        pytest.param({"env": {"A": float("nan")}}, "env 'A': nan is not a finite number", id="env-nan"),
        pytest.param({"labels": {"a": float("inf")}}, "labels 'a': inf is not a finite number", id="label-inf"),
        pytest.param({"cpus": float("nan")}, "should be a finite number", id="cpus-nan"),
    ],
)
def test_a_number_that_is_not_finite_is_refused(fields, words):
    error = refused(**fields)

    assert [d["field"] for d in error.details] == list(fields)
    assert words in error.message


OVER_LIMITS = [
    # (fields, field, the limit's number in the message, its setting)
    pytest.param({"command": ["echo"] * 4097}, "command", "4096", "GPUSH_MAX_COMMAND_ITEMS", id="argv-items"),
    pytest.param({"command": ["echo", "y" * 131_073]}, "command", "131072", "GPUSH_MAX_ARG_CHARS", id="argv-item"),
    pytest.param({"command": "y" * 131_073}, "command", "131072", "GPUSH_MAX_ARG_CHARS", id="shell-command"),
    pytest.param(
        {"command": ["echo"] + ["y" * 100_000] * 3}, "command", "262144", "GPUSH_MAX_COMMAND_CHARS", id="argv-total"
    ),
    pytest.param({"env": {f"V{i}": "1" for i in range(1025)}}, "env", "1024", "GPUSH_MAX_ENV_VARS", id="env-count"),
    pytest.param({"env": {"V" * 257: "1"}}, "env", "256", "GPUSH_MAX_ENV_NAME_CHARS", id="env-name"),
    pytest.param({"env": {"V": "y" * 131_073}}, "env", "131072", "GPUSH_MAX_ENV_VALUE_CHARS", id="env-value"),
    pytest.param(
        {"env": {f"V{i}": "y" * 100_000 for i in range(3)}}, "env", "262144", "GPUSH_MAX_ENV_CHARS", id="env-total"
    ),
    pytest.param({"labels": {f"l{i}": "x" for i in range(129)}}, "labels", "128", "GPUSH_MAX_LABELS", id="labels"),
    pytest.param({"image": "i" * 1025}, "image", "1024", "GPUSH_MAX_IMAGE_CHARS", id="image"),
]


@pytest.mark.parametrize(("fields", "field", "limit", "setting"), OVER_LIMITS)
def test_a_field_over_its_limit_is_refused_naming_the_limit_and_its_setting(fields, field, limit, setting):
    error = refused(**fields)

    assert [d["field"] for d in error.details] == [field]
    assert f"at most {int(limit):,}" in error.message
    assert setting in error.message
    assert len(error.message) < 2000  # the error does not echo the whole field


def test_real_jobs_fit_well_inside_the_default_limits():
    spec = job(
        command=["torchrun", "--nproc-per-node=8", "train.py"] + [f"--opt{i}=v" for i in range(500)],
        env={f"VAR_{i}": "x" * 1000 for i in range(200)},
        labels={f"example.com/l{i}": "v" for i in range(64)},
        image="registry.example.com:5000/" + "team/" * 20 + "image@sha256:" + "0" * 64,
    )

    assert len(spec.command) == 503


def test_limits_are_read_from_gpush_environment_variables(limits_from_env):
    assert job(labels={"a": "1", "b": "2", "c": "3"})
    limits_from_env(labels=2, command_items=2)

    assert spec_limits().labels == 2
    assert "GPUSH_MAX_LABELS" in refused(labels={"a": "1", "b": "2", "c": "3"}).message
    assert "GPUSH_MAX_COMMAND_ITEMS" in refused(command=["a", "b", "c"]).message


@pytest.mark.parametrize("value", ["lots", "0", "-3", "1.5"])
def test_a_limit_that_is_not_a_positive_whole_number_is_refused_by_name(limits_from_env, value):
    limits_from_env(env_vars=value)

    with pytest.raises(GpushError, match=f"GPUSH_MAX_ENV_VARS={value!r} is not a whole number"):
        spec_limits()


def test_a_batch_over_its_limit_is_refused_before_its_jobs_are_read(limits_from_env):
    limits_from_env(batch_jobs=3)
    with pytest.raises(ValidationError) as info:
        JobBatch.model_validate({"jobs": [{"kind": "nonsense"}] * 4})

    (error,) = info.value.errors()
    assert error["loc"] == ("jobs",)
    assert "at most 3" in error["msg"] and "GPUSH_MAX_BATCH_JOBS" in error["msg"]
    assert JobBatch.model_validate({"jobs": [{"kind": "training", "command": "true"}] * 3})


def test_an_error_shows_a_shortened_value_not_the_whole_field():
    error = refused(command=["echo", "y" * 200_000], env={"A": "\ud800"})

    assert len(error.message) < 2000
    assert all(len(str(d["value"])) < 1000 for d in error.details)
    shown = [d["value"] for d in error.details if d["field"] == "env"][0]
    assert "\ud800" not in str(shown)  # a lone surrogate cannot be written as UTF-8 JSON


def test_a_label_key_far_too_long_is_refused_without_repeating_it():
    error = refused(labels={"k" * 1_000_000: "v"})

    assert "[prefix/]name" in error.message
    assert len(error.message) < 2000


# -- topology: the job file takes what --topology takes -------------------------------


def test_topology_as_text_reads_as_the_cli_flag_does():
    # `topology: block:required` in a job file, as `--topology block:required` on the CLI.
    assert job(topology="block:required").topology.model_dump() == {"level": "block", "mode": "required"}
    assert job(topology="nvlink").topology.model_dump() == {"level": "nvlink", "mode": "preferred"}
    assert "'required' or 'preferred'" in str(refused(topology="block:maybe"))
    for bad in (5, ["block"], True):
        assert "such as block:required" in str(refused(topology=bad))


def test_a_bad_topology_level_says_what_a_level_is():
    for bad in ({"level": ""}, {"level": "a b"}, ":required"):
        message = str(refused(topology=bad))
        assert "nvlink, pcie or socket" in message and "gpush inventory --topology" in message, message
        assert "should match pattern" not in message
