"""Routing policies as admins and users meet them: the shipped policies load and pass
validation against realistic fleets; the first matching rule routes a job and
explain says why for every rule; broken YAML and bad fields name their line and
column; validation refuses what would strand or mis-isolate jobs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec
from broker.intake.jobfile import validate_spec
from broker.routing.policy import (
    ClusterView,
    Policy,
    choose_mig_profile,
    cluster_view,
    evaluate,
    load_policy,
    policy_json_schema,
    validate,
)

POLICIES = Path(__file__).resolve().parents[2] / "policies"
SHIPPED = ["default.yaml", "all-kubernetes.yaml", "slurm-only.yaml"]


# -- fleets, jobs and policies -----------------------------------------------------------


def units(cluster: str, node: str, sharing: str, model: str, memory: float, count: int, **more: Any) -> CapacityUnit:
    """``count`` units of one kind on one node, as an adapter's inventory reports them."""
    physical = more.pop("gpu_memory_gb", memory)
    in_mig_mode = more.pop("in_mig_mode", sharing.endswith("/mig"))
    equivalent = {"mig": 1 / 7, "mps": 0.01, "timeslice": 1 / 4}.get(sharing.split("/")[1], 1.0)
    return CapacityUnit(
        cluster=cluster,
        node=node,
        sharing=Sharing(sharing),
        gpu_model=model,
        unit_memory_gb=memory,
        capacity=count,
        allocated=0,
        gpu_equivalent=equivalent,
        gpu_memory_gb=physical,
        in_mig_mode=in_mig_mode,
        **more,
    )


def slurm_units(name: str = "slurm-a") -> list[CapacityUnit]:
    """A Slurm cluster: an A100 40 GB carved 1g.5gb x7, another 3g.20gb x2, an MPS
    V100 (100 shares), and a node of whole A100 80 GB GPUs."""
    a100 = "A100-SXM4-40GB"
    return [
        units(name, "mig-01", "slurm/mig", a100, 5, 7, mig_profile="1g.5gb", gpus=(0,), gpu_memory_gb=40),
        units(name, "mig-01", "slurm/mig", a100, 20, 2, mig_profile="3g.20gb", gpus=(1,), gpu_memory_gb=40),
        units(name, "mps-01", "slurm/mps", "V100-SXM2-32GB", 32, 100, gpus=(0,)),
        units(name, "big-01", "slurm/exclusive", "A100-SXM4-80GB", 80, 4, gpus=(0, 1, 2, 3)),
    ]


def k8s_units(name: str = "k8s-a") -> list[CapacityUnit]:
    """A Kubernetes cluster: T4s time-sliced 4 ways, an A100 40 GB under the MIG mixed
    strategy (2g.10gb x3 + 1g.5gb on one GPU, 3g.20gb x2 on the other), whole L40S."""
    a100 = "A100-SXM4-40GB"
    return [
        units(name, "t4-01", "k8s/timeslice", "T4", 16, 4, gpus=(0,)),
        units(name, "t4-02", "k8s/timeslice", "T4", 16, 4, gpus=(0,)),
        units(name, "mig-01", "k8s/mig", a100, 10, 3, mig_profile="2g.10gb", gpus=(0,), gpu_memory_gb=40),
        units(name, "mig-01", "k8s/mig", a100, 5, 1, mig_profile="1g.5gb", gpus=(0,), gpu_memory_gb=40),
        units(name, "mig-01", "k8s/mig", a100, 20, 2, mig_profile="3g.20gb", gpus=(1,), gpu_memory_gb=40),
        units(name, "l40s-01", "k8s/exclusive", "L40S", 48, 2, gpus=(0, 1)),
    ]


def fleet(kind_slurm: str = "slurm", kind_k8s: str = "k8s") -> dict[str, ClusterView]:
    return {
        "slurm-a": cluster_view("slurm-a", kind_slurm, slurm_units()),
        "k8s-a": cluster_view("k8s-a", kind_k8s, k8s_units()),
    }


def job(**fields: Any) -> JobSpec:
    """A valid job spec (training on one whole GPU unless ``fields`` say otherwise)."""
    return validate_spec({"kind": "training", "command": ["python", "run.py"], **fields})


def rule(name: str, route: str = "slurm-a slurm/exclusive", *fallbacks: str, **match: Any) -> dict[str, Any]:
    """A rule as plain data; routes are written "cluster sharing"."""

    def as_route(text: str) -> dict[str, str]:
        cluster, sharing = text.split()
        return {"cluster": cluster, "sharing": sharing}

    return {"name": name, "match": match, "route": as_route(route), "fallbacks": [as_route(f) for f in fallbacks]}


def policy(*rules: dict[str, Any]) -> Policy:
    return Policy.model_validate({"rules": list(rules)})


def from_yaml(text: str, source: str = "test.yaml") -> Policy:
    return load_policy(textwrap.dedent(text).lstrip(), source)


def refused(text: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        from_yaml(text)
    return info.value


def messages(findings: list) -> str:
    return "\n".join(f.message for f in findings)


# -- the shipped policies ------------------------------------------------------------------


@pytest.mark.parametrize("kinds", [("slurm", "k8s"), ("sim", "sim")], ids=["real-clusters", "simulated"])
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_policies_load_and_validate_cleanly(name: str, kinds: tuple[str, str]) -> None:
    loaded = load_policy((POLICIES / name).read_text(), f"policies/{name}")
    report = validate(loaded, fleet(*kinds))
    assert report.ok, report.describe()
    assert report.warnings == [], report.describe()
    assert "valid" in report.describe()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_policies_explain_who_they_are_for(name: str) -> None:
    text = (POLICIES / name).read_text()
    assert text.startswith("# "), "each shipped policy opens with a comment saying who it is for"
    loaded = load_policy(text, name)
    assert all(r.why for r in loaded.rules), "every shipped rule says why, for explain"


@pytest.mark.parametrize(
    ("fields", "rule_name", "first_route"),
    [
        ({"isolation": "hardware", "gpu_memory_gb": 10}, "isolated-training-on-mig", "slurm-a slurm/mig"),
        ({"isolation": "hardware", "gpu_memory_gb": 30}, "training-on-whole-gpus", "slurm-a slurm/exclusive"),
        ({"gpus": 8}, "training-on-whole-gpus", "slurm-a slurm/exclusive"),
        (
            {"kind": "inference", "isolation": "process", "gpu_memory_gb": 3},
            "small-inference-on-mps",
            "slurm-a slurm/mps",
        ),
        (
            {"kind": "inference", "isolation": "process", "gpu_memory_gb": 12},
            "isolated-inference-on-mig",
            "k8s-a k8s/mig",
        ),
        (
            {"kind": "inference", "gpu_memory_gb": 4, "elastic": {"min_replicas": 1, "max_replicas": 8}},
            "shared-inference-and-batch-on-timeslice",
            "k8s-a k8s/timeslice",
        ),
        (
            {"kind": "batch", "isolation": "none", "gpu_memory_gb": 2},
            "shared-inference-and-batch-on-timeslice",
            "k8s-a k8s/timeslice",
        ),
        ({"kind": "batch"}, "everything-else-on-whole-gpus", "slurm-a slurm/exclusive"),
        ({"kind": "inference", "gpu_memory_gb": 12}, "everything-else-on-whole-gpus", "slurm-a slurm/exclusive"),
    ],
)
def test_default_policy_routes_jobs_as_the_field_does(fields: dict, rule_name: str, first_route: str) -> None:
    default = load_policy((POLICIES / "default.yaml").read_text(), "default.yaml")
    decision = evaluate(default, job(**fields), "nlp")
    assert decision.rule_name == rule_name
    assert str(decision.routes[0]) == first_route


def test_hardware_isolated_training_falls_back_from_slurm_mig_to_kubernetes_mig() -> None:
    default = load_policy((POLICIES / "default.yaml").read_text(), "default.yaml")
    decision = evaluate(default, job(isolation="hardware", gpu_memory_gb=5), "nlp")
    assert [str(r) for r in decision.routes] == ["slurm-a slurm/mig", "k8s-a k8s/mig"]


# -- evaluation and explain ----------------------------------------------------------------


def test_first_matching_rule_wins_and_later_rules_are_not_tried() -> None:
    two = policy(
        rule("training-on-mig", "slurm-a slurm/mig", "k8s-a k8s/mig", kind="training", isolation="hardware"),
        rule("training-anywhere", "k8s-a k8s/exclusive", kind="training"),
        rule("rest", "slurm-a slurm/exclusive"),
    )
    decision = evaluate(two, job(isolation="hardware", gpu_memory_gb=8), "nlp")
    assert (decision.rule, decision.rule_name) == (0, "training-on-mig")
    assert [str(r) for r in decision.routes] == ["slurm-a slurm/mig", "k8s-a k8s/mig"]
    assert [t.outcome for t in decision.trials] == ["matched", "not tried", "not tried"]
    assert "training-on-mig" in decision.trials[1].reasons[0]


def test_explain_shows_every_rule_tried_and_why() -> None:
    rules = policy(
        rule(
            "isolated-training", "slurm-a slurm/mig", kind="training", isolation="hardware", gpu_memory_gb={"max": 40}
        ),
        rule("nlp-inference", "k8s-a k8s/exclusive", kind="inference", labels={"team": "nlp"}),
        rule("premium", "k8s-a k8s/exclusive", tenant=["acme", "globex"]),
    )
    decision = evaluate(rules, job(kind="inference", isolation="hardware", gpu_memory_gb=48), "initech")
    assert decision.rule is None and decision.routes == []
    assert [t.matched for t in decision.trials] == [False, False, False]
    text = decision.explain()
    assert "1. isolated-training: no match - kind=inference is not in [training]; gpu_memory_gb=48 is above max 40" in (
        text
    )
    assert "2. nlp-inference: no match - label team is not set (the rule wants team=nlp)" in text
    assert "3. premium: no match - tenant=initech is not in [acme, globex]" in text
    assert "no rule matches kind=inference isolation=hardware" in decision.message
    assert "held" in decision.message
    json.dumps(decision.to_dict())  # the API returns it as is

    routed = evaluate(rules, job(isolation="hardware", gpu_memory_gb=40), "nlp")
    assert routed.trials[0].reasons == ("matches: kind=training, isolation=hardware, gpu_memory_gb=40 (max 40)",)
    assert "route: slurm-a slurm/mig" in routed.explain()


def test_explain_says_a_multi_node_jobs_nodes_and_topology_ask() -> None:
    rules = policy(rule("training", "slurm-a slurm/exclusive", kind="training"))
    gang = job(kind="training", gpus=8, nodes=4, topology={"level": "block", "mode": "required"})
    assert (
        evaluate(rules, gang, None)
        .explain()
        .startswith("job: kind=training isolation=exclusive gpus=8 nodes=4 topology=block:required")
    )
    assert "nodes=" not in evaluate(rules, job(kind="training"), None).explain().splitlines()[0]


@pytest.mark.parametrize(
    ("gpu_memory_gb", "matched"), [(3.9, False), (4, True), (12.5, True), (20, True), (20.5, False)]
)
def test_memory_ranges_are_inclusive(gpu_memory_gb: float, matched: bool) -> None:
    ranged = policy(rule("mid", kind="inference", gpu_memory_gb={"min": 4, "max": 20}))
    decision = evaluate(ranged, job(kind="inference", gpu_memory_gb=gpu_memory_gb), "nlp")
    assert decision.matched is matched


@pytest.mark.parametrize(("gpus", "matched"), [(1, False), (2, True), (4, True), (5, False)])
def test_gpu_count_ranges_are_inclusive(gpus: int, matched: bool) -> None:
    ranged = policy(rule("two-to-four", gpus={"min": 2, "max": 4}))
    decision = evaluate(ranged, job(gpus=gpus), "nlp")
    assert decision.matched is matched
    if not matched:
        expected = {1: "gpus=1 is below min 2", 5: "gpus=5 is above max 4"}[gpus]
        assert decision.trials[0].reasons[0] == expected


def test_a_job_that_states_no_memory_does_not_match_a_memory_range() -> None:
    small = policy(rule("small", gpu_memory_gb={"max": 16}))
    decision = evaluate(small, job(), "nlp")
    assert not decision.matched
    assert decision.trials[0].reasons == ("gpu_memory_gb is not set (the rule wants max 16)",)


def test_labels_must_all_be_present_with_equal_values() -> None:
    labelled = policy(rule("nlp-prod", labels={"team": "nlp", "env": "prod"}))
    assert evaluate(labelled, job(labels={"team": "nlp", "env": "prod", "extra": "x"}), "t").matched
    wrong = evaluate(labelled, job(labels={"team": "vision", "env": "prod"}), "t")
    assert wrong.trials[0].reasons == ("label team=vision is not team=nlp",)
    assert not evaluate(labelled, job(labels={"team": "nlp"}), "t").matched


def test_label_values_that_yaml_reads_as_numbers_match_as_text() -> None:
    tiered = from_yaml(
        """
        rules:
          - name: tier-one
            match: {labels: {tier: 1, gpu: true}}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
        """
    )
    assert evaluate(tiered, job(labels={"tier": "1", "gpu": "true"}), "t").matched


def test_tenant_matches_the_resolved_owner_one_value_or_a_list() -> None:
    one = policy(rule("acme-only", tenant="acme"))
    many = policy(rule("partners", tenant=["acme", "globex"]))
    assert evaluate(one, job(), "acme").matched
    assert evaluate(many, job(), "globex").matched
    assert not evaluate(many, job(), "initech").matched
    # The broker's resolved owner wins over what the spec says; without one, the spec's.
    assert not evaluate(one, job(tenant="acme"), "initech").matched
    assert evaluate(one, job(tenant="acme"), None).matched


def test_isolation_defaults_by_kind_when_the_job_does_not_say() -> None:
    exclusive_only = policy(rule("whole", isolation="exclusive"))
    assert evaluate(exclusive_only, job(kind="batch"), "t").matched
    assert not evaluate(exclusive_only, job(kind="inference", gpu_memory_gb=4), "t").matched


# -- loading: errors name the line and column ---------------------------------------------------


def test_yaml_syntax_error_names_the_line_and_column() -> None:
    error = refused(
        """
        rules:
          - name: broken
            match: {kind: [training}
            route: {cluster: slurm-a, sharing: slurm/mig}
        """
    )
    assert error.message.startswith("test.yaml, line 3, column 28: not valid YAML")
    assert error.details[0]["line"] == 3 and error.details[0]["column"] == 28


def test_schema_error_names_line_column_field_value_and_what_is_allowed() -> None:
    error = refused(
        """
        rules:
          - name: ok
            match: {}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
          - name: typo
            match: {kind: training}
            route:
              cluster: slurm-a
              sharing: slurm/mgi
        """
    )
    assert error.details == [
        {
            "field": "rules.1.route.sharing",
            "value": "slurm/mgi",
            "message": "use one of 'slurm/exclusive', 'slurm/mig', 'slurm/mps', 'k8s/timeslice', "
            "'k8s/mig' or 'k8s/exclusive'",
            "line": 9,
            "column": 16,
        }
    ]
    assert error.message.startswith("test.yaml, line 9, column 16: rules.1.route.sharing = 'slurm/mgi': use one of")


def test_one_value_written_for_a_list_points_at_that_value() -> None:
    error = refused(
        """
        rules:
          - name: typo
            match: {kind: trainig}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
        """
    )
    assert error.details[0]["field"] == "rules.0.match.kind"
    assert (error.details[0]["line"], error.details[0]["column"]) == (3, 19)
    assert "'training', 'inference' or 'batch'" in error.message


def test_unknown_keys_are_errors_with_a_suggestion() -> None:
    error = refused(
        """
        rules:
          - name: a
            match: {}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
            fallback:
              - {cluster: k8s-a, sharing: k8s/exclusive}
        """
    )
    (detail,) = error.details
    assert detail["field"] == "rules.0.fallback"
    assert (detail["line"], detail["column"]) == (5, 5)
    assert "did you mean 'fallbacks'?" in detail["message"]


@pytest.mark.parametrize(
    ("match", "words"),
    [
        ("{gpu_memory_gb: {min: 20, max: 10}}", "min (20) is above max (10)"),
        ("{gpus: {}}", "an empty range"),
        ("{kind: []}", "an empty list matches no job"),
        ("{isolation: mig}", "'exclusive', 'hardware', 'process' or 'none'"),
    ],
)
def test_matches_that_could_never_hold_are_refused(match: str, words: str) -> None:
    error = refused(
        f"""
        rules:
          - name: a
            match: {match}
            route: {{cluster: slurm-a, sharing: slurm/exclusive}}
        """
    )
    assert words in error.message
    assert error.details[0]["line"] == 3


def test_missing_match_says_how_to_match_everything() -> None:
    error = refused(
        """
        rules:
          - name: a
            route: {cluster: slurm-a, sharing: slurm/exclusive}
        """
    )
    assert "rules.0.match: required: write match: {} to match every job" in error.message


def test_rule_names_must_be_unique() -> None:
    error = refused(
        """
        rules:
          - name: same
            match: {kind: training}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
          - name: same
            match: {}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
        """
    )
    assert error.details[0]["field"] == "rules.1.name"
    assert error.details[0]["line"] == 5
    assert "rule 2 repeats the name of rule 1" in error.message


def test_a_key_written_twice_is_an_error_not_silently_dropped() -> None:
    error = refused(
        """
        rules:
          - name: a
            match: {}
            route: {cluster: slurm-a, sharing: slurm/mig}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
        """
    )
    assert "test.yaml, line 5, column 5: key 'route' appears twice" in error.message


def test_route_details_are_checked_where_they_are_written() -> None:
    error = refused(
        """
        rules:
          - name: a
            match: {}
            route: {cluster: k8s-a, sharing: k8s/mig, partition: gpu, gpu_model: T4}
        """
    )
    text = error.message
    assert "partition is a Slurm setting" in text
    assert "T4 is not MIG-capable" in text
    assert all(d["line"] == 4 for d in error.details)
    unknown = refused(
        """
        rules:
          - name: a
            match: {}
            route: {cluster: k8s-a, sharing: k8s/exclusive, gpu_model: B9000}
        """
    )
    assert "unknown GPU model 'B9000'" in unknown.message


def test_gpu_model_aliases_become_the_canonical_name() -> None:
    aliased = policy({"name": "a", "match": {}, "route": {"cluster": "x", "sharing": "slurm/mig", "gpu_model": "a100"}})
    assert aliased.rules[0].route.gpu_model == "A100-SXM4-40GB"


@pytest.mark.parametrize("text", ["", "# only a comment\n", "- name: a\n", "rules: []\n"])
def test_a_file_without_rules_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        load_policy(text, "empty.yaml")
    assert info.value.message.startswith("empty.yaml")


# -- validation ------------------------------------------------------------------------------


def test_unknown_cluster_is_refused_listing_the_known_ones() -> None:
    loaded = from_yaml(
        """
        rules:
          - name: everything
            match: {}
            route: {cluster: slurm-b, sharing: slurm/exclusive}
        """
    )
    report = validate(loaded, fleet())
    assert not report.ok
    (error,) = report.errors
    assert "'slurm-b', which is not registered (registered: k8s-a, slurm-a)" in error.message
    assert "Did you mean 'slurm-a'?" in error.message
    assert (error.rule, error.rule_name, error.line, error.column) == (0, "everything", 4, 12)
    assert "test.yaml, line 4, column 12: error: rule 1 'everything'" in report.describe()


def test_sharing_mode_the_cluster_kind_lacks_is_refused() -> None:
    report = validate(policy(rule("ts", "slurm-a k8s/timeslice", isolation="none")), fleet())
    assert "'slurm-a' is a slurm cluster and k8s/timeslice is a k8s mode" in messages(report.errors)
    assert "route to one of slurm/exclusive, slurm/mig, slurm/mps" in messages(report.errors)


def test_a_simulated_cluster_offers_only_the_modes_in_its_inventory() -> None:
    sim = {"slurm-a": cluster_view("slurm-a", "sim", [u for u in slurm_units() if u.sharing != Sharing.SLURM_MPS])}
    real = {"slurm-a": cluster_view("slurm-a", "slurm", [u for u in slurm_units() if u.sharing != Sharing.SLURM_MPS])}
    mps = policy(rule("mps", "slurm-a slurm/mps", isolation="process"), rule("rest"))
    assert "simulated cluster 'slurm-a' has no slurm/mps units" in messages(validate(mps, sim).errors)
    # A real Slurm cluster may add MPS nodes at any time: only a warning.
    on_real = validate(mps, real)
    assert on_real.ok
    assert "has no slurm/mps units right now" in messages(on_real.warnings)


def test_mig_route_no_offered_profile_can_serve_is_refused() -> None:
    too_big = policy(
        rule("big-mig", "slurm-a slurm/mig", isolation="hardware", gpu_memory_gb={"min": 30, "max": 40}),
        rule("rest"),
    )
    errors = messages(validate(too_big, fleet()).errors)
    assert "at least 30 GB per slice, and no MIG profile on 'slurm-a' covers that" in errors
    assert "offered: 1g.5gb (5 GB), 3g.20gb (20 GB)" in errors

    no_mig = {"slurm-a": cluster_view("slurm-a", "slurm", [u for u in slurm_units() if u.mig_profile is None])}
    small = policy(rule("mig", "slurm-a slurm/mig", isolation="hardware", gpu_memory_gb={"max": 5}), rule("rest"))
    assert "'slurm-a' offers no MIG profile" in messages(validate(small, no_mig).errors)


def test_mig_route_covering_part_of_the_memory_range_warns() -> None:
    partly = policy(rule("mig", "slurm-a slurm/mig", isolation="hardware", gpu_memory_gb={"max": 40}), rule("rest"))
    report = validate(partly, fleet())
    assert report.ok
    assert "jobs asking more than 20 GB per slice match this rule" in messages(report.warnings)
    assert "gpu_memory_gb: {max: 20}" in messages(report.warnings)


def test_mps_routed_to_gpus_in_mig_mode_is_refused() -> None:
    bad_node = units("slurm-a", "mps-02", "slurm/mps", "A100-SXM4-40GB", 40, 100, in_mig_mode=True)
    view = cluster_view("slurm-a", "slurm", [*slurm_units(), bad_node])
    assert view.mps_in_mig_mode
    mps = policy(rule("mps", "slurm-a slurm/mps", isolation="process", gpu_memory_gb={"max": 4}), rule("rest"))
    report = validate(mps, {"slurm-a": view})
    assert not report.ok
    assert "MPS and MIG cannot run on one GPU" in messages(report.errors)
    assert "nodes mps-02" in messages(report.errors)
    assert validate(mps, fleet()).ok


@pytest.mark.parametrize(
    ("isolation", "route", "ok"),
    [
        (["hardware"], "k8s-a k8s/timeslice", False),
        (["hardware"], "slurm-a slurm/mps", False),
        (["hardware"], "k8s-a k8s/mig", True),
        (["hardware"], "slurm-a slurm/exclusive", True),
        (["none", "process"], "slurm-a slurm/mps", True),
        (["none", "process"], "k8s-a k8s/timeslice", False),
        (["none"], "k8s-a k8s/timeslice", True),
        (["exclusive"], "k8s-a k8s/mig", False),
        (None, "k8s-a k8s/mig", False),  # no isolation in the match: it takes exclusive jobs too
        (None, "k8s-a k8s/exclusive", True),
    ],
)
def test_a_route_weaker_than_the_isolation_a_rule_admits_is_refused(
    isolation: list[str] | None, route: str, ok: bool
) -> None:
    match: dict[str, Any] = {"gpu_memory_gb": {"max": 4}}
    if isolation is not None:
        match["isolation"] = isolation
    report = validate(policy(rule("r", route, **match), rule("rest")), fleet())
    assert report.ok is ok, report.describe()
    if not ok:
        assert "isolation, but the rule matches jobs that ask for" in messages(report.errors)


def test_a_fallback_weaker_than_the_rule_is_refused_too() -> None:
    rules = policy(rule("r", "slurm-a slurm/mig", "k8s-a k8s/timeslice", isolation="hardware"), rule("rest"))
    (error,) = validate(rules, fleet()).errors
    assert error.field == "rules.0.fallbacks.0"
    assert error.message.startswith("fallback 1 k8s-a k8s/timeslice gives none isolation")


def test_a_shadowed_rule_is_refused() -> None:
    loaded = from_yaml(
        """
        rules:
          - name: all-training
            match: {kind: training}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
          - name: big-nlp-training
            match: {kind: training, gpus: {min: 4}, labels: {team: nlp}}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
          - name: rest
            match: {}
            route: {cluster: slurm-a, sharing: slurm/exclusive}
        """
    )
    report = validate(loaded, fleet())
    (error,) = report.errors
    assert (error.rule_name, error.line) == ("big-nlp-training", 5)
    assert "never matches: every job it matches is taken first by rule 1 'all-training', line 2" in error.message


@pytest.mark.parametrize(
    ("earlier", "later", "shadowed"),
    [
        ({"gpu_memory_gb": {"max": 20}}, {"gpu_memory_gb": {"min": 1, "max": 10}}, True),
        ({"gpu_memory_gb": {"max": 20}}, {"gpu_memory_gb": {"max": 40}}, False),  # wider: takes 21-40 GB jobs
        ({"gpu_memory_gb": {"max": 20}}, {}, False),  # takes jobs that state no memory
        ({"gpus": {"min": 1}}, {}, True),  # every job has at least one GPU
        ({"gpus": {"max": 2}}, {"gpus": {"min": 2, "max": 2}}, True),
        ({"kind": ["training", "batch"]}, {"kind": "batch", "isolation": "none"}, True),
        ({"kind": ["training", "inference", "batch"]}, {}, True),
        ({"kind": "training"}, {"kind": ["training", "batch"]}, False),
        ({"isolation": ["none", "process"]}, {}, False),
        ({"tenant": ["acme", "globex"]}, {"tenant": "acme"}, True),
        ({"tenant": "acme"}, {}, False),
        ({"labels": {"team": "nlp"}}, {"labels": {"team": "nlp", "env": "prod"}}, True),
        ({"labels": {"team": "nlp", "env": "prod"}}, {"labels": {"team": "nlp"}}, False),
        ({"labels": {"team": "nlp"}}, {"labels": {"team": "vision"}}, False),
    ],
)
def test_shadowing_is_judged_key_by_key(earlier: dict, later: dict, shadowed: bool) -> None:
    rules = policy(rule("earlier", **earlier), rule("later", **later), rule("rest"))
    report = validate(rules, fleet())
    found = [e for e in report.errors if e.rule_name == "later" and "never matches" in e.message]
    assert bool(found) is shadowed, report.describe()


def test_a_catch_all_before_the_end_shadows_every_later_rule() -> None:
    rules = policy(rule("everything"), rule("training", kind="training"), rule("inference", kind="inference"))
    report = validate(rules, fleet())
    assert [e.rule_name for e in report.errors] == ["training", "inference"]


def test_no_catch_all_is_a_warning_not_an_error() -> None:
    report = validate(policy(rule("training", kind="training")), fleet())
    assert report.ok
    (warning,) = report.warnings
    assert "no rule matches every job" in warning.message
    assert "held" in warning.message


def test_route_to_a_gpu_model_the_cluster_lacks_is_refused() -> None:
    h100 = policy(
        {"name": "a", "match": {}, "route": {"cluster": "k8s-a", "sharing": "k8s/exclusive", "gpu_model": "H100"}}
    )
    assert "'k8s-a' has no H100-SXM5-80GB GPUs (it has A100-SXM4-40GB, L40S, T4)" in messages(
        validate(h100, fleet()).errors
    )


def test_memory_no_gpu_of_the_mode_has_is_refused() -> None:
    huge = policy(rule("huge", "k8s-a k8s/exclusive", gpu_memory_gb={"min": 60}), rule("rest"))
    assert "no k8s/exclusive unit on 'k8s-a' has more than 48 GB" in messages(validate(huge, fleet()).errors)


def test_time_slicing_without_a_memory_bound_warns_of_oom_kills() -> None:
    unbounded = policy(rule("shared", "k8s-a k8s/timeslice", isolation="none"), rule("rest"))
    report = validate(unbounded, fleet())
    assert report.ok
    assert "OOM" in messages(report.warnings)


def test_a_cluster_that_did_not_answer_is_checked_for_all_but_its_inventory() -> None:
    silent = {"slurm-a": cluster_view("slurm-a", "slurm", None), "k8s-a": cluster_view("k8s-a", "k8s", k8s_units())}
    default = load_policy((POLICIES / "default.yaml").read_text(), "default.yaml")
    report = validate(default, silent)
    assert report.ok, report.describe()
    assert "'slurm-a' did not report its inventory" in messages(report.warnings)
    weak = policy(rule("r", "slurm-a slurm/mps", isolation="hardware", gpu_memory_gb={"max": 4}), rule("rest"))
    assert "gives process isolation" in messages(validate(weak, silent).errors)


def test_a_report_with_errors_raises_for_apply() -> None:
    report = validate(policy(rule("r", "nowhere slurm/exclusive")), fleet())
    with pytest.raises(InvalidRequest) as info:
        report.raise_if_invalid()
    assert info.value.details[0]["rule_name"] == "r"
    json.dumps(report.to_dict())


# -- MIG profile choice and cluster views ---------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_memory_gb", "profile"),
    [
        (4, "1g.5gb"),
        (5, "1g.5gb"),  # covers exactly
        (5.5, "1g.10gb"),  # same memory as 2g.10gb, fewer compute slices
        (12, "3g.20gb"),
        (20, "3g.20gb"),
        (21, None),
        (None, "1g.5gb"),
    ],
)
def test_choose_mig_profile_picks_the_smallest_profile_that_covers(gpu_memory_gb: float | None, profile: str) -> None:
    offered = {"3g.20gb": 20, "2g.10gb": 10, "1g.10gb": 10, "1g.5gb": 5}
    assert choose_mig_profile(gpu_memory_gb, offered) == profile


def test_choose_mig_profile_offers_only_what_the_inventory_has() -> None:
    assert choose_mig_profile(4, {}) is None
    assert choose_mig_profile(4, cluster_view("k8s-a", "k8s", k8s_units()).mig_profiles) == "1g.5gb"
    assert choose_mig_profile(6, cluster_view("k8s-a", "k8s", k8s_units()).mig_profiles) == "2g.10gb"


def test_cluster_view_summarises_an_inventory() -> None:
    view = cluster_view("slurm-a", "slurm", slurm_units())
    assert view.sharing == {Sharing.SLURM_EXCLUSIVE, Sharing.SLURM_MIG, Sharing.SLURM_MPS}
    assert dict(view.mig_profiles) == {"1g.5gb": 5, "3g.20gb": 20}
    assert view.largest_gpu_memory_gb == 80
    assert not view.mps_in_mig_mode
    broken = units(
        "slurm-a", "mig-02", "slurm/mig", "A100-SXM4-80GB", 40, 2, mig_profile="3g.40gb", broken="no such MIG"
    )
    assert "3g.40gb" not in cluster_view("slurm-a", "slurm", [*slurm_units(), broken]).mig_profiles
    with pytest.raises(ValueError, match="unknown cluster kind 'lsf'"):
        cluster_view("x", "lsf", [])


# -- the JSON Schema ------------------------------------------------------------------------------


def test_json_schema_is_valid_and_accepts_the_shipped_policies() -> None:
    schema = policy_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for name in SHIPPED:
        document = yaml.safe_load((POLICIES / name).read_text())
        assert list(validator.iter_errors(document)) == [], name
    numeric_label = yaml.safe_load(
        "rules: [{name: a, match: {labels: {tier: 1}}, route: {cluster: x, sharing: slurm/mig}}]"
    )
    assert list(validator.iter_errors(numeric_label)) == []
    typo = {"rules": [{"name": "a", "match": {}, "route": {"cluster": "x", "sharing": "slurm/mgi"}}]}
    assert list(validator.iter_errors(typo))
    extra = {
        "rules": [{"name": "a", "match": {"kindd": "training"}, "route": {"cluster": "x", "sharing": "slurm/mig"}}]
    }
    assert list(validator.iter_errors(extra))


def test_json_schema_describes_the_fields_for_editors() -> None:
    schema = policy_json_schema()
    route = schema["$defs"]["Route"]["properties"]
    assert "slurm/mig" in json.dumps(schema["$defs"]["Sharing"])
    assert route["partition"]["description"]
    assert schema["$defs"]["Match"]["properties"]["gpu_memory_gb"]["description"]
    json.dumps(schema)


def test_the_mig_and_lending_sections_name_registered_clusters_and_say_how_to_write_them() -> None:
    text = (POLICIES / "default.yaml").read_text() + textwrap.dedent(
        """
        mig: {automatic: true, every: 10m, clusters: [slurm-a, nosuch], quiet_hours: ["22:00-06:00"]}
        lending:
          - {nodes: [lend-*], clusters: [slurm-a, elsewhere], hold: 30m, minimum: {slurm-a: 1}}
        """
    )
    loaded = load_policy(text, "p.yaml")
    assert (loaded.mig.every, loaded.lending[0].hold, loaded.lending[0].holds("lend-07")) == (600, 1800, True)
    report = validate(loaded, fleet("slurm", "k8s"))
    assert "mig.clusters names 'nosuch', which is not registered" in messages(report.errors)
    assert "lending pool 1 names cluster 'elsewhere', which is not registered" in messages(report.errors)
    bad = refused(
        """
        rules: [{name: all, match: {}, route: {cluster: slurm-a, sharing: slurm/exclusive}}]
        mig: {every: ten, quiet_hours: ["25:00-01:00"]}
        lending: [{nodes: [x], clusters: [a, a]}]
        """
    )
    assert "'ten' is not a duration" in str(bad)
    assert 'is not a window: write "HH:MM-HH:MM" in UTC' in str(bad)
    assert "joins two clusters, not a with itself" in str(bad)


def test_a_lending_pool_sets_nodes_up_only_on_kubernetes() -> None:
    text = (POLICIES / "default.yaml").read_text() + textwrap.dedent(
        """
        lending:
          - nodes: [lend-*]
            clusters: [slurm-a, k8s-a]
            setup:
              k8s-a: {device_plugin: time-sliced-4, mig: all-disabled}
              slurm-a: {mig: all-1g.5gb}
        """
    )
    loaded = load_policy(text, "p.yaml")
    assert loaded.lending[0].setup["k8s-a"].labels() == {"device_plugin": "time-sliced-4", "mig": "all-disabled"}
    report = validate(loaded, fleet("slurm", "k8s"))
    assert "sets nodes up on slurm-a, a slurm cluster, but only Kubernetes" in messages(report.errors)
    assert "remove setup.slurm-a" in messages(report.errors)
    # MIG off on Kubernetes with no way back to Slurm's layout: a warning saying what to add
    assert "add mig_on_leave" in messages(report.warnings)
    for setup, why in (
        ("{c: {device_plugin: ts}}", "setup name the pool's clusters (a, b), not c"),
        ('{a: {device_plugin: "no spaces"}}', "'no spaces' is not a config name"),
        ("{a: {replicas: 4}}", "replicas"),
    ):
        bad = refused(
            f"""
            rules: [{{name: all, match: {{}}, route: {{cluster: slurm-a, sharing: slurm/exclusive}}}}]
            lending: [{{nodes: [x], clusters: [a, b], setup: {setup}}}]
            """
        )
        assert why in str(bad), str(bad)
