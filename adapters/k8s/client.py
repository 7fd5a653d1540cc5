"""The one layer that talks to Kubernetes: the official ``kubernetes`` client, kept thin.

Only this module imports ``kubernetes``. It borrows the client's configuration
(kubeconfig with its contexts, exec and token plugins, in-cluster service accounts,
TLS) and its HTTP layer, and speaks the REST API with plain JSON: the adapter works
on the objects as the API server sends them, never on the client's generated models,
which cost more to build than the request itself and drop fields they do not know.

What callers may assume:

- **Typed failures.** A refusal that retrying will not fix raises a
  :class:`broker.core.adapter.Rejected` with the API server's own message (422 Invalid,
  400 BadRequest, 403 Forbidden, 404 for a missing namespace); a server that does not
  answer, answers 5xx or 429, or refuses the credentials (401: a token that expired
  may be renewed) raises :class:`broker.core.adapter.Unreachable`. Three answers have their
  own types because callers act on them: :class:`NotFound` (404),
  :class:`AlreadyExists` (409 on create) and :class:`Gone` (410: a watch or a list
  continuation too old to resume).
- **Reads are retried** (three attempts, short backoff) when the server did not
  answer; writes are not, so a create is never sent twice by this layer.
- **Bounded watches.** :meth:`KubeClient.watch` returns within about ``seconds`` plus
  the connect time: it hands back the events that arrived and the resourceVersion to
  resume from. A dropped connection is not an error (the next call resumes); a
  resourceVersion the server no longer has raises :class:`Gone`.
- **Lazy configuration.** The kubeconfig is read on the first call, so a broker
  process starts whatever the state of the file; a missing file or context raises
  :class:`broker.core.adapter.Unreachable` naming it.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import urllib3
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from broker.core.adapter import Rejected, Unreachable

# Where each kind the adapter touches lives in the REST API: (group path, plural, namespaced).
RESOURCES: dict[str, tuple[str, str, bool]] = {
    "pods": ("/api/v1", "pods", True),
    "configmaps": ("/api/v1", "configmaps", True),
    "events": ("/api/v1", "events", True),
    "nodes": ("/api/v1", "nodes", False),
    "namespaces": ("/api/v1", "namespaces", False),
    "resourcequotas": ("/api/v1", "resourcequotas", True),
    "services": ("/api/v1", "services", True),
    "jobs": ("/apis/batch/v1", "jobs", True),
    "deployments": ("/apis/apps/v1", "deployments", True),
}
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
IN_CLUSTER = "in-cluster"


class NotFound(Rejected):
    """404: the object (or its namespace) does not exist."""


class AlreadyExists(Rejected):
    """409 AlreadyExists on create: an object of that name is there already."""


class Conflict(Unreachable):
    """409 on a write with a stale resourceVersion: read again and retry."""


class Gone(Unreachable):
    """410: the resourceVersion (or list continuation) is too old; list again."""


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED (BOOKMARK and ERROR never reach callers)
    object: dict[str, Any]


@dataclass(frozen=True)
class WatchBatch:
    """What one bounded watch call saw, and the resourceVersion to resume from."""

    events: list[WatchEvent]
    resource_version: str
    dropped: bool = False  # the stream ended early (connection lost); resume next time


_read_retry = retry(
    retry=retry_if_exception(lambda exc: isinstance(exc, Unreachable) and not isinstance(exc, (Gone, Conflict))),
    stop=stop_after_attempt(3),
    wait=wait_exponential(multiplier=0.2, max=2),
    reraise=True,
)


def _status_error(status: int, body: bytes | str | None, what: str) -> Exception:
    """An API server's error answer (a Status object) as gpush's typed error."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    reason, message = "", text.strip()[:500]
    try:
        data = json.loads(text)
        if isinstance(data, dict):
            reason = str(data.get("reason") or "")
            message = str(data.get("message") or message)
    except ValueError:
        pass
    where = f"{what}: " if what else ""
    detail = f"{where}{message or reason or f'HTTP {status}'} (HTTP {status}{f' {reason}' if reason else ''})"
    if status == 404:
        return NotFound(detail)
    if status == 409:
        return AlreadyExists(detail) if reason == "AlreadyExists" else Conflict(detail)
    if status == 410:
        return Gone(detail)
    if status == 401:
        return Unreachable(f"the Kubernetes API refused the credentials: {detail}")
    if status == 429 or status >= 500:
        return Unreachable(f"the Kubernetes API is busy or failing: {detail}")
    return Rejected(f"the Kubernetes API refused it: {detail}")


def collection_path(kind: str, namespace: str | None = None) -> str:
    try:
        prefix, plural, namespaced = RESOURCES[kind]
    except KeyError:
        raise ValueError(f"the Kubernetes client does not know kind {kind!r}: {', '.join(RESOURCES)}") from None
    if namespaced:
        if not namespace:
            raise ValueError(f"{kind} are namespaced: give a namespace")
        return f"{prefix}/namespaces/{quote(namespace, safe='')}/{plural}"
    return f"{prefix}/{plural}"


def object_path(kind: str, namespace: str | None, name: str) -> str:
    return f"{collection_path(kind, namespace)}/{quote(name, safe='')}"


def custom_path(group: str, version: str, plural: str, namespace: str | None = None) -> str:
    if namespace:
        return f"/apis/{group}/{version}/namespaces/{quote(namespace, safe='')}/{plural}"
    return f"/apis/{group}/{version}/{plural}"


class KubeClient:
    """The few calls the adapter makes, over the official client's configuration and HTTP."""

    def __init__(
        self,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        timeout: float = 30.0,
        pool_size: int = 16,
    ):
        self.kubeconfig = kubeconfig
        self.context = context
        self.timeout = timeout
        self.pool_size = pool_size
        self._api: Any = None
        self._lock = threading.Lock()
        self.where: str | None = None  # where the configuration came from, once loaded

    # -- configuration -----------------------------------------------------------------

    def _client(self) -> Any:
        if self._api is not None:
            return self._api
        with self._lock:
            if self._api is None:
                self._api = self._load()
        return self._api

    def _load(self) -> Any:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        configuration = client.Configuration()
        in_cluster_env = "KUBERNETES_SERVICE_HOST" in os.environ
        try:
            if self.kubeconfig == IN_CLUSTER or (
                self.kubeconfig is None and in_cluster_env and not _default_kubeconfig_exists()
            ):
                config.load_incluster_config(client_configuration=configuration)
                where = "the in-cluster service account"
            else:
                path = str(Path(self.kubeconfig).expanduser()) if self.kubeconfig else None
                if path and not Path(path).exists():
                    raise Unreachable(f"kubeconfig {path} does not exist (set the cluster's kubeconfig)")
                config.load_kube_config(
                    config_file=path,
                    context=self.context,
                    client_configuration=configuration,
                    persist_config=False,
                )
                where = f"kubeconfig {path or '$KUBECONFIG or ~/.kube/config'}"
        except ConfigException as exc:
            raise Unreachable(f"cannot load the Kubernetes configuration: {exc}") from None
        configuration.connection_pool_maxsize = max(self.pool_size, 4)
        api = client.ApiClient(configuration)
        api.user_agent = "gpush-k8s-adapter"
        self.where = where
        return api

    # -- the HTTP exchange ---------------------------------------------------------------

    def _send(
        self,
        method: str,
        path: str,
        *,
        query: Iterable[tuple[str, Any]] = (),
        body: Any = None,
        content_type: str | None = None,
        timeout: Any = None,
        accept: str = "application/json",
        what: str = "",
    ) -> Any:
        """One request; returns the rest layer's response, unread, after checking its status."""
        api = self._client()
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        query = [(k, v) for k, v in query if v is not None]
        try:
            request = api.param_serialize(
                method=method,
                resource_path=path,
                query_params=query or None,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = api.call_api(*request, _request_timeout=timeout or self.timeout)
        except urllib3.exceptions.HTTPError as exc:
            raise Unreachable(f"the Kubernetes API at {api.configuration.host} does not answer: {exc}") from None
        except OSError as exc:
            raise Unreachable(f"the Kubernetes API at {api.configuration.host} does not answer: {exc}") from None
        except Exception as exc:
            from kubernetes.client.exceptions import ApiException

            if not isinstance(exc, ApiException):
                raise
            # The client's rest layer raises it itself for TLS and request-building failures.
            if exc.status:
                raise _status_error(exc.status, exc.body, what) from None
            raise Unreachable(f"the Kubernetes API call failed: {exc}") from None
        if not 200 <= response.status <= 299:
            try:
                data = response.read()
            except (urllib3.exceptions.HTTPError, OSError):
                data = None
            raise _status_error(response.status, data, what)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._send(method, path, **kwargs)
        try:
            data = response.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unreachable(f"the Kubernetes API dropped the answer to {method} {path}: {exc}") from None
        if not data:
            return {}
        try:
            return json.loads(data)
        except ValueError:
            raise Unreachable(f"the Kubernetes API answered {method} {path} with something not JSON") from None

    # -- generic verbs -------------------------------------------------------------------

    @_read_retry
    def version(self) -> dict[str, Any]:
        """/version: gitVersion, platform, ..."""
        return self._json("GET", "/version", what="version")

    @_read_retry
    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """One object, or None when there is none (its namespace missing included)."""
        try:
            return self._json("GET", object_path(kind, namespace, name), what=f"{kind}/{name}")
        except NotFound:
            return None

    @_read_retry
    def _page(self, path: str, query: list[tuple[str, Any]], what: str) -> dict[str, Any]:
        return self._json("GET", path, query=query, what=what)

    def list_path(
        self,
        path: str,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int = 500,
        what: str = "",
    ) -> tuple[list[dict[str, Any]], str]:
        """Every object of a collection, page by page; and the list's resourceVersion."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        version = ""
        while True:
            query = [
                ("labelSelector", label_selector),
                ("fieldSelector", field_selector),
                ("limit", limit),
                ("continue", token),
            ]
            page = self._page(path, query, what)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            version = version or str(meta.get("resourceVersion") or "")
            token = meta.get("continue")
            if not token:
                return items, version

    def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int = 500,
    ) -> tuple[list[dict[str, Any]], str]:
        """Objects of a kind (in a namespace, or everywhere when None and the kind is namespaced)."""
        _, plural, namespaced = RESOURCES[kind]
        if namespaced and namespace is None:
            path = f"{RESOURCES[kind][0]}/{plural}"  # all namespaces
        else:
            path = collection_path(kind, namespace)
        return self.list_path(
            path, label_selector=label_selector, field_selector=field_selector, limit=limit, what=kind
        )

    def peek(self, kind: str, namespace: str | None = None, *, label_selector: str | None = None) -> list[dict]:
        """At most one object of a collection (one page of one): whether the caller may list
        it at all, without reading all of it (:class:`Rejected` with the server's 403)."""
        prefix, plural, namespaced = RESOURCES[kind]
        path = f"{prefix}/{plural}" if namespaced and namespace is None else collection_path(kind, namespace)
        return self._page(path, [("labelSelector", label_selector), ("limit", 1)], kind).get("items") or []

    def create(self, kind: str, namespace: str | None, body: Mapping[str, Any]) -> dict[str, Any]:
        name = (body.get("metadata") or {}).get("name", "")
        return self._json("POST", collection_path(kind, namespace), body=dict(body), what=f"create {kind}/{name}")

    def replace(self, kind: str, namespace: str | None, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Replace an object whole (PUT); without a resourceVersion in ``body`` it is unconditional."""
        return self._json("PUT", object_path(kind, namespace, name), body=dict(body), what=f"replace {kind}/{name}")

    def patch(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        content_type: str = MERGE_PATCH,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        path = object_path(kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return self._json("PATCH", path, body=body, content_type=content_type, what=f"patch {kind}/{name}")

    def delete(
        self, kind: str, namespace: str | None, name: str, *, propagation: str = "Background", grace: int | None = None
    ) -> bool:
        """Delete one object (``grace``: its pods' grace period in seconds); False when it was not there."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            self._json("DELETE", object_path(kind, namespace, name), body=body, what=f"delete {kind}/{name}")
        except NotFound:
            return False
        return True

    # -- what the adapter needs by name ----------------------------------------------------

    def scale(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set a Deployment's replicas through its scale subresource."""
        return self.patch("deployments", namespace, name, {"spec": {"replicas": replicas}}, subresource="scale")

    @_read_retry
    def read_namespaced_pod_log(
        self,
        name: str,
        namespace: str,
        *,
        container: str | None = None,
        tail_lines: int | None = None,
        limit_bytes: int | None = None,
        previous: bool = False,
    ) -> bytes:
        """A Pod's log (the ``pods/log`` subresource, not followed) as the kubelet keeps it, as
        bytes: a reader that asks for ``limit_bytes`` may get a character cut in two. Empty when
        the Pod is not on a node yet (the server answers 204). :class:`NotFound` when the Pod is
        gone; :class:`Rejected` with the kubelet's words when its container has no log yet
        (``container "job" in pod "x" is waiting to start: ContainerCreating``)."""
        query = [
            ("container", container),
            ("tailLines", tail_lines),
            ("limitBytes", limit_bytes),
            ("previous", "true" if previous else None),
        ]
        path = object_path("pods", namespace, name) + "/log"
        response = self._send("GET", path, query=query, accept="text/plain", what=f"pods/{name}/log")
        try:
            return response.read() or b""
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unreachable(f"the Kubernetes API dropped the log of pod {name}: {exc}") from None

    def create_namespace(self, name: str, body: Mapping[str, Any] | None = None) -> bool:
        """Create a Namespace (``body``: its manifest, default a bare one); False when it was there."""
        try:
            bare = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
            self.create("namespaces", None, body or bare)
        except AlreadyExists:
            return False
        return True

    @_read_retry
    def list_custom(self, group: str, version: str, plural: str, namespace: str | None = None) -> list[dict]:
        """Custom objects (the GPU Operator's ClusterPolicy); [] when the CRD is not installed."""
        try:
            return self._json("GET", custom_path(group, version, plural, namespace), what=plural).get("items") or []
        except NotFound:
            return []

    def patch_custom(
        self, group: str, version: str, plural: str, name: str, body: Any, namespace: str | None = None
    ) -> dict[str, Any]:
        path = f"{custom_path(group, version, plural, namespace)}/{quote(name, safe='')}"
        return self._json("PATCH", path, body=body, content_type=MERGE_PATCH, what=f"patch {plural}/{name}")

    def events_for(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        """Events about one object, oldest first (for reasons the object does not carry)."""
        items, _ = self.list(
            "events", namespace, field_selector=f"involvedObject.kind={kind},involvedObject.name={name}"
        )
        return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    # -- watch -----------------------------------------------------------------------------

    def watch(
        self,
        kind: str,
        namespace: str | None,
        *,
        resource_version: str,
        label_selector: str | None = None,
        seconds: float = 1.0,
        on_event: Callable[[WatchEvent], None] | None = None,
        stop: threading.Event | None = None,
    ) -> WatchBatch:
        """Changes after ``resource_version``, for at most about ``seconds``.

        The server is asked to end the watch after ``seconds`` (rounded up: its unit is
        a second) and the client stops reading once ``seconds`` have passed or nothing
        arrived for that long, whichever is first, so a busy collection cannot hold the
        caller. Bookmarks only move the resourceVersion. ``Gone`` when the server no
        longer has ``resource_version``; a connection lost midway ends the batch early
        with what arrived (``dropped``). With ``on_event``, each event goes to it as it
        arrives instead of into the batch (an informer applies them at once); ``stop`` set
        ends the watch at the next line.
        """
        path = collection_path(kind, namespace) if namespace or not RESOURCES[kind][2] else None
        if path is None:
            path = f"{RESOURCES[kind][0]}/{RESOURCES[kind][1]}"
        query = [
            ("watch", "true"),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("labelSelector", label_selector),
            ("timeoutSeconds", max(1, math.ceil(seconds))),
        ]
        deadline = time.monotonic() + seconds
        response = self._send(
            "GET", path, query=query, timeout=(min(self.timeout, 10.0), max(seconds, 0.01)), what=f"watch {kind}"
        )
        raw = response.response
        events: list[WatchEvent] = []
        version = resource_version
        dropped = False
        try:
            for line in _lines(raw):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                kind_of = event.get("type")
                obj = event.get("object") or {}
                if kind_of == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        raise Gone(f"watch {kind} from {resource_version}: {obj.get('message') or 'too old'}")
                    raise _status_error(int(code or 500), json.dumps(obj), f"watch {kind}")
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    version = str(rv)
                if kind_of in ("ADDED", "MODIFIED", "DELETED"):
                    if on_event is None:
                        events.append(WatchEvent(kind_of, obj))
                    else:
                        on_event(WatchEvent(kind_of, obj))
                if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                    break
        except (urllib3.exceptions.ReadTimeoutError, TimeoutError):
            pass  # nothing more arrived in time: the batch is complete
        except (urllib3.exceptions.HTTPError, OSError):
            dropped = True
        finally:
            try:
                raw.release_conn()
                raw.close()
            except Exception:  # noqa: BLE001 - closing a broken stream may fail again; nothing to do
                pass
        return WatchBatch(events, version, dropped)


def _lines(raw: Any) -> Iterable[str]:
    """Lines of a streamed answer (a watch sends one JSON event per line)."""
    buffer = bytearray()
    for chunk in raw.stream(amt=None, decode_content=True):
        buffer.extend(chunk)
        while True:
            end = buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            yield line.decode("utf-8", "replace")
    if buffer.strip():
        yield bytes(buffer).decode("utf-8", "replace")


def _default_kubeconfig_exists() -> bool:
    paths = os.environ.get("KUBECONFIG", "")
    candidates = [p for p in paths.split(os.pathsep) if p] or [str(Path("~/.kube/config").expanduser())]
    return any(Path(p).exists() for p in candidates)
