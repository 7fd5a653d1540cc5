"""A cluster's nodes as gpush changes them: fenced by a cordon (NodeFencer), and labelled for the
GPU Operator when a lent node is set up (NodeConfigurer).

:class:`NodeFencing` cordons a node and notes the reason in its ``gpush.io/fenced`` annotation;
``fenced`` lists only those, and ``unfence`` never lifts a cordon someone else set
(adapters.k8s.mig names the annotations). :class:`NodeSetup` sets the device plugin's config
label and the MIG manager's ``nvidia.com/mig.config``, and reads back whether the node has them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.k8s.context import KubeContext
from adapters.k8s.mig import FENCED_ANNOTATION, FENCED_OVER_CORDON, MIG_CONFIG_LABEL, MIG_STATE_LABEL
from adapters.k8s.render import DEVICE_PLUGIN_CONFIG


class NodeFencing:
    """gpush's cordons on one cluster (NodeFencer)."""

    def __init__(self, ctx: KubeContext):
        self.ctx = ctx

    def fence(self, node: str, reason: str) -> None:
        """Cordon ``node`` (``spec.unschedulable``, as ``kubectl cordon``) and record ``reason`` in its
        ``gpush.io/fenced`` annotation: no new Pod lands there, Pods running there go on. NodeFencing a
        fenced node again only updates the reason. A node someone had cordoned already is marked so
        (``gpush.io/fenced-over-cordon``), and unfencing it leaves their cordon in place."""
        found = self.ctx.node(node)
        annotations = (found.get("metadata") or {}).get("annotations") or {}
        cordoned = bool((found.get("spec") or {}).get("unschedulable"))
        if cordoned and annotations.get(FENCED_ANNOTATION) == reason:
            return
        marks = {FENCED_ANNOTATION: reason}
        if cordoned and FENCED_ANNOTATION not in annotations:
            marks[FENCED_OVER_CORDON] = "true"
        body = {"metadata": {"annotations": marks}, "spec": {"unschedulable": True}}
        self.ctx.client.patch("nodes", None, node, body)

    def unfence(self, node: str) -> None:
        """Drop gpush's fence: its annotations go and the node is uncordoned, unless someone had
        cordoned it before gpush fenced it. A node gpush did not fence is left as it is (cordoned
        or not: someone else's cordon is not gpush's to lift)."""
        found = self.ctx.node(node)
        annotations = (found.get("metadata") or {}).get("annotations") or {}
        if FENCED_ANNOTATION not in annotations:
            return
        body: dict[str, Any] = {"metadata": {"annotations": {FENCED_ANNOTATION: None, FENCED_OVER_CORDON: None}}}
        if annotations.get(FENCED_OVER_CORDON) != "true":
            body["spec"] = {"unschedulable": None}  # what kubectl uncordon leaves: the field unset
        self.ctx.client.patch("nodes", None, node, body)

    def fenced(self) -> dict[str, str]:
        """The nodes gpush fenced, with their reasons (read now, not from the node cache, so a
        fence just set is in the answer); nodes only someone else cordoned are not."""
        nodes, _ = self.ctx.client.list("nodes")
        out = {}
        for found in nodes:
            meta = found.get("metadata") or {}
            reason = (meta.get("annotations") or {}).get(FENCED_ANNOTATION)
            if reason is not None:
                out[str(meta.get("name"))] = reason
        return out


class NodeSetup:
    """Setting a lent node up for the GPU Operator (NodeConfigurer)."""

    def __init__(self, ctx: KubeContext):
        self.ctx = ctx

    def configure_node(self, node: str, setup: Mapping[str, str]) -> None:
        """Label ``node`` as the GPU Operator reads it: ``nvidia.com/device-plugin.config=<device_plugin>``
        (the device plugin's config key: time-slicing replicas, MPS) and, with ``mig``,
        ``nvidia.com/mig.config=<mig>`` with the MIG manager's state ``pending`` (``all-disabled``
        makes whole GPUs of a MIG node). Labels already so are not touched."""
        labels = (self.ctx.node(node).get("metadata") or {}).get("labels") or {}
        patch: dict[str, str] = {}
        if setup.get("device_plugin") and labels.get(DEVICE_PLUGIN_CONFIG) != setup["device_plugin"]:
            patch[DEVICE_PLUGIN_CONFIG] = setup["device_plugin"]
        if setup.get("mig") and labels.get(MIG_CONFIG_LABEL) != setup["mig"]:
            patch.update({MIG_CONFIG_LABEL: setup["mig"], MIG_STATE_LABEL: "pending"})
        if patch:
            self.ctx.client.patch("nodes", None, node, {"metadata": {"labels": patch}})

    def node_configured(self, node: str, setup: Mapping[str, str]) -> bool | None:
        """Whether ``node`` has ``setup``: its labels say it, and the MIG manager reports
        ``success`` for the ``mig`` config (``failed``: False; still at work: None)."""
        labels = (self.ctx.node(node).get("metadata") or {}).get("labels") or {}
        if setup.get("device_plugin") and labels.get(DEVICE_PLUGIN_CONFIG) != setup["device_plugin"]:
            return None
        if setup.get("mig"):
            if labels.get(MIG_CONFIG_LABEL) != setup["mig"]:
                return None
            state = labels.get(MIG_STATE_LABEL)
            if state == "failed":
                return False
            if state != "success":
                return None
        return True
