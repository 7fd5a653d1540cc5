"""The shadowed-rule check at scale (issue 14): the indexed check finds exactly the
rules, and the earlier rule that takes their jobs, that comparing every pair of rules
found; a policy at the rule cap validates; one over it is refused with what to do,
through the API, the CLI and `gpush simulate`."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from broker.core.errors import InvalidRequest
from broker.core.schemas import Isolation, Kind
from broker.routing import rules as policy_rules
from broker.routing.policy import Match, Policy, cluster_view, load_policy, validate
from broker.routing.rules import MAX_RULES
from broker.routing.shadowing import shadowed_by

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "examples" / "fleet.yaml"
WORKLOAD = ROOT / "examples" / "workload.yaml"
ROUTE = {"cluster": "slurm-a", "sharing": "slurm/exclusive"}


# -- the oracle: the pairwise check as it was before issue 14 ------------------------------


def pairwise_covers(earlier: Match, later: Match) -> bool:
    """Every job ``later`` matches is matched by ``earlier`` (checked key by key)."""
    for key, universe in (("kind", set(Kind)), ("isolation", set(Isolation)), ("tenant", None)):
        wide, narrow = getattr(earlier, key), getattr(later, key)
        if wide is None:
            continue
        if narrow is None:
            if universe is None or not universe <= set(wide):
                return False
        elif not set(narrow) <= set(wide):
            return False
    if earlier.gpus is not None and not earlier.gpus.covers(later.gpus):
        return False
    if earlier.gpu_memory_gb is not None:
        if later.gpu_memory_gb is None or not earlier.gpu_memory_gb.covers(later.gpu_memory_gb):
            return False
    return earlier.labels.items() <= later.labels.items()


def pairwise_shadowed_by(matches: list[Match]) -> list[int | None]:
    return [
        next((position for position in range(index) if pairwise_covers(matches[position], match)), None)
        for index, match in enumerate(matches)
    ]


# -- random small policies, drawn from few values so that rules often cover each other ----


def _some(rng: random.Random, values: list[Any]) -> list[Any] | None:
    # None half the time; otherwise a list, sometimes of every value (which covers a
    # rule that leaves the key out), sometimes with a value twice.
    if rng.random() < 0.5:
        return None
    chosen = rng.sample(values, rng.randint(1, len(values)))
    return chosen + chosen[:1] if rng.random() < 0.1 else chosen


def _range(rng: random.Random, lows: list[Any], highs: list[Any]) -> dict[str, Any] | None:
    if rng.random() < 0.4:
        return None
    low, high = rng.choice(lows), rng.choice(highs)
    if low is not None and high is not None and low > high:
        low, high = high, low
    if low is None and high is None:
        high = highs[-1]
    return {k: v for k, v in (("min", low), ("max", high)) if v is not None}


def random_match(rng: random.Random) -> Match:
    fields: dict[str, Any] = {
        "kind": _some(rng, [k.value for k in Kind]),
        "isolation": _some(rng, [i.value for i in Isolation]),
        "tenant": _some(rng, ["a", "b", "c"]),
        "gpus": _range(rng, [None, 1, 2, 4], [None, 1, 2, 4, 8]),
        "gpu_memory_gb": _range(rng, [None, 0, 4, 10], [None, 4, 10, 20, 80]),
        "labels": {key: rng.choice("12") for key in ("team", "tier", "zone") if rng.random() < 0.3},
    }
    return Match.model_validate({k: v for k, v in fields.items() if v is not None})


def random_policies(count: int, seed: int) -> list[list[Match]]:
    rng = random.Random(seed)
    return [[random_match(rng) for _ in range(rng.randint(1, 14))] for _ in range(count)]


def test_the_indexed_check_finds_what_comparing_every_pair_found() -> None:
    shadowed = unshadowed = 0
    for matches in random_policies(600, seed=14):
        expected = pairwise_shadowed_by(matches)
        assert shadowed_by(matches) == expected, [m.model_dump(exclude_defaults=True) for m in matches]
        shadowed += sum(1 for e in expected if e is not None)
        unshadowed += sum(1 for e in expected if e is None)
    # The corpus exercises both answers, and often.
    assert shadowed > 500 and unshadowed > 500


def test_validate_reports_the_same_shadowed_rules_as_before() -> None:
    views = {"slurm-a": cluster_view("slurm-a", "slurm", None)}
    for matches in random_policies(150, seed=41):
        policy = Policy.model_validate(
            {
                "rules": [
                    {"name": f"r{n}", "match": m.model_dump(exclude_defaults=True, mode="json"), "route": ROUTE}
                    for n, m in enumerate(matches)
                ]
            }
        )
        report = validate(policy, views)
        found = [
            (f.rule, int(re.search(r"taken first by rule (\d+) 'r(\d+)'", f.message).group(1)) - 1)
            for f in report.errors
            if f.message.startswith("never matches")
        ]
        expected = [(n, e) for n, e in enumerate(pairwise_shadowed_by(matches)) if e is not None]
        assert found == expected


# -- the rule cap --------------------------------------------------------------------------


def rule(index: int, **match: Any) -> dict[str, Any]:
    kinds = [k.value for k in Kind]
    match = {"tenant": f"team-{index}", "kind": kinds[index % 3], "gpus": {"max": 1 + index % 8}, **match}
    return {"name": f"rule-{index:05d}", "match": match, "route": ROUTE}


def test_a_policy_at_the_rule_cap_validates() -> None:
    # Built from data: PyYAML's reader would spend most of this test on the text.
    rules = [rule(n) for n in range(MAX_RULES - 2)]
    rules.append(rule(MAX_RULES - 2, tenant="team-0", kind="training", gpus={"max": 1}))  # inside rule 1
    rules.append({"name": "everything-else", "match": {}, "route": ROUTE})
    policy = Policy.model_validate({"rules": rules})

    report = validate(policy, {"slurm-a": cluster_view("slurm-a", "slurm", None)})

    assert report.rules == MAX_RULES
    assert [(f.rule, f.message.split(";")[0]) for f in report.errors] == [
        (
            MAX_RULES - 2,
            "never matches: every job it matches is taken first by rule 1 'rule-00000' (kind=[training], "
            "tenant=[team-0], gpus max 1)",
        )
    ]


def test_a_policy_over_the_rule_cap_is_refused_saying_how_many_and_what_to_do() -> None:
    rules = [{"name": f"r{n}", "match": {}, "route": ROUTE} for n in range(MAX_RULES + 1)]

    with pytest.raises(ValueError) as refused:
        Policy.model_validate({"rules": rules})

    message = str(refused.value)
    assert f"the policy has {MAX_RULES + 1:,} rules, more than the {MAX_RULES:,} a policy may hold" in message
    assert "one rule with lists (tenant: [team-a, team-b]" in message and "split" in message


@pytest.fixture
def small_cap(monkeypatch) -> int:
    """A cap of 3 rules for the tests of the API, the CLI and simulate: the cap is
    checked where the policy's model is built, which all of them go through, and
    reading a policy of 10,001 rules of YAML takes PyYAML seconds."""
    monkeypatch.setattr(policy_rules, "MAX_RULES", 3)
    return 3


def over_cap(tmp_path: Path, cap: int) -> Path:
    path = tmp_path / "big.yaml"
    path.write_text(
        "rules:\n" + "".join(f"  - {{name: r{n}, match: {{tenant: t{n}}}, route: {ROUTE}}}\n" for n in range(cap + 1))
    )
    return path


def test_over_the_cap_the_loader_says_where_and_what_to_do(small_cap: int, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as refused:
        load_policy(over_cap(tmp_path, small_cap).read_text(), "big.yaml")

    assert str(refused.value).startswith(
        "big.yaml, line 2, column 3: rules: the policy has 4 rules, more than the 3 a policy may hold: merge rules"
    )


def test_over_the_cap_the_api_refuses_validate_for_any_user(http, small_cap: int, tmp_path: Path) -> None:
    text = over_cap(tmp_path, small_cap).read_text()

    response = http(role="user").post("/v1/policy:validate", json={"text": text, "source": "big.yaml"})

    assert response.status_code == InvalidRequest.http_status == 422
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert "the policy has 4 rules, more than the 3 a policy may hold" in error["message"]


def test_over_the_cap_the_cli_refuses_validate_and_simulate(gpush, small_cap: int, tmp_path: Path) -> None:
    path = over_cap(tmp_path, small_cap)

    validated = gpush("policy", "validate", path)
    simulated = gpush("simulate", "--fleet", FLEET, "--workload", WORKLOAD, "--policy", path, "--report", tmp_path)

    for result in (validated, simulated):
        assert result.code == 2, result.err
        assert "the policy has 4 rules, more than the 3 a policy may hold" in result.err
