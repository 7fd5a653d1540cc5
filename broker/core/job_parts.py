"""The parts of a job spec that are models of their own: an elastic job's replicas, how a
job is told of a preemption, how close its GPUs or nodes must be (the spec itself:
:mod:`broker.core.schemas`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from broker.core.spec_values import MAX_GRACE_SECONDS, not_a_bool, parse_grace, short_text

Int = Annotated[int, BeforeValidator(not_a_bool)]


class Elastic(BaseModel):
    """Replica range of an inference job that scales."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min_replicas: Int = Field(1, ge=0, le=10_000)
    max_replicas: Int = Field(1, ge=1, le=10_000)

    @model_validator(mode="after")
    def _ordered(self) -> Elastic:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is more than max_replicas ({self.max_replicas})")
        return self


# Signals a job may ask to be told of a preemption with (broker.core.adapter.PREEMPT_SIGNALS).
PreemptSignal = Literal["SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"]


def checkpoint_text(value: Any) -> Any:
    """``USR1@2m`` (as the CLI's --checkpoint and sbatch --signal write it) as {signal, grace}."""
    if not isinstance(value, str):
        return value
    signal, at, grace = value.strip().partition("@")
    if not signal:
        raise ValueError(f"{short_text(value)}: name the signal first: SIGNAL[@GRACE], such as USR1@2m or TERM")
    return {"signal": signal} | ({"grace": grace} if at and grace else {})


def _signal_name(value: Any) -> Any:
    # USR1, usr1, SIGUSR1 all name one signal; stored as SIGUSR1, as scancel and kill print it.
    if isinstance(value, str):
        text = value.strip().upper()
        return text if text.startswith("SIG") else "SIG" + text
    return value


class Checkpoint(BaseModel):
    """How a job wants to be told of a preemption: ``signal`` first, then ``grace`` seconds
    to save its state and exit before its cluster stops it. Kubernetes tells a container
    only with its stop signal (SIGTERM unless the image says otherwise)."""

    model_config = ConfigDict(extra="forbid")

    signal: Annotated[PreemptSignal, BeforeValidator(_signal_name)] = Field(
        "SIGTERM", description="SIGTERM, SIGINT, SIGHUP, SIGUSR1 or SIGUSR2 (USR1 is read as SIGUSR1)"
    )
    grace: Annotated[int, BeforeValidator(parse_grace)] = Field(
        60, ge=0, le=MAX_GRACE_SECONDS, description="seconds to save state after the signal: 90, 2m, 1m30s"
    )


def topology_text(value: Any) -> Any:
    """``block:required`` or ``nvlink`` (as the CLI's --topology writes it) as {level, mode}."""
    if value is None or isinstance(value, (dict, TopologyAsk)):
        return value
    if not isinstance(value, str):
        raise ValueError("give LEVEL[:required], such as block:required, or {level: block, mode: required}")
    level, _, mode = value.strip().partition(":")
    return {"level": level, "mode": mode or "preferred"}


_LEVEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class TopologyAsk(BaseModel):
    """How close a job's GPUs or nodes must be (broker.core.topology): ``level`` names a
    level inside a node (``nvlink``, ``pcie``, ``socket``) or one of its cluster's network
    levels (``block``, ``rack``, a Slurm tree's ``switch``); ``required``: the job waits
    until it fits within one domain of that level; ``preferred``: as few domains as
    possible now."""

    model_config = ConfigDict(extra="forbid")

    level: str = Field(
        json_schema_extra={"pattern": _LEVEL_PATTERN}, description="nvlink, pcie, socket, or a network level"
    )
    mode: Literal["required", "preferred"] = Field("preferred", description="required | preferred")

    @field_validator("level")
    @classmethod
    def _a_level_name(cls, level: str) -> str:
        if not re.match(_LEVEL_PATTERN, level):
            raise ValueError(
                "name a level: nvlink, pcie or socket (inside a node), or one of the cluster's network levels "
                "such as block or rack (`gpush inventory --topology` lists them); letters, digits, '_', '.' "
                "and '-', at most 63"
            )
        return level
