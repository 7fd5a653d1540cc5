"""Property tests of both renderers (issue 14): whatever a job spec holds, either a clear
refusal or a script/manifest whose command and environment are exactly the spec's.

Slurm: the rendered batch script is run for real, under ``sh`` (dash here) and ``bash``,
with the job's program replaced by this Python printing its argv and environment as JSON,
so the oracle is the shell's own reading of the renderer's quoting. Kubernetes: the
container's ``command`` and ``env`` are compared with the spec and with
broker.jobenv.environment's ``job_environment``; labels are valid or refused.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from typing import Any

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from adapters.k8s.render import DEFAULT_PATH as K8S_PATH
from adapters.k8s.render import RenderOptions
from adapters.k8s.render import render as render_k8s
from adapters.slurm.render import DEFAULT_PATH as SLURM_PATH
from adapters.slurm.render import SHELL_VARIABLES
from adapters.slurm.render import render as render_slurm
from broker.core.adapter import Placement, Rejected, Sharing
from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec
from broker.jobenv.environment import DEVICE_VARIABLES, RESERVED_PREFIX, job_environment

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
JOB_ID = 7
K8S_OPTIONS = RenderOptions(tag="gpush", namespace="gpush", image="python:3.11-slim")
# The label domains Kubernetes and gpush keep for themselves: a job's label there is refused.
RESERVED_DOMAINS = ("gpush.io", "kubernetes.io", "k8s.io")
K8S_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?\Z")
# The program the Slurm oracle runs instead of the job's: its argv and environment as JSON.
ECHO = "import json, os, sys; print(json.dumps([sys.argv[1:], dict(os.environ)]))"
# Variables a shell sets for itself when run with an empty environment, and the one
# Python sets for itself (PEP 538 locale coercion).
SHELL_OWN = {"PWD", "OLDPWD", "SHLVL", "_", "LC_CTYPE"}
# Names the oracle cannot use: they change how Python or the loader start, or how the
# program decodes its argv, not how the script passes them.
ORACLE_UNSAFE = re.compile(r"^(PYTHON|LD_|LC_|LANG)")

# -- strategies --------------------------------------------------------------------------

NASTY = [
    "",
    "'",
    "''",
    '"',
    "\\",
    "$HOME",
    "${PATH}",
    "$(touch pwned)",
    "`touch pwned`",
    "; rm -rf / #",
    "a\nb",
    "\n#SBATCH --exclusive\n",
    "#SBATCH --gres=gpu:8",
    "x' #SBATCH --mem=1\n#SBATCH --time=1",
    "-c",
    "--",
    "*",
    "~",
    "é中文🙂",
    "\t \t",
    "A=b",
]
SHELL_CHARS = list("'\"$`;\\\n\t !#*?[]{}()<>|&~=-%^")
# Text a job may hold: any Unicode but NUL, CR and lone surrogates (refused, see SPOILERS).
text = st.one_of(
    st.sampled_from(NASTY),
    st.text(
        alphabet=st.one_of(st.sampled_from(SHELL_CHARS), st.characters(codec="utf-8", exclude_characters="\x00\r")),
        max_size=24,
    ),
)
env_names = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True),
    st.sampled_from(["PATH", "HOME", "IFS", "ENV", "GPUSH_JOB_ID", "GPUSH_X", "SBATCH_X", "SLURM_JOB_ID"]),
    # Valid names the shell of a Slurm script owns: refused there, passed on Kubernetes.
    st.sampled_from(sorted(SHELL_VARIABLES)),
)
label_keys = st.one_of(
    st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True),
    st.sampled_from(["team/model", "app.example.com/x-y", "Z.z_1"]),
)
label_values = st.one_of(
    st.sampled_from(["", "x" * 63, "a.b_c-d"]),
    st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,8}[A-Za-z0-9])?", fullmatch=True),
)
principals = st.sampled_from(["ml", "alice", "alice@example.com", "a.b-c_d", "x_", "9"])
# One value a spec may not hold, put in one place: JobSpec or the renderer refuses it.
BAD_TEXT = ["\x00", "a\r\nb", "x\ud800"]
SPOILERS = st.one_of(
    st.tuples(st.just("arg"), st.sampled_from(BAD_TEXT)),
    st.tuples(st.just("env_value"), st.sampled_from(BAD_TEXT)),
    st.tuples(st.just("env_name"), st.sampled_from(["1X", "A-B", "X\n", "", "A B", "É", *DEVICE_VARIABLES])),
    st.tuples(st.just("label_key"), st.sampled_from(["Bad Key", "-x", "gpush.io/job-id", "x.kubernetes.io/y"])),
    st.tuples(st.just("label_value"), st.sampled_from(["-x", "x-", "a b", "a\n", "x" * 64, "é"])),
    st.tuples(st.sampled_from(["tenant", "user", "name"]), st.sampled_from(["_x", "@", "bad name", "x\n", ""])),
)


@st.composite
def job_specs(draw: st.DrawFn, program: list[str]) -> tuple[dict[str, Any], JobSpec | ValidationError]:
    """The fields of a spec (one in five spoiled by a value it may not hold) and the
    JobSpec they validate to, or JobSpec's refusal."""
    args = draw(st.lists(text, max_size=6))
    fields: dict[str, Any] = draw(
        st.fixed_dictionaries(
            {"kind": st.sampled_from(["batch", "training"])},
            optional={
                "env": st.dictionaries(env_names, text, max_size=5),
                "labels": st.dictionaries(label_keys, label_values, max_size=4),
                "tenant": principals,
                "user": principals,
                "name": st.sampled_from(["job-1", "x@y", "J.2_b"]),
                "gpu_memory_gb": st.sampled_from([5, 10.5]),
            },
        )
    )
    if draw(st.sampled_from([False, False, False, False, True])):
        where, bad = draw(SPOILERS)
        if where == "arg":
            args = [*args, bad]
        elif where == "env_value":
            fields["env"] = {**fields.get("env", {}), "SPOILED": bad}
        elif where == "env_name":
            fields["env"] = {**fields.get("env", {}), bad: "x"}
        elif where == "label_key":
            fields["labels"] = {**fields.get("labels", {}), bad: "x"}
        elif where == "label_value":
            fields["labels"] = {**fields.get("labels", {}), "spoiled": bad}
        else:
            fields[where] = bad
    fields["command"] = [*program, *args]
    try:
        return fields, JobSpec.model_validate(fields)
    except ValidationError as refused:
        return fields, refused


def assert_clear_refusal(fields: dict[str, Any], refused: ValidationError) -> None:
    """JobSpec's refusal names the field that was wrong (intake turns it into InvalidRequest)."""
    errors = refused.errors()
    assert errors
    for error in errors:
        assert error["loc"] and error["loc"][0] in fields, error
        assert error["msg"], error


def expected_env(spec: JobSpec, placement: Placement, path: str) -> dict[str, str]:
    env = job_environment(JOB_ID, spec, placement, device_memory_gb=80.0, path=path)
    # The job's own variables reach it as typed, except gpush's GPUSH_* (and PATH defaults).
    for name, value in spec.env.items():
        if not name.startswith(RESERVED_PREFIX):
            assert env[name] == value
    assert env["GPUSH_JOB_ID"] == str(JOB_ID)
    if "PATH" not in spec.env:
        assert env["PATH"] == path
    return env


# -- Slurm -------------------------------------------------------------------------------

SLURM_PLACEMENTS = [
    Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 1, 1.0, node="gpu01", gpu_model="A100-SXM4-40GB"),
    Placement("slurm-a", Sharing.SLURM_MIG, 1, 1 / 7, node="mig01", mig_profile="1g.5gb"),
    Placement("slurm-a", Sharing.SLURM_MPS, 25, 0.25, node="mps01", gpu_model="A100-SXM4-40GB"),
]
# /bin/sh is dash on Debian, bash in POSIX mode on RHEL: the script must mean the same to both.
SHELLS = [
    [path, *options] for shell, *options in (["sh"], ["bash"], ["bash", "--posix"]) if (path := shutil.which(shell))
]


def run_script(shell: list[str], script: str, tmp_path) -> tuple[list[str], dict[str, str]]:
    path = tmp_path / "job.sh"
    path.write_text(script, encoding="utf-8")
    done = subprocess.run([*shell, str(path)], cwd=tmp_path, env={}, capture_output=True, timeout=30)
    assert done.returncode == 0, (shell, done.stderr.decode(errors="replace"), script)
    argv, env = json.loads(done.stdout)
    return argv, env


def header(script: str) -> list[str]:
    """The lines sbatch reads directives from: those before the first command."""
    lines = []
    for line in script.split("\n"):
        if line.strip() and not line.startswith("#"):
            break
        lines.append(line)
    return lines


@PROPERTY
@given(job=job_specs([sys.executable, "-c", ECHO]), placement=st.sampled_from(SLURM_PLACEMENTS))
def test_slurm_script_passes_argv_and_env_byte_for_byte_or_refuses(job, placement, tmp_path_factory):
    fields, spec = job
    if isinstance(spec, ValidationError):
        event("refused by JobSpec")
        assert_clear_refusal(fields, spec)
        return
    try:
        submission = render_slurm(JOB_ID, spec, placement, tag="gpush", gres_type="a100", gpu_memory_gb=80.0)
    except (Rejected, InvalidRequest) as refused:
        event("refused by the renderer")
        assert str(refused)
        assert any(name in spec.env for name in (*DEVICE_VARIABLES, *SHELL_VARIABLES)), refused
        return
    assert not any(name in spec.env for name in (*DEVICE_VARIABLES, *SHELL_VARIABLES))
    env = expected_env(spec, placement, SLURM_PATH)
    assert submission.environment == env  # what the REST backend sends beside the script
    script = submission.script
    # No value adds a directive: sbatch reads #SBATCH only before the first command, and
    # the renderer writes none of its own (options travel as sbatch's argv).
    assert header(script) == script.split("\n")[:2]
    assert not any("#SBATCH" in line for line in header(script))
    assert all("\n" not in arg and "\r" not in arg for arg in submission.sbatch_args())
    if any(ORACLE_UNSAFE.match(name) for name in env):
        event("not run: a variable the oracle cannot use")
        return
    event("run under the shells")
    tmp_path = tmp_path_factory.mktemp("slurm")
    for shell in SHELLS:
        argv, seen = run_script(shell, script, tmp_path)
        assert argv == spec.command[3:], shell
        assert {k: v for k, v in seen.items() if k not in SHELL_OWN or k in env} == env, shell


# -- Kubernetes --------------------------------------------------------------------------

K8S_PLACEMENTS = [
    Placement("k8s-a", Sharing.K8S_EXCLUSIVE, 1, 1.0, gpu_model="H100-SXM5-80GB", node="n1"),
    Placement("k8s-a", Sharing.K8S_MIG, 1, 1 / 7, mig_profile="1g.10gb"),
    Placement("k8s-a", Sharing.K8S_TIMESLICE, 1, 0.25, gpu_model="T4", gpu_memory_gb=4),
    Placement("k8s-a", Sharing.K8S_EXCLUSIVE, 1, 1.0, gpu_model="H100-SXM5-80GB", replicas=3),
]


def k8s_job(**fields: Any) -> tuple[dict[str, Any], JobSpec]:
    fields = {"kind": "batch", "command": ["python", "serve.py"], **fields}
    return fields, JobSpec.model_validate(fields)


@PROPERTY
@given(job=job_specs(["python", "serve.py"]), placement=st.sampled_from(K8S_PLACEMENTS), elastic=st.booleans())
# Each refusal the renderer makes, drawn rarely at random: both a device variable and a
# reserved label (the variable is named), and a reserved label alone.
@example(
    job=k8s_job(env={"CUDA_VISIBLE_DEVICES": "0"}, labels={"gpush.io/job-id": "9"}),
    placement=K8S_PLACEMENTS[0],
    elastic=False,
)
@example(job=k8s_job(labels={"team": "a", "x.kubernetes.io/y": "x"}), placement=K8S_PLACEMENTS[1], elastic=True)
def test_k8s_container_gets_argv_and_env_exactly_and_valid_labels_or_refuses(job, placement, elastic):
    fields, spec = job
    if elastic and not isinstance(spec, ValidationError):
        elastic_fields = {
            "kind": "inference",
            "isolation": "exclusive",
            "elastic": {"min_replicas": 1, "max_replicas": 4},
        }
        fields = {**fields, **elastic_fields}
        spec = JobSpec.model_validate(fields)
    if isinstance(spec, ValidationError):
        event("refused by JobSpec")
        assert_clear_refusal(fields, spec)
        return
    try:
        manifest = render_k8s(JOB_ID, spec, placement, K8S_OPTIONS, gpu_memory_gb=80.0)
    except (Rejected, InvalidRequest) as refused:
        event("refused by the renderer")
        # The environment is rendered before the labels, so a job that does both is told
        # about its device variables; one that only claims a reserved domain, about the label.
        devices = [name for name in DEVICE_VARIABLES if name in spec.env]
        if devices:
            assert str(refused).startswith(f"the job sets {', '.join(devices)}: the cluster chooses the GPUs")
            return
        prefixes = {key: key.split("/", 1)[0] for key in spec.labels if "/" in key}
        reserved = [
            key
            for key, prefix in prefixes.items()
            if any(prefix == domain or prefix.endswith("." + domain) for domain in RESERVED_DOMAINS)
        ]
        assert reserved, refused
        assert str(refused).startswith(f"label {reserved[0]} is in a domain that gpush or Kubernetes reserves")
        return
    event("rendered")
    body = manifest.body
    assert (manifest.kind, body["kind"]) == (("deployments", "Deployment") if elastic else ("jobs", "Job"))
    template = body["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["command"] == spec.command
    assert "args" not in container
    env = expected_env(spec, placement, K8S_PATH)
    assert [e["name"] for e in container["env"]] == sorted(env)
    assert {e["name"]: e["value"] for e in container["env"]} == env
    # Labels: the job's own travel as typed; every label gpush adds is valid.
    for labels in (body["metadata"]["labels"], template["metadata"]["labels"]):
        for key, value in spec.labels.items():
            assert labels[key] == value
        assert all(K8S_LABEL_VALUE.match(value) for value in labels.values()), labels
        assert labels["gpush.io/job-id"] == str(JOB_ID) and labels["gpush.io/broker"] == "gpush"
    annotations = template["metadata"]["annotations"]
    if spec.tenant:
        assert annotations["gpush.io/tenant"] == spec.tenant
    if spec.user:
        assert annotations["gpush.io/user"] == spec.user
