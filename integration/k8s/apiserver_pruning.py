"""Pruning of custom resources by their CRD's structural schema, as apiextensions-apiserver prunes.

A real server drops every field of a custom resource its CRD's schema does not declare, on create,
update and patch alike, so a misspelt field (``spec.devicePlugn``) is gone from the stored object;
with ``fieldValidation`` unset or ``Warn`` (the default since 1.27) it says so in a ``Warning:
299 - "unknown field \\"spec.devicePlugn\\""`` header per field, with ``Strict`` it refuses the
request (400 on create and update, 422 on a merge or JSON patch), with ``Ignore`` it prunes in
silence. The rules, from schema/pruning/algorithm.go and schema/objectmeta:

* a field not in the object's ``properties`` is dropped, unless ``additionalProperties`` is given
  (its schema then applies to every other field) or ``x-kubernetes-preserve-unknown-fields: true``
  keeps the unknown fields of that object (its known ones are still pruned inside);
* ``apiVersion``, ``kind`` and ``metadata`` are kept at the root and in every object marked
  ``x-kubernetes-embedded-resource``; arrays are pruned item by item with ``items``;
* the root ``metadata`` keeps only ObjectMeta's fields;
* the unknown paths are reported as ``spec.a.b`` and ``spec.list[0].c``, sorted, then those of
  ``metadata``.
"""

from __future__ import annotations

from typing import Any

_META_FIELDS = frozenset({"apiVersion", "kind", "metadata"})
OBJECT_META_FIELDS = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "selfLink",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "managedFields",
    }
)
_PRESERVE = "x-kubernetes-preserve-unknown-fields"
_EMBEDDED = "x-kubernetes-embedded-resource"


def _key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _additional(schema: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """Whether ``additionalProperties`` is set, and its schema (None for ``true``: a structural
    schema has no schema for it then, so what is under such a field is pruned as unknown)."""
    if "additionalProperties" not in schema:
        return False, None
    extra = schema["additionalProperties"]
    return True, extra if isinstance(extra, dict) else None


def _prune(value: Any, schema: dict[str, Any] | None, path: str, unknown: list[str]) -> None:
    if schema is not None and schema.get(_PRESERVE):
        _skip(value, schema, path, unknown)
        return
    if isinstance(value, dict):
        if schema is None:
            for key in list(value):
                unknown.append(_key(path, key))
                del value[key]
            return
        properties = schema.get("properties") or {}
        has_extra, extra = _additional(schema)
        for key in list(value):
            if schema.get(_EMBEDDED) and key in _META_FIELDS:
                continue
            if key in properties:
                _prune(value[key], properties[key], _key(path, key), unknown)
            elif has_extra:
                _prune(value[key], extra, _key(path, key), unknown)
            else:
                if key not in _META_FIELDS or path:
                    unknown.append(_key(path, key))
                del value[key]
    elif isinstance(value, list):
        items = schema.get("items") if schema is not None else None
        for i, item in enumerate(value):
            _prune(item, items if isinstance(items, dict) else None, f"{path}[{i}]", unknown)


def _skip(value: Any, schema: dict[str, Any] | None, path: str, unknown: list[str]) -> None:
    """Under x-kubernetes-preserve-unknown-fields: unknown fields stay, known ones are pruned."""
    if schema is None:
        return
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        has_extra, extra = _additional(schema)
        for key in list(value):
            if schema.get(_EMBEDDED) and key in _META_FIELDS:
                continue
            if key in properties:
                _prune(value[key], properties[key], _key(path, key), unknown)
            elif has_extra:
                _prune(value[key], extra, _key(path, key), unknown)
    elif isinstance(value, list):
        items = schema.get("items")
        for i, item in enumerate(value):
            _skip(item, items if isinstance(items, dict) else None, f"{path}[{i}]", unknown)


def prune(obj: dict[str, Any], schema: dict[str, Any] | None) -> list[str]:
    """Drop from ``obj`` (a custom resource, in place) what ``schema`` (its version's
    openAPIV3Schema) does not declare; the paths dropped, as the real server reports them."""
    root = {**(schema or {}), _EMBEDDED: True}
    unknown: list[str] = []
    _prune(obj, root, "", unknown)
    unknown.sort()
    metadata = obj.get("metadata")
    if isinstance(metadata, dict):
        for key in list(metadata):
            if key not in OBJECT_META_FIELDS:
                unknown.append(f"metadata.{key}")
                del metadata[key]
    return unknown
