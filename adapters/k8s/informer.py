"""A watch-fed cache of one kind of object (an informer), so the inventory does not list
every Node and Pod of the cluster on every scheduling cycle.

What callers may assume of :class:`Informer`:

- **List, then watch.** The first :meth:`snapshot` lists the collection (paginated) and
  starts one daemon thread that watches from the list's resourceVersion, applying each
  event as it arrives; a watch that ends is resumed from the last resourceVersion, and
  one answered 410 Gone lists again. This is what client-go's informers do, and it costs
  the API server one watch instead of a full list per cycle.
- **Eventually consistent, never silently stale.** A snapshot may lag the cluster by the
  time an event takes to arrive. When the watch has failed for longer than
  ``stale_after`` seconds, :meth:`snapshot` lists again itself (and raises what the list
  raises), so a cache never hides a cluster that stopped answering.
- **Trimmed objects.** ``trim`` keeps only what the caller reads (a Pod's node, phase and
  resource requests), so a cache of every Pod of a large cluster stays small.
- :meth:`stop` ends the thread; it is a daemon thread, so a process may also just exit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from adapters.k8s.client import Gone, KubeClient, WatchEvent
from broker.core.adapter import AdapterError

log = logging.getLogger(__name__)

Trim = Callable[[dict[str, Any]], dict[str, Any] | None]


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


class Informer:
    """The objects of one kind (cluster-wide, or in one namespace), kept by a watch."""

    def __init__(
        self,
        client: KubeClient,
        kind: str,
        namespace: str | None = None,
        *,
        trim: Trim | None = None,
        watch_seconds: float = 30.0,
        stale_after: float = 10.0,
        name: str = "",
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.client = client
        self.kind = kind
        self.namespace = namespace
        self.trim = trim or (lambda obj: obj)
        self.on_event = on_event  # told each watched object as it arrives, untrimmed
        self.watch_seconds = watch_seconds
        self.stale_after = stale_after
        self.name = name or kind
        self._objects: dict[str, dict[str, Any]] = {}
        self._version: str | None = None
        self._lock = threading.Lock()
        self._list_lock = threading.Lock()  # one list at a time (the caller's or the thread's)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing_since: float | None = None
        self.error: str | None = None  # the last watch failure, until a watch succeeds again

    def snapshot(self) -> list[dict[str, Any]]:
        """The cached objects; lists first when the cache is empty or its watch keeps failing."""
        if self._version is None or self._stale():
            self._relist()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"k8s-informer-{self.name}", daemon=True)
            self._thread.start()
        with self._lock:
            return list(self._objects.values())

    def stop(self) -> None:
        self._stop.set()

    def _stale(self) -> bool:
        since = self._failing_since
        return since is not None and time.monotonic() - since > self.stale_after

    def _relist(self) -> None:
        with self._list_lock:
            items, version = self.client.list(self.kind, self.namespace)
            objects = {}
            for obj in items:
                kept = self.trim(obj)
                if kept is not None:
                    objects[_key(obj)] = kept
            with self._lock:
                self._objects = objects
                self._version = version
            self._failing_since = None
            self.error = None

    def _apply(self, event: WatchEvent) -> None:
        key = _key(event.object)
        kept = None if event.type == "DELETED" else self.trim(event.object)
        with self._lock:
            if kept is None:
                self._objects.pop(key, None)
            else:
                self._objects[key] = kept
        if self.on_event is not None:
            try:
                self.on_event(event.object)
            except Exception:  # a listener's bug must not stop the watch
                log.exception("informer %s: the event listener failed", self.name)

    def _run(self) -> None:
        delay = 0.2
        while not self._stop.is_set():
            try:
                if self._version is None:
                    self._relist()
                batch = self.client.watch(
                    self.kind,
                    self.namespace,
                    resource_version=self._version or "",
                    seconds=self.watch_seconds,
                    on_event=self._apply,
                    stop=self._stop,
                )
                self._version = batch.resource_version
                if batch.dropped:
                    raise AdapterError(f"the {self.kind} watch was cut off")
                self._failing_since, self.error, delay = None, None, 0.2
            except Gone:
                self._version = None  # too old: list again
            except AdapterError as exc:
                self.error = str(exc)
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                log.debug("informer %s: %s; retrying in %.1f s", self.name, exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
            except Exception:  # noqa: BLE001 - a bug must not end the cache silently; it goes stale
                log.exception("informer %s failed; retrying", self.name)
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)


def trim_pod(pod: dict[str, Any]) -> dict[str, Any] | None:
    """What the inventory reads of a Pod: its node, phase and GPU requests; None for a Pod
    that holds nothing (not bound, or finished)."""
    spec = pod.get("spec") or {}
    phase = (pod.get("status") or {}).get("phase")
    if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
        return None
    meta = pod.get("metadata") or {}
    containers = [{"resources": c.get("resources") or {}} for c in spec.get("containers") or []]
    return {
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
        "spec": {"nodeName": spec["nodeName"], "containers": containers},
        "status": {"phase": phase},
    }
