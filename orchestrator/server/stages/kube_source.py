"""A stage's replicas from the Kubernetes API: its Pods, watched.

A stage whose pipeline entry names its Pods (``pods:``, a label selector) is
found by watching those Pods in the orchestrator's own namespace with the
official ``kubernetes`` client: a replica is a Pod with a ``status.podIP``,
its ``Ready`` condition True and no ``deletionTimestamp``; its address is that
IP and the port of the stage's address. Every change hands the whole set
(``on_pods``) to the ReplicaSet, which lets a replica no longer in it drain (no
new request; those it holds finish) — a deletion is seen when it starts, not
when DNS catches up.

The watch is blocking HTTP, so it runs in a thread of its own: list, then watch
from the list's resourceVersion; a watch that ends (the server's timeout) is
opened again from the last version seen; ``410 Gone`` (that version is too old)
lists again; a dropped or refused connection is retried with backoff. Where
there is no API to ask (not in a Pod) or it refuses us (401/403: no Role),
``on_fallback`` is told once why and the watch ends: the stage goes back to
DNS (``resolver``).

In a Pod the credentials are the service account's (``load_incluster_config``'s
files); ``OMNI_KUBE_SERVICEACCOUNT_DIR`` points elsewhere (the tests' server).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.server.stages.resolver import host_port
from services.mesh import environment

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PodReplica:
    """A ready Pod of a stage: where to dial it, and what it is called."""

    address: str
    pod: str
    node: str


@dataclass(frozen=True)
class KubeSettings:
    watch_timeout_s: int = 240  # the server ends a watch after this; it is opened again
    backoff_s: float = 0.5  # a failed connection is retried after this, doubling
    max_backoff_s: float = 10.0


class Refused(Exception):
    """The API cannot be asked (no in-cluster config) or refuses us (401/403)."""


def ready_replicas(pods: Iterable[Mapping[str, Any]], port: int) -> dict[str, PodReplica]:
    """The Pods that take requests, by address: an IP, Ready, not being deleted."""
    found: dict[str, PodReplica] = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or ()
        )
        if ip and ready and not meta.get("deletionTimestamp"):
            address = host_port(ip, port)
            node = (pod.get("spec") or {}).get("nodeName") or ""
            found[address] = PodReplica(address, meta.get("name", ""), node)
    return found


class PodWatch:
    """One stage's Pods (``selector``) watched in a thread; ``on_pods`` gets every
    ready set, ``on_fallback`` why the API is not to be used (once, then it ends).
    Both are called on the event loop that called ``start``."""

    def __init__(
        self,
        stage: str,
        selector: str,
        port: int,
        on_pods: Callable[[dict[str, PodReplica]], None],
        on_fallback: Callable[[str], None],
        settings: KubeSettings = KubeSettings(),
    ) -> None:
        self.stage = stage
        self.selector = selector
        self.port = port
        self.settings = settings
        self._on_pods = on_pods
        self._on_fallback = on_fallback
        self._stopping = threading.Event()
        self._response: Any = None  # the watch being read, shut down by stop()
        self._pods: dict[str, Mapping[str, Any]] = {}  # by name, as last listed or seen
        self._backoff: float | None = None  # the next wait after a failure; None: none
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._told: dict[str, PodReplica] | None = None  # the last set handed over

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"pods-{self.stage}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        response = self._response
        if response is not None:
            response.shutdown()  # wakes the thread's blocking read
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    # --- the thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            api, namespace = _core_api()
        except Refused as exc:
            self._tell(self._on_fallback, str(exc))
            return
        try:
            self._follow(api, namespace)
        finally:
            api.api_client.close()

    def _follow(self, api: Any, namespace: str) -> None:
        from kubernetes.client.exceptions import ApiException

        version = ""  # "" lists first
        while not self._stopping.is_set():
            try:
                if not version:
                    version = self._list(api, namespace)
                version = self._watch(api, namespace, version)
            except ApiException as exc:
                if exc.status in (401, 403):
                    why = f"the Kubernetes API refused to list pods in {namespace}: {exc.status}"
                    self._tell(self._on_fallback, f"{why} {exc.reason}")
                    return
                if exc.status == 410:
                    logger.info(
                        "stage %s: pod version %s is gone (410): listing again", self.stage, version
                    )
                    version = ""
                    continue
                self._failed(f"{exc.status} {exc.reason}")
            except Exception as exc:  # a dropped connection, a refused one, a timeout
                if self._stopping.is_set():
                    return
                self._failed(f"{type(exc).__name__}: {exc}")

    def _connected(self) -> None:
        """The API answered: the next failure waits the shortest backoff again."""
        if self._backoff is not None:
            logger.info("stage %s: watching its pods again", self.stage)
        self._backoff = None

    def _failed(self, why: str) -> None:
        # One line per outage: what we know stays routed meanwhile.
        if self._backoff is None:
            logger.warning("stage %s: watching its pods failed (%s): retrying", self.stage, why)
            self._backoff = self.settings.backoff_s
        self._stopping.wait(self._backoff)
        self._backoff = min(self._backoff * 2, self.settings.max_backoff_s)

    def _list(self, api: Any, namespace: str) -> str:
        response = api.list_namespaced_pod(
            namespace,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=(10, 60),
        )
        listing = json.loads(response.data)
        self._connected()
        self._pods = {p["metadata"]["name"]: p for p in listing.get("items") or ()}
        self._ready_now()
        return str(listing["metadata"]["resourceVersion"])

    def _watch(self, api: Any, namespace: str, version: str) -> str:
        """Follows the pods from ``version`` until the server ends the watch; the last
        version seen. Raises ApiException(410) when ``version`` is too old."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        timeout = self.settings.watch_timeout_s
        response = api.list_namespaced_pod(
            namespace,
            label_selector=self.selector,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _preload_content=False,
            # A connection that silently died is noticed: nothing for this long.
            _request_timeout=(10, timeout + 30),
        )
        self._response = response
        self._connected()
        try:
            if self._stopping.is_set():
                return version
            for line in iter_resp_lines(response):
                event = json.loads(line)
                kind, pod = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=pod.get("code", 500), reason=pod.get("message", ""))
                version = str(pod["metadata"]["resourceVersion"])
                if kind == "BOOKMARK":
                    continue
                name = pod["metadata"]["name"]
                if kind == "DELETED":
                    self._pods.pop(name, None)
                else:
                    self._pods[name] = pod
                self._ready_now()
        finally:
            self._response = None
            response.release_conn()
        return version

    def _ready_now(self) -> None:
        """Hands the ready set over when it changed (most Pod updates change nothing)."""
        ready = ready_replicas(self._pods.values(), self.port)
        if ready != self._told:
            self._told = ready
            self._tell(self._on_pods, ready)

    def _tell(self, callback: Callable[[Any], None], what: Any) -> None:
        assert self._loop is not None
        if not self._stopping.is_set():
            self._loop.call_soon_threadsafe(callback, what)


def _core_api() -> tuple[Any, str]:
    """A CoreV1Api with this Pod's service account, and its namespace; Refused when
    there is none (not in a Pod, or no token mounted)."""
    # Imported here, as in the thread's other methods: the client takes a while to
    # import and an orchestrator with no stage naming its Pods never needs it.
    from kubernetes import client
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.config.incluster_config import InClusterConfigLoader

    folder = environment.KUBE_SERVICEACCOUNT_DIR.get()
    configuration = client.Configuration()
    try:
        InClusterConfigLoader(
            token_filename=str(folder / "token"), cert_filename=str(folder / "ca.crt")
        ).load_and_set(configuration)
        namespace = (folder / "namespace").read_text().strip()
    except (ConfigException, OSError) as exc:
        raise Refused(f"no Kubernetes API to ask ({exc})") from None
    return client.CoreV1Api(client.ApiClient(configuration)), namespace
