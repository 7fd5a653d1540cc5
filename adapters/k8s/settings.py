"""A Kubernetes cluster's settings (``gpush cluster add NAME --kind k8s --config KEY=VALUE``) and
the checks that refuse a config which cannot work, naming what to change."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapters.k8s.mig import DEFAULT_MIG_CONFIG
from adapters.k8s.render import check_tag
from adapters.k8s.tenancy import PER_TENANT, SHARED, check_namespace, check_pattern
from adapters.k8s.timeslice import DEFAULT_CONFIG
from adapters.k8s.topology import TopologyLevel, check_levels, levels_from
from adapters.settings import key_value_pairs
from broker.core.gpus import gpu_model

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class KubernetesSettings(BaseModel):
    """A Kubernetes cluster's config (``gpush cluster add NAME --kind k8s --config KEY=VALUE``)."""

    model_config = ConfigDict(extra="forbid")

    kubeconfig: str | None = Field(
        None, description="kubeconfig path; 'in-cluster' for the broker Pod's service account; default $KUBECONFIG"
    )
    context: str | None = Field(None, description="kubeconfig context (default: its current-context)")
    namespace: str = Field(
        "gpush",
        pattern=_DNS_LABEL,
        description="where gpush's Jobs and Deployments go (with namespace_mode=per-tenant: those without an owner)",
    )
    create_namespace: bool = Field(False, description="create namespaces (the tenants' too) on first use")
    namespace_mode: Literal["shared", "per-tenant"] = Field(
        SHARED,
        description="shared: every tenant's jobs in namespace; per-tenant: each tenant's in its own "
        "(tenant_namespaces, namespace_pattern), with a ResourceQuota from its GPU quota",
    )
    tenant_namespaces: dict[str, str] = Field(
        default_factory=dict, description="tenant -> its namespace (per-tenant): vision=cv-jobs,nlp=nlp-jobs"
    )
    namespace_pattern: str | None = Field(
        None,
        description="the namespace of a tenant that tenant_namespaces does not name (per-tenant), {tenant} "
        "being its name made a DNS label: gpush-{tenant}",
    )
    tag: str = Field("gpush", description="names this broker's objects (<tag>-<id>) and labels them")
    image: str | None = Field(None, description="image for jobs that name none")
    service_account: str | None = Field(None, description="service account of the Pods (default: none mounted)")
    run_as_user: int = Field(1000, ge=1, description="the non-root uid Pods run as")
    priority_class: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict, description="added to every Pod: KEY=VALUE,...")
    timeslice_config: str = Field(DEFAULT_CONFIG, description="NAMESPACE/NAME of the time-slicing ConfigMap")
    mig_config: str = Field(
        DEFAULT_MIG_CONFIG,
        description="NAMESPACE/NAME of the GPU Operator's mig-parted ConfigMap (the ClusterPolicy's "
        "migManager.config.name, when set, names it instead)",
    )
    gpu_types: dict[str, str] = Field(default_factory=dict, description="nvidia.com/gpu.product -> GPU model")
    submit_threads: int = Field(8, ge=1, le=64)
    watch_seconds: float = Field(0.02, gt=0, le=30, description="longest a status read waits for events")
    cache_seconds: float = Field(1.0, ge=0)
    informers: bool = Field(True, description="keep Nodes and Pods by watch instead of listing them each cycle")
    timeout: float = Field(30.0, gt=0)
    topology_levels: list[TopologyLevel] = Field(
        default_factory=list,
        description="the network's levels, widest first, as Kueue's Topology names them: LEVEL=NODE_LABEL,... "
        "(block=cloud.provider.com/topology-block,rack=cloud.provider.com/topology-rack); each node's domain at "
        "a level is its label's value (adapters.k8s.topology)",
    )

    @field_validator("tag")
    @classmethod
    def _tag(cls, value: str) -> str:
        return check_tag(value)

    @field_validator("node_selector", mode="before")
    @classmethod
    def _selector_pairs(cls, value: Any) -> Any:
        return key_value_pairs(value, "node_selector", "pool=gpu,zone=a")

    @field_validator("gpu_types", mode="before")
    @classmethod
    def _type_pairs(cls, value: Any) -> Any:
        return key_value_pairs(value, "gpu_types", "NVIDIA-A100-SXM4-80GB=A100-SXM4-80GB")

    @field_validator("gpu_types")
    @classmethod
    def _known_models(cls, value: dict[str, str]) -> dict[str, str]:
        return {product: gpu_model(model).name for product, model in value.items()}

    @field_validator("topology_levels", mode="before")
    @classmethod
    def _level_pairs(cls, value: Any) -> Any:
        return levels_from(value)

    @field_validator("topology_levels")
    @classmethod
    def _levels(cls, value: list[TopologyLevel]) -> list[TopologyLevel]:
        return list(check_levels(value))

    @field_validator("tenant_namespaces", mode="before")
    @classmethod
    def _tenant_pairs(cls, value: Any) -> Any:
        return key_value_pairs(value, "tenant_namespaces", "vision=cv-jobs,nlp=nlp-jobs", form="TENANT=NAMESPACE")

    @field_validator("tenant_namespaces")
    @classmethod
    def _one_namespace_each(cls, value: dict[str, str]) -> dict[str, str]:
        held: dict[str, str] = {}
        for tenant, namespace in value.items():
            check_namespace(namespace, f"tenant {tenant}'s namespace")
            if namespace in held:
                raise ValueError(
                    f"tenants {held[namespace]} and {tenant} both map to namespace {namespace}: give each tenant "
                    "a namespace of its own (its ResourceQuota is that tenant's GPU quota)"
                )
            held[namespace] = tenant
        return value

    @field_validator("namespace_pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        return None if value is None else check_pattern(value)

    @model_validator(mode="after")
    def _tenancy(self) -> KubernetesSettings:
        given = [key for key in ("tenant_namespaces", "namespace_pattern") if getattr(self, key)]
        if self.namespace_mode == SHARED and given:
            raise ValueError(
                f"{' and '.join(given)} take effect with namespace_mode=per-tenant: add "
                f"--config namespace_mode=per-tenant, or leave {'them' if len(given) > 1 else 'it'} out"
            )
        if self.namespace_mode == PER_TENANT:
            if not given:
                raise ValueError(
                    "namespace_mode=per-tenant needs tenant_namespaces (TENANT=NAMESPACE,...), namespace_pattern "
                    "(e.g. gpush-{tenant}), or both, to say where each tenant's jobs go"
                )
            for tenant, namespace in self.tenant_namespaces.items():
                if namespace == self.namespace:
                    raise ValueError(
                        f"tenant_namespaces maps tenant {tenant} to {namespace}, the namespace of jobs without an "
                        "owner (namespace): give the tenant a namespace of its own"
                    )
        return self
