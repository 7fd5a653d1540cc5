"""Property tests of the job-file parser behind `gpush submit -f` (issue 14): whatever
text comes in, reading it (load_documents, then build_specs' validation) gives jobs or
an InvalidRequest naming the file in a bounded message, never another exception; and
valid job specs dumped to YAML read back as the same JobSpecs."""

from __future__ import annotations

from typing import Any

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from broker.core.errors import InvalidRequest
from broker.core.schemas import Isolation, JobSpec, Kind
from broker.intake.jobfile import build_specs, load_documents, validate_spec
from tests.routing.test_policy_properties import mutated

SOURCE = "prop-job.yaml"
MAX_MESSAGE = 20_000


def settings_for(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def read_job_file(text: str) -> list[JobSpec]:
    """What `gpush submit -f FILE` reads from FILE, with no flags."""
    return build_specs(load_documents(text, source=SOURCE), {}, source=SOURCE)


def reads_or_refuses(text: str) -> list[JobSpec] | None:
    """The jobs, or None after checking the refusal is an InvalidRequest that names the
    file and is bounded; any other exception fails the test."""
    try:
        specs = read_job_file(text)
    except InvalidRequest as exc:
        assert exc.message.startswith(SOURCE), exc.message[:300]
        assert len(exc.message) < MAX_MESSAGE, (len(exc.message), exc.message[:300])
        return None
    assert specs and all(isinstance(spec, JobSpec) for spec in specs)
    return specs


# -- arbitrary text ----------------------------------------------------------------------

# Any code point but lone surrogates (text read from a file is valid UTF-8).
any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=400)

yamlish_text = st.lists(
    st.sampled_from(
        [
            "kind: training",
            "kind: inference",
            "isolation: hardware",
            "gpus: 2",
            "gpus: 0",
            "gpu_memory_gb: 20",
            "gpu_memory_gb: .nan",
            "command: [python, train.py]",
            "command: ''",
            "env: {A: 1, 1A: x}",
            "labels: {team: a}",
            "elastic: {min_replicas: 2, max_replicas: 1}",
            "memory: 16G",
            "time_limit: 1-00:00:00",
            "\n",
            "\n- ",
            "  ",
            "- ",
            ": ",
            "? ",
            "&a ",
            "*a",
            "<<: *a",
            "[",
            "]",
            "{",
            "}",
            ",",
            "'",
            '"',
            "!!binary ",
            "!!python/name:os.system ",
            "---\n",
            "...\n",
            "#",
            "\t",
            "\r",
            "\x00",
            "\x85",
            "0x" + "f" * 70,
            "9" * 5000,
        ]
    ),
    max_size=40,
).map("".join)


@settings_for(300)
@given(any_text)
@example("")
@example("---\n---\n")
@example("[]")
@example("[1]")
@example("- kind: training\n  command: [x]\n- 3\n")
@example("kind: training\ncommand: &c [x, *c]\n")
@example("a: &a [1]\nb: [*a, *a]\n")
@example("? [1, 2]\n: x\n")
@example("kind: training\ncommand: [x]\n" + "labels: {" + "k" * 5000 + ": [1]}\n")
@example("kind: training\ncommand: [x]\n" + "x" * 100_000 + ": 1\n")
@example("kind: training\ncommand:\n" + "- [1]\n" * 4000)
@example("kind: training\ncommand: [x]\nenv:\n" + "".join(f"  V{i}: [1]\n" for i in range(1000)))
@example("".join(f"---\nkind: trainin\ncommand: [{i}]\n" for i in range(3000)))
def test_arbitrary_text_reads_as_jobs_or_is_refused_naming_the_file(text):
    reads_or_refuses(text)


@settings_for(300)
@given(yamlish_text)
def test_yaml_shaped_text_reads_as_jobs_or_is_refused_naming_the_file(text):
    reads_or_refuses(text)


# -- plausible but wrong structures --------------------------------------------------------

FIELDS = list(JobSpec.model_fields) + ["min_replicas", "max_replicas", "comand", "<<"]
WORDS = [
    *FIELDS,
    *(k.value for k in Kind),
    *(i.value for i in Isolation),
    "16G",
    "1h30m",
    "1-00:00:00",
    "python",
    "",
    " ",
    "x" * 300,
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(WORDS),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=30),
)
keys = st.one_of(
    st.sampled_from(FIELDS),
    st.text(max_size=20),
    st.integers(min_value=-5, max_value=5),
    st.booleans(),
    st.none(),
)


def junk_from(base: st.SearchStrategy[Any], max_leaves: int = 16) -> st.SearchStrategy[Any]:
    return st.recursive(
        base,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
        max_leaves=max_leaves,
    )


@st.composite
def junk(draw: st.DrawFn) -> Any:
    """Random nesting of mappings, lists and scalars, some of its nodes repeated by
    reference so that YAML writes them as anchors and aliases."""
    shared = draw(junk_from(scalars, 6))
    return draw(junk_from(st.one_of(scalars, st.just(shared))))


def small_junk(draw: st.DrawFn) -> st.SearchStrategy[Any]:
    """Junk for the values of one example: small, sharing one node drawn here."""
    shared = draw(junk_from(scalars, 6))
    return junk_from(st.one_of(scalars, st.just(shared)), 6)


@st.composite
def wrong_jobs(draw: st.DrawFn) -> Any:
    """Valid jobs (one mapping, or a list of them) changed here and there: junk values,
    missing or unknown keys, a node repeated elsewhere."""
    valid = st.one_of(valid_jobs(), st.lists(valid_jobs(), min_size=1, max_size=3))
    return draw(mutated(valid, keys, small_junk(draw)))


def dumped(document: Any, flow: bool | None, many: bool) -> str:
    if many and isinstance(document, list):
        return yaml.safe_dump_all(document, default_flow_style=flow, allow_unicode=True, sort_keys=False)
    return yaml.safe_dump(document, default_flow_style=flow, allow_unicode=True, sort_keys=False)


@settings_for(100)
@given(junk(), st.sampled_from([None, False, True]), st.booleans())
def test_any_yaml_structure_reads_as_jobs_or_is_refused(document, flow, many):
    reads_or_refuses(dumped(document, flow, many))


@settings_for(100)
@given(wrong_jobs(), st.sampled_from([None, False, True]), st.booleans())
def test_a_job_with_wrong_pieces_reads_or_is_refused(document, flow, many):
    reads_or_refuses(dumped(document, flow, many))


# -- round trip of valid job specs ---------------------------------------------------------

# Text a program can take: no surrogates, no control characters (NUL and CR are refused).
printable = st.text(st.characters(exclude_categories=("Cs", "Cc")), max_size=20)
env_names = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,15}\Z")
label_keys = st.from_regex(r"\A([a-z0-9]([-a-z0-9.]{0,8}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,10}[A-Za-z0-9])?\Z")
label_values = st.from_regex(r"\A([A-Za-z0-9]([-A-Za-z0-9_.]{0,10}[A-Za-z0-9])?)?\Z")


@st.composite
def valid_jobs(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(list(Kind)))
    job: dict[str, Any] = {"kind": kind.value}
    isolation = draw(st.none() | st.sampled_from(list(Isolation)))
    if isolation is not None:
        job["isolation"] = isolation.value
    if draw(st.booleans()):
        job["gpus"] = draw(st.integers(min_value=1, max_value=1024))
    shares = (isolation or {Kind.INFERENCE: Isolation.NONE}.get(kind, Isolation.EXCLUSIVE)) != Isolation.EXCLUSIVE
    if shares or draw(st.booleans()):  # required whenever the job shares a GPU
        job["gpu_memory_gb"] = draw(
            st.one_of(
                st.integers(min_value=1, max_value=1024),
                st.floats(min_value=0.01, max_value=1024, allow_nan=False, allow_infinity=False),
            )
        )
    first = draw(printable.filter(bool))
    job["command"] = [first, *draw(st.lists(printable, max_size=4))]
    if draw(st.booleans()):
        job["env"] = draw(st.dictionaries(env_names, printable, max_size=4))
    if draw(st.booleans()):
        job["labels"] = draw(st.dictionaries(label_keys, label_values, max_size=4))
    return job


@settings_for(120)
@given(st.lists(valid_jobs(), min_size=1, max_size=3), st.sampled_from([None, False, True]), st.sampled_from("123"))
def test_valid_job_specs_dumped_to_yaml_read_back_as_the_same_specs(jobs, flow, layout):
    # 1: one mapping (the first job); 2: `---` documents; 3: a list of mappings.
    if layout == "1":
        jobs = jobs[:1]
        text = yaml.safe_dump(jobs[0], default_flow_style=flow, allow_unicode=True)
    elif layout == "2":
        text = yaml.safe_dump_all(jobs, default_flow_style=flow, allow_unicode=True)
    else:
        text = yaml.safe_dump(jobs, default_flow_style=flow, allow_unicode=True)

    specs = read_job_file(text)

    assert specs == [validate_spec(job) for job in jobs]
    for spec, job in zip(specs, jobs, strict=True):
        assert spec.kind == Kind(job["kind"])
        if "isolation" in job:
            assert spec.isolation == Isolation(job["isolation"])
        assert spec.gpus == job.get("gpus", 1)
        assert spec.gpu_memory_gb == job.get("gpu_memory_gb")
        assert spec.command == job["command"]
        assert spec.env == job.get("env", {})
        assert spec.labels == job.get("labels", {})
