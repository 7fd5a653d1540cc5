"""Routing policies: which cluster and sharing mode a job goes to, and why.

The public face of the routing policy, so that callers import one module: the format
and loading (broker.routing.rules), evaluating a job (broker.routing.evaluation) and
the checks a policy must pass before it becomes active (broker.routing.validation).
All of it is pure: no database, no HTTP, no adapters. The broker stores policy
versions (broker.routing.versions) and calls :func:`evaluate` in the scheduling cycle.
"""

from broker.routing.evaluation import Decision, RuleTrial, evaluate
from broker.routing.rules import (
    MIG_SHARING,
    GpuCountRange,
    LabelValue,
    Match,
    MemoryRange,
    Policy,
    Route,
    Rule,
    TenantName,
    load_policy,
    policy_json_schema,
)
from broker.routing.validation import (
    CLUSTER_KINDS,
    ISOLATION_STRENGTH,
    ClusterView,
    Finding,
    ValidationReport,
    choose_mig_profile,
    cluster_view,
    validate,
)

__all__ = [
    "CLUSTER_KINDS",
    "ISOLATION_STRENGTH",
    "MIG_SHARING",
    "ClusterView",
    "Decision",
    "Finding",
    "GpuCountRange",
    "LabelValue",
    "Match",
    "MemoryRange",
    "Policy",
    "Route",
    "Rule",
    "RuleTrial",
    "TenantName",
    "ValidationReport",
    "choose_mig_profile",
    "cluster_view",
    "evaluate",
    "load_policy",
    "policy_json_schema",
    "validate",
]
