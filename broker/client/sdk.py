"""The gpush client SDK: typed calls to the broker's REST API over httpx.

The CLI is built on it, and so are Ray integrations and scripts. Submissions carry
an idempotency key (one is generated when the caller gives none), so the client
retries a submission after a timeout or a dropped connection without ever creating
two jobs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
from tenacity import (
    retry,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from broker.core.errors import ERRORS_BY_CODE, GpushError, InvalidRequest, Unavailable
from broker.core.schemas import JobEventOut, JobOut, JobPage, JobSpec, TokenCreated, TokenOut, Whoami

EMBEDDED_URL = "http://gpush.embedded"


class _Retryable(Exception):
    """A transport failure or a 502/503/504 on a call that is safe to repeat."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class GpushClient:
    """A connection to one gpush broker.

    ``GpushClient(url, token)`` talks HTTP to ``gpush server``;
    :func:`broker.client.embedded.embedded_client` gives one that runs the broker's API
    in this process on the local database (the embedded default): this module never
    imports the server. Errors are raised as :mod:`broker.core.errors` types.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.token = token
        headers = {"User-Agent": "gpush-client"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)
        self._retries = max(1, retries)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GpushClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ----------------------------------------------------------------

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise _Retryable(exc) from exc
        except (httpx.InvalidURL, UnicodeEncodeError) as exc:
            raise InvalidRequest(_unsendable(path, kwargs.get("params") or {}, exc)) from None
        if response.status_code in (502, 503, 504):
            raise _Retryable(_error_from(response))
        return response

    def _request(
        self, method: str, path: str, *, safe_to_retry: bool = True, expect_body: bool = True, **kwargs: Any
    ) -> Any:
        attempts = self._retries if safe_to_retry else 1
        sender = retry(
            retry=retry_if_exception_type(_Retryable),
            stop=stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=0.2, max=5),
            reraise=True,
        )(self._send)
        try:
            response = sender(method, path, **kwargs)
        except _Retryable as exc:
            if isinstance(exc.cause, GpushError):
                raise exc.cause from None
            raise Unavailable(
                f"cannot reach the gpush broker at {self.url} ({exc.cause}): is `gpush server` running "
                "there? Check --url / GPUSH_URL"
            ) from None
        if response.status_code >= 400:
            raise _error_from(response)
        return response.json() if expect_body else None

    # -- jobs ---------------------------------------------------------------------

    def submit(self, spec: JobSpec | dict[str, Any], *, idempotency_key: str | None = None) -> JobOut:
        """Queue a job; returns it (the stored one if the idempotency key was seen before)."""
        body = _spec_body(spec)
        body["idempotency_key"] = idempotency_key or body.get("idempotency_key") or _auto_key()
        return JobOut.model_validate(self._request("POST", "/v1/jobs", json=body))

    def submit_batch(self, specs: Iterable[JobSpec | dict[str, Any]]) -> dict[str, Any]:
        """Queue many jobs at once, all or none. Returns ``{"jobs": [{id, state, created}], "created": n}``."""
        jobs = []
        for spec in specs:
            body = _spec_body(spec)
            body.setdefault("idempotency_key", None)
            body["idempotency_key"] = body["idempotency_key"] or _auto_key()
            jobs.append(body)
        return self._request("POST", "/v1/jobs:batch", json={"jobs": jobs})

    def get(self, job_id: int) -> JobOut:
        return JobOut.model_validate(self._request("GET", f"/v1/jobs/{int(job_id)}"))

    def list(
        self,
        *,
        states: Iterable[str] = (),
        tenant: str | None = None,
        user: str | None = None,
        kind: str | None = None,
        labels: dict[str, str] | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> JobPage:
        """One page of jobs, newest first; ``labels``: only jobs that carry all of them."""
        params: dict[str, Any] = {"limit": limit}
        states = list(states)
        if states:
            params["state"] = states
        if labels:
            params["label"] = [f"{k}={v}" for k, v in labels.items()]
        for name, value in (("tenant", tenant), ("user", user), ("kind", kind), ("cursor", cursor)):
            if value is not None:
                params[name] = value
        return JobPage.model_validate(self._request("GET", "/v1/jobs", params=params))

    def iter_jobs(self, **filters: Any) -> Iterator[JobOut]:
        """Every job that matches, newest first, following the cursor page by page."""
        cursor = None
        while True:
            page = self.list(cursor=cursor, **filters)
            yield from page.jobs
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def events(self, job_id: int) -> list[JobEventOut]:
        return [JobEventOut.model_validate(e) for e in self._request("GET", f"/v1/jobs/{int(job_id)}/events")]

    def cancel(self, job_id: int) -> dict[str, Any]:
        """Cancel a job; returns ``{"job": ..., "outcome": cancelled|cancel_requested|...}``."""
        result = self._request("POST", f"/v1/jobs/{int(job_id)}/cancel")
        result["job"] = JobOut.model_validate(result["job"])
        return result

    def scale(self, job_id: int, replicas: int) -> JobOut:
        """Scale a running elastic job to ``replicas`` (within its range, under its tenant's quota)."""
        body = {"replicas": int(replicas)}
        return JobOut.model_validate(self._request("POST", f"/v1/jobs/{int(job_id)}/scale", json=body))

    def checkpoint(self, job_id: int, note: str | None = None) -> dict[str, Any]:
        """Report that running job ``job_id`` saved its state (a job's checkpoint hook calls
        this with ``int(os.environ["GPUSH_JOB_ID"])``): preemption then loses only the work since."""
        return self._request("POST", f"/v1/jobs/{int(job_id)}/checkpoint", json={"note": note}, safe_to_retry=False)

    def logs(
        self,
        job_id: int,
        *,
        stream: str = "stdout",
        replica: int | None = None,
        offset: int = 0,
        tail: int | None = None,
    ) -> dict[str, Any]:
        """A job's output from ``offset`` (or its last ``tail`` lines): ``text``,
        ``next_offset`` to read on, ``location``, ``readable``, ``final`` (the job ended)."""
        params: dict[str, Any] = {"stream": stream, "offset": offset}
        if replica is not None:
            params["replica"] = replica
        if tail is not None:
            params["tail"] = tail
        return self._request("GET", f"/v1/jobs/{int(job_id)}/logs", params=params)

    # -- clusters and tenants -----------------------------------------------------

    def add_cluster(self, name: str, kind: str, config: dict[str, Any], *, replace: bool = False) -> dict[str, Any]:
        body = {"name": name, "kind": kind, "config": config, "replace": replace}
        return self._request("POST", "/v1/clusters", json=body, safe_to_retry=False)

    def list_clusters(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/clusters")

    def apply_timeslice(self, cluster: str, replicas: int, node_label: str | None = None) -> dict[str, Any]:
        """Apply time-slicing to a Kubernetes cluster (admins); returns the changes made."""
        body = {"replicas": replicas, "node_label": node_label}
        return self._request("POST", f"/v1/clusters/{cluster}/timeslice", json=body, safe_to_retry=False)

    def tenant_quotas(self, cluster: str) -> dict[str, Any]:
        """The cluster's limits for the tenants' GPU quotas (admins): ``rendered`` is YAML."""
        return self._request("GET", f"/v1/clusters/{cluster}/tenant-quotas")

    def remove_cluster(self, name: str) -> None:
        self._request("DELETE", f"/v1/clusters/{name}", expect_body=False)

    def set_tenant(
        self, name: str, *, weight: float | None = None, gpu_quota: float | None = None, clear_quota: bool = False
    ) -> dict[str, Any]:
        body = {"weight": weight, "gpu_quota": gpu_quota, "clear_quota": clear_quota}
        return self._request("PUT", f"/v1/tenants/{name}", json=body)

    def list_tenants(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/tenants")

    def usage(
        self, *, since: str | None = None, until: str | None = None, by: str = "tenant", tenant: str | None = None
    ) -> dict[str, Any]:
        """GPU-hours per group (GET /v1/usage); ``since``/``until`` ISO 8601."""
        params = {k: v for k, v in {"since": since, "until": until, "by": by, "tenant": tenant}.items() if v}
        return self._request("GET", "/v1/usage", params=params)

    # -- routing policy -------------------------------------------------------------

    def policy_schema(self) -> dict[str, Any]:
        return self._request("GET", "/v1/policy/schema")

    def validate_policy(self, text: str, *, source: str = "policy") -> dict[str, Any]:
        return self._request("POST", "/v1/policy:validate", json={"text": text, "source": source})

    def apply_policy(
        self, text: str, *, comment: str, base_version: int | None = None, source: str = "policy"
    ) -> dict[str, Any]:
        body = {"text": text, "comment": comment, "base_version": base_version, "source": source}
        return self._request("POST", "/v1/policy", json=body, safe_to_retry=False)

    def rollback_policy(self, version: int, *, comment: str = "") -> dict[str, Any]:
        body = {"version": version, "comment": comment}
        return self._request("POST", "/v1/policy:rollback", json=body, safe_to_retry=False)

    def show_policy(self, version: int | None = None) -> dict[str, Any]:
        return self._request("GET", "/v1/policy", params={"version": version} if version is not None else None)

    def policy_history(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/policy/history")

    def policy_diff(self, a: int, b: int) -> str:
        return self._request("GET", "/v1/policy/diff", params={"a": a, "b": b})["diff"]

    def explain(
        self, *, job_id: int | None = None, spec: JobSpec | dict[str, Any] | None = None, version: int | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"job_id": job_id, "version": version}
        if spec is not None:
            body["spec"] = _spec_body(spec)
        return self._request("POST", "/v1/policy:explain", json=body)

    # -- identity and admin -------------------------------------------------------

    # -- inventory ----------------------------------------------------------------

    @property
    def http(self) -> httpx.Client:
        """The HTTP client (embedded: into this process's API), for ``gpush agent``."""
        return self._http

    def inventory(self, cluster: str | None = None) -> dict[str, Any]:
        return self._request("GET", "/v1/inventory", params=_params(cluster=cluster))

    def drift(self, cluster: str | None = None) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/inventory/drift", params=_params(cluster=cluster))

    def gres_conf(self, node: str, style: str = "multiple-files") -> dict[str, Any]:
        return self._request("GET", f"/v1/nodes/{node}/gres-conf", params={"style": style})

    def mig_plan(
        self, cluster: str | None = None, *, repartition_busy: bool = False, enable_mig: bool = False
    ) -> dict[str, Any]:
        params = _params(cluster=cluster, repartition_busy=repartition_busy or None, enable_mig=enable_mig or None)
        return self._request("GET", "/v1/mig/plan", params=params)

    def mig_apply(
        self,
        *,
        cluster: str | None = None,
        node: str | None = None,
        dry_run: bool = False,
        repartition_busy: bool = False,
    ) -> dict[str, Any]:
        body = {"cluster": cluster, "node": node, "dry_run": dry_run, "repartition_busy": repartition_busy}
        return self._request("POST", "/v1/mig/changes", json=body)

    def mig_changes(self, *, all: bool = False) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/mig/changes", params=_params(all=all or None))

    def mig_change(self, change_id: int) -> dict[str, Any]:
        return self._request("GET", f"/v1/mig/changes/{change_id}")

    def fleet_events(
        self, *, limit: int | None = None, since: str | None = None, node: str | None = None
    ) -> list[dict[str, Any]]:
        """The fleet's events (MIG change and node move steps), oldest first (admins)."""
        return self._request("GET", "/v1/events", params=_params(limit=limit, since=since, node=node))

    def lending_moves(self, *, all: bool = False) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/lending/moves", params=_params(all=all or None))

    def mig_clear(self, change_id: int) -> dict[str, Any]:
        return self._request("POST", f"/v1/mig/changes/{change_id}:clear")

    def whoami(self) -> Whoami:
        return Whoami.model_validate(self._request("GET", "/v1/whoami"))

    def create_token(
        self,
        *,
        user: str,
        tenant: str,
        role: str = "user",
        description: str | None = None,
        nodes: list[str] | None = None,
    ) -> TokenCreated:
        """``nodes``: an agent token's node names or globs (required for role agent; ``["*"]``: any)."""
        body = {"user": user, "tenant": tenant, "role": role, "description": description}
        if nodes is not None:  # a broker from before node-bound agent tokens refuses the field
            body["nodes"] = nodes
        return TokenCreated.model_validate(self._request("POST", "/v1/admin/tokens", json=body, safe_to_retry=False))

    def list_tokens(self) -> list[TokenOut]:
        return [TokenOut.model_validate(t) for t in self._request("GET", "/v1/admin/tokens")]

    def revoke_token(self, token_id: int) -> TokenOut:
        return TokenOut.model_validate(self._request("POST", f"/v1/admin/tokens/{int(token_id)}/revoke"))


def _params(**values: Any) -> dict[str, Any]:
    """Query parameters that are set (httpx would send None as an empty value)."""
    return {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in values.items() if v is not None}


def _auto_key() -> str:
    return f"auto-{uuid.uuid4()}"


def _spec_body(spec: JobSpec | dict[str, Any]) -> dict[str, Any]:
    if isinstance(spec, JobSpec):
        return spec.model_dump(mode="json", exclude_none=True)
    return dict(spec)


def _unsendable(path: str, params: dict[str, Any], exc: Exception) -> str:
    """Why httpx could not put a request on the wire, naming the value at fault: text
    that is no UTF-8 (bytes a shell passed as they were, which Python keeps as lone
    surrogates), or a URL over the 65,536 characters httpx allows."""
    values = [(name, v) for name, value in params.items() for v in (value if isinstance(value, list) else [value])]
    values = [(name, str(v)) for name, v in values] + [("the path", path)]
    if isinstance(exc, UnicodeEncodeError):
        for name, value in values:
            try:
                value.encode()
            except UnicodeEncodeError:
                try:  # the bytes as the shell had them
                    shown = repr(value.encode("utf-8", "surrogateescape"))[1:201]
                except UnicodeEncodeError:  # a surrogate no byte gives (from a Python caller)
                    shown = repr(value)[:200]
                return f"{name} {shown} is not UTF-8 text (bytes a shell passed as they were): pass it in UTF-8"
        return "the request holds text that is not UTF-8 (bytes a shell passed as they were): pass it in UTF-8"
    name, value = max(values, key=lambda item: len(item[1]))
    return (
        f"{name} is {len(value):,} characters long: the request would be longer than an HTTP client sends "
        f"({exc}); pass a shorter value"
    )


def _error_from(response: httpx.Response) -> GpushError:
    try:
        body = response.json()["error"]
        cls = ERRORS_BY_CODE.get(body.get("code"), GpushError)
        return cls(body.get("message") or response.reason_phrase, details=body.get("details"))
    except (ValueError, KeyError, TypeError):
        if response.status_code == 401:
            cls = ERRORS_BY_CODE["unauthenticated"]
        elif response.status_code == 404:
            cls = ERRORS_BY_CODE["not_found"]
        else:
            cls = GpushError
        return cls(f"the broker answered {response.status_code} {response.reason_phrase}: {response.text[:300]}")
