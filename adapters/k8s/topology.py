"""A Kubernetes cluster's network topology: the levels its admin names (the ``topology_levels``
setting) and a node's position at them (a :data:`broker.core.topology.Position`).

The setting has the shape of Kueue's Topology object (``spec.levels``, widest first, each a
``nodeLabel``), with a short name for each level that jobs ask for (``topology: {level: rack}``)
and that Kueue's object has no room for:

    topology_levels:
      - {level: block, nodeLabel: cloud.provider.com/topology-block}
      - {level: rack, nodeLabel: cloud.provider.com/topology-rack}

or on the command line ``--config topology_levels=block=cloud.provider.com/topology-block,
rack=cloud.provider.com/topology-rack`` (``LEVEL=LABEL`` pairs, widest first). Checked as Kueue
and Kubernetes check them: each label key a qualified name (``[prefix/]name``, the prefix a
DNS subdomain of at most 253 characters, the name at most 63 of ``A-Z a-z 0-9 - _ .``), no label
and no level name twice, at most :data:`MAX_LEVELS` levels, ``kubernetes.io/hostname`` only as
the last (Kueue's rule). A last level of ``kubernetes.io/hostname`` is allowed and adds nothing:
a domain of one node groups no nodes, and a gang's ranks have a node each already. Level names
may not be those of the levels inside a node (``nvlink``, ``pcie``, ``socket``): a job's
``topology.level`` names either kind.

A node's domain at a level is its label's value; a node without the label, or with an empty
value, has domain None there (for the broker to report as drift; the adapter only says it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from adapters.k8s.render import HOSTNAME_LABEL
from broker.core.topology import GPU_LEVELS, Position

MAX_LEVELS = 8  # Kueue's v1beta1 Topology takes up to 16 levels; gpush at most 8
LEVEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
_KEYS = {"level", "nodeLabel", "label", "node_label"}
EXAMPLE = "block=cloud.provider.com/topology-block,rack=cloud.provider.com/topology-rack"


def label_key_problem(key: str) -> str | None:
    """What Kubernetes would refuse in ``key`` as a label key (a qualified name), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and not prefix:
        return f"node label {key!r} has an empty prefix before '/': write PREFIX/NAME or NAME"
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return (
            f"node label {key!r}: its prefix {prefix!r} must be a DNS subdomain (lowercase letters, digits, "
            "'-' and '.', at most 253 characters), e.g. cloud.provider.com"
        )
    if not name or len(name) > 63 or not _LABEL_NAME.match(name):
        return (
            f"node label {key!r}: its name {name!r} must be 1 to 63 of A-Z a-z 0-9 - _ ., starting and ending "
            "with a letter or digit, e.g. topology-rack"
        )
    return None


class TopologyLevel(BaseModel):
    """One network level: the name jobs use for it and the node label that holds its domains."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    level: str = Field(description="the level's name in jobs' topology asks, e.g. block or rack")
    node_label: str = Field(
        validation_alias=AliasChoices("nodeLabel", "label", "node_label"),
        serialization_alias="nodeLabel",
        description="the node label whose value is a node's domain at this level (Kueue's nodeLabel)",
    )

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(set(map(str, data)) - _KEYS)
            given = set(data)
            missing = [k for k, names in (("level", {"level"}), ("nodeLabel", _KEYS - {"level"})) if not names & given]
            if unknown or missing:
                wrong = f"{', '.join(unknown)} is not a key of it" if unknown else f"{' and '.join(missing)} missing"
                raise ValueError(f"a level is {{level: NAME, nodeLabel: LABEL}}: {wrong}")
        return data

    @field_validator("level")
    @classmethod
    def _level(cls, value: str) -> str:
        if not LEVEL_NAME.match(value):
            raise ValueError(
                f"level name {value!r}: use 1 to 63 of A-Z a-z 0-9 _ . -, starting with a letter or digit, "
                "e.g. block or rack"
            )
        if value in GPU_LEVELS:
            raise ValueError(
                f"level name {value!r} names a level inside a node ({', '.join(GPU_LEVELS)}): "
                "give the network level another name, e.g. block or rack"
            )
        return value

    @field_validator("node_label")
    @classmethod
    def _label(cls, value: str) -> str:
        problem = label_key_problem(value)
        if problem:
            raise ValueError(problem)
        return value


def levels_from(value: Any) -> Any:
    """The setting as given: ``LEVEL=LABEL,...`` (the command line; order kept) or a list
    (of mappings, passed on to pydantic)."""
    if isinstance(value, list | tuple):
        return value
    if not isinstance(value, str):
        raise ValueError(f"write LEVEL=NODE_LABEL[,...] or a list of {{level, nodeLabel}}, widest first: {EXAMPLE}")
    out = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        level, sep, label = part.partition("=")
        if not sep or not level.strip() or not label.strip():
            raise ValueError(f"write LEVEL=NODE_LABEL[,...], widest first, e.g. {EXAMPLE} (not {part!r})")
        out.append({"level": level.strip(), "nodeLabel": label.strip()})
    return out


def check_levels(levels: Sequence[TopologyLevel]) -> Sequence[TopologyLevel]:
    """Refuse what Kueue's Topology refuses and what gpush could not tell apart."""
    if len(levels) > MAX_LEVELS:
        raise ValueError(f"{len(levels)} levels: name at most {MAX_LEVELS}, widest first")
    for what, values in (("level name", [t.level for t in levels]), ("node label", [t.node_label for t in levels])):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ValueError(f"{what} {', '.join(twice)} given twice: name each level once, widest first")
    labels = [t.node_label for t in levels]
    if HOSTNAME_LABEL in labels[:-1]:
        raise ValueError(
            f"{HOSTNAME_LABEL} can only be the last (narrowest) level, as in Kueue's Topology "
            "(where it adds nothing: a domain of one node groups nothing); move it last or leave it out"
        )
    return levels


def node_position(labels: Mapping[str, str], levels: Iterable[TopologyLevel]) -> Position:
    """The node's domain at each level, widest first; None where it lacks the label (or it is empty)."""
    return tuple((t.level, labels.get(t.node_label) or None) for t in levels)
