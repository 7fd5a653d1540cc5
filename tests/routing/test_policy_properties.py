"""Property tests of the policy parser (issue 14): whatever text comes in, load_policy
either returns a Policy or raises InvalidRequest naming the source in a bounded
message, never another exception; and policies built from valid pieces, dumped to
YAML, load back with every field as written."""

from __future__ import annotations

from typing import Any

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from broker.core.adapter import Sharing
from broker.core.errors import InvalidRequest
from broker.core.gpus import MODELS
from broker.core.schemas import Isolation, Kind
from broker.routing.policy import MIG_SHARING, Policy, load_policy

SOURCE = "prop-policy.yaml"
MAX_MESSAGE = 20_000


def settings_for(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def loads_or_refuses(text: str) -> Policy | None:
    """The policy, or None after checking the refusal is an InvalidRequest that names
    the source and is bounded; any other exception fails the test."""
    try:
        policy = load_policy(text, SOURCE)
    except InvalidRequest as exc:
        assert exc.message.startswith(SOURCE), exc.message[:300]
        assert len(exc.message) < MAX_MESSAGE, len(exc.message)
        assert str(exc) == exc.message
        return None
    assert isinstance(policy, Policy)
    assert policy.rules and policy.source == SOURCE
    return policy


# -- arbitrary text ----------------------------------------------------------------------

# Any code point but lone surrogates (text read from a file is valid UTF-8), control
# characters included.
any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=400)

# Text made of YAML's own punctuation and a policy's words, so the parser gets past
# its first character more often than with arbitrary code points.
yamlish_text = st.lists(
    st.sampled_from(
        [
            "rules:",
            "\n",
            "\n  - ",
            "  ",
            "name: r1",
            "match:",
            "{}",
            "route:",
            "cluster: a",
            "sharing: slurm/mig",
            "fallbacks:",
            "kind: [training, batch]",
            "gpus: {min: 2, max: 1}",
            "&a ",
            "*a",
            "<<: ",
            "? ",
            ": ",
            "- ",
            "[",
            "]",
            "{",
            "}",
            ",",
            "'",
            '"',
            "!!str ",
            "!!python/object ",
            "---\n",
            "...\n",
            "#",
            "\t",
            "\x00",
            "\ufeff",
            "%YAML 1.1\n",
            ".nan",
            "-.inf",
            "0x" + "f" * 70,
        ]
    ),
    max_size=40,
).map("".join)


@settings_for(300)
@given(any_text)
@example("")
@example("\x00")
@example("\ud7ff\ue000")
@example("rules: &a [*a]")
@example("rules: [&r {name: r, match: {}, route: {cluster: a, sharing: slurm/mig}}, *r]")
@example("? [a, b]\n: 1")
@example("<<: 1")
@example("rules:\n  - name: 1\n    1: 2\n    '1': 3")
@example("a: 1\n---\nb: 2\n")
def test_arbitrary_text_loads_or_is_refused_with_the_source_named(text):
    loads_or_refuses(text)


@settings_for(300)
@given(yamlish_text)
def test_yaml_shaped_text_loads_or_is_refused_with_the_source_named(text):
    loads_or_refuses(text)


# -- plausible but wrong structures --------------------------------------------------------

KEYS = [
    "rules",
    "name",
    "why",
    "match",
    "route",
    "fallbacks",
    "cluster",
    "sharing",
    "partition",
    "gpu_model",
    "kind",
    "isolation",
    "gpus",
    "gpu_memory_gb",
    "tenant",
    "labels",
    "min",
    "max",
    "rule",
    "Rules",
    "<<",
]
WORDS = [
    *KEYS,
    *(s.value for s in Sharing),
    *(k.value for k in Kind),
    *(i.value for i in Isolation),
    *(m.name for m in MODELS[:4]),
    "slurm-a",
    "k8s-a",
    "team-a",
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
    st.sampled_from(KEYS),
    st.text(max_size=20),
    st.integers(min_value=-5, max_value=5),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
)


def junk_from(base: st.SearchStrategy[Any], max_leaves: int = 20) -> st.SearchStrategy[Any]:
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


def containers(document: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every mapping and list in ``document``, with its path, each once."""
    found = [(path, document)] if isinstance(document, dict | list) else []
    items = document.items() if isinstance(document, dict) else enumerate(document) if found else ()
    for key, item in items:
        found += containers(item, (*path, key))
    return found


@st.composite
def mutated(
    draw: st.DrawFn, valid: st.SearchStrategy[Any], keys: st.SearchStrategy[Any], value: st.SearchStrategy[Any]
) -> Any:
    """A valid document with up to three changes: a value replaced by junk, a key left
    out, a key added, or a node repeated elsewhere (an anchor and an alias)."""
    document = draw(valid)
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        nodes = containers(document)
        _, target = draw(st.sampled_from(nodes))
        action = draw(st.sampled_from(["replace", "delete", "add", "alias"]))
        if action == "alias":
            new = draw(st.sampled_from([node for _, node in nodes]))
            if any(node is target for _, node in containers(new)):
                continue  # the target inside itself: a cycle, which safe_dump cannot write
        else:
            new = draw(value)
        if isinstance(target, dict):
            if target and action != "add":
                key = draw(st.sampled_from(list(target)))
                if action == "delete":
                    del target[key]
                else:
                    target[key] = new
            else:
                target[draw(keys)] = new
        elif target and action != "add":
            index = draw(st.integers(min_value=0, max_value=len(target) - 1))
            if action == "delete":
                del target[index]
            else:
                target[index] = new
        else:
            target.append(new)
    return document


@st.composite
def wrong_policy(draw: st.DrawFn) -> Any:
    """A valid policy changed here and there: junk values, missing or unknown keys."""
    return draw(mutated(valid_policies(), keys, small_junk(draw)))


def dumped(document: Any, flow: bool | None) -> str | None:
    try:
        return yaml.safe_dump(document, default_flow_style=flow, allow_unicode=True, sort_keys=False)
    except yaml.YAMLError:
        return None  # something safe_dump cannot write (never the case so far)


@settings_for(100)
@given(junk(), st.sampled_from([None, False, True]))
def test_any_yaml_structure_loads_or_is_refused(document, flow):
    text = dumped(document, flow)
    if text is not None:
        loads_or_refuses(text)


@settings_for(60)
@given(wrong_policy(), st.sampled_from([None, False, True]))
def test_a_policy_with_wrong_pieces_loads_or_is_refused(document, flow):
    text = dumped(document, flow)
    if text is not None:
        loads_or_refuses(text)


# -- round trip of valid policies ----------------------------------------------------------

names = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,20}\Z")
tenants = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.@-]{0,20}\Z")
partitions = st.from_regex(r"\A[A-Za-z0-9_.-]{1,20}\Z")


def one_or_many(values: st.SearchStrategy[str]) -> st.SearchStrategy[str | list[str]]:
    return st.one_of(values, st.lists(values, min_size=1, max_size=3))


@st.composite
def ranges(draw: st.DrawFn, numbers: st.SearchStrategy[float]) -> dict[str, float]:
    low, high = sorted(draw(st.lists(numbers, min_size=2, max_size=2)))
    keep = draw(st.sampled_from(["min", "max", "both"]))
    return {"min": low} if keep == "min" else {"max": high} if keep == "max" else {"min": low, "max": high}


@st.composite
def routes(draw: st.DrawFn) -> dict[str, Any]:
    sharing = draw(st.sampled_from(list(Sharing)))
    route: dict[str, Any] = {"cluster": draw(names), "sharing": sharing.value}
    if sharing.flavor == "slurm" and draw(st.booleans()):
        route["partition"] = draw(partitions)
    if draw(st.booleans()):
        models = [m for m in MODELS if m.mig_capable or sharing not in MIG_SHARING]
        route["gpu_model"] = draw(st.sampled_from(models)).name
    return route


@st.composite
def matches(draw: st.DrawFn) -> dict[str, Any]:
    return draw(
        st.fixed_dictionaries(
            {},
            optional={
                "kind": one_or_many(st.sampled_from([k.value for k in Kind])),
                "isolation": one_or_many(st.sampled_from([i.value for i in Isolation])),
                "tenant": one_or_many(tenants),
                "gpus": ranges(st.integers(min_value=1, max_value=1024)),
                "gpu_memory_gb": ranges(st.floats(min_value=0.5, max_value=1024, allow_nan=False)),
                "labels": st.dictionaries(names, names, max_size=3),
            },
        )
    )


@st.composite
def valid_policies(draw: st.DrawFn) -> dict[str, Any]:
    rule_names = draw(st.lists(names, min_size=1, max_size=6, unique=True))
    rules = []
    for name in rule_names:
        rule: dict[str, Any] = {"name": name, "match": draw(matches()), "route": draw(routes())}
        if draw(st.booleans()):
            rule["why"] = draw(st.text(st.characters(exclude_categories=("Cs", "Cc")), max_size=60))
        if draw(st.booleans()):
            rule["fallbacks"] = draw(st.lists(routes(), max_size=3))
        rules.append(rule)
    return {"rules": rules}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def assert_route(route: Any, written: dict[str, Any]) -> None:
    assert route.cluster == written["cluster"]
    assert route.sharing == Sharing(written["sharing"])
    assert route.partition == written.get("partition")
    assert route.gpu_model == written.get("gpu_model")


@settings_for(50)
@given(valid_policies(), st.sampled_from([None, False, True]))
def test_a_valid_policy_dumped_to_yaml_loads_back_as_written(document, flow):
    text = yaml.safe_dump(document, default_flow_style=flow, allow_unicode=True, sort_keys=False)

    policy = load_policy(text, SOURCE)

    assert [rule.name for rule in policy.rules] == [rule["name"] for rule in document["rules"]]
    for rule, written in zip(policy.rules, document["rules"]):
        assert rule.why == written.get("why")
        match, wanted = rule.match, written["match"]
        for key, kind in (("kind", Kind), ("isolation", Isolation)):
            expected = [kind(v) for v in as_list(wanted[key])] if key in wanted else None
            assert getattr(match, key) == expected
        assert match.tenant == (as_list(wanted["tenant"]) if "tenant" in wanted else None)
        for key in ("gpus", "gpu_memory_gb"):
            bounds = getattr(match, key)
            if key not in wanted:
                assert bounds is None
            else:
                assert (bounds.min, bounds.max) == (wanted[key].get("min"), wanted[key].get("max"))
        assert match.labels == wanted.get("labels", {})
        assert_route(rule.route, written["route"])
        assert len(rule.fallbacks) == len(written.get("fallbacks", []))
        for route, written_route in zip(rule.fallbacks, written.get("fallbacks", [])):
            assert_route(route, written_route)
    # Built from the same data without YAML, the policy is the same.
    assert policy.model_dump() == Policy.model_validate(document).model_dump()
