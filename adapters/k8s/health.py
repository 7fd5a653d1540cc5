"""Whether a Kubernetes cluster can take gpush's jobs: the API answers, and the broker may read
where its jobs go (its namespace, or with a namespace per tenant its Jobs in every namespace)."""

from __future__ import annotations

from adapters.k8s.context import KubeContext, rbac_hint
from adapters.k8s.render import selector
from broker.core.adapter import AdapterError, Health


def check_health(ctx: KubeContext) -> Health:
    client, namespace = ctx.client, ctx.namespace
    try:
        version = str(client.version().get("gitVersion") or "?")
    except AdapterError as exc:
        return Health(False, f"Kubernetes cluster {ctx.name} does not answer: {exc}")
    try:
        found = client.get("namespaces", None, namespace)
    except AdapterError as exc:
        return Health(
            False,
            f"Kubernetes {version} answers, but namespace {namespace} is not readable: {exc}{rbac_hint(exc)}",
        )
    if not ctx.tenancy.per_tenant:
        if found is None and not ctx.settings.create_namespace:
            return Health(
                False,
                f"Kubernetes {version} answers, but namespace {namespace} does not exist: create it "
                f"(kubectl create namespace {namespace}) or set create_namespace=true",
                version,
            )
        said = "created on first use" if found is None else "readable"
        return Health(True, f"Kubernetes {version}: namespace {namespace} {said}", version)
    # A namespace per tenant: the broker finds its jobs by label in every namespace.
    try:
        client.peek("jobs", None, label_selector=selector(ctx.tag))
    except AdapterError as exc:
        return Health(
            False,
            f"Kubernetes {version} answers, but with a namespace per tenant the broker must list and watch "
            f"Jobs, Deployments and Pods in every namespace, and listing Jobs failed: {exc}{rbac_hint(exc)}",
            version,
        )
    created = "created on first use" if ctx.settings.create_namespace else "created by an admin"
    return Health(True, f"Kubernetes {version}: a namespace per tenant ({created})", version)
