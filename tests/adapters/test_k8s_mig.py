"""The pure part of MIG layouts on Kubernetes (adapters.k8s.mig): gpush's mig-parted config per
node, merged into the MIG manager's ConfigMap, and what the node's labels say of its layout."""

from __future__ import annotations

import pytest
import yaml

from adapters.k8s.mig import (
    MIG_CONFIG_LABEL,
    MIG_STATE_LABEL,
    MigConfigError,
    caught_up,
    config_names,
    current_layouts,
    instances_of,
    label_totals,
    merge_config,
    next_config_name,
    parse_configs,
    render_entries,
    resolve,
    spread_counts,
)
from broker.core.gpus import gpu_model

A100 = gpu_model("A100-SXM4-40GB")

# As the GPU Operator ships it (abridged), with a comment and a flow-style config.
OPERATOR_CONFIG = """\
version: v1
mig-configs:
  # MIG off everywhere
  all-disabled:
    - devices: all
      mig-enabled: false

  all-1g.5gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 7
  # two halves
  all-3g.20gb: [{devices: all, mig-enabled: true, mig-devices: {"3g.20gb": 2}}]
"""

OTHERS = {
    "all-disabled": "  # MIG off everywhere\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n",
    "all-1g.5gb": (
        '  all-1g.5gb:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        "1g.5gb": 7\n'
    ),
    "all-3g.20gb": '  # two halves\n  all-3g.20gb: [{devices: all, mig-enabled: true, mig-devices: {"3g.20gb": 2}}]\n',
}


def test_a_new_node_config_is_added_and_every_other_config_keeps_its_text():
    entries = render_entries({0: {"1g.5gb": 7}, 1: {"3g.20gb": 2}, 2: {"1g.5gb": 7}, 3: None})
    merged = merge_config(OPERATOR_CONFIG, "gpush-a100-0", entries)
    assert merged.startswith(OPERATOR_CONFIG)  # appended after the last config, nothing else touched
    for text in OTHERS.values():
        assert text in merged
    configs = parse_configs(merged, "test")
    assert resolve(configs["gpush-a100-0"], 4) == {0: {"1g.5gb": 7}, 1: {"3g.20gb": 2}, 2: {"1g.5gb": 7}, 3: None}
    # GPUs of one layout share an entry, as broker.mig.config renders them.
    assert [e["devices"] for e in configs["gpush-a100-0"]] == [[0, 2], [1], [3]]


def test_publishing_again_writes_the_other_name_and_drops_the_first_keeping_the_rest():
    first, second = config_names("a100-0")
    once = merge_config(OPERATOR_CONFIG, first, render_entries({0: {"3g.20gb": 2}}))
    # A config of the admin's after gpush's, so gpush's is in the middle of the file.
    once += '  admin-own:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {"7g.40gb": 1}\n'
    twice = merge_config(once, second, render_entries({0: {"7g.40gb": 1}}), drop=[first])
    configs = parse_configs(twice, "test")
    assert first not in configs
    assert resolve(configs[second], 1) == {0: {"7g.40gb": 1}}
    assert list(configs) == ["all-disabled", "all-1g.5gb", "all-3g.20gb", "admin-own", second]
    for text in [*OTHERS.values(), "  admin-own:\n    - devices: [0]\n"]:
        assert text in twice
    # Replacing the name in place keeps its position.
    again = merge_config(twice, second, render_entries({0: None}))
    assert list(parse_configs(again, "test")) == list(configs)
    assert resolve(parse_configs(again, "test")[second], 1) == {0: None}


def test_a_missing_or_empty_config_file_becomes_one_with_gpushs_config_alone():
    for text in (None, "", "version: v1\nmig-configs: {}\n"):
        merged = merge_config(text, "gpush-n", render_entries({0: {}}))
        assert yaml.safe_load(merged) == {
            "version": "v1",
            "mig-configs": {"gpush-n": [{"devices": [0], "mig-enabled": True, "mig-devices": {}}]},
        }


def test_a_file_that_is_no_mig_parted_config_is_refused_with_where_it_came_from():
    with pytest.raises(MigConfigError, match="ConfigMap x"):
        parse_configs("version: v2\nmig-configs: {}\n", "ConfigMap x")
    with pytest.raises(MigConfigError, match="devices"):
        resolve([{"devices": "some", "mig-enabled": True}], 2, "bad")
    with pytest.raises(MigConfigError, match="mig-devices"):
        resolve([{"devices": [0], "mig-enabled": True, "mig-devices": {"1g.5gb": "seven"}}], 1, "bad")


def test_devices_all_covers_the_nodes_gpus_and_a_later_entry_wins():
    entries = [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"1g.5gb": 7}},
        {"devices": [1], "mig-enabled": False},
    ]
    assert resolve(entries, 3) == {0: {"1g.5gb": 7}, 1: None, 2: {"1g.5gb": 7}}


def test_the_two_names_of_a_node_alternate_and_fit_a_label_value():
    first, second = config_names("a100-0")
    assert (first, second) == ("gpush-a100-0", "gpush-a100-0_2")
    assert next_config_name("a100-0", None) == first
    assert next_config_name("a100-0", "all-3g.20gb") == first
    assert next_config_name("a100-0", first) == second
    assert next_config_name("a100-0", second) == first
    long_node = "gpu-node-" + "x" * 80 + ".example.internal"
    names = config_names(long_node)
    assert all(len(n) <= 63 for n in names) and names[0] != config_names(long_node + "2")[0]


def test_label_counts_are_dealt_over_the_gpus_as_a_node_of_one_layout_has_them():
    assert spread_counts(A100, {"3g.20gb": 4}, 2) == {0: {"3g.20gb": 2}, 1: {"3g.20gb": 2}}
    spread = spread_counts(A100, {"3g.20gb": 2, "2g.10gb": 1, "1g.5gb": 3}, 2)
    assert sum(sum(c.values()) for c in spread.values()) == 6  # totals kept
    # Dealt round-robin, 7g.40gb and a 1g.5gb would share GPU 0, which cannot hold both: first fit.
    assert spread_counts(A100, {"7g.40gb": 1, "1g.5gb": 7}, 2) == {0: {"7g.40gb": 1}, 1: {"1g.5gb": 7}}


def test_label_totals_read_the_mixed_and_the_single_strategy():
    mixed = {"nvidia.com/mig-3g.20gb.count": "2", "nvidia.com/mig-1g.5gb.count": "1", "nvidia.com/gpu.count": "1"}
    assert label_totals(mixed) == {"3g.20gb": 2, "1g.5gb": 1}
    single = {
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
        "nvidia.com/gpu.count": "14",
    }
    assert label_totals(single) == {"1g.5gb": 14}


def test_the_current_layout_comes_from_gpushs_config_else_an_applied_one_else_the_labels():
    configs = parse_configs(merge_config(OPERATOR_CONFIG, "gpush-n", render_entries({0: {"7g.40gb": 1}})), "t")
    labels = {"nvidia.com/mig-3g.20gb.count": "4", "nvidia.com/gpu.count": "2"}
    own = config_names("n")
    # gpush's own config holds what gpush asked for the GPUs, even while it failed on another.
    layouts, where = current_layouts(
        {**labels, MIG_CONFIG_LABEL: "gpush-n", MIG_STATE_LABEL: "failed"}, configs, A100, 2, own
    )
    assert (layouts, where) == ({0: {"7g.40gb": 1}}, "mig-parted config gpush-n")
    # Another config counts once the MIG manager applied it.
    applied = {**labels, MIG_CONFIG_LABEL: "all-1g.5gb", MIG_STATE_LABEL: "success"}
    assert current_layouts(applied, configs, A100, 2, own)[0] == {0: {"1g.5gb": 7}, 1: {"1g.5gb": 7}}
    pending = {**applied, MIG_STATE_LABEL: "pending"}
    assert current_layouts(pending, configs, A100, 2, own) == (
        {0: {"3g.20gb": 2}, 1: {"3g.20gb": 2}},
        "the node's nvidia.com/mig-<profile>.count labels",
    )


def test_the_device_plugin_has_caught_up_when_allocatable_counts_are_the_configs():
    layouts = {0: {"1g.5gb": 7}, 1: {"3g.20gb": 2}}
    now = {"nvidia.com/gpu": "0", "nvidia.com/mig-1g.5gb": "7", "nvidia.com/mig-3g.20gb": "2"}
    assert caught_up(layouts, now, every_gpu=True)
    before = {"nvidia.com/mig-3g.20gb": "4"}
    assert not caught_up(layouts, before, every_gpu=True)
    # An extra profile the config no longer has: the old layout is still advertised.
    assert not caught_up(layouts, {**now, "nvidia.com/mig-2g.10gb": "1"}, every_gpu=True)
    # Not every GPU in the config: other GPUs may offer more of a profile.
    assert caught_up(layouts, {**now, "nvidia.com/mig-3g.20gb": "4"}, every_gpu=False)


def test_instances_are_answered_as_published_while_the_counts_agree_else_placed():
    published = ["1g.5gb@6", "3g.20gb@0"]
    assert instances_of(A100, {"3g.20gb": 1, "1g.5gb": 1}, published) == ("1g.5gb@6", "3g.20gb@0")
    assert instances_of(A100, {"3g.20gb": 2}, published) == ("3g.20gb@0", "3g.20gb@4")
    assert instances_of(A100, None, None) == ()
    with pytest.raises(ValueError, match="does not know"):
        instances_of(None, {"3g.20gb": 2}, None)
