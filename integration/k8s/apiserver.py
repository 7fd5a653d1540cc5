"""A Kubernetes API test server: the real REST API over HTTP, for the official client and the simulator.

No Kubernetes API server can be installed on the machines that run the integration suite, so this
module serves the API itself, well enough that ``kubernetes.config.load_kube_config`` and the
official client's typed APIs, ``kubernetes.watch.Watch`` and ``kubernetes.dynamic.DynamicClient``
work against it unchanged. It is generic: it knows resources, not GPUs; the node simulator
(integration/k8s/simulator.py) plays kubelet, scheduler and controllers over HTTP.

Served: discovery (/api, /api/v1, /apis, /apis/<group>[/<version>], /version, /healthz), the core
kinds (Namespace, Pod with binding and eviction, Node, ConfigMap, Secret, Service, ServiceAccount,
Event, ResourceQuota, LimitRange), apps/v1 (Deployment, ReplicaSet, StatefulSet, DaemonSet), batch/v1 (Job, CronJob),
coordination.k8s.io/v1 Lease, apiextensions.k8s.io/v1 CustomResourceDefinition and the custom
resources each one defines. Verbs: get, list (selectors, pagination), watch, create, update, patch
(JSON, merge, strategic merge; apply approximated as a merge), delete (with propagation), and
deleteCollection; the status and scale subresources; ``pods/log``, read from the node's kubelet
(apiserver_logs: the node simulator serves its kubelets' logs). The semantics live in apiserver_store.
Like kube-apiserver it compacts its change history on a timer (``compaction_interval``, 300 s), stores
quantities in their canonical form (apiserver_quantity), and prunes the fields of custom resources
their schema does not declare, warning or refusing by ``fieldValidation`` (apiserver_pruning).

Use :func:`start` in tests (the server runs in a background thread), or run
``python -m integration.k8s.apiserver --port 6443 --kubeconfig kubeconfig.yaml`` by hand.

Who may do what: the server's own token is a cluster admin's. ``users`` adds tokens of named
users (``system:serviceaccount:gpush:gpush-broker``); their requests are recorded in ``audit``
(a list, when given) as the attributes kube-apiserver authorizes by, and, with an
``authorizer`` (such as apiserver_rbac.RbacPolicy's ``allows``), a request for a resource it
does not allow is refused with the real server's 403.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import uvicorn
import yaml
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from integration.k8s.apiserver_errors import (
    ApiError,
    bad_request,
    invalid,
    method_not_allowed,
    no_such_resource,
    unauthorized,
    unsupported,
    unsupported_media_type,
)
from integration.k8s.apiserver_kinds import ALL_VERBS, ResourceType
from integration.k8s.apiserver_logs import PodLogs
from integration.k8s.apiserver_patch import APPLY_PATCH, JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH
from integration.k8s.apiserver_rbac import RequestAttributes, forbidden, request_attributes
from integration.k8s.apiserver_selectors import FieldSelector, LabelSelector, parse_field_selector, parse_label_selector
from integration.k8s.apiserver_store import (
    ADDED,
    DELETED,
    FIELD_VALIDATIONS,
    MODIFIED,
    Change,
    Collection,
    Entry,
    Store,
)

log = logging.getLogger(__name__)

KUBERNETES_VERSION = {
    "major": "1",
    "minor": "33",
    "gitVersion": "v1.33.0-gpush.test",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-04-23T00:00:00Z",
    "goVersion": "go1.24.2",
    "compiler": "gc",
    "platform": "linux/amd64",
}
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH, APPLY_PATCH)
# kube-apiserver's --etcd-compaction-interval: history older than one to two of these is gone (410).
COMPACTION_INTERVAL = 300.0
_UNAUTHENTICATED_PATHS = frozenset({"/healthz", "/livez", "/readyz", "/version"})
_JSON = "application/json"


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type=_JSON)


def _status_success(rt: ResourceType, entry: Entry | None = None, code: int = 200) -> Response:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
    if entry is not None:
        details: dict[str, Any] = {"name": entry.name}
        if rt.group:
            details["group"] = rt.group
        details["kind"] = rt.plural
        details["uid"] = entry.obj["metadata"]["uid"]
        body["details"] = details
    else:
        body["code"] = code
    return _json(body, code)


def _flag(value: str | None) -> bool:
    return value in ("true", "1", "True")


def _int(query: Any, name: str, default: int = 0) -> int:
    raw = query.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f"{name}: Invalid value: {raw!r}: must be an integer") from None


def _watch_line(kind: str, raw: bytes) -> bytes:
    return b'{"type":"' + kind.encode() + b'","object":' + raw + b"}\n"


def _watch_lines(
    changes: Sequence[Change], namespace: str | None, labels: LabelSelector, fields: FieldSelector
) -> list[bytes]:
    """The events one watcher sees: an object that starts or stops matching its selectors is
    ADDED or DELETED for it, as on the real server."""
    lines = []
    selective = bool(labels or fields)
    for change in changes:
        entry = change.entry
        if namespace is not None and entry.namespace != namespace:
            continue
        kind = change.type
        if selective:
            now = labels.matches_object(entry.obj) and fields.matches_object(entry.obj)
            if kind == MODIFIED:
                prev = change.prev
                before = prev is not None and labels.matches_object(prev.obj) and fields.matches_object(prev.obj)
                if now and not before:
                    kind = ADDED
                elif before and not now:
                    kind = DELETED
                elif not now:
                    continue
            elif not now:
                continue
        lines.append(_watch_line(kind, entry.raw))
    return lines


class ApiServerApp:
    """The ASGI application: routing, authentication, query parsing and rendering over a Store."""

    def __init__(
        self,
        store: Store,
        *,
        token: str | None,
        bookmark_interval: float = 5.0,
        watch_timeout: float = 1800.0,
        compaction_interval: float | None = COMPACTION_INTERVAL,
        address: str = "",
        users: Mapping[str, str] | None = None,
        authorizer: Callable[[RequestAttributes], bool] | None = None,
        audit: list[RequestAttributes] | None = None,
    ) -> None:
        self.store = store
        self.token = token
        self.users = dict(users or {})  # token -> user name, besides the admin's token
        self.authorizer = authorizer
        self.audit = audit
        self.bookmark_interval = bookmark_interval
        self.watch_timeout = watch_timeout
        self.compaction_interval = compaction_interval
        self.address = address
        self.logs = PodLogs(store)
        self._compactor: asyncio.Task[None] | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            response = await self._handle(request)
        except ApiError as exc:
            response = _json(exc.status(), exc.code)
        except Exception as exc:  # the server must answer a Status even for its own bugs
            log.exception("internal error on %s %s", request.method, request.url.path)
            response = _json(ApiError(500, "InternalError", f"Internal error occurred: {exc!r}").status(), 500)
        await response(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.store.attach_loop(asyncio.get_running_loop())
                self.store.start_watch_cache()
                if self.compaction_interval:
                    self._compactor = asyncio.create_task(self._compact_every(self.compaction_interval))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._compactor is not None:
                    self._compactor.cancel()
                self.store.attach_loop(None)
                await self.logs.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _compact_every(self, interval: float) -> None:
        """kube-apiserver's compactor: each tick compacts etcd to the revision the tick before saw."""
        while True:
            await asyncio.sleep(interval)
            self.store.compaction_tick()

    # --- routing ----------------------------------------------------------------------------------------

    async def _handle(self, request: Request) -> Response:
        path = request.url.path.rstrip("/") or "/"  # the client asks for /version/
        if path in ("/healthz", "/livez", "/readyz"):
            return PlainTextResponse("ok")
        if path == "/version":
            return _json(KUBERNETES_VERSION)
        if self.token is not None and path not in _UNAUTHENTICATED_PATHS:
            presented = request.headers.get("authorization") or ""
            if presented != f"Bearer {self.token}":
                user = self.users.get(presented.removeprefix("Bearer ")) if presented.startswith("Bearer ") else None
                if user is None:
                    raise unauthorized()
                self._authorize(request_attributes(user, request.method, path, request.query_params))
        segments = [s for s in path.split("/") if s]
        if not segments:
            return _json({"paths": ["/api", "/api/v1", "/apis", *self._group_paths(), "/healthz", "/version"]})
        if segments[0] == "api":
            if len(segments) == 1:
                return _json(
                    {
                        "kind": "APIVersions",
                        "versions": ["v1"],
                        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.address}],
                    }
                )
            if segments[1] != "v1":
                raise no_such_resource()
            return await self._resource_request(request, "", "v1", segments[2:])
        if segments[0] == "apis":
            if len(segments) == 1:
                return _json(
                    {
                        "kind": "APIGroupList",
                        "apiVersion": "v1",
                        "groups": [self._group(g, v) for g, v in self.store.groups().items()],
                    }
                )
            versions = self.store.groups().get(segments[1])
            if not versions:
                raise no_such_resource()
            if len(segments) == 2:
                return _json({"kind": "APIGroup", "apiVersion": "v1", **self._group(segments[1], versions)})
            return await self._resource_request(request, segments[1], segments[2], segments[3:])
        raise no_such_resource()

    def _authorize(self, attributes: RequestAttributes) -> None:
        if self.audit is not None:
            self.audit.append(attributes)
        if self.authorizer is not None and attributes.resource_request and not self.authorizer(attributes):
            raise forbidden(attributes)

    def _group_paths(self) -> list[str]:
        paths = []
        for group, versions in self.store.groups().items():
            paths.append(f"/apis/{group}")
            paths.extend(f"/apis/{group}/{v}" for v in versions)
        return paths

    @staticmethod
    def _group(group: str, versions: list[str]) -> dict[str, Any]:
        listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": listed, "preferredVersion": listed[0]}

    def _resource_list(self, group: str, version: str) -> dict[str, Any]:
        resources: list[dict[str, Any]] = []
        rts = self.store.resources(group, version)
        if not rts:
            raise no_such_resource()
        for rt in rts:
            entry: dict[str, Any] = {
                "name": rt.plural,
                "singularName": rt.singular,
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": list(ALL_VERBS),
            }
            if rt.short_names:
                entry["shortNames"] = list(rt.short_names)
            if rt.categories:
                entry["categories"] = list(rt.categories)
            resources.append(entry)
            sub = {"singularName": "", "namespaced": rt.namespaced}
            if rt.status:
                resources.append(
                    {"name": f"{rt.plural}/status", **sub, "kind": rt.kind, "verbs": ["get", "patch", "update"]}
                )
            if rt.scale:
                resources.append(
                    {
                        "name": f"{rt.plural}/scale",
                        **sub,
                        "group": "autoscaling",
                        "version": "v1",
                        "kind": "Scale",
                        "verbs": ["get", "patch", "update"],
                    }
                )
            if rt.key == "pods":
                resources.append({"name": "pods/binding", **sub, "kind": "Binding", "verbs": ["create"]})
                resources.append({"name": "pods/log", **sub, "kind": "Pod", "verbs": ["get"]})
                resources.append(
                    {
                        "name": "pods/eviction",
                        **sub,
                        "group": "policy",
                        "version": "v1",
                        "kind": "Eviction",
                        "verbs": ["create"],
                    }
                )
        group_version = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}

    async def _resource_request(self, request: Request, group: str, version: str, rest: list[str]) -> Response:
        method = request.method
        if not rest:
            if method != "GET":
                raise method_not_allowed()
            return _json(self._resource_list(group, version))
        watch_path = rest[0] == "watch"
        if watch_path:
            rest = rest[1:]
        namespace: str | None = None
        if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise no_such_resource()
        rt = self.store.resolve(group, version, rest[0])
        if rt is None or (namespace is not None and not rt.namespaced):
            raise no_such_resource()
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        if rt.namespaced and namespace is None and name is not None:
            raise no_such_resource()
        query = request.query_params
        ns = namespace or ""
        if name is None:
            if method == "GET":
                if watch_path or _flag(query.get("watch")):
                    return self._watch(rt, namespace, query)
                return self._list(rt, namespace, version, query)
            if method == "POST":
                if rt.namespaced and namespace is None:
                    raise method_not_allowed()
                warnings: list[str] = []
                entry = self.store.create(
                    rt,
                    ns,
                    await self._body(request),
                    version=version,
                    dry_run=self._dry_run(query),
                    field_validation=self._field_validation(rt, query, "CreateOptions"),
                    warnings=warnings,
                )
                return self._object(rt, version, entry, 201, warnings)
            if method == "DELETE":
                return await self._delete_collection(request, rt, namespace, version)
            raise method_not_allowed()
        if watch_path:
            return self._watch(rt, namespace, query, name=name)
        if subresource is None:
            return await self._object_request(request, rt, ns, name, version)
        if subresource == "status" and rt.status:
            return await self._object_request(request, rt, ns, name, version, subresource="status")
        if subresource == "scale" and rt.scale:
            return await self._scale_request(request, rt, ns, name)
        if rt.key == "pods" and subresource == "log":
            if method != "GET":
                raise method_not_allowed()
            return await self.logs.get(ns, name, query)
        if rt.key == "pods" and subresource == "binding":
            if method != "POST":
                raise method_not_allowed()
            self.store.bind(ns, name, await self._body(request))
            return _status_success(rt, code=201)
        if rt.key == "pods" and subresource == "eviction":
            if method != "POST":
                raise method_not_allowed()
            body = await self._body(request)
            options = body.get("deleteOptions") if isinstance(body, dict) else None
            self.store.delete(rt, ns, name, preconditions=(options or {}).get("preconditions"))
            return _status_success(rt, code=201)
        raise no_such_resource()

    # --- verbs --------------------------------------------------------------------------------------------

    @staticmethod
    async def _body(request: Request, *, optional: bool = False) -> Any:
        raw = await request.body()
        if not raw.strip():
            if optional:
                return None
            raise bad_request("the request body is empty")
        content_type = request.headers.get("content-type", _JSON).split(";")[0].strip()
        try:
            if content_type == APPLY_PATCH or content_type.endswith("yaml"):
                return yaml.safe_load(raw)
            return orjson.loads(raw)
        except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
            raise bad_request(
                f"the request body is not valid {'YAML' if 'yaml' in content_type else 'JSON'}: {exc}"
            ) from None

    @staticmethod
    def _dry_run(query: Any) -> bool:
        values = query.getlist("dryRun")
        if any(v != "All" for v in values):
            raise bad_request(f'dryRun: Unsupported value: {values!r}: supported values: "All"')
        return bool(values)

    @staticmethod
    def _field_validation(rt: ResourceType, query: Any, options: str) -> str:
        value = query.get("fieldValidation") or ""
        if value not in ("", *FIELD_VALIDATIONS):
            supported = sorted(["", *FIELD_VALIDATIONS])
            raise invalid(rt, "", [unsupported("fieldValidation", value, supported)], kind=options, group="meta.k8s.io")
        return value or "Warn"  # the default since Kubernetes 1.27

    @staticmethod
    def _object(
        rt: ResourceType, version: str, entry: Entry, code: int = 200, warnings: Sequence[str] = ()
    ) -> Response:
        raw = entry.raw
        served = rt.api_version(version)
        if not rt.builtin and entry.obj.get("apiVersion") != served:
            raw = orjson.dumps({**entry.obj, "apiVersion": served})
        response = Response(raw, code, media_type=_JSON)
        for text in dict.fromkeys(warnings):  # one header per distinct warning, as the real server
            quoted = text.replace("\\", "\\\\").replace('"', '\\"')
            response.headers.append("Warning", f'299 - "{quoted}"')
        return response

    @staticmethod
    def _patch_type(request: Request) -> str:
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        if content_type not in PATCH_TYPES:
            raise unsupported_media_type(content_type, list(PATCH_TYPES))
        return content_type

    async def _object_request(
        self, request: Request, rt: ResourceType, ns: str, name: str, version: str, subresource: str | None = None
    ) -> Response:
        method = request.method
        query = request.query_params
        if method == "GET":
            return self._object(rt, version, self.store.get(rt, ns, name))
        warnings: list[str] = []
        if method == "PUT":
            body = await self._body(request)
            entry = self.store.replace(
                rt,
                ns,
                name,
                body,
                subresource=subresource,
                version=version,
                dry_run=self._dry_run(query),
                field_validation=self._field_validation(rt, query, "UpdateOptions"),
                warnings=warnings,
            )
            return self._object(rt, version, entry, warnings=warnings)
        if method == "PATCH":
            content_type = self._patch_type(request)
            body = await self._body(request)
            entry, created = self.store.patch(
                rt,
                ns,
                name,
                content_type,
                body,
                subresource=subresource,
                version=version,
                dry_run=self._dry_run(query),
                field_manager=query.get("fieldManager"),
                field_validation=self._field_validation(rt, query, "PatchOptions"),
                warnings=warnings,
            )
            return self._object(rt, version, entry, 201 if created else 200, warnings)
        if method == "DELETE" and subresource is None:
            propagation, preconditions = self._delete_options(query, await self._body(request, optional=True))
            entry = self.store.delete(
                rt, ns, name, propagation=propagation, preconditions=preconditions, dry_run=self._dry_run(query)
            )
            if rt.key in ("pods", "services"):  # registries with ReturnDeletedObject: the object as deleted
                return self._object(rt, version, entry)
            return _status_success(rt, entry)
        raise method_not_allowed()

    async def _scale_request(self, request: Request, rt: ResourceType, ns: str, name: str) -> Response:
        method = request.method
        dry_run = self._dry_run(request.query_params)
        if method == "GET":
            return _json(self.store.scale_of(self.store.get(rt, ns, name)))
        if method == "PUT":
            return _json(self.store.replace_scale(rt, ns, name, await self._body(request), dry_run=dry_run))
        if method == "PATCH":
            content_type = self._patch_type(request)
            body = await self._body(request)
            return _json(self.store.patch_scale(rt, ns, name, content_type, body, dry_run=dry_run))
        raise method_not_allowed()

    @staticmethod
    def _delete_options(query: Any, body: Any) -> tuple[str | None, dict[str, Any] | None]:
        options = body if isinstance(body, dict) else {}
        propagation = query.get("propagationPolicy") or options.get("propagationPolicy")
        orphan = query.get("orphanDependents")
        orphan = _flag(orphan) if orphan is not None else options.get("orphanDependents")
        if propagation is None and orphan is not None:
            propagation = "Orphan" if orphan else "Background"
        return propagation, options.get("preconditions")

    def _selectors(self, rt: ResourceType, query: Any) -> tuple[LabelSelector, FieldSelector]:
        return (
            parse_label_selector(query.get("labelSelector")),
            parse_field_selector(query.get("fieldSelector"), rt.selectable),
        )

    def _list(self, rt: ResourceType, namespace: str | None, version: str, query: Any) -> Response:
        labels, fields = self._selectors(rt, query)
        result = self.store.list(
            rt,
            namespace,
            labels=labels,
            fields=fields,
            limit=_int(query, "limit"),
            continue_token=query.get("continue"),
            resource_version=query.get("resourceVersion"),
            resource_version_match=query.get("resourceVersionMatch"),
        )
        metadata: dict[str, Any] = {"resourceVersion": str(result.resource_version)}
        if result.continue_token:
            metadata["continue"] = result.continue_token
        if result.remaining is not None:
            metadata["remainingItemCount"] = result.remaining
        head = orjson.dumps({"kind": f"{rt.kind}List", "apiVersion": rt.api_version(version), "metadata": metadata})
        items = b",".join(entry.item(rt.builtin) for entry in result.entries)
        return Response(head[:-1] + b',"items":[' + items + b"]}", media_type=_JSON)

    async def _delete_collection(
        self, request: Request, rt: ResourceType, namespace: str | None, version: str
    ) -> Response:
        query = request.query_params
        labels, fields = self._selectors(rt, query)
        propagation, _ = self._delete_options(query, await self._body(request, optional=True))
        deleted = self.store.delete_collection(
            rt, namespace, labels=labels, fields=fields, propagation=propagation, dry_run=self._dry_run(query)
        )
        head = orjson.dumps(
            {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version(version),
                "metadata": {"resourceVersion": str(self.store.revision)},
            }
        )
        items = b",".join(entry.item(rt.builtin) for entry in deleted)
        return Response(head[:-1] + b',"items":[' + items + b"]}", media_type=_JSON)

    # --- watch ------------------------------------------------------------------------------------------

    def _watch(self, rt: ResourceType, namespace: str | None, query: Any, name: str | None = None) -> Response:
        labels, fields = self._selectors(rt, query)
        if name is not None:
            fields = FieldSelector((*fields.terms, ("metadata.name", True, name)))
        timeout = _int(query, "timeoutSeconds", 0) or self.watch_timeout
        bookmarks = _flag(query.get("allowWatchBookmarks"))
        initial_end = bookmarks and _flag(query.get("sendInitialEvents"))
        try:
            coll, initial, start_rv = self.store.watch_start(
                rt, namespace, query.get("resourceVersion"), labels, fields
            )
        except ApiError as exc:
            if exc.code != 410:
                raise
            # The real server answers 200 and sends the 410 as an ERROR event of the stream.
            return Response(_watch_line("ERROR", orjson.dumps(exc.status())), media_type=_JSON)
        stream = self._stream(rt, coll, namespace, labels, fields, initial, start_rv, timeout, bookmarks, initial_end)
        return StreamingResponse(stream, media_type=_JSON)

    def _bookmark(self, rt: ResourceType, rv: int, initial_end: bool = False) -> bytes:
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        if initial_end:
            metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
        return _watch_line(
            "BOOKMARK", orjson.dumps({"kind": rt.kind, "apiVersion": rt.api_version(), "metadata": metadata})
        )

    async def _stream(
        self,
        rt: ResourceType,
        coll: Collection,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        initial: list[Entry],
        start_rv: int,
        timeout: float,
        bookmarks: bool,
        initial_end: bool,
    ) -> AsyncIterator[bytes]:
        store = self.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if initial:
            yield b"".join(_watch_line(ADDED, e.raw) for e in initial)
        if initial_end:
            yield self._bookmark(rt, start_rv, initial_end=True)
        last = start_rv
        next_bookmark = loop.time() + self.bookmark_interval
        while not (coll.closed or store.closing):
            signal_ = store.signal(coll)
            changes, revision = store.changes_after(coll, last)
            if changes is None:
                gone = ApiError(410, "Expired", f"too old resource version: {last} ({coll.compacted_rv + 1})")
                yield _watch_line("ERROR", orjson.dumps(gone.status()))
                return
            # Every change to this collection up to ``revision`` is in ``changes``.
            last = revision
            if changes:
                lines = _watch_lines(changes, namespace, labels, fields)
                if lines:
                    yield b"".join(lines)
            now = loop.time()
            if now >= deadline:
                return
            if bookmarks and now >= next_bookmark:
                yield self._bookmark(rt, revision)
                next_bookmark = now + self.bookmark_interval
            wait = deadline - now
            if bookmarks:
                wait = min(wait, max(0.0, next_bookmark - now))
            try:
                await asyncio.wait_for(signal_.wait(), wait)
            except TimeoutError:
                pass


class TestApiServer:
    """One running test API server: its URL, its bearer token, its store, and a kubeconfig for it."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        state_file: str | Path | None = None,
        *,
        event_window: int = 100_000,
        bookmark_interval: float = 5.0,
        watch_timeout: float = 1800.0,
        compaction_interval: float | None = COMPACTION_INTERVAL,
        users: Mapping[str, str] | None = None,
        authorizer: Callable[[RequestAttributes], bool] | None = None,
        audit: list[RequestAttributes] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self.users = dict(users or {})  # token -> user name (see the module docstring)
        self.authorizer = authorizer
        self.audit = audit
        self.state_file = Path(state_file) if state_file else None
        self.event_window = event_window
        self.bookmark_interval = bookmark_interval
        self.watch_timeout = watch_timeout
        self.compaction_interval = compaction_interval
        if self.state_file is not None and self.state_file.exists():
            self.store = Store.load(self.state_file, event_window=event_window)
        else:
            self.store = Store(event_window=event_window)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> TestApiServer:
        if self._server is not None:
            return self
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(1024)
        self.port = sock.getsockname()[1]
        app = ApiServerApp(
            self.store,
            token=self.token,
            bookmark_interval=self.bookmark_interval,
            watch_timeout=self.watch_timeout,
            compaction_interval=self.compaction_interval,
            address=f"{self.host}:{self.port}",
            users=self.users,
            authorizer=self.authorizer,
            audit=self.audit,
        )
        config = uvicorn.Config(
            app,
            lifespan="on",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            timeout_keep_alive=60,
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name=f"k8s-test-apiserver-{self.port}", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + 15
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise RuntimeError(f"the Kubernetes API test server did not start on {self.url}")
            time.sleep(0.005)
        self._server, self._thread, self._socket = server, thread, sock
        return self

    def stop(self) -> None:
        """Stop serving (open watches end) and write the state file if there is one."""
        server, thread, sock = self._server, self._thread, self._socket
        if server is None:
            return
        self._server = self._thread = self._socket = None
        self.store.close()
        server.should_exit = True
        if thread is not None:
            thread.join(15)
        if sock is not None:
            sock.close()
        if self.state_file is not None:
            self.store.save(self.state_file)

    def restart(self) -> None:
        """Stop and start again on the same port from the saved state: the objects and the
        resourceVersion counter survive, the change history does not (older resourceVersions get 410)."""
        self.stop()
        if self.state_file is not None:
            self.store = Store.load(self.state_file, event_window=self.event_window)
        else:
            self.store = Store.from_snapshot(self.store.snapshot(), event_window=self.event_window)
        self.start()

    def kubeconfig(
        self, context: str = "gpush-test", namespace: str = "default", token: str | None = None
    ) -> dict[str, Any]:
        """A kubeconfig for this server: as its admin, or with ``token`` one of ``users``'."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": self.url}}],
            "users": [{"name": context, "user": {"token": token or self.token}}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
            "current-context": context,
            "preferences": {},
        }

    def write_kubeconfig(self, path: str | Path, context: str = "gpush-test", token: str | None = None) -> Path:
        """A kubeconfig whose current context reaches this server with its token (or ``token``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.kubeconfig(context, token=token), sort_keys=False))
        path.chmod(0o600)
        return path

    def __enter__(self) -> TestApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    state_file: str | Path | None = None,
    **options: Any,
) -> TestApiServer:
    """Start a test API server in a background thread; ``token=None`` makes up a random one.

    ``options``: ``users``, ``authorizer`` and ``audit`` (see the module docstring),
    ``event_window`` (changes kept per resource for watches and continue tokens),
    ``bookmark_interval`` (seconds between BOOKMARK events), ``watch_timeout`` (seconds a watch
    without ``timeoutSeconds`` stays open), ``compaction_interval`` (seconds between compactions of
    the change history, 300 as kube-apiserver's ``--etcd-compaction-interval``; each compacts to the
    revision the one before saw, so resourceVersions older than one to two intervals get 410
    Expired; None never compacts on its own).
    """
    return TestApiServer(host, port, token, state_file, **options).start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m integration.k8s.apiserver",
        description="Serve the Kubernetes API test server until interrupted.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    parser.add_argument("--token", help="bearer token clients must send (default: a random one, in the kubeconfig)")
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for this server here")
    parser.add_argument("--context", default="gpush-test", help="context name in the kubeconfig (default gpush-test)")
    parser.add_argument("--state", type=Path, help="load objects from this file at start and save them at exit")
    parser.add_argument("--event-window", type=int, default=100_000, help="changes kept per resource for watches")
    parser.add_argument(
        "--compaction-interval",
        type=float,
        default=COMPACTION_INTERVAL,
        help="seconds between compactions of the change history (default 300, as kube-apiserver; 0: never)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = start(
        args.host,
        args.port,
        args.token,
        args.state,
        event_window=args.event_window,
        compaction_interval=args.compaction_interval or None,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    if args.kubeconfig:
        server.write_kubeconfig(args.kubeconfig, args.context)
    where = f"; kubeconfig {args.kubeconfig}" if args.kubeconfig else f"; token {server.token}"
    print(f"Kubernetes API test server on {server.url}{where}", flush=True)
    try:
        while not stop.wait(1):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
