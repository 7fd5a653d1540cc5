"""The one YAML loader (issue 14): every file gpush reads refuses alias bombs, deep
nesting, cycles and numbers too long to print, at the line and column, with a message
that names the limit and echoes only an excerpt of what was written; real files still
load."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from adapters.k8s.timeslice import replicas_in
from broker.core import yamltext
from broker.core.errors import InvalidRequest
from broker.core.yamltext import (
    EXCERPT_CHARS,
    MAX_ALIAS_NODES,
    MAX_ALIASES,
    MAX_DEPTH,
    excerpt,
    load_yaml,
)
from broker.intake.jobfile import load_documents
from broker.routing.policy import load_policy
from broker.simulation.fleet import load_fleet
from broker.simulation.workload import read_workload

ROOT = Path(__file__).resolve().parents[2]


def laughs(levels: int = 9, width: int = 9, *, key: str = "rules") -> str:
    """The billion laughs: each anchor a list of ``width`` aliases to the one before,
    ``key`` set to the last (9 levels of 9: 9**9 strings from about 450 bytes)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\n{key}: *l{levels - 1}\n"


def nested(depth: int, *, key: str = "rules") -> str:
    return f"{key}: " + "[" * depth + "]" * depth + "\n"


def aliases(count: int) -> str:
    """``count`` aliases to one small scalar: many aliases, few nodes."""
    return "a: &a 1\nb: [" + ", ".join(["*a"] * count) + "]\n"


def python_load_yaml(text: str) -> Any:
    """load_yaml as it reads where PyYAML has no libyaml (the pure-Python loader)."""
    return python_load_yaml_all(text, all_documents=False)


def python_load_yaml_all(text: str, *, all_documents: bool = True) -> Any:
    saved = yamltext.BoundedLoader
    yamltext.BoundedLoader = yamltext.PyBoundedLoader
    try:
        return load_yaml(text, source="file.yaml", all_documents=all_documents)
    finally:
        yamltext.BoundedLoader = saved


# Every place gpush reads YAML, each as: text -> whatever it reads (or InvalidRequest).
LOADERS: dict[str, Callable[[str], Any]] = {
    "load_yaml": lambda text: load_yaml(text, source="file.yaml"),
    "load_yaml (pure Python)": python_load_yaml,
    "policy": lambda text: load_policy(text, "file.yaml"),
    "job file": lambda text: load_documents(text, source="file.yaml"),
    "fleet": lambda text: load_fleet(text, "file.yaml"),
    "workload": lambda text: read_workload(text, "file.yaml"),
}


def refusal(load: Callable[[str], Any], text: str) -> str:
    started = time.monotonic()
    with pytest.raises(InvalidRequest) as info:
        load(text)
    assert time.monotonic() - started < 5
    assert len(info.value.message) < 1000
    return info.value.message


@pytest.mark.parametrize("load", LOADERS.values(), ids=LOADERS.keys())
def test_every_loader_refuses_the_billion_laughs_before_building_it(load):
    message = refusal(load, laughs())

    assert "file.yaml, line " in message
    assert f"more than {MAX_ALIAS_NODES:,} nodes" in message


@pytest.mark.parametrize("load", LOADERS.values(), ids=LOADERS.keys())
def test_every_loader_refuses_more_aliases_than_its_budget(load):
    message = refusal(load, aliases(MAX_ALIASES + 1))

    assert f"more than {MAX_ALIASES:,} aliases" in message and "line 2" in message


@pytest.mark.parametrize("load", LOADERS.values(), ids=LOADERS.keys())
def test_every_loader_refuses_deep_nesting_by_its_limit_not_a_traceback(load):
    message = refusal(load, nested(5000))

    assert f"nested more than {MAX_DEPTH} levels deep" in message
    assert "line 1, column" in message


@pytest.mark.parametrize("load", LOADERS.values(), ids=LOADERS.keys())
def test_every_loader_refuses_an_alias_inside_what_it_names(load):
    message = refusal(load, "rules: &loop [a, *loop]\n")

    assert "alias *loop is inside the node it names" in message


@pytest.mark.parametrize("load", LOADERS.values(), ids=LOADERS.keys())
def test_every_loader_refuses_a_number_too_long_to_read_or_print(load):
    # Python raises ValueError (not a YAML error) on an integer of over 4,300 digits.
    message = refusal(load, "rules: " + "7" * 5000 + "\n")

    assert "a number of more than" in message and "line 1, column 8" in message


def test_a_refused_value_is_shown_as_an_excerpt():
    anchor = "x" * 100_000
    message = refusal(LOADERS["load_yaml"], f"a: [*{anchor}]\n")

    # libyaml's composer does not name the alias; PyYAML's names it, cut to an excerpt.
    assert "undefined alias" in message and len(message) < 3 * EXCERPT_CHARS


def test_what_real_files_need_is_well_within_the_limits():
    # Sharing one set of fallbacks across thousands of rules is what aliases are for.
    route = "route: {cluster: a, sharing: slurm/exclusive}"
    first = f"  - {{name: r0, match: {{tenant: t0}}, {route}, fallbacks: &f [{{cluster: b, sharing: k8s/mig}}]}}"
    rules = [f"  - {{name: r{i}, match: {{tenant: t{i}}}, {route}, fallbacks: *f}}" for i in range(1, 2000)]

    policy = load_policy("rules:\n" + "\n".join([first, *rules]) + "\n", "big.yaml")

    assert len(policy.rules) == 2000 and policy.rules[-1].fallbacks[0].cluster == "b"
    assert load_yaml(nested(MAX_DEPTH - 1, key="a"), source="deep.yaml")["a"] is not None


@pytest.mark.parametrize("path", sorted(ROOT.glob("policies/*.yaml")), ids=lambda p: p.name)
def test_the_shipped_policies_still_load(path):
    assert load_policy(path.read_text(), str(path)).rules


@pytest.mark.parametrize("path", sorted(ROOT.glob("examples/*.yaml")), ids=lambda p: p.name)
def test_the_examples_still_load(path):
    text = path.read_text()
    if path.name == "fleet.yaml":
        assert load_fleet(text, str(path)).clusters
    elif path.name == "workload.yaml":
        assert read_workload(text, str(path)).arrivals
    else:
        assert load_documents(text, source=str(path))


def test_the_device_plugin_config_is_read_within_the_limits():
    assert replicas_in(laughs(key="sharing")) is None
    assert replicas_in(nested(5000, key="sharing")) is None
    assert replicas_in("version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}") == 4


def test_the_ray_cluster_config_is_read_within_the_limits(tmp_path):
    from broker.ray.provider import monitor_cluster_config

    bomb = tmp_path / "cluster.yaml"
    bomb.write_text(laughs(key="provider"))
    assert monitor_cluster_config(["monitor", f"--autoscaling-config={bomb}"]) is None
    bomb.write_text("provider: {type: external}\n")
    assert monitor_cluster_config(["monitor", f"--autoscaling-config={bomb}"]) == {"provider": {"type": "external"}}


@pytest.mark.parametrize(
    "value",
    ["y" * 100_000, ["y" * 100_000] * 1000, {"k" * 1000: [[[[["deep"]]]]]}, 10**5000],
    ids=["long string", "long list", "nested", "huge int"],
)
def test_an_excerpt_is_bounded_whatever_the_value(value):
    shown = excerpt(value)

    assert len(shown) <= EXCERPT_CHARS


def test_a_short_value_is_shown_whole():
    assert excerpt("slurm-a") == "'slurm-a'"
    assert excerpt("slurm-a", quote=False) == "slurm-a"


@pytest.mark.parametrize("text", ["rules: [\x1f]", "a: \x00", "\ufffe"])
def test_a_control_character_is_a_clear_refusal_naming_where(text) -> None:
    """yaml's reader refuses these as the loader is made: once a 500 from policy:validate."""
    with pytest.raises(InvalidRequest, match="policy.yaml"):
        load_policy(text, "policy.yaml")
    with pytest.raises(InvalidRequest, match="job.yaml"):
        load_yaml(text, source="job.yaml")


def test_both_loaders_read_every_shipped_file_alike():
    files = sorted([*ROOT.glob("policies/*.yaml"), *ROOT.glob("examples/*.yaml")])
    assert files
    for path in files:
        text = path.read_text()
        assert python_load_yaml_all(text) == load_yaml(text, source=path.name, all_documents=True), path


def test_an_anchor_defined_again_counts_its_new_value():
    # The second &a names a list of 5,000: 30 aliases to it are 150,000 nodes.
    big = "[" + ", ".join(["x"] * 5000) + "]"
    text = f"a: &a 1\nb: &a {big}\nc: [" + ", ".join(["*a"] * 30) + "]\n"

    message = refusal(LOADERS["load_yaml"], text)

    assert f"more than {MAX_ALIAS_NODES:,} nodes" in message


def test_the_garbage_collector_is_back_on_after_a_read_and_a_refusal():
    assert gc.isenabled()
    load_yaml("a: 1\n", source="file.yaml")
    assert gc.isenabled()
    refusal(LOADERS["load_yaml"], laughs())
    assert gc.isenabled()


def test_a_collector_turned_off_by_the_program_stays_off():
    gc.disable()
    try:
        load_yaml("a: 1\n", source="file.yaml")
        assert not gc.isenabled()
    finally:
        gc.enable()
