"""The three patch formats of the Kubernetes API: JSON merge patch, strategic merge patch, JSON patch.

* ``application/merge-patch+json`` is RFC 7386: maps merge, ``null`` deletes, lists replace.
* ``application/strategic-merge-patch+json`` merges like merge patch, except that the lists Kubernetes
  declares with a merge key merge item by item: ``containers``, ``env``, ``volumes``, ``volumeMounts``,
  ``ports``, ``conditions`` and a few more (the table below). ``$patch: delete`` removes an item or a
  map, ``$patch: replace`` replaces a map or list, ``$deleteFromPrimitiveList/<field>`` removes
  scalars from a merged list of scalars; ``$setElementOrder`` and ``$retainKeys`` are accepted and
  ignored. The real server finds the merge key from the Go struct tags of the path being patched; this
  table goes by the field's name alone, which is the same for every kind the test server stores.
  The real server refuses strategic merge for custom resources with 415; so does this one (the caller
  checks).
* ``application/json-patch+json`` is RFC 6902 (add, remove, replace, move, copy, test).
"""

from __future__ import annotations

import copy
from typing import Any

from integration.k8s.apiserver_errors import ApiError, bad_request

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

# Lists that strategic merge patch merges by a key, with that key (patchMergeKey in the Go types).
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "conditions": "type",
    "ownerReferences": "uid",
    "addresses": "type",
    "resourceClaims": "name",
    "schedulingGates": "name",
    "topologySpreadConstraints": "topologyKey",
    "images": "names",
}
# Lists of scalars that strategic merge patch merges as sets.
MERGE_SCALAR_LISTS = frozenset({"finalizers"})


def _invalid_patch(message: str) -> ApiError:
    return ApiError(422, "Invalid", message)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386. The result may share unchanged parts with ``target``; callers copy before mutating."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: _strip_directives(v)
            for k, v in value.items()
            if k != "$patch"
            and k != "$retainKeys"
            and not k.startswith(("$setElementOrder/", "$deleteFromPrimitiveList/"))
        }
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def _list_merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":
        # Container ports merge by containerPort, Service ports by port.
        for item in items:
            if isinstance(item, dict):
                return "containerPort" if "containerPort" in item else "port"
        return None
    return MERGE_KEYS.get(field)


def _strategic_list(field: str, target: Any, patch: list[Any]) -> list[Any]:
    if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
        return [_strip_directives(p) for p in patch if not (isinstance(p, dict) and p.get("$patch") == "replace")]
    if field in MERGE_SCALAR_LISTS and isinstance(target, list):
        merged = list(target)
        merged.extend(p for p in patch if p not in merged)
        return merged
    key = _list_merge_key(field, patch if patch else (target or []))
    if key is None or not isinstance(target, list):
        return [_strip_directives(p) for p in patch if not (isinstance(p, dict) and p.get("$patch") == "delete")]
    result = list(target)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise bad_request(f"map: {item!r} does not contain declared merge key: {key}")
        index = next((i for i, t in enumerate(result) if isinstance(t, dict) and t.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_strip_directives(item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return _strip_directives(patch)
    if directive == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [v for v in result[field] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _strategic_list(key, result.get(key), value)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = value
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise _invalid_patch(
            f"the server rejected our request due to an error in our request: invalid JSON pointer {path!r}"
        )
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        if isinstance(doc, dict):
            if part not in doc:
                raise _invalid_patch(
                    f"the server rejected our request due to an error in our request: doc is missing path: {path!r}"
                )
            doc = doc[part]
        elif isinstance(doc, list):
            doc = doc[_index(doc, part, path, allow_end=False)]
        else:
            raise _invalid_patch(
                f"the server rejected our request due to an error in our request: doc is missing path: {path!r}"
            )
    return doc


def _index(doc: list[Any], part: str, path: str, allow_end: bool) -> int:
    if part == "-" and allow_end:
        return len(doc)
    if not part.isdigit():
        raise _invalid_patch(
            f"the server rejected our request due to an error in our request: invalid index in {path!r}"
        )
    index = int(part)
    if index > len(doc) or (index == len(doc) and not allow_end):
        raise _invalid_patch(
            f"the server rejected our request due to an error in our request: index out of range: {path!r}"
        )
    return index


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, path, allow_end=True), value)
    else:
        raise _invalid_patch(
            f"the server rejected our request due to an error in our request: doc is missing path: {path!r}"
        )
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    parts = _pointer(path)
    if not parts:
        raise _invalid_patch(
            "the server rejected our request due to an error in our request: cannot remove the whole document"
        )
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, path, allow_end=False))
    raise _invalid_patch(
        f"the server rejected our request due to an error in our request: "
        f"unable to remove nonexistent key: {last}: missing value"
    )


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 on a private copy of ``target``; a failed ``test`` or a missing path is 422."""
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(
                f"the server rejected our request due to an error in our request: malformed operation {op!r}"
            )
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise bad_request(
                f'the server rejected our request due to an error in our request: missing value for "{kind}"'
            )
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            _walk(doc, _pointer(path), path)
            if not _pointer(path):
                doc = copy.deepcopy(op["value"])
            else:
                doc, _ = _remove(doc, path)
                doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "move":
            doc, value = _remove(doc, op.get("from", ""))
            doc = _add(doc, path, value)
        elif kind == "copy":
            value = copy.deepcopy(_walk(doc, _pointer(op.get("from", "")), op.get("from", "")))
            doc = _add(doc, path, value)
        elif kind == "test":
            if _walk(doc, _pointer(path), path) != op["value"]:
                raise _invalid_patch(
                    f"the server rejected our request due to an error in our request: testing value {path} failed"
                )
        else:
            raise bad_request(
                f"the server rejected our request due to an error in our request: unknown operation {kind!r}"
            )
    return doc


def apply_patch(content_type: str, target: dict[str, Any], patch: Any) -> Any:
    """The patched document; the caller validates it like a PUT body."""
    if content_type == JSON_PATCH:
        return json_patch(target, patch)
    if not isinstance(patch, dict):
        raise bad_request("the body of the request must be a JSON object for a merge patch")
    if content_type == MERGE_PATCH:
        return merge_patch(target, patch)
    return strategic_merge_patch(target, patch)
