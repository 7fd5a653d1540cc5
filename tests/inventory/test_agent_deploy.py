"""The node agent as the repository ships it (deploy/): every file a drift finding's fix
names exists, and each is what it claims to be: a systemd unit that runs `gpush agent`,
Kubernetes objects whose every field Kubernetes knows, with the environment the agent
reads and the labels the fix text selects on."""

from __future__ import annotations

import configparser
import re
import shlex
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
import kubernetes.client
import pytest
import yaml

from broker.cli.main import cli
from broker.inventory import wording
from tests.inventory.test_reconcile import (
    NOW,
    agent,
    gpu,
    k8s,
    k8s_units,
    k8s_whole_node,
    recorded_slurm_units,
    run,
    slurm,
    slurm_node,
    slurm_units,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_PATH = re.compile(r"deploy/[\w./-]*\w")


def agent_fixes() -> list[str]:
    """The fix of every finding about an agent that is missing or silent, on both kinds."""
    old = NOW - timedelta(hours=2)
    inventories = [
        run(slurm(recorded_slurm_units())),  # no_agents
        run(k8s(k8s_units(k8s_whole_node("worker-1", 1)))),  # no_agents
        run(
            slurm(slurm_units(slurm_node("gpu09", "gpu:a100:2"), slurm_node("gpu10", "gpu:a100:2"))),
            reports=[agent("gpu09", [gpu(0), gpu(1)])],
        ),  # no_agent_report on gpu10
        run(slurm(slurm_units(slurm_node("gpu11", "gpu:a100:1"))), reports=[agent("gpu11", [gpu(0)], at=old)]),
        run(k8s(k8s_units(k8s_whole_node("worker-2", 1))), reports=[agent("worker-2", [gpu(0)], at=old)]),
    ]
    wanted = {"no_agents", "no_agent_report", "agent_report_stale"}
    fixes = [f.fix for inventory in inventories for f in inventory.findings if f.kind in wanted]
    assert len(fixes) == len(inventories), fixes
    return fixes


def test_the_agent_fixes_name_only_files_the_repository_ships():
    named = {path for fix in agent_fixes() for path in DEPLOY_PATH.findall(fix)}
    assert named == {wording.AGENT_SYSTEMD_UNIT, wording.AGENT_DAEMONSET, "deploy/README.md"}
    for path in named:
        assert (ROOT / path).is_file(), path


def test_a_fix_names_the_way_its_cluster_runs_the_agent():
    slurm_fix = wording.agent_install("slurm", "gpu01")
    k8s_fix = wording.agent_install("k8s", "worker-1")
    assert wording.AGENT_SYSTEMD_UNIT in slurm_fix and wording.AGENT_DAEMONSET not in slurm_fix
    assert f"kubectl apply -f {wording.AGENT_DAEMONSET}" in k8s_fix and wording.AGENT_SYSTEMD_UNIT not in k8s_fix
    assert "systemctl status gpush-agent" in wording.agent_check("slurm", "gpu01")
    assert "spec.nodeName=worker-1" in wording.agent_check("k8s", "worker-1")


# -- the systemd unit ------------------------------------------------------------------


def test_the_systemd_unit_runs_gpush_agent_with_its_settings_from_a_file():
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # systemd's keys are case-sensitive
    unit.read_string((ROOT / wording.AGENT_SYSTEMD_UNIT).read_text())
    assert unit.sections() == ["Unit", "Service", "Install"]
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "gpush" and argv[1] == "agent"
    assert service["EnvironmentFile"].startswith("/")
    assert service["Restart"] == "always"
    # The agent reads the GPU devices and the MPS pipe directory in /tmp.
    assert "PrivateDevices" not in service and "PrivateTmp" not in service and "DynamicUser" not in service
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    agent_options = _agent_options()
    for option in argv[2:]:
        if option.startswith("--"):
            assert option in agent_options, option


# -- the DaemonSet -------------------------------------------------------------------


def daemonset_documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((ROOT / wording.AGENT_DAEMONSET).read_text()))


def test_every_document_of_the_manifest_is_a_kubernetes_object_kubernetes_knows_field_by_field():
    documents = daemonset_documents()
    assert [(d["apiVersion"], d["kind"]) for d in documents] == [("v1", "Namespace"), ("apps/v1", "DaemonSet")]
    for document in documents:
        assert document["metadata"]["name"]
        assert unknown_fields(document, f"V1{document['kind']}") == [], document["kind"]


def test_the_daemonset_runs_gpush_agent_on_gpu_nodes_under_the_node_name():
    namespace, daemonset = daemonset_documents()
    assert daemonset["metadata"]["namespace"] == namespace["metadata"]["name"] == "gpush"
    template = daemonset["spec"]["template"]
    selector = daemonset["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    # The fix text finds the pods by this label.
    key, value = wording.AGENT_SELECTOR.split("=")
    assert template["metadata"]["labels"][key] == value
    (container,) = template["spec"]["containers"]
    assert container["command"][:2] == ["gpush", "agent"]
    env = {e["name"]: e for e in container["env"]}
    assert env["GPUSH_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Each GPUSH_ variable it sets is one gpush reads.
    read = {param.envvar for command in (cli, cli.commands["agent"]) for param in command.params if param.envvar}
    assert {name for name in env if name.startswith("GPUSH_")} <= read
    assert {"GPUSH_URL", "GPUSH_TOKEN", "GPUSH_NODE"} <= set(env)
    # The agent asks the device plugin for no GPU: jobs keep them all.
    assert "nvidia.com/gpu" not in str(container.get("resources", {}))


def test_a_misspelt_field_would_be_caught():
    _namespace, daemonset = daemonset_documents()
    daemonset["spec"]["template"]["spec"]["hostPid"] = True
    assert unknown_fields(daemonset, "V1DaemonSet") == ["spec.template.spec.hostPid"]


def unknown_fields(value: Any, model: str, where: str = "") -> list[str]:
    """The keys of ``value`` that the Kubernetes model ``model`` (and its nested models)
    does not have, as dotted paths. Read from the models of the `kubernetes` client."""
    if match := re.fullmatch(r"(?:list|List)\[(.+)\]", model):
        return [p for i, item in enumerate(value) for p in unknown_fields(item, match.group(1), f"{where}.{i}")]
    if match := re.fullmatch(r"(?:dict\(str, ?(.+)\)|Dict\[str, ?(.+)\])", model):
        inner = match.group(1) or match.group(2)
        return [p for k, item in value.items() for p in unknown_fields(item, inner, f"{where}.{k}")]
    cls = getattr(kubernetes.client, model, None)
    if cls is None:  # str, int, bool, object: no fields of its own
        return []
    by_key = {key: attr for attr, key in cls.attribute_map.items()}
    found = []
    for key, item in value.items():
        path = f"{where}.{key}".lstrip(".")
        if key not in by_key:
            found.append(path)
        else:
            found += unknown_fields(item, cls.openapi_types[by_key[key]], path)
    return found


def _agent_options() -> set[str]:
    command = cli.commands["agent"]
    assert isinstance(command, click.Command)
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


@pytest.mark.parametrize("kind", ["slurm", "k8s", "sim"])
def test_every_kind_of_cluster_gets_a_fix_that_names_a_shipped_file(kind):
    for fix in (wording.agent_install(kind, "n1"), wording.agent_check(kind, "n1")):
        paths = DEPLOY_PATH.findall(fix)
        assert paths and all((ROOT / p).is_file() for p in paths), fix
