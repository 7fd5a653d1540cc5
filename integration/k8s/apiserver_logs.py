"""The ``pods/log`` subresource of the Kubernetes API test server: the log comes from the node's kubelet.

``GET /api/v1/namespaces/{ns}/pods/{name}/log`` does what the real server does
(k8s.io/kubernetes pkg/registry/core/pod/rest/log.go, ``LogLocation`` in pod/strategy.go, the
``LocationStreamer`` and its response checker in k8s.io/apiserver):

1. The query is PodLogOptions: ``container``, ``follow``, ``previous``, ``timestamps``,
   ``tailLines``, ``limitBytes``, ``sinceSeconds``, ``sinceTime`` (``pretty``, ``stream`` and
   ``insecureSkipTLSVerifyBackend`` are taken and ignored). Negative ``tailLines``, ``limitBytes`` or
   ``sinceSeconds`` below 1, or both ``since`` options, are 422 Invalid on kind PodLogOptions.
2. The Pod must exist (404 NotFound, ``pods "x" not found``). Without ``container`` a Pod of one
   container means that one; otherwise 400 ``a container name must be specified for pod x, choose
   one of: [a b]``; an unknown name is 400 ``container c is not valid for pod x``.
3. A Pod not yet bound to a node has no log anywhere: 204 No Content, as the real server answers.
4. The node's kubelet is asked, at the first of the node's ``InternalIP``, ``ExternalIP``,
   ``Hostname`` addresses (kubeadm's ``--kubelet-preferred-address-types``) and
   ``status.daemonEndpoints.kubeletEndpoint.Port``, for ``/containerLogs/{ns}/{name}/{container}``
   with the same options, over plain HTTP (a real server speaks TLS to real kubelets; the node
   simulator's kubelet server, integration/k8s/kubelet_server.py, is plain HTTP on the loopback).
5. Its answer is streamed back as ``text/plain``; ``follow=true`` streams until the kubelet ends
   the answer (the container ended) or the server stops. An error answer becomes a Status: the
   kubelet's 400 is 400 BadRequest with its words (``container "job" in pod "x" is waiting to
   start: ContainerCreating``), 404 NotFound, 500 InternalError; a kubelet that cannot be reached
   is 500 with the dial error.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
from starlette.responses import Response, StreamingResponse

from integration.k8s.apiserver_errors import ApiError, FieldError, bad_request, forbidden, invalid, invalid_value
from integration.k8s.apiserver_store import Store

KUBELET_ADDRESS_TYPES = ("InternalIP", "ExternalIP", "Hostname")
DEFAULT_KUBELET_PORT = 10250
_MAX_ERROR_BODY = 50_000  # what the real response checker reads of a kubelet's error answer
_CLOSING_POLL = 0.5  # seconds between looks at whether the server is stopping, while a follow waits


@dataclass(frozen=True)
class PodLogOptions:
    container: str = ""
    follow: bool = False
    previous: bool = False
    timestamps: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None
    since_seconds: int | None = None
    since_time: str | None = None

    @classmethod
    def from_query(cls, query: Any, name: str) -> PodLogOptions:
        options = cls(
            container=query.get("container") or "",
            follow=_flag(query, "follow"),
            previous=_flag(query, "previous"),
            timestamps=_flag(query, "timestamps"),
            tail_lines=_number(query, "tailLines"),
            limit_bytes=_number(query, "limitBytes"),
            since_seconds=_number(query, "sinceSeconds"),
            since_time=query.get("sinceTime") or None,
        )
        if options.since_time is not None:
            try:
                datetime.datetime.fromisoformat(options.since_time.replace("Z", "+00:00"))
            except ValueError:
                raise bad_request(f'sinceTime: Invalid value: "{options.since_time}": must be RFC 3339') from None
        errors: list[FieldError] = []
        if options.tail_lines is not None and options.tail_lines < 0:
            errors.append(invalid_value("tailLines", options.tail_lines, "must be greater than or equal to 0"))
        if options.limit_bytes is not None and options.limit_bytes < 1:
            errors.append(invalid_value("limitBytes", options.limit_bytes, "must be greater than 0"))
        if options.since_seconds is not None and options.since_time is not None:
            errors.append(forbidden("", "at most one of `sinceTime` or `sinceSeconds` may be specified"))
        elif options.since_seconds is not None and options.since_seconds < 1:
            errors.append(invalid_value("sinceSeconds", options.since_seconds, "must be greater than 0"))
        if errors:
            raise invalid(_PodLogOptionsKind(), name, errors)
        return options

    def kubelet_query(self) -> list[tuple[str, str]]:
        """The options as LogLocation passes them on: only those set."""
        query = [(flag, "true") for flag in ("follow", "previous", "timestamps") if getattr(self, flag)]
        for key, value in (
            ("sinceSeconds", self.since_seconds),
            ("sinceTime", self.since_time),
            ("tailLines", self.tail_lines),
            ("limitBytes", self.limit_bytes),
        ):
            if value is not None:
                query.append((key, str(value)))
        return query


class _PodLogOptionsKind:
    """What :func:`invalid` needs to name PodLogOptions (a kind with no resource of its own)."""

    group = ""
    kind = "PodLogOptions"
    plural = "podlogoptions"


def _flag(query: Any, name: str) -> bool:
    return query.get(name) in ("true", "1", "True")


def _number(query: Any, name: str) -> int | None:
    raw = query.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f"{name}: Invalid value: {raw!r}: must be an integer") from None


def _container(pod: dict[str, Any], name: str, wanted: str) -> str:
    spec = pod.get("spec") or {}
    containers = [c.get("name", "") for c in spec.get("containers") or ()]
    init = [c.get("name", "") for c in spec.get("initContainers") or ()]
    ephemeral = [c.get("name", "") for c in spec.get("ephemeralContainers") or ()]
    if not wanted:
        if len(containers) == 1:
            return containers[0]
        if not containers:
            raise bad_request(f"a container name must be specified for pod {name}")
        message = f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]"
        if init:
            message += f" or one of the init containers: [{' '.join(init)}]"
        raise bad_request(message)
    if wanted not in (*containers, *init, *ephemeral):
        raise bad_request(f"container {wanted} is not valid for pod {name}")
    return wanted


def kubelet_location(node: dict[str, Any]) -> tuple[str, int]:
    """Where a node's kubelet answers: its preferred address and its kubelet port."""
    status = node.get("status") or {}
    addresses = [a for a in status.get("addresses") or () if isinstance(a, dict)]
    for kind in KUBELET_ADDRESS_TYPES:
        for address in addresses:
            if address.get("type") == kind and address.get("address"):
                port = ((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port") or 0
                return address["address"], int(port) if int(port) > 0 else DEFAULT_KUBELET_PORT
    known = ", ".join(f"{a.get('type')}:{a.get('address')}" for a in addresses)
    raise ApiError(500, "InternalError", f"no preferred addresses found; known addresses: [{known}]")


class PodLogs:
    """Serves ``pods/{name}/log`` for one server; holds the HTTP client it reaches kubelets with."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the server's event loop, on first use
            timeout = httpx.Timeout(connect=5.0, read=None, write=10.0, pool=10.0)
            self._client = httpx.AsyncClient(timeout=timeout, trust_env=False)
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def get(self, namespace: str, name: str, query: Any) -> Response:
        options = PodLogOptions.from_query(query, name)
        pods = self.store.resource_type("pods")
        pod = self.store.get(pods, namespace, name).obj
        container = _container(pod, name, options.container)
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name:
            return Response(status_code=204)
        node = self.store.get(self.store.resource_type("nodes"), "", node_name).obj
        host, port = kubelet_location(node)
        where = f"[{host}]" if ":" in host else host
        path = "/".join(quote(part, safe="") for part in (namespace, name, container))
        url = f"http://{where}:{port}/containerLogs/{path}"
        client = self._http()
        request = client.build_request("GET", url, params=options.kubelet_query())
        try:
            answer = await client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise ApiError(
                500, "InternalError", f'Get "{request.url}": dial tcp {host}:{port}: {exc or type(exc).__name__}'
            ) from None
        if not 200 <= answer.status_code <= 206:
            raise await self._kubelet_error(answer, name)
        return StreamingResponse(self._relay(answer), media_type="text/plain")

    async def _kubelet_error(self, answer: httpx.Response, name: str) -> ApiError:
        body = bytearray()
        try:
            async for chunk in answer.aiter_raw():
                body.extend(chunk)
                if len(body) >= _MAX_ERROR_BODY:
                    break
        finally:
            await answer.aclose()
        text = bytes(body[:_MAX_ERROR_BODY]).decode("utf-8", "replace").strip()
        code = answer.status_code
        if code == 400:
            return bad_request(text)
        if code == 404:
            return ApiError(404, "NotFound", text, {"name": name, "kind": "pods/log"})
        if code == 500:
            return ApiError(500, "InternalError", f"Internal error occurred: {text}")
        return ApiError(code, "", text or f"the kubelet answered {code}", {"name": name, "kind": "pods/log"})

    async def _relay(self, answer: httpx.Response) -> AsyncIterator[bytes]:
        """The kubelet's answer as it comes; ends when the kubelet ends it, or when the server stops
        (a follow may wait on a quiet container for as long as it runs)."""
        chunks = answer.aiter_raw()
        pending: asyncio.Future[bytes] | None = None
        try:
            while True:
                pending = asyncio.ensure_future(anext(chunks))
                while True:
                    done, _ = await asyncio.wait({pending}, timeout=_CLOSING_POLL)
                    if done or self.store.closing:
                        break
                if not done:
                    return
                try:
                    chunk = pending.result()
                except StopAsyncIteration:
                    return
                except httpx.TransportError:
                    return  # the kubelet went away mid-answer: the log ends there, as on a real server
                yield chunk
        finally:
            # The reader hung up or the server stops: the read in flight fails once the answer
            # closes, and nobody is left to hear it.
            if pending is not None and not pending.done():
                pending.cancel()
                pending.add_done_callback(lambda f: f.cancelled() or f.exception())
            await answer.aclose()
