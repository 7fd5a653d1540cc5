"""The sections of a routing policy that change the fleet: MIG layouts that follow the
queue (``mig:``) and nodes two clusters share, lent as their queues call for it
(``lending:``).

This module owns their format: :class:`MigLayouts` and :class:`LendingPool`, with the
:class:`NodeSetup` a cluster gives a node that moves to it. broker.fleet acts on them
(its MIG changes and node moves) and broker.routing.validation checks the clusters they
name; the policy that holds them, its rules and loading it from YAML are
broker.routing.rules.
"""

from __future__ import annotations

import fnmatch
import re
from datetime import UTC
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from broker.core.spec_values import parse_seconds

Seconds = Annotated[int, BeforeValidator(parse_seconds)]
_QUIET_RE = re.compile(r"([01][0-9]|2[0-3]):[0-5][0-9]-([01][0-9]|2[0-3]):[0-5][0-9]")


def _quiet_window(value: Any) -> Any:
    if not isinstance(value, str) or not _QUIET_RE.fullmatch(value.strip()):
        raise ValueError(
            f'{value!r} is not a window: write "HH:MM-HH:MM" in UTC, hours 00-23 and minutes 00-59, '
            'such as "22:00-06:00"'
        )
    return value.strip()


class MigLayouts(BaseModel):
    """MIG layouts that follow the queue (broker.fleet.mig_changes). Without this section a
    layout changes only when an admin runs ``gpush mig apply``.

    With ``automatic``, the scheduler plans every ``every`` seconds as ``gpush mig plan``
    does and changes the GPUs the plan re-cuts, outside ``quiet_hours`` (UTC windows such
    as ``"08:00-18:00"``; one that ends before it starts runs over midnight) and never a
    GPU changed less than ``min_interval`` ago. ``max_reconfiguring`` GPUs change at once,
    whoever asked; a change waits ``wait_for_jobs`` for the work on the instances it
    destroys to end, and each later step has ``step_timeout`` before it rolls back."""

    model_config = ConfigDict(extra="forbid")

    automatic: bool = Field(False, description="the scheduler applies the MIG plan itself")
    every: Seconds = Field(600, ge=60, le=86_400, description="seconds between two plans of the automatic mode")
    clusters: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=1000, description="the clusters it may change; empty: every one"
    )
    max_reconfiguring: int = Field(2, ge=1, le=10_000, description="GPUs changing their layout at once")
    min_interval: Seconds = Field(
        3600, ge=0, le=7 * 86_400, description="least seconds between two automatic changes of one GPU"
    )
    quiet_hours: list[Annotated[str, BeforeValidator(_quiet_window)]] = Field(
        default_factory=list, max_length=24, description='UTC windows "HH:MM-HH:MM" when no automatic change starts'
    )
    wait_for_jobs: Seconds = Field(
        3600, ge=60, le=7 * 86_400, description="seconds a change waits for the work on its instances to end"
    )
    step_timeout: Seconds = Field(
        600, ge=30, le=86_400, description="seconds each later step may take before the change rolls back"
    )
    repartition_busy: bool = Field(False, description="also re-cut GPUs with work on instances the change keeps")

    def quiet(self, moment: Any) -> bool:
        """Whether ``moment`` (an aware datetime) falls in one of the quiet hours (UTC)."""
        minute = moment.astimezone(UTC).hour * 60 + moment.astimezone(UTC).minute
        for window in self.quiet_hours:
            start, end = (int(t[:2]) * 60 + int(t[3:]) for t in window.split("-"))
            if (start <= minute < end) if start <= end else (minute >= start or minute < end):
                return True
        return False


_CONFIG_NAME = r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"  # a Kubernetes label value


class NodeSetup(BaseModel):
    """How a cluster sets a lent node's GPUs up when the node moves there (the GPU Operator's
    configs on Kubernetes, by name): its sharing while that cluster has it."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("device_plugin", "mig", "mig_on_leave", mode="before")
    @classmethod
    def _config_name(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.match(_CONFIG_NAME, value):
            raise ValueError(
                f"{value!r} is not a config name: the name of a key in the GPU Operator's ConfigMap, a Kubernetes "
                "label value (letters, digits, - _ ., at most 63, starting and ending with a letter or digit)"
            )
        return value

    device_plugin: str | None = Field(
        None,
        pattern=_CONFIG_NAME,
        description="the device plugin config (nvidia.com/device-plugin.config): time-slicing replicas or MPS",
    )
    mig: str | None = Field(
        None,
        pattern=_CONFIG_NAME,
        description="the MIG manager config (nvidia.com/mig.config); all-disabled makes whole GPUs",
    )
    mig_on_leave: str | None = Field(
        None,
        pattern=_CONFIG_NAME,
        description="the MIG manager config that gives the node back as the other cluster has it "
        "(the layout Slurm's gres.conf names), applied once the node is empty here, before it leaves",
    )

    def labels(self) -> dict[str, str]:
        """What the node takes when it moves to this cluster."""
        return {k: v for k, v in (("device_plugin", self.device_plugin), ("mig", self.mig)) if v}

    def leaving(self) -> dict[str, str]:
        """What the node takes before it leaves this cluster."""
        return {"mig": self.mig_on_leave} if self.mig_on_leave else {}


class LendingPool(BaseModel):
    """Nodes that both of ``clusters`` list (slurmd and a kubelet on one machine), offered by
    one of them at a time and lent to the other as the queues call for it
    (broker.placement.lending). The first cluster is their home: it offers them until the
    other's waiting work exceeds its own by ``threshold`` GPU-equivalents."""

    model_config = ConfigDict(extra="forbid")

    nodes: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        min_length=1, max_length=1000, description="node names or globs (lend-*) that both clusters list"
    )
    clusters: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        min_length=2, max_length=2, description="the two clusters: home first"
    )
    minimum: dict[str, Annotated[int, Field(ge=0, le=100_000)]] = Field(
        default_factory=dict, description="nodes each cluster keeps at least"
    )
    maximum: dict[str, Annotated[int, Field(ge=0, le=100_000)]] = Field(
        default_factory=dict, description="nodes each cluster holds at most"
    )
    hold: Seconds = Field(1800, ge=0, le=7 * 86_400, description="seconds a node stays where it moved")
    threshold: float = Field(
        2.0, gt=0, le=1_000_000, description="GPU-equivalents of waiting work one side needs over the other"
    )
    max_moving: int = Field(2, ge=1, le=10_000, description="moves under way at once")
    setup: dict[str, NodeSetup] = Field(
        default_factory=dict,
        description="per cluster, how it sets a node up when the node moves there (its sharing: "
        "time-slicing replicas, MPS, a MIG layout); a cluster not named takes the node as it is",
    )

    @model_validator(mode="after")
    def _two_clusters(self) -> LendingPool:
        if self.clusters[0] == self.clusters[1]:
            raise ValueError(f"a lending pool joins two clusters, not {self.clusters[0]} with itself")
        unknown = sorted((set(self.minimum) | set(self.maximum) | set(self.setup)) - set(self.clusters))
        if unknown:
            raise ValueError(
                f"minimum, maximum and setup name the pool's clusters ({', '.join(self.clusters)}), "
                f"not {', '.join(unknown)}"
            )
        return self

    def holds(self, node: str) -> bool:
        return any(fnmatch.fnmatchcase(node, pattern) for pattern in self.nodes)
