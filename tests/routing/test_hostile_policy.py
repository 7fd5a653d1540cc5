"""A hostile policy (issue 14) at the API and the command line: an alias bomb or a
policy nested thousands deep is refused at once, in a few hundred bytes, by any user
token, without the broker growing; never a 500 or a traceback."""

from __future__ import annotations

import json
import re
import time
import tracemalloc

import pytest

from broker.core.yamltext import MAX_ALIAS_NODES, MAX_DEPTH
from tests.core.test_yamltext import laughs, nested

VALIDATE = "/v1/policy:validate"


def refused_quickly(http, text: str) -> dict:
    """POST the policy as a plain user; the error body, checked to be small and to
    have come back fast without the process growing."""
    client = http()
    client.post(VALIDATE, json={"text": "rules: []"})  # the first request opens what every request needs
    tracemalloc.start()
    started = time.monotonic()
    try:
        response = client.post(VALIDATE, json={"text": text, "source": "bomb.yaml"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 5
    assert peak < 20 * 1024 * 1024, f"the broker grew by {peak / 2**20:.0f} MiB"
    assert response.status_code == 422, response.text[:300]
    assert len(response.content) < 4000
    return response.json()["error"]


def test_the_billion_laughs_is_refused_at_once_without_growing_the_broker(http):
    error = refused_quickly(http, laughs())

    assert error["code"] == "invalid"
    assert (
        f"bomb.yaml, line 6, column 10: aliases (*name) here expand to more than {MAX_ALIAS_NODES:,}"
        in (error["message"])
    )


def test_a_policy_nested_5000_deep_is_refused_by_the_limit_not_a_500(http):
    error = refused_quickly(http, nested(5000))

    # The column is where the parser stopped: libyaml's scanner reads a run of brackets
    # ahead of the events, up to its own limit, before composing counts the 65th.
    assert re.search(rf"bomb\.yaml, line 1, column \d+: nested more than {MAX_DEPTH} levels deep", error["message"])


def test_a_bomb_within_the_alias_budget_still_gets_a_bounded_message(http):
    # 4 levels: about 15,000 nodes through aliases, under the budget; every rule is
    # then a list where a mapping belongs, and no message echoes the lists.
    error = refused_quickly(http, laughs(levels=4))

    assert "rules.0" in error["message"]


def test_a_long_value_in_a_policy_is_echoed_as_an_excerpt(http):
    name = "x" * 1_000_000
    text = f"rules:\n  - name: {name}\n    match: {{}}\n    route: {{cluster: a, sharing: slurm/exclusive}}\n"

    error = http().post(VALIDATE, json={"text": text}).json()["error"]

    assert "rules.0.name = 'xxx" in error["message"] and len(json.dumps(error)) < 2000


def test_thousands_of_errors_are_listed_as_the_first_ones_and_a_count(http):
    rules = "".join(f"  - {{name: r{i}, match: {{}}, route: {{cluster: a, sharing: nope}}}}\n" for i in range(1000))

    error = http().post(VALIDATE, json={"text": "rules:\n" + rules}).json()["error"]

    assert len(error["details"]) == 50 and "... and 950 more errors" in error["message"]


@pytest.mark.parametrize("depth", [5000, 100_000])
def test_a_deeply_nested_json_body_is_a_4xx(http, depth):
    raw = b'{"text": ' + b"[" * depth + b"]" * depth + b"}"
    response = http().post(VALIDATE, content=raw, headers={"Content-Type": "application/json"})

    assert 400 <= response.status_code < 500, response.text[:300]


def test_gpush_policy_validate_exits_2_on_the_billion_laughs(gpush, tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(laughs())

    result = gpush("policy", "validate", bomb)

    assert result.code == 2, result.err[-500:]
    assert f"more than {MAX_ALIAS_NODES:,} nodes" in result.err and len(result.err) < 2000


def test_gpush_policy_validate_exits_2_on_a_policy_nested_5000_deep(gpush, tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text(nested(5000))

    result = gpush("policy", "validate", deep)

    assert result.code == 2, result.err[-500:]
    assert "nested more than" in result.err and "Traceback" not in result.err
