"""The object store of the Kubernetes API test server: the registry behind every verb.

It owns what etcd and the generic registry own in a real cluster:

* one global ``resourceVersion`` counter, bumped by every write (etcd's revision);
* objects per resource type, indexed by namespace and name; a write replaces the stored dict, never
  mutates it, so an :class:`Entry` can cache its JSON and be shared with watchers;
* per resource type, the changes since the last compaction, for watches that resume from a
  resourceVersion, for consistent pagination (a continue token lists the state as of its
  resourceVersion) and for ``resourceVersionMatch=Exact``; older than the retained window is 410.
  The window is what kube-apiserver keeps: :meth:`Store.compaction_tick`, which the server calls
  on a timer (every 5 minutes by default, as ``--etcd-compaction-interval``), forgets everything up
  to the revision the tick before it saw, so a watch from, or a list at, a resourceVersion older
  than one to two intervals is 410 Expired; a watch already open is not cut off by it, as the watch
  cache keeps feeding it. A new watch is served from the watch cache, which starts at the revision
  it listed when the server started: a watch from an older resourceVersion is 410 at once;
* create, update, patch and delete with the real semantics: optimistic concurrency, generation,
  the status and scale subresources, defaults and validation (apiserver_validation), and garbage
  collection of owned objects, done synchronously at the delete;
* custom resources: a CustomResourceDefinition registers its resource when created and deletes its
  objects when deleted;
* a snapshot to a file and back, so a test can restart the server: the counter continues, the
  change history does not, so an older resourceVersion is answered with 410 and the client re-lists.

All methods take the store's lock, so tests may call them from their own thread while the server
runs. Watchers in the server's event loop are woken through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import threading
import time
import uuid
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from integration.k8s.apiserver_errors import (
    STALE_WRITE,
    ApiError,
    already_exists,
    bad_request,
    conflict,
    expired,
    invalid,
    invalid_value,
    namespace_not_found,
    not_found,
    required,
    unsupported_media_type,
)
from integration.k8s.apiserver_kinds import BUILTINS, CRD_KEY, NAMESPACES_KEY, ResourceType, from_crd, version_priority
from integration.k8s.apiserver_patch import (
    APPLY_PATCH,
    JSON_PATCH,
    MERGE_PATCH,
    STRATEGIC_MERGE_PATCH,
    apply_patch,
)
from integration.k8s.apiserver_pruning import prune
from integration.k8s.apiserver_selectors import FieldSelector, LabelSelector, selector_to_string
from integration.k8s.apiserver_validation import (
    apply_defaults,
    name_errors,
    prepare_create,
    validate,
    validate_status,
)

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
DEFAULT_NAMESPACES = ("default", "kube-node-lease", "kube-public", "kube-system")
PROPAGATION_POLICIES = ("Orphan", "Background", "Foreground")
# fieldValidation: what a write does with fields the schema does not know ("Warn" when not given).
FIELD_VALIDATIONS = ("Ignore", "Warn", "Strict")
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_SERVER_SET_METADATA = (
    "uid",
    "creationTimestamp",
    "resourceVersion",
    "generation",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "selfLink",
    "managedFields",
)
TOO_OLD_CONTINUE = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new list "
    "without the continue parameter, or use the continue token in this response to retrieve the remainder of the "
    "results. Continuing with the provided token results in an inconsistent list - objects that were created, "
    "modified, or deleted between the time the first chunk was returned and now may show up in the list."
)


class Entry:
    """One stored version of an object. Never mutated after it is committed."""

    __slots__ = ("obj", "rv", "_raw", "_item")

    def __init__(self, obj: dict[str, Any], rv: int) -> None:
        self.obj = obj
        self.rv = rv
        self._raw: bytes | None = None
        self._item: bytes | None = None

    @property
    def namespace(self) -> str:
        return self.obj["metadata"].get("namespace", "")

    @property
    def name(self) -> str:
        return self.obj["metadata"]["name"]

    @property
    def key(self) -> tuple[str, str]:
        metadata = self.obj["metadata"]
        return metadata.get("namespace", ""), metadata["name"]

    @property
    def raw(self) -> bytes:
        if self._raw is None:
            self._raw = orjson.dumps(self.obj)
        return self._raw

    def item(self, builtin: bool) -> bytes:
        """The object as an item of a list: built-in kinds leave out kind and apiVersion there."""
        if not builtin:
            return self.raw
        if self._item is None:
            self._item = orjson.dumps({k: v for k, v in self.obj.items() if k != "kind" and k != "apiVersion"})
        return self._item


class Change(NamedTuple):
    rv: int
    type: str
    entry: Entry  # the object after the change; for DELETED its last state, at the delete's resourceVersion
    prev: Entry | None  # the object before the change


def _change_rv(change: Change) -> int:
    return change.rv


class Collection:
    """The objects of one resource type and the changes to them still retained."""

    def __init__(self, rt: ResourceType) -> None:
        self.rt = rt
        self.objects: dict[str, dict[str, Entry]] = {}  # namespace ("" when cluster-scoped) -> name -> entry
        self.changes: list[Change] = []
        self.compacted_rv = 0  # changes at or below this resourceVersion may be gone
        self.signal: asyncio.Event | None = None
        self.wake_pending = False
        self.closed = False

    def get(self, namespace: str, name: str) -> Entry | None:
        names = self.objects.get(namespace)
        return names.get(name) if names else None

    def count(self) -> int:
        return sum(len(names) for names in self.objects.values())

    def sorted_entries(self, namespace: str | None) -> list[Entry]:
        """In etcd key order: namespace, then name."""
        if namespace is not None:
            names = self.objects.get(namespace) or {}
            return [names[n] for n in sorted(names)]
        return [names[n] for ns in sorted(self.objects) for names in (self.objects[ns],) for n in sorted(names)]


@dataclass
class ListResult:
    rt: ResourceType
    entries: list[Entry]
    resource_version: int
    continue_token: str
    remaining: int | None


def _private_copy(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return orjson.loads(orjson.dumps(body))


def _metadata(obj: dict[str, Any]) -> dict[str, Any]:
    metadata = obj.get("metadata")
    if metadata is None:
        metadata = obj["metadata"] = {}
    if not isinstance(metadata, dict):
        raise bad_request("json: cannot unmarshal into Go struct field of type v1.ObjectMeta")
    return metadata


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    """What a change to bumps metadata.generation: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "kind", "apiVersion")}


def _owner_uids(obj: dict[str, Any]) -> list[str]:
    refs = obj["metadata"].get("ownerReferences") or ()
    return [r["uid"] for r in refs if isinstance(r, dict) and isinstance(r.get("uid"), str)]


def _parse_rv(value: str) -> int:
    try:
        rv = int(value)
    except (TypeError, ValueError):
        raise bad_request(f"resourceVersion: Invalid value: {value!r}: must be a non-negative integer") from None
    if rv < 0:
        raise bad_request(f"resourceVersion: Invalid value: {value!r}: must be a non-negative integer")
    return rv


def encode_continue(rv: int, key: tuple[str, str]) -> str:
    raw = orjson.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": list(key)})
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, tuple[str, str]]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = orjson.loads(raw)
        return int(data["rv"]), (str(data["start"][0]), str(data["start"][1]))
    except (ValueError, KeyError, IndexError, TypeError, orjson.JSONDecodeError):
        raise bad_request(f"continue key is not valid: {token!r}") from None


class Store:
    """Objects, resourceVersions and change history of one test API server."""

    def __init__(
        self,
        *,
        event_window: int = 100_000,
        clock: Callable[[], float] = time.time,
        bootstrap: bool = True,
    ) -> None:
        self.lock = threading.RLock()
        self.revision = 0
        # etcd's compacted revision: a list or a new watch at an older resourceVersion is 410.
        self.compacted_revision = 0
        self._compaction_mark: int | None = None  # the revision the last compaction tick saw
        # The revision kube-apiserver's watch cache listed when the server started: its window
        # begins there, so a new watch from an older resourceVersion is 410 at once, history
        # kept in etcd or not (set by :meth:`start_watch_cache` as the server starts).
        self.watch_cache_revision = 0
        self.event_window = max(1, event_window)
        self._slack = max(1, self.event_window // 4)
        self._clock = clock
        self._types: dict[str, ResourceType] = {}
        self._routes: dict[tuple[str, str, str], ResourceType] = {}
        self._collections: dict[str, Collection] = {}
        self._owners: dict[str, set[tuple[str, str, str]]] = {}  # owner uid -> dependents (type key, ns, name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        for rt in BUILTINS:
            self._register(rt)
        if bootstrap:
            for name in DEFAULT_NAMESPACES:
                self.create(self._types[NAMESPACES_KEY], "", {"metadata": {"name": name}})

    # --- registry -------------------------------------------------------------------------------------

    def _register(self, rt: ResourceType) -> None:
        old = self._types.get(rt.key)
        if old is not None:
            for version in old.versions:
                self._routes.pop((old.group, version, old.plural), None)
        self._types[rt.key] = rt
        for version in rt.versions:
            self._routes[(rt.group, version, rt.plural)] = rt
        coll = self._collections.get(rt.key)
        if coll is None:
            self._collections[rt.key] = Collection(rt)
        else:
            coll.rt = rt

    def _unregister(self, key: str) -> None:
        rt = self._types.pop(key, None)
        if rt is not None:
            for version in rt.versions:
                self._routes.pop((rt.group, version, rt.plural), None)
        coll = self._collections.pop(key, None)
        if coll is not None:
            coll.closed = True
            self._wake(coll)

    def resolve(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._routes.get((group, version, plural))

    def resource_type(self, resource: str) -> ResourceType:
        """A type by the name kubectl takes: ``pods``, ``jobs.batch``, ``clusterpolicies.nvidia.com``."""
        rt = self._types.get(resource)
        if rt is None:
            raise KeyError(f"no resource {resource!r}; known: {', '.join(sorted(self._types))}")
        return rt

    def groups(self) -> dict[str, list[str]]:
        """API groups (not the core group) with their served versions, preferred first."""
        with self.lock:
            groups: dict[str, set[str]] = {}
            for rt in self._types.values():
                if rt.group:
                    groups.setdefault(rt.group, set()).update(rt.versions)
            return {g: sorted(v, key=version_priority) for g, v in sorted(groups.items())}

    def resources(self, group: str, version: str) -> list[ResourceType]:
        with self.lock:
            return [rt for (g, v, _), rt in sorted(self._routes.items()) if g == group and v == version]

    def _collection(self, rt: ResourceType) -> Collection:
        coll = self._collections.get(rt.key)
        if coll is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        return coll

    # --- watch signalling -----------------------------------------------------------------------------

    def attach_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop

    def start_watch_cache(self) -> int:
        """The server starts: its watch cache lists at the current revision and serves watches
        from there on (cacher.go: a watch from an older resourceVersion is "too old", 410)."""
        with self.lock:
            self.watch_cache_revision = self.revision
            return self.revision

    def signal(self, coll: Collection) -> asyncio.Event:
        """An event set at the next change to ``coll``; call from the server's event loop only."""
        if coll.signal is None:
            coll.signal = asyncio.Event()
        return coll.signal

    def _wake(self, coll: Collection) -> None:
        loop = self._loop
        if loop is None or coll.wake_pending:
            return
        coll.wake_pending = True
        try:
            loop.call_soon_threadsafe(self._fire, coll)
        except RuntimeError:  # the loop has closed
            coll.wake_pending = False

    @staticmethod
    def _fire(coll: Collection) -> None:
        coll.wake_pending = False
        event, coll.signal = coll.signal, None
        if event is not None:
            event.set()

    def close(self) -> None:
        """Ends every watch stream; the server calls this when it stops."""
        with self.lock:
            self.closing = True
            for coll in self._collections.values():
                self._wake(coll)

    # --- commit -----------------------------------------------------------------------------------------

    def _now(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._clock()))

    def _commit(self, coll: Collection, kind: str, obj: dict[str, Any], prev: Entry | None) -> Entry:
        self.revision += 1
        rv = self.revision
        obj["metadata"]["resourceVersion"] = str(rv)
        entry = Entry(obj, rv)
        namespace, name = entry.key
        if kind == DELETED:
            names = coll.objects[namespace]
            del names[name]
            if not names:
                del coll.objects[namespace]
        else:
            coll.objects.setdefault(namespace, {})[name] = entry
        self._index_owners(coll.rt.key, prev, None if kind == DELETED else entry)
        changes = coll.changes
        changes.append(Change(rv, kind, entry, prev))
        if len(changes) > self.event_window + self._slack:
            drop = len(changes) - self.event_window
            coll.compacted_rv = changes[drop - 1].rv
            del changes[:drop]
        self._wake(coll)
        return entry

    def _index_owners(self, key: str, prev: Entry | None, entry: Entry | None) -> None:
        if prev is not None:
            ref = (key, *prev.key)
            for uid in _owner_uids(prev.obj):
                dependents = self._owners.get(uid)
                if dependents is not None:
                    dependents.discard(ref)
                    if not dependents:
                        del self._owners[uid]
        if entry is not None:
            ref = (key, *entry.key)
            for uid in _owner_uids(entry.obj):
                self._owners.setdefault(uid, set()).add(ref)

    def compact(self) -> int:
        """Forget all change history now, as an etcd compaction to the current revision would;
        older resourceVersions get 410 (tests force this; the server compacts on its own timer)."""
        with self.lock:
            for coll in self._collections.values():
                coll.changes.clear()
                coll.compacted_rv = self.revision
            self.compacted_revision = self.revision
            return self.revision

    def compaction_tick(self) -> int:
        """One tick of kube-apiserver's compactor: compact to the revision the previous tick saw
        (so between one and two intervals of history stay), and remember the current one for the
        next. Returns the revision compacted to (0 on the first tick)."""
        with self.lock:
            target, self._compaction_mark = self._compaction_mark, self.revision
            if target:
                self._compact_through(target)
            return target or 0

    def _compact_through(self, target: int) -> None:
        for coll in self._collections.values():
            drop = bisect_right(coll.changes, target, key=_change_rv)
            if drop:
                coll.compacted_rv = max(coll.compacted_rv, coll.changes[drop - 1].rv)
                del coll.changes[:drop]
        self.compacted_revision = max(self.compacted_revision, target)

    def _horizon(self, coll: Collection) -> int:
        """The oldest resourceVersion a list or a new watch of ``coll`` may still ask for."""
        return max(coll.compacted_rv, self.compacted_revision)

    # --- type and metadata checks --------------------------------------------------------------------

    def _check_type(self, rt: ResourceType, obj: dict[str, Any], version: str | None) -> None:
        expected = rt.api_version(version)
        api_version = obj.get("apiVersion")
        if (
            api_version
            and api_version != expected
            and not (not rt.builtin and api_version in {rt.api_version(v) for v in rt.versions})
        ):
            raise bad_request(
                f"the API version in the data ({api_version}) does not match the expected API version ({expected})"
            )
        kind = obj.get("kind")
        if kind and kind != rt.kind:
            raise bad_request(f"the kind in the data ({kind}) does not match the expected kind ({rt.kind})")

    @staticmethod
    def _prune_unknown(
        rt: ResourceType,
        obj: dict[str, Any],
        version: str | None,
        field_validation: str,
        warnings: list[str] | None,
        *,
        patched: bool = False,
    ) -> None:
        """A custom resource's fields its schema does not declare: dropped, and warned of, or
        refused under fieldValidation=Strict, as apiextensions-apiserver does (apiserver_pruning)."""
        if rt.builtin:
            return
        version = version or rt.version
        raw = orjson.dumps(obj).decode() if patched else ""
        unknown = prune(obj, rt.schemas.get(version))
        if not unknown or field_validation == "Ignore":
            return
        messages = [f'unknown field "{path}"' for path in unknown]
        if field_validation == "Strict":
            why = "strict decoding error: " + ", ".join(messages)
            if patched:
                # patch.go: the patched object as the invalid value of a nameless, kindless Invalid.
                error = invalid_value("patch", raw, why)
                raise ApiError(422, "Invalid", f' "" is invalid: {error.message()}', {"causes": [error.cause()]})
            raise bad_request(f'{rt.kind} in version "{version}" cannot be handled as a {rt.kind}: {why}')
        if warnings is not None:
            warnings.extend(messages)

    def _check_namespace(self, rt: ResourceType, metadata: dict[str, Any], namespace: str) -> None:
        if rt.namespaced:
            given = metadata.get("namespace")
            if given and given != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            metadata["namespace"] = namespace
        else:
            metadata.pop("namespace", None)

    def _generate_name(self, coll: Collection, namespace: str, prefix: str) -> str:
        prefix = prefix[:58]
        while True:
            name = prefix + "".join(random.choices(_GENERATE_ALPHABET, k=5))
            if coll.get(namespace, name) is None:
                return name

    # --- verbs ------------------------------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str, name: str) -> Entry:
        with self.lock:
            entry = self._collection(rt).get(namespace, name)
            if entry is None:
                raise not_found(rt, name)
            return entry

    def create(
        self,
        rt: ResourceType,
        namespace: str,
        body: Any,
        *,
        version: str | None = None,
        dry_run: bool = False,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
    ) -> Entry:
        """``warnings`` collects what the answer's Warning headers say (the unknown fields dropped)."""
        obj = _private_copy(body)
        with self.lock:
            coll = self._collection(rt)
            self._check_type(rt, obj, version)
            self._prune_unknown(rt, obj, version, field_validation, warnings)
            metadata = _metadata(obj)
            self._check_namespace(rt, metadata, namespace)
            name = metadata.get("name")
            if not name:
                prefix = metadata.get("generateName")
                if not prefix or not isinstance(prefix, str):
                    raise invalid(rt, "", [required("metadata.name", "name or generateName is required")])
                name = metadata["name"] = self._generate_name(coll, namespace, prefix)
            if not isinstance(name, str):
                raise bad_request("metadata.name must be a string")
            errors = name_errors(name, rt.name_rule)
            if errors:
                raise invalid(rt, name, errors)
            if rt.namespaced and self._collections[NAMESPACES_KEY].get("", namespace) is None:
                raise namespace_not_found(namespace)
            for field in _SERVER_SET_METADATA:
                metadata.pop(field, None)
            now = self._now()
            metadata["uid"] = str(uuid.uuid4())
            metadata["creationTimestamp"] = now
            if rt.generation:
                metadata["generation"] = 1
            obj = {"kind": rt.kind, "apiVersion": obj.get("apiVersion") or rt.api_version(version), **obj}
            apply_defaults(rt, obj)
            errors = prepare_create(rt, obj, now)
            errors += validate(rt, obj, None)
            if errors:
                raise invalid(rt, name, errors)
            if coll.get(namespace, name) is not None:
                raise already_exists(rt, name)
            if dry_run:
                return Entry(obj, 0)
            entry = self._commit(coll, ADDED, obj, None)
            if rt.key == CRD_KEY:
                self._register(from_crd(obj))
            return entry

    def replace(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        version: str | None = None,
        dry_run: bool = False,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
    ) -> Entry:
        obj = _private_copy(body)
        with self.lock:
            coll = self._collection(rt)
            current = coll.get(namespace, name)
            if current is None:
                raise not_found(rt, name)
            return self._replace(coll, current, obj, subresource, version, dry_run, field_validation, warnings)

    def _replace(
        self,
        coll: Collection,
        current: Entry,
        obj: dict[str, Any],
        subresource: str | None,
        version: str | None,
        dry_run: bool,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
        patched: bool = False,
    ) -> Entry:
        rt = coll.rt
        self._check_type(rt, obj, version)
        self._prune_unknown(rt, obj, version, field_validation, warnings, patched=patched)
        metadata = _metadata(obj)
        given = metadata.get("name")
        if given and given != current.name:
            raise bad_request(f"the name of the object ({given}) does not match the name on the URL ({current.name})")
        self._check_namespace(rt, metadata, current.namespace)
        rv = metadata.get("resourceVersion")
        if rv and rv != str(current.rv):
            raise conflict(rt, current.name, STALE_WRITE)
        old = current.obj
        if subresource == "status":
            new = _private_copy(old)
            if "status" in obj:
                new["status"] = obj["status"]
            else:
                new.pop("status", None)
            errors = validate_status(rt, new)
        else:
            new = {**obj, "kind": old["kind"], "apiVersion": old["apiVersion"]}
            metadata = new["metadata"]
            old_metadata = old["metadata"]
            for field in ("uid", "creationTimestamp", "generation", "namespace", "name"):
                if field in old_metadata:
                    metadata[field] = old_metadata[field]
                else:
                    metadata.pop(field, None)
            for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink", "managedFields"):
                metadata.pop(field, None)
            if rt.status:
                # On the main resource the real server ignores status; only .../status writes it.
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            apply_defaults(rt, new, old)
            errors = validate(rt, new, old)
            if rt.generation and _spec_part(new) != _spec_part(old):
                metadata["generation"] = old_metadata.get("generation", 0) + 1
        if errors:
            raise invalid(rt, current.name, errors)
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return current  # a no-op write: no new resourceVersion, no watch event
        if dry_run:
            return Entry(new, current.rv)
        entry = self._commit(coll, MODIFIED, new, current)
        if rt.key == CRD_KEY:
            self._register(from_crd(new))
        return entry

    def patch(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        content_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
        version: str | None = None,
        dry_run: bool = False,
        field_manager: str | None = None,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
    ) -> tuple[Entry, bool]:
        """The patched object and whether the patch created it (server-side apply only)."""
        with self.lock:
            coll = self._collection(rt)
            current = coll.get(namespace, name)
            if content_type == APPLY_PATCH:
                if not field_manager:
                    raise invalid(
                        rt,
                        "",
                        [required("fieldManager", "is required for apply patch")],
                        kind="PatchOptions",
                        group="meta.k8s.io",
                    )
                if not isinstance(patch, dict):
                    raise bad_request("the body of an apply patch must be an object")
                if current is None:
                    if subresource:
                        raise not_found(rt, name)
                    body = _private_copy(patch)
                    _metadata(body).setdefault("name", name)
                    given = body["metadata"]["name"]
                    if given != name:
                        raise bad_request(
                            f"the name of the object ({given}) does not match the name on the URL ({name})"
                        )
                    created = self.create(
                        rt,
                        namespace,
                        body,
                        version=version,
                        dry_run=dry_run,
                        field_validation=field_validation,
                        warnings=warnings,
                    )
                    return created, True
                # Server-side apply without field ownership: the applied fields merge into the object.
                content_type = STRATEGIC_MERGE_PATCH if rt.builtin else MERGE_PATCH
            if content_type == STRATEGIC_MERGE_PATCH and not rt.builtin:
                raise unsupported_media_type(content_type, [JSON_PATCH, MERGE_PATCH, APPLY_PATCH])
            if current is None:
                raise not_found(rt, name)
            patched = apply_patch(content_type, current.obj, patch)
            entry = self._replace(
                coll,
                current,
                _private_copy(patched),
                subresource,
                version,
                dry_run,
                field_validation,
                warnings,
                patched=True,
            )
            return entry, False

    # --- scale and binding ----------------------------------------------------------------------------

    @staticmethod
    def scale_of(entry: Entry) -> dict[str, Any]:
        """The autoscaling/v1 Scale view of a workload."""
        obj = entry.obj
        metadata = obj["metadata"]
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: metadata[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in metadata
            },
            "spec": {"replicas": spec.get("replicas", 0)},
            "status": {"replicas": status.get("replicas", 0), "selector": selector_to_string(spec.get("selector"))},
        }

    def replace_scale(self, rt: ResourceType, namespace: str, name: str, body: Any, *, dry_run: bool = False) -> dict:
        scale = _private_copy(body)
        with self.lock:
            coll = self._collection(rt)
            current = coll.get(namespace, name)
            if current is None:
                raise not_found(rt, name)
            return self._set_replicas(coll, current, scale, dry_run)

    def patch_scale(
        self, rt: ResourceType, namespace: str, name: str, content_type: str, patch: Any, *, dry_run: bool = False
    ) -> dict:
        with self.lock:
            coll = self._collection(rt)
            current = coll.get(namespace, name)
            if current is None:
                raise not_found(rt, name)
            if content_type == APPLY_PATCH:
                content_type = STRATEGIC_MERGE_PATCH
            scale = apply_patch(content_type, self.scale_of(current), patch)
            return self._set_replicas(coll, current, _private_copy(scale), dry_run)

    def _set_replicas(self, coll: Collection, current: Entry, scale: dict[str, Any], dry_run: bool) -> dict:
        rt = coll.rt
        metadata = _metadata(scale)
        rv = metadata.get("resourceVersion")
        if rv and rv != str(current.rv):
            raise conflict(rt, current.name, STALE_WRITE)
        replicas = (scale.get("spec") or {}).get("replicas", 0)
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise bad_request('Scale in version "v1" cannot be handled as a Scale: spec.replicas must be an integer')
        if replicas < 0:
            raise invalid(
                rt,
                current.name,
                [invalid_value("spec.replicas", replicas, "must be greater than or equal to 0")],
                kind="Scale",
                group="autoscaling",
            )
        new = _private_copy(current.obj)
        new.setdefault("spec", {})["replicas"] = replicas
        return self.scale_of(self._replace(coll, current, new, None, None, dry_run))

    def bind(self, namespace: str, name: str, body: Any) -> Entry:
        """pods/binding: what a scheduler posts to place a Pod; the only way to set spec.nodeName."""
        binding = _private_copy(body)
        rt = self._types["pods"]
        with self.lock:
            coll = self._collection(rt)
            current = coll.get(namespace, name)
            if current is None:
                raise not_found(rt, name)
            node = (binding.get("target") or {}).get("name")
            if not node:
                raise invalid(rt, name, [required("target.name")], kind="Binding")
            assigned = (current.obj.get("spec") or {}).get("nodeName")
            if assigned:
                raise conflict(rt, name, f'pod {name} is already assigned to node "{assigned}"', subresource="binding")
            new = _private_copy(current.obj)
            new["spec"]["nodeName"] = node
            status = new.setdefault("status", {})
            conditions = [c for c in status.get("conditions") or () if c.get("type") != "PodScheduled"]
            conditions.append(
                {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": self._now()}
            )
            status["conditions"] = conditions
            return self._commit(coll, MODIFIED, new, current)

    # --- delete and garbage collection ---------------------------------------------------------------

    def delete(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        *,
        propagation: str | None = None,
        preconditions: dict[str, Any] | None = None,
        dry_run: bool = False,
    ) -> Entry:
        if propagation is not None and propagation not in PROPAGATION_POLICIES:
            raise bad_request(
                f'propagationPolicy: Unsupported value: "{propagation}": '
                'supported values: "Orphan", "Background", "Foreground"'
            )
        with self.lock:
            coll = self._collection(rt)
            current = coll.get(namespace, name)
            if current is None:
                raise not_found(rt, name)
            preconditions = preconditions or {}
            uid, actual_uid = preconditions.get("uid"), current.obj["metadata"]["uid"]
            if uid and uid != actual_uid:
                raise conflict(
                    rt, name, f"Precondition failed: UID in precondition: {uid}, UID in object meta: {actual_uid}"
                )
            rv = preconditions.get("resourceVersion")
            if rv and rv != str(current.rv):
                raise conflict(
                    rt,
                    name,
                    f"Precondition failed: ResourceVersion in precondition: {rv}, "
                    f"ResourceVersion in meta: {current.rv}",
                )
            if dry_run:
                return current
            return self._delete(coll, current, propagation or rt.default_propagation)

    def _delete(self, coll: Collection, current: Entry, propagation: str) -> Entry:
        rt = coll.rt
        uid = current.obj["metadata"]["uid"]
        if rt.key == NAMESPACES_KEY:
            self._empty_namespace(current.name)
        elif rt.key == CRD_KEY:
            self._drop_custom_resources(current.obj)
        if propagation == "Foreground":
            self._delete_dependents(uid, propagation)
        final = {**current.obj, "metadata": dict(current.obj["metadata"])}
        entry = self._commit(coll, DELETED, final, current)
        if propagation == "Background":
            self._delete_dependents(uid, propagation)
        elif propagation == "Orphan":
            self._orphan_dependents(uid)
        return entry

    def _dependents(self, uid: str) -> Iterator[tuple[Collection, Entry]]:
        for key, namespace, name in sorted(self._owners.get(uid, ())):
            coll = self._collections.get(key)
            entry = coll.get(namespace, name) if coll else None
            if entry is not None:
                yield coll, entry

    def _drop_owner_ref(self, coll: Collection, entry: Entry, uid: str) -> None:
        new = _private_copy(entry.obj)
        refs = [r for r in new["metadata"].get("ownerReferences") or () if r.get("uid") != uid]
        if refs:
            new["metadata"]["ownerReferences"] = refs
        else:
            new["metadata"].pop("ownerReferences", None)
        self._commit(coll, MODIFIED, new, entry)

    def _delete_dependents(self, uid: str, propagation: str) -> None:
        for coll, entry in list(self._dependents(uid)):
            entry = coll.get(*entry.key)
            if entry is None:
                continue
            if len(_owner_uids(entry.obj)) > 1:
                # Another owner still holds it; the collector only removes this owner's reference.
                self._drop_owner_ref(coll, entry, uid)
            else:
                self._delete(coll, entry, propagation)

    def _orphan_dependents(self, uid: str) -> None:
        for coll, entry in list(self._dependents(uid)):
            self._drop_owner_ref(coll, entry, uid)

    def _empty_namespace(self, namespace: str) -> None:
        for coll in list(self._collections.values()):
            if not coll.rt.namespaced:
                continue
            for entry in list((coll.objects.get(namespace) or {}).values()):
                if coll.get(namespace, entry.name) is entry:
                    self._delete(coll, entry, "Background")

    def _drop_custom_resources(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec") or {}
        key = f"{(spec.get('names') or {}).get('plural')}.{spec.get('group')}"
        coll = self._collections.get(key)
        if coll is None:
            return
        for entry in coll.sorted_entries(None):
            self._delete(coll, entry, "Background")
        self._unregister(key)

    def delete_collection(
        self,
        rt: ResourceType,
        namespace: str | None,
        *,
        labels: LabelSelector = LabelSelector(),
        fields: FieldSelector = FieldSelector(),
        propagation: str | None = None,
        dry_run: bool = False,
    ) -> list[Entry]:
        with self.lock:
            coll = self._collection(rt)
            deleted = []
            for entry in coll.sorted_entries(namespace):
                if not (labels.matches_object(entry.obj) and fields.matches_object(entry.obj)):
                    continue
                current = coll.get(*entry.key)
                if current is None:
                    continue
                if dry_run:
                    deleted.append(current)
                else:
                    deleted.append(self._delete(coll, current, propagation or rt.default_propagation))
            return deleted

    # --- list and watch --------------------------------------------------------------------------------

    def _state_at(self, coll: Collection, rv: int, namespace: str | None) -> list[Entry]:
        """The objects as they were at ``rv``, undoing the retained changes after it."""
        if rv < self._horizon(coll):
            raise expired(TOO_OLD_CONTINUE)
        start = bisect_right(coll.changes, rv, key=_change_rv)
        if start == len(coll.changes):
            return coll.sorted_entries(namespace)
        state = {e.key: e for e in coll.sorted_entries(namespace)}
        seen: set[tuple[str, str]] = set()
        for change in coll.changes[start:]:
            key = change.entry.key
            if key in seen or (namespace is not None and key[0] != namespace):
                continue
            seen.add(key)
            if change.type == ADDED:
                state.pop(key, None)
            elif change.prev is not None:
                state[key] = change.prev
        return [state[k] for k in sorted(state)]

    def list(
        self,
        rt: ResourceType,
        namespace: str | None,
        *,
        labels: LabelSelector = LabelSelector(),
        fields: FieldSelector = FieldSelector(),
        limit: int = 0,
        continue_token: str | None = None,
        resource_version: str | None = None,
        resource_version_match: str | None = None,
    ) -> ListResult:
        with self.lock:
            coll = self._collection(rt)
            start_after: tuple[str, str] | None = None
            if continue_token:
                if resource_version:
                    raise bad_request("specifying resource version is not allowed when using continue")
                list_rv, start_after = decode_continue(continue_token)
                entries = self._state_at(coll, list_rv, namespace)
            elif resource_version_match == "Exact" and resource_version:
                list_rv = _parse_rv(resource_version)
                if list_rv < self._horizon(coll):
                    raise expired(f"too old resource version: {list_rv} ({self._horizon(coll) + 1})")
                entries = self._state_at(coll, list_rv, namespace)
            else:
                if resource_version:
                    _parse_rv(resource_version)
                list_rv = self.revision
                entries = coll.sorted_entries(namespace)
            start = 0
            if start_after is not None:
                start = bisect_right(entries, start_after, key=lambda e: e.key)
            selective = bool(labels or fields)
            selected: list[Entry] = []
            token, remaining = "", None
            for i in range(start, len(entries)):
                entry = entries[i]
                if selective and not (labels.matches_object(entry.obj) and fields.matches_object(entry.obj)):
                    continue
                if limit and len(selected) == limit:
                    if not selective:
                        remaining = len(entries) - i
                    token = encode_continue(list_rv, selected[-1].key)
                    break
                selected.append(entry)
            return ListResult(rt, selected, list_rv, token, remaining)

    def watch_start(
        self,
        rt: ResourceType,
        namespace: str | None,
        resource_version: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
    ) -> tuple[Collection, list[Entry], int]:
        """The collection to follow, the synthetic ADDED objects to send first, the resourceVersion to follow from.

        Without a resourceVersion (or "0") the watch starts with the current objects, as the real
        server does; with one it sends the changes after it, or 410 when those are no longer kept.
        """
        with self.lock:
            coll = self._collection(rt)
            if resource_version in (None, "", "0"):
                initial = [
                    e
                    for e in coll.sorted_entries(namespace)
                    if labels.matches_object(e.obj) and fields.matches_object(e.obj)
                ]
                return coll, initial, self.revision
            rv = _parse_rv(resource_version)
            oldest = max(self._horizon(coll), self.watch_cache_revision)
            if rv < oldest:
                raise expired(f"too old resource version: {rv} ({oldest + 1})")
            return coll, [], rv

    def changes_after(self, coll: Collection, rv: int) -> tuple[list[Change] | None, int]:
        """Changes to ``coll`` after ``rv`` (None when no longer retained) and the current revision.

        For a watch already open: only changes to its own collection that it has not had yet and
        that were compacted away end it, not the store-wide compacted revision."""
        with self.lock:
            if rv < coll.compacted_rv:
                return None, self.revision
            start = bisect_right(coll.changes, rv, key=_change_rv)
            return coll.changes[start:], self.revision

    # --- persistence ------------------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        with self.lock:
            keys = sorted(self._collections, key=lambda k: (k != CRD_KEY, k))
            collections = {
                key: [e.obj for e in self._collections[key].sorted_entries(None)]
                for key in keys
                if self._collections[key].objects
            }
            return orjson.dumps({"resourceVersion": self.revision, "collections": collections})

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(self.snapshot())
        os.replace(tmp, path)

    @classmethod
    def from_snapshot(cls, data: bytes, **options: Any) -> Store:
        """A store with the snapshot's objects and counter, and no change history."""
        state = orjson.loads(data)
        store = cls(bootstrap=False, **options)
        for key, objects in state["collections"].items():
            coll = store._collections.get(key)
            if coll is None:
                continue  # custom resources whose definition is gone
            for obj in objects:
                entry = Entry(obj, int(obj["metadata"]["resourceVersion"]))
                coll.objects.setdefault(entry.namespace, {})[entry.name] = entry
                store._index_owners(key, None, entry)
                if key == CRD_KEY:
                    store._register(from_crd(obj))
        store.revision = int(state["resourceVersion"])
        store.compacted_revision = store.revision
        for coll in store._collections.values():
            coll.compacted_rv = store.revision
        return store

    @classmethod
    def load(cls, path: str | os.PathLike[str], **options: Any) -> Store:
        return cls.from_snapshot(Path(path).read_bytes(), **options)

    # --- for tests and tools: direct access by resource name ------------------------------------------

    @property
    def resource_version(self) -> int:
        return self.revision

    def get_object(self, resource: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        """A copy of one stored object, or None; ``resource`` as kubectl names it (``jobs.batch``)."""
        with self.lock:
            rt = self.resource_type(resource)
            entry = self._collections[rt.key].get(namespace if rt.namespaced else "", name)
            return orjson.loads(entry.raw) if entry else None

    def list_objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            rt = self.resource_type(resource)
            return [orjson.loads(e.raw) for e in self._collections[rt.key].sorted_entries(namespace)]

    def create_object(self, resource: str, obj: dict[str, Any], namespace: str = "") -> dict[str, Any]:
        """Create as a client would, with defaults and validation, without going through HTTP."""
        rt = self.resource_type(resource)
        if rt.namespaced:
            namespace = namespace or (obj.get("metadata") or {}).get("namespace") or "default"
        return orjson.loads(self.create(rt, namespace if rt.namespaced else "", obj).raw)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {key: coll.count() for key, coll in self._collections.items() if coll.objects}
