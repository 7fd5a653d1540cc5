"""Who asked the test API server for what, and whether RBAC rules allow it.

kube-apiserver authorizes every request by its attributes: the user, the verb, and for the
API's resources the API group, resource, subresource, namespace and name (for other paths,
the path), read off the request as k8s.io/apiserver's RequestInfoFactory reads them: GET of
a collection is ``list``, or ``watch`` with ``watch=true`` (or the old ``/watch/`` prefix),
DELETE of a collection ``deletecollection``, PUT ``update``, PATCH ``patch``, POST ``create``.
:func:`request_attributes` does the same, so a test can record what a client really asked
for (``TestApiServer(users=..., audit=[])``) and check it against an RBAC policy, and
:class:`RbacPolicy` plays the RBAC authorizer over Roles, ClusterRoles and their bindings
(``TestApiServer(authorizer=policy.allows)``), refusing the rest with the real server's 403.

What it does not play: aggregated ClusterRoles, groups (only users and service accounts are
subjects), impersonation, and the default roles a real cluster binds: requests that are not
for a resource (``/version``, discovery), which every user may make there, are recorded here
but never refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from integration.k8s.apiserver_errors import ApiError

RBAC_GROUP = "rbac.authorization.k8s.io"
_VERBS = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
_NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})


@dataclass(frozen=True)
class RequestAttributes:
    """One request as an authorizer sees it (k8s.io/apiserver's authorizer.Attributes)."""

    user: str
    verb: str
    api_group: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""  # "" for cluster-scoped resources and for lists across namespaces
    name: str = ""
    path: str = ""
    resource_request: bool = True

    @property
    def resource_and_subresource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    def describe(self) -> str:
        """The request in RBAC's terms: ``list batch/jobs (all namespaces)``."""
        if not self.resource_request:
            return f"{self.verb} {self.path}"
        group = f"{self.api_group}/" if self.api_group else ""
        where = f"namespace {self.namespace}" if self.namespace else "cluster scope"
        named = f" {self.name}" if self.name else ""
        return f"{self.verb} {group}{self.resource_and_subresource}{named} ({where})"


def request_attributes(user: str, method: str, path: str, query: Mapping[str, str]) -> RequestAttributes:
    """The attributes kube-apiserver authorizes ``method path?query`` by."""
    parts = [p for p in path.split("/") if p]
    verb = _VERBS.get(method.upper(), method.lower())
    if len(parts) >= 2 and parts[0] == "api":
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return RequestAttributes(user, method.lower(), path=path, resource_request=False)
    if not rest:  # discovery of a group version
        return RequestAttributes(user, method.lower(), path=path, resource_request=False)
    if rest[0] == "watch":
        verb, rest = "watch", rest[1:]
    namespace = ""
    if rest and rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0] if rest else ""
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in ("true", "1", "True") else "list"
    if not name and verb in ("list", "watch"):
        field_selector = query.get("fieldSelector") or ""
        for term in field_selector.split(","):
            key, sep, value = term.partition("=")
            if sep and key.strip() == "metadata.name" and not value.startswith("="):
                name = value.strip()
    if not name and verb == "delete":
        verb = "deletecollection"
    return RequestAttributes(user, verb, group, resource, subresource, namespace, name, path)


def forbidden(attributes: RequestAttributes) -> ApiError:
    """kube-apiserver's 403 for a request RBAC does not allow, in its words."""
    who = f'User "{attributes.user}"'
    if not attributes.resource_request:
        return ApiError(403, "Forbidden", f'forbidden: {who} cannot {attributes.verb} path "{attributes.path}"', {})
    qualified = f"{attributes.resource}.{attributes.api_group}" if attributes.api_group else attributes.resource
    subject = f'{qualified} "{attributes.name}"' if attributes.name else qualified
    where = f'in the namespace "{attributes.namespace}"' if attributes.namespace else "at the cluster scope"
    message = (
        f"{subject} is forbidden: {who} cannot {attributes.verb} resource "
        f'"{attributes.resource_and_subresource}" in API group "{attributes.api_group}" {where}'
    )
    details: dict[str, Any] = {"name": attributes.name} if attributes.name else {}
    if attributes.api_group:
        details["group"] = attributes.api_group
    details["kind"] = attributes.resource
    return ApiError(403, "Forbidden", message, details)


@dataclass(frozen=True)
class Grant:
    """One verb on one resource of one API group that a binding gives a user, everywhere
    (``namespace`` None: a ClusterRoleBinding) or in one namespace (a RoleBinding)."""

    user: str
    namespace: str | None
    api_group: str
    resource: str  # with its subresource: pods/log
    verb: str
    resource_names: frozenset[str] = frozenset()
    source: str = ""  # "ClusterRole gpush-broker-jobs (ClusterRoleBinding gpush-broker-jobs)"

    def allows(self, attributes: RequestAttributes) -> bool:
        if not attributes.resource_request or attributes.user != self.user:
            return False
        if self.namespace is not None and attributes.namespace != self.namespace:
            return False
        return (
            _matches(self.verb, attributes.verb)
            and _matches(self.api_group, attributes.api_group)
            and _resource_matches(self.resource, attributes.resource_and_subresource)
            and (not self.resource_names or attributes.name in self.resource_names)
        )

    def describe(self) -> str:
        group = f"{self.api_group}/" if self.api_group else ""
        names = f" named {', '.join(sorted(self.resource_names))}" if self.resource_names else ""
        where = f"namespace {self.namespace}" if self.namespace is not None else "every namespace and cluster scope"
        return f"{self.verb} {group}{self.resource}{names} ({where}) from {self.source}"


def _matches(granted: str, asked: str) -> bool:
    return granted == "*" or granted == asked


def _resource_matches(granted: str, asked: str) -> bool:
    if granted in ("*", asked):
        return True
    # "*/scale" grants the scale subresource of every resource
    return granted.startswith("*/") and "/" in asked and asked.split("/", 1)[1] == granted[2:]


def subject_user(subject: Mapping[str, Any], binding_namespace: str | None) -> str | None:
    """The user name a binding's subject stands for (None: a group, which is not played)."""
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        namespace = subject.get("namespace") or binding_namespace
        return f"system:serviceaccount:{namespace}:{subject['name']}"
    if kind == "User":
        return str(subject["name"])
    return None


class RbacPolicy:
    """The RBAC authorizer over a set of Roles, ClusterRoles and bindings (see the module docstring)."""

    def __init__(self, grants: Iterable[Grant]):
        self.grants = list(grants)

    @classmethod
    def from_documents(cls, documents: Iterable[Mapping[str, Any] | None]) -> RbacPolicy:
        """The grants of the bindings among ``documents`` (what ``kubectl apply -f`` takes;
        other kinds are skipped). A binding whose role is not among them is an error, as a
        policy that grants less than it reads as would make a test pass for the wrong reason."""
        roles: dict[tuple[str, str | None, str], list[Mapping[str, Any]]] = {}
        bindings = []
        for document in documents:
            if not document or document.get("apiVersion") != f"{RBAC_GROUP}/v1":
                continue
            kind, metadata = document["kind"], document["metadata"]
            if kind == "ClusterRole":
                roles[("ClusterRole", None, metadata["name"])] = list(document.get("rules") or [])
            elif kind == "Role":
                roles[("Role", metadata["namespace"], metadata["name"])] = list(document.get("rules") or [])
            elif kind in ("ClusterRoleBinding", "RoleBinding"):
                bindings.append(document)
            else:
                raise ValueError(f"not an RBAC kind: {kind}")
        grants: list[Grant] = []
        for binding in bindings:
            kind, metadata, ref = binding["kind"], binding["metadata"], binding["roleRef"]
            namespace = metadata.get("namespace") if kind == "RoleBinding" else None
            if kind == "ClusterRoleBinding" and ref["kind"] != "ClusterRole":
                raise ValueError(f"ClusterRoleBinding {metadata['name']} must refer to a ClusterRole")
            key = (ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"])
            if key not in roles:
                raise ValueError(f"{kind} {metadata['name']} refers to {ref['kind']} {ref['name']}, which is not there")
            source = f"{ref['kind']} {ref['name']} ({kind} {metadata['name']})"
            users = [u for s in binding.get("subjects") or () if (u := subject_user(s, namespace)) is not None]
            for rule in roles[key]:
                for user in users:
                    for group in rule.get("apiGroups") or ():
                        for resource in rule.get("resources") or ():
                            for verb in rule.get("verbs") or ():
                                names = frozenset(rule.get("resourceNames") or ())
                                grants.append(Grant(user, namespace, group, resource, verb, names, source))
        return cls(grants)

    def allows(self, attributes: RequestAttributes) -> bool:
        return any(grant.allows(attributes) for grant in self.grants)

    def unused(self, requests: Iterable[RequestAttributes]) -> list[Grant]:
        """The grants no request in ``requests`` needed: what a least-privilege policy should not hold."""
        asked = list(requests)
        return [grant for grant in self.grants if not any(grant.allows(r) for r in asked)]


def wildcards(documents: Iterable[Mapping[str, Any] | None]) -> list[str]:
    """Every ``*`` in the rules of ``documents``'s Roles and ClusterRoles, where it is."""
    found = []
    for document in documents:
        if not document or document.get("kind") not in ("Role", "ClusterRole"):
            continue
        for index, rule in enumerate(document.get("rules") or ()):
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                if any("*" in str(value) for value in rule.get(key) or ()):
                    found.append(f"{document['kind']} {document['metadata']['name']} rule {index} {key}")
    return found
