"""Defaulting and validation of the test API server: what the real server fills in and refuses.

Only the rules that catch habits a client must not learn are here: names that are not DNS-1123, label
keys and values the real server refuses, quantities it cannot parse ("16GB"), extended resources
(``nvidia.com/gpu``) requested without an equal limit, Jobs whose Pods would restart Always,
workload selectors that do not match their template, Pod spec updates, immutable selectors,
CustomResourceDefinitions without schemas. Defaults are the ones a client reads back and may rely on:
Pod phase Pending and QoS class, requests taken from limits, restartPolicy, Job selectors and
labels, Deployment replicas and strategy.

Quantities are decoded as the real server decodes them and stored in their canonical form
(apiserver_quantity: ``0.5`` is stored ``500m``, ``1024Mi`` is ``1Gi``) wherever a built-in kind
holds one: container requests and limits, Pod overhead, emptyDir size limits, Pod and volume claim
templates, Node capacity and allocatable, ResourceQuota and LimitRange. Pods get the Priority
admission plugin's ``priority`` and ``preemptionPolicy`` when they name no PriorityClass (or a
system one), and every Pod spec, alone or in a template, ``enableServiceLinks: true``.

Decode errors (a label value that is not a string, a malformed quantity) are 400 BadRequest as on
the real server; everything else is collected into a list of :class:`FieldError` that the store
turns into one 422 Invalid.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from integration.k8s.apiserver_errors import (
    ApiError,
    FieldError,
    bad_request,
    forbidden,
    immutable,
    invalid_value,
    required,
    unsupported,
)
from integration.k8s.apiserver_kinds import ResourceType
from integration.k8s.apiserver_quantity import QuantityError, from_json
from integration.k8s.apiserver_selectors import selector_from_object

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
    "end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
DNS1035_MESSAGE = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
    "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
QUALIFIED_NAME_MESSAGE = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
LABEL_VALUE_MESSAGE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
    "for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
# The PriorityClasses every cluster has (scheduling/v1: system-node-critical, system-cluster-critical).
SYSTEM_PRIORITY_CLASSES = {"system-node-critical": 2000001000, "system-cluster-critical": 2000000000}
# What the Priority admission plugin gives a Pod without a PriorityClass when no class is the default.
DEFAULT_PRIORITY = 0
DEFAULT_PREEMPTION_POLICY = "PreemptLowerPriority"

POD_UPDATE_FORBIDDEN = (
    "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,"
    "`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),"
    "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)"
)


def parse_quantity(value: Any) -> Fraction | None:
    """A resource quantity (``500m``, ``16Gi``, ``1e3``, a JSON number) as an exact number; None if invalid."""
    if value is None:
        return None
    try:
        return from_json(value).value
    except QuantityError:
        return None


def name_errors(name: str, rule: str, field: str = "metadata.name") -> list[FieldError]:
    pattern, message, limit = {
        "subdomain": (_SUBDOMAIN, SUBDOMAIN_MESSAGE, 253),
        "label": (_LABEL, LABEL_MESSAGE, 63),
        "dns1035": (_DNS1035, DNS1035_MESSAGE, 63),
    }[rule]
    errors = []
    if len(name) > limit:
        errors.append(invalid_value(field, name, f"must be no more than {limit} characters"))
    if not pattern.match(name):
        errors.append(invalid_value(field, name, message))
    return errors


def _qualified_name_errors(key: str, field: str) -> list[FieldError]:
    prefix, _, name = key.rpartition("/")
    errors = []
    if "/" in key:
        if not prefix:
            errors.append(invalid_value(field, key, "prefix part must be non-empty"))
        elif len(prefix) > 253 or not _SUBDOMAIN.match(prefix):
            errors.append(invalid_value(field, key, "prefix part " + SUBDOMAIN_MESSAGE))
    if not name:
        errors.append(invalid_value(field, key, "name part must be non-empty"))
    elif len(name) > 63:
        errors.append(invalid_value(field, key, "name part must be no more than 63 characters"))
    elif not _QUALIFIED_NAME.match(name):
        errors.append(invalid_value(field, key, QUALIFIED_NAME_MESSAGE))
    return errors


def _string_map(rt: ResourceType, value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise bad_request(
            f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: json: cannot unmarshal '
            f"into Go struct field ObjectMeta.metadata.{what} of type map[string]string"
        )
    return value


def label_errors(labels: dict[str, str], field: str) -> list[FieldError]:
    errors = []
    for key, value in labels.items():
        errors.extend(_qualified_name_errors(key, field))
        if len(value) > 63:
            errors.append(invalid_value(field, value, "must be no more than 63 characters"))
        elif not _LABEL_VALUE.match(value):
            errors.append(invalid_value(field, value, LABEL_VALUE_MESSAGE))
    return errors


def metadata_errors(rt: ResourceType, obj: dict[str, Any]) -> list[FieldError]:
    metadata = obj["metadata"]
    labels = _string_map(rt, metadata.get("labels"), "labels")
    annotations = _string_map(rt, metadata.get("annotations"), "annotations")
    errors = label_errors(labels, "metadata.labels")
    for key in annotations:
        errors.extend(_qualified_name_errors(key, "metadata.annotations"))
    return errors


# --- Pod specs, alone and in workload templates ------------------------------------------------------


def _is_extended(resource: str) -> bool:
    return "/" in resource and not resource.startswith("kubernetes.io/")


# --- Quantities, decoded and stored canonical ---------------------------------------------------------


def _canonical(rt: ResourceType, value: Any) -> str:
    try:
        return str(from_json(value))
    except QuantityError as exc:
        raise bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: {exc}') from None


def _canonical_map(rt: ResourceType, values: Any) -> None:
    """A ResourceList (resource name -> Quantity), rewritten in place."""
    if isinstance(values, dict):
        for name, value in values.items():
            values[name] = _canonical(rt, value)


def _canonical_requirements(rt: ResourceType, resources: Any) -> None:
    if isinstance(resources, dict):
        _canonical_map(rt, resources.get("requests"))
        _canonical_map(rt, resources.get("limits"))


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _canonical_pod_spec(rt: ResourceType, spec: Any) -> None:
    spec = _dict(spec)
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for container in _dicts(spec.get(group)):
            _canonical_requirements(rt, container.get("resources"))
    _canonical_map(rt, spec.get("overhead"))
    _canonical_requirements(rt, spec.get("resources"))  # Pod-level resources
    for volume in _dicts(spec.get("volumes")):
        empty_dir = _dict(volume.get("emptyDir"))
        if empty_dir.get("sizeLimit") is not None:
            empty_dir["sizeLimit"] = _canonical(rt, empty_dir["sizeLimit"])
        claim = _dict(_dict(_dict(volume.get("ephemeral")).get("volumeClaimTemplate")).get("spec"))
        _canonical_requirements(rt, claim.get("resources"))


def canonicalize_quantities(rt: ResourceType, obj: dict[str, Any]) -> None:
    """Every Quantity of a built-in object in the canonical form the real server stores; 400 for
    one it cannot parse. Custom resources are left as sent (their schema's quantities are strings)."""
    if not rt.builtin:
        return
    spec, status = _dict(obj.get("spec")), _dict(obj.get("status"))
    key = rt.key
    if key == "pods":
        _canonical_pod_spec(rt, spec)
        for group in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
            for container_status in _dicts(status.get(group)):
                _canonical_map(rt, container_status.get("allocatedResources"))
                _canonical_requirements(rt, container_status.get("resources"))
    elif key == "nodes":
        _canonical_map(rt, status.get("capacity"))
        _canonical_map(rt, status.get("allocatable"))
    elif key == "resourcequotas":
        _canonical_map(rt, spec.get("hard"))
        _canonical_map(rt, status.get("hard"))
        _canonical_map(rt, status.get("used"))
    elif key == "limitranges":
        for item in _dicts(spec.get("limits")):
            for field in ("max", "min", "default", "defaultRequest", "maxLimitRequestRatio"):
                _canonical_map(rt, item.get(field))
    elif rt.group in ("apps", "batch"):
        if rt.kind == "CronJob":
            spec = _dict(_dict(spec.get("jobTemplate")).get("spec"))
        _canonical_pod_spec(rt, _dict(spec.get("template")).get("spec"))
        for claim in _dicts(spec.get("volumeClaimTemplates")):
            _canonical_requirements(rt, _dict(claim.get("spec")).get("resources"))


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for group in ("initContainers", "containers") for c in spec.get(group) or () if isinstance(c, dict)]


def _resource_errors(resources: dict[str, Any], path: str) -> list[FieldError]:
    errors = []
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    for resource, quantity in requests.items():
        request = parse_quantity(quantity)
        if _is_extended(resource):
            if request is not None and request.denominator != 1:
                errors.append(invalid_value(f"{path}.requests[{resource}]", quantity, "must be an integer"))
            if resource not in limits:
                errors.append(required(f"{path}.limits", "Limit must be set for non overcommitable resources"))
            elif parse_quantity(limits[resource]) != request:
                errors.append(
                    invalid_value(
                        f"{path}.requests[{resource}]",
                        quantity,
                        f"must be equal to {resource} limit of {limits[resource]}",
                    )
                )
        elif resource in limits and request is not None and request > parse_quantity(limits[resource]):
            errors.append(
                invalid_value(
                    f"{path}.requests",
                    quantity,
                    f"must be less than or equal to {resource} limit of {limits[resource]}",
                )
            )
    return errors


def pod_spec_errors(rt: ResourceType, spec: Any, path: str) -> list[FieldError]:
    if not isinstance(spec, dict):
        return [required(path)]
    errors = []
    if not spec.get("containers"):
        errors.append(required(f"{path}.containers"))
    seen: set[str] = set()
    for group in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(group) or ()):
            where = f"{path}.{group}[{i}]"
            if not isinstance(container, dict):
                errors.append(required(where))
                continue
            name = container.get("name")
            if not name:
                errors.append(required(f"{where}.name"))
            elif name in seen:
                errors.append(FieldError(f"{where}.name", "Duplicate value", "", name))
            else:
                seen.add(name)
                errors.extend(name_errors(name, "label", f"{where}.name"))
            if not container.get("image"):
                errors.append(required(f"{where}.image"))
            resources = container.get("resources") or {}
            errors.extend(_resource_errors(resources, f"{where}.resources"))
    policy = spec.get("restartPolicy")
    if policy not in ("Always", "OnFailure", "Never"):
        errors.append(unsupported(f"{path}.restartPolicy", policy, ["Always", "OnFailure", "Never"]))
    for field in ("hostname", "subdomain"):  # the Pod's DNS name <hostname>.<subdomain> (a headless Service)
        if spec.get(field):
            errors.extend(name_errors(str(spec[field]), "label", f"{path}.{field}"))
    return errors


def _pull_policy(image: str) -> str:
    """SetDefaults_Container: Always for the tag ``latest``, which an image with neither tag nor
    digest has (parsers.ParseImageName); IfNotPresent otherwise, a digest alone included."""
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else ("" if digest else "latest")
    return "Always" if tag == "latest" else "IfNotPresent"


def _default_pod_spec(spec: dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    for container in _containers(spec):
        container.setdefault("resources", {})
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        if isinstance(container.get("image"), str):
            container.setdefault("imagePullPolicy", _pull_policy(container["image"]))
        for port in _dicts(container.get("ports")):
            port.setdefault("protocol", "TCP")


def qos_class(spec: dict[str, Any]) -> str:
    any_set, guaranteed = False, True
    for container in _containers(spec):
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for resource in ("cpu", "memory"):
            if resource in requests or resource in limits:
                any_set = True
            if resource not in limits or (
                resource in requests and parse_quantity(requests[resource]) != parse_quantity(limits[resource])
            ):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def _default_pod(obj: dict[str, Any], old: dict[str, Any] | None) -> None:
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        return
    _default_pod_spec(spec)
    if old is not None:
        # The Priority admission plugin keeps what it set at create on an update that leaves it out.
        old_spec = _dict(old.get("spec"))
        for field in ("priority", "preemptionPolicy"):
            if spec.get(field) is None and old_spec.get(field) is not None:
                spec[field] = old_spec[field]
    for container in _containers(spec):
        resources = container["resources"]
        limits = resources.get("limits") or {}
        if limits:
            # The real server defaults each request a container leaves out to its limit.
            resources["requests"] = {**limits, **(resources.get("requests") or {})}


def admit_priority(name: str, spec: dict[str, Any]) -> None:
    """The Priority admission plugin on a new Pod: the priority and preemption policy of its
    PriorityClass, or of none (0, PreemptLowerPriority: no class is the cluster's default here);
    a Pod that says otherwise is forbidden. Classes other than the system ones are not served
    here, so a Pod naming one keeps what it says."""
    class_name = spec.get("priorityClassName")
    if class_name and class_name not in SYSTEM_PRIORITY_CLASSES:
        return
    priority = SYSTEM_PRIORITY_CLASSES.get(class_name or "", DEFAULT_PRIORITY)
    given = spec.get("priority")
    if given is not None and given != priority:
        raise _forbidden_pod(
            name,
            f"the integer value of priority ({given}) must not be provided in pod spec; "
            f"priority admission controller computed {priority} from the given PriorityClass name",
        )
    policy = spec.get("preemptionPolicy")
    if policy is not None and policy != DEFAULT_PREEMPTION_POLICY:
        raise _forbidden_pod(
            name,
            f"the string value of PreemptionPolicy ({policy}) must not be provided in pod spec; "
            f"priority admission controller computed {DEFAULT_PREEMPTION_POLICY} from the given PriorityClass name",
        )
    spec["priority"] = priority
    spec["preemptionPolicy"] = DEFAULT_PREEMPTION_POLICY


def _forbidden_pod(name: str, why: str) -> ApiError:
    return ApiError(403, "Forbidden", f'pods "{name}" is forbidden: {why}', {"name": name, "kind": "pods"})


def _pod_update_errors(obj: dict[str, Any], old: dict[str, Any]) -> list[FieldError]:
    new_spec, old_spec = dict(obj.get("spec") or {}), old.get("spec") or {}
    for group in ("containers", "initContainers"):
        if group in new_spec and isinstance(new_spec[group], list):
            olds = old_spec.get(group) or []
            new_spec[group] = [
                {**c, "image": olds[i].get("image")} if i < len(olds) and isinstance(c, dict) else c
                for i, c in enumerate(new_spec[group])
            ]
    for key in ("activeDeadlineSeconds", "terminationGracePeriodSeconds"):
        new_spec.pop(key, None)
        if key in old_spec:
            new_spec[key] = old_spec[key]
    old_tolerations = old_spec.get("tolerations") or []
    new_tolerations = new_spec.get("tolerations") or []
    if new_tolerations[: len(old_tolerations)] == old_tolerations:
        new_spec.pop("tolerations", None)
        if "tolerations" in old_spec:
            new_spec["tolerations"] = old_spec["tolerations"]
    if new_spec != old_spec:
        return [forbidden("spec", POD_UPDATE_FORBIDDEN)]
    return []


# --- Workloads --------------------------------------------------------------------------------------


def _template(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return {}
    template = spec.get("template")
    return template if isinstance(template, dict) else {}


def _default_workload(obj: dict[str, Any], kind: str) -> None:
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        return
    template = spec.get("template")
    if isinstance(template, dict) and isinstance(template.get("spec"), dict):
        template.setdefault("metadata", {})
        _default_pod_spec(template["spec"])
    if kind in ("Deployment", "ReplicaSet", "StatefulSet"):
        spec.setdefault("replicas", 1)
    if kind in ("Deployment", "StatefulSet", "DaemonSet"):
        spec.setdefault("revisionHistoryLimit", 10)
    if kind == "Deployment":
        spec.setdefault("progressDeadlineSeconds", 600)
        strategy = spec.setdefault("strategy", {"type": "RollingUpdate"})
        if strategy.get("type", "RollingUpdate") == "RollingUpdate":
            strategy["type"] = "RollingUpdate"
            strategy.setdefault("rollingUpdate", {"maxUnavailable": "25%", "maxSurge": "25%"})
    elif kind == "StatefulSet":
        spec.setdefault("podManagementPolicy", "OrderedReady")
        spec.setdefault("updateStrategy", {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}})
    elif kind == "DaemonSet":
        spec.setdefault(
            "updateStrategy", {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
        )
    elif kind == "Job":
        if "completions" not in spec and "parallelism" not in spec:
            spec["completions"] = 1
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completionMode", "NonIndexed")
        spec.setdefault("suspend", False)
        spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
    elif kind == "CronJob":
        spec.setdefault("concurrencyPolicy", "Allow")
        spec.setdefault("suspend", False)
        spec.setdefault("successfulJobsHistoryLimit", 3)
        spec.setdefault("failedJobsHistoryLimit", 1)
        job_template = spec.get("jobTemplate")
        if isinstance(job_template, dict):
            _default_workload(job_template, "Job")


def _workload_errors(rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None) -> list[FieldError]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [required("spec")]
    if rt.kind == "CronJob":
        return [] if spec.get("schedule") else [required("spec.schedule")]
    errors = []
    template = _template(obj)
    if not template:
        return [required("spec.template")]
    labels = (template.get("metadata") or {}).get("labels") or {}
    errors.extend(label_errors(labels, "spec.template.metadata.labels"))
    errors.extend(pod_spec_errors(rt, template.get("spec"), "spec.template.spec"))
    policy = (template.get("spec") or {}).get("restartPolicy")
    allowed = ["OnFailure", "Never"] if rt.kind == "Job" else ["Always"]
    if policy in ("Always", "OnFailure", "Never") and policy not in allowed:
        errors.append(unsupported("spec.template.spec.restartPolicy", policy, allowed))
    selector = spec.get("selector")
    if selector is None:
        errors.append(required("spec.selector"))
    else:
        parsed = selector_from_object(selector)
        if parsed is None:
            errors.append(invalid_value("spec.selector", selector, "invalid label selector"))
        elif not parsed:
            errors.append(invalid_value("spec.selector", selector, f"empty selector is invalid for {rt.singular}"))
        elif not parsed.matches(labels):
            errors.append(
                invalid_value("spec.template.metadata.labels", labels, "`selector` does not match template `labels`")
            )
    for field in ("replicas", "parallelism", "completions", "backoffLimit"):
        value = spec.get(field)
        if isinstance(value, int) and value < 0:
            errors.append(invalid_value(f"spec.{field}", value, "must be greater than or equal to 0"))
    if rt.kind == "Job":
        errors.extend(_completion_mode_errors(spec, old))
    if old is not None:
        old_spec = old.get("spec") or {}
        if spec.get("selector") != old_spec.get("selector"):
            errors.append(immutable("spec.selector", spec.get("selector")))
        if rt.kind == "Job":
            if spec.get("template") != old_spec.get("template"):
                errors.append(FieldError("spec.template", "Invalid value", "field is immutable"))
            if spec.get("completions") != old_spec.get("completions"):
                errors.append(immutable("spec.completions", spec.get("completions")))
    return errors


def _completion_mode_errors(spec: dict[str, Any], old: dict[str, Any] | None) -> list[FieldError]:
    """batch/v1 validation of ``completionMode`` (apis/batch/validation): Indexed needs
    ``completions``; the mode cannot change. A ``podFailurePolicy`` needs ``restartPolicy: Never``
    and known actions."""
    mode = spec.get("completionMode") or "NonIndexed"
    if mode not in ("NonIndexed", "Indexed"):
        return [unsupported("spec.completionMode", mode, ["NonIndexed", "Indexed"])]
    errors = []
    if mode == "Indexed" and spec.get("completions") is None:
        errors.append(required("spec.completions", "when completion mode is Indexed"))
    if old is not None and mode != ((old.get("spec") or {}).get("completionMode") or "NonIndexed"):
        errors.append(immutable("spec.completionMode", mode))
    policy = spec.get("podFailurePolicy")
    if isinstance(policy, dict):
        restart = ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy")
        if restart != "Never":
            detail = 'only "Never" is supported when podFailurePolicy is specified'
            errors.append(invalid_value("spec.template.spec.restartPolicy", restart, detail))
        for i, rule in enumerate(policy.get("rules") or ()):
            action = (rule or {}).get("action")
            if action not in ("Count", "FailIndex", "FailJob", "Ignore"):
                actions = ["Count", "FailIndex", "FailJob", "Ignore"]
                errors.append(unsupported(f"spec.podFailurePolicy.rules[{i}].action", action, actions))
    return errors


def _prepare_job(obj: dict[str, Any]) -> list[FieldError]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return []
    if spec.get("manualSelector"):
        return []
    if spec.get("selector") is not None:
        return [invalid_value("spec.selector", spec["selector"], "`selector` will be auto-generated")]
    uid, name = obj["metadata"]["uid"], obj["metadata"]["name"]
    spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    template = spec.get("template")
    if isinstance(template, dict):
        metadata = template.setdefault("metadata", {})
        metadata["labels"] = {
            **(metadata.get("labels") or {}),
            "batch.kubernetes.io/controller-uid": uid,
            "batch.kubernetes.io/job-name": name,
            "controller-uid": uid,
            "job-name": name,
        }
    return []


# --- CustomResourceDefinitions -------------------------------------------------------------------------


def _default_crd(obj: dict[str, Any]) -> None:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    names = spec.get("names")
    if isinstance(names, dict) and isinstance(names.get("kind"), str):
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
    spec.setdefault("conversion", {"strategy": "None"})


def _crd_errors(obj: dict[str, Any], old: dict[str, Any] | None) -> list[FieldError]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [required("spec")]
    errors = []
    group = spec.get("group") or ""
    names = spec.get("names") or {}
    plural = names.get("plural") or ""
    if not group:
        errors.append(required("spec.group"))
    elif "." not in group:
        errors.append(invalid_value("spec.group", group, "should be a domain with at least one dot"))
    if not plural:
        errors.append(required("spec.names.plural"))
    else:
        errors.extend(name_errors(plural, "label", "spec.names.plural"))
    if not names.get("kind"):
        errors.append(required("spec.names.kind"))
    if spec.get("scope") not in ("Cluster", "Namespaced"):
        errors.append(unsupported("spec.scope", spec.get("scope"), ["Cluster", "Namespaced"]))
    versions = spec.get("versions") or []
    if not versions:
        errors.append(required("spec.versions", "must have exactly one version marked as storage version"))
    elif sum(1 for v in versions if v.get("storage")) != 1:
        errors.append(
            invalid_value("spec.versions", versions, "must have exactly one version marked as storage version")
        )
    for i, version in enumerate(versions):
        if not version.get("name"):
            errors.append(required(f"spec.versions[{i}].name"))
        if not ((version.get("schema") or {}).get("openAPIV3Schema")):
            errors.append(required(f"spec.versions[{i}].schema.openAPIV3Schema", "schemas are required"))
    name = obj["metadata"]["name"]
    if group and plural and name != f"{plural}.{group}":
        errors.append(invalid_value("metadata.name", name, 'must be spec.names.plural+"."+spec.group'))
    if old is not None:
        old_spec = old.get("spec") or {}
        if group != old_spec.get("group"):
            errors.append(immutable("spec.group", group))
        if spec.get("scope") != old_spec.get("scope"):
            errors.append(immutable("spec.scope", spec.get("scope")))
    return errors


def crd_status(obj: dict[str, Any], now: str) -> dict[str, Any]:
    spec = obj["spec"]
    return {
        "conditions": [
            {
                "type": "NamesAccepted",
                "status": "True",
                "lastTransitionTime": now,
                "reason": "NoConflicts",
                "message": "no conflicts found",
            },
            {
                "type": "Established",
                "status": "True",
                "lastTransitionTime": now,
                "reason": "InitialNamesAccepted",
                "message": "the initial names have been accepted",
            },
        ],
        "acceptedNames": spec["names"],
        "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
    }


# --- Entry points the store calls ---------------------------------------------------------------------


def apply_defaults(rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None = None) -> None:
    """What the real server does to every create and update before validation: quantities decoded
    into their canonical form, then the defaults; ``old`` is the stored object on an update."""
    canonicalize_quantities(rt, obj)
    key = rt.key
    if key == "pods":
        _default_pod(obj, old)
    elif rt.group in ("apps", "batch"):
        _default_workload(obj, rt.kind)
    elif key == "namespaces":
        metadata = obj["metadata"]
        if metadata.get("name"):
            metadata["labels"] = {**(metadata.get("labels") or {}), "kubernetes.io/metadata.name": metadata["name"]}
        spec = obj.setdefault("spec", {})
        if isinstance(spec, dict):
            spec.setdefault("finalizers", ["kubernetes"])
    elif key == "nodes":
        obj.setdefault("spec", {})
    elif key == "services":
        spec = obj.setdefault("spec", {})
        if isinstance(spec, dict):
            spec.setdefault("type", "ClusterIP")
            spec.setdefault("sessionAffinity", "None")
    elif key == "customresourcedefinitions.apiextensions.k8s.io":
        _default_crd(obj)


_NODE_INFO_FIELDS = (
    "machineID",
    "systemUUID",
    "bootID",
    "kernelVersion",
    "osImage",
    "containerRuntimeVersion",
    "kubeletVersion",
    "kubeProxyVersion",
    "operatingSystem",
    "architecture",
)
_ZERO_STATUS_COUNTS = {
    "replicasets.apps": ("replicas",),
    "statefulsets.apps": ("replicas", "availableReplicas"),
    "daemonsets.apps": ("currentNumberScheduled", "numberMisscheduled", "desiredNumberScheduled", "numberReady"),
}


def _default_container_status(status: Any) -> None:
    if not isinstance(status, dict):
        return
    for key, zero in (("name", ""), ("ready", False), ("restartCount", 0), ("image", ""), ("imageID", "")):
        status.setdefault(key, zero)
    for state_key in ("state", "lastState"):
        state = status.get(state_key)
        if isinstance(state, dict) and isinstance(state.get("terminated"), dict):
            state["terminated"].setdefault("exitCode", 0)


def default_status(rt: ResourceType, obj: dict[str, Any]) -> None:
    """Status fields Go always prints (no omitempty): the real server's JSON has them even when no
    writer set them, and the official client's models require several of them."""
    status = obj.get("status")
    if not isinstance(status, dict):
        return
    key = rt.key
    if key == "nodes":
        info = status.get("nodeInfo")
        status["nodeInfo"] = {**dict.fromkeys(_NODE_INFO_FIELDS, ""), **(info if isinstance(info, dict) else {})}
        endpoint = (status.get("daemonEndpoints") or {}).get("kubeletEndpoint")
        if isinstance(endpoint, dict):
            endpoint.setdefault("Port", 0)
    elif key == "pods":
        for group in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
            for container_status in status.get(group) or ():
                _default_container_status(container_status)
    elif key in _ZERO_STATUS_COUNTS:
        for field in _ZERO_STATUS_COUNTS[key]:
            status.setdefault(field, 0)


def prepare_create(rt: ResourceType, obj: dict[str, Any], now: str) -> list[FieldError]:
    """What create sets that update keeps: the initial status, generated selectors."""
    key = rt.key
    errors: list[FieldError] = []
    if key == "nodes":
        pass  # the kubelet registers a Node with its status, so create keeps it
    elif key == "pods":
        spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
        admit_priority(obj["metadata"]["name"], spec)
        obj["status"] = {"phase": "Pending", "qosClass": qos_class(spec)}
    elif key == "namespaces":
        obj["status"] = {"phase": "Active"}
    elif key == "services":
        obj["status"] = {"loadBalancer": {}}
    elif key == "jobs.batch":
        obj["status"] = {}
        errors = _prepare_job(obj)
    elif key == "customresourcedefinitions.apiextensions.k8s.io":
        if not _crd_errors(obj, None):
            obj["status"] = crd_status(obj, now)
    elif rt.status:
        if rt.builtin:
            obj["status"] = {}
        else:
            obj.pop("status", None)
    default_status(rt, obj)
    return errors


def validate(rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None) -> list[FieldError]:
    """Every rule this server enforces for ``obj``; ``old`` is the stored object on an update."""
    errors = metadata_errors(rt, obj)
    key = rt.key
    if key == "pods":
        errors.extend(pod_spec_errors(rt, obj.get("spec"), "spec"))
        if old is not None:
            errors.extend(_pod_update_errors(obj, old))
    elif rt.group in ("apps", "batch"):
        errors.extend(_workload_errors(rt, obj, old))
    elif key == "customresourcedefinitions.apiextensions.k8s.io":
        errors.extend(_crd_errors(obj, old))
    return errors


def validate_status(rt: ResourceType, obj: dict[str, Any]) -> list[FieldError]:
    """Checks on a write to the status subresource, after its defaults."""
    default_status(rt, obj)
    canonicalize_quantities(rt, obj)
    return []
