"""Watch-backed caches of everything the operator reads: the NeuronModels and every child kind it creates
(labelled neuronfleet.dev/model) but Secrets, each kept by one LIST and then one long WATCH per kind (per
namespace in namespaced mode), so that a reconcile reads memory, not the API server. Secrets are read by name
(`reconcile.apply_secret`): a LIST or WATCH of Secrets, which RBAC cannot narrow to a label, would need the
right to read every Secret of the cluster.

A watch resumes from the last resourceVersion it saw when its server-side timeout ends; an expired
resourceVersion (410 Gone) or a broken stream makes it LIST again (the "list then watch" protocol:
https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes). After the
first LIST, every change to a cached object is reported to `on_change(event type, object)` (the operator
turns a child's change into its owner's reconcile), except the echo of the operator's own write (the object
it wrote through `stored`, with that resourceVersion).

`Cache.get` and `Cache.list` wait until the kind's first LIST is in; what the cache does not cover (a kind it
does not watch, a namespace outside the watched ones) is None, and `kube.Kube` reads it live.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import re
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from . import spec
from .kube import unreachable

log = logging.getLogger(__name__)

WATCH_SECONDS = 300  # one watch request's server-side timeout; it then resumes from its resourceVersion
RETRY_SECONDS = (1.0, 10.0)  # backoff after a LIST or watch the API server refused: first, most
CHILD_LABEL = "neuronfleet.dev/model"  # builders.LABEL_PREFIX + "/model"; every child carries it
CHILD_KINDS = (
    "Pod",  # serving pods' states (crash loops, unschedulable) and the compile pod's report
    "Job",
    "Deployment",
    "Service",
    "ConfigMap",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "NetworkPolicy",
)

Key = tuple[str, str]  # namespace, name
OnChange = Callable[[str, dict[str, Any]], None]

_TERM = re.compile(
    r"^\s*(?P<neg>!)?(?P<key>[A-Za-z0-9_./-]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_.-]*))?\s*$"
)


def selector_matcher(selector: str) -> Callable[[dict[str, str]], bool] | None:
    """A predicate on labels for an equality-based selector (`k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-joined);
    None for what it does not read (set-based terms), which the caller then asks the API server."""
    checks: list[Callable[[dict[str, str]], bool]] = []
    for term in filter(str.strip, selector.split(",")):
        m = _TERM.match(term)
        if m is None:
            return None
        key, op, value = m["key"], m["op"], m["value"]
        if op and m["neg"]:
            return None
        if op:
            checks.append(lambda labels, k=key, v=value, eq=op != "!=": (labels.get(k) == v) == eq)
        else:
            checks.append(lambda labels, k=key, present=not m["neg"]: (k in labels) == present)
    return lambda labels: all(check(labels) for check in checks)


def watch_namespaces(argv: Iterable[str]) -> list[str] | None:
    """The namespaces `kopf run` was given (`-n X`, `--namespace X`, `--namespace=X`), or None for the whole
    cluster (`-A`, `--all-namespaces`, none given, or a glob pattern, which no single watch can follow)."""
    args, out = list(argv), []
    for i, arg in enumerate(args):
        if arg in ("-A", "--all-namespaces"):
            return None
        if arg in ("-n", "--namespace") and i + 1 < len(args):
            out.append(args[i + 1])
        elif arg.startswith("--namespace="):
            out.append(arg.split("=", 1)[1])
        elif arg.startswith("-n") and len(arg) > 2 and not arg.startswith("--"):
            out.append(arg[2:])
    if not out or any(set(n) & set("*?[]!") for n in out):
        return None
    return out


DELIVERED_KEPT = 8  # versions remembered per object: a write's answer is rarely more than a few events behind


def resource_version(obj: dict[str, Any]) -> str:
    return (obj.get("metadata") or {}).get("resourceVersion", "")


class Cache:
    """Objects of the watched kinds by (namespace, name), kept by LIST + WATCH through `kube` (which must
    offer `list_all(kind, namespace, selector)` -> (items, resourceVersion) and `watch(kind, namespace,
    selector, resourceVersion, timeout)` -> async iterator of (type, object))."""

    def __init__(self, kube: Any, namespaces: list[str] | None, on_change: OnChange) -> None:
        self._kube, self._namespaces, self._on_change = kube, namespaces, on_change
        self.selectors = {spec.KIND: "", **{kind: CHILD_LABEL for kind in CHILD_KINDS}}
        self._objects: dict[str, dict[Key, dict[str, Any]]] = {kind: {} for kind in self.selectors}
        self._synced: dict[tuple[str, str | None], asyncio.Event] = {}
        self._written: dict[tuple[str, str, str], str] = {}  # (kind, ns, name) -> the rv the operator wrote
        # (kind, ns, name) -> the last resourceVersions the list or watch delivered (see `stored`)
        self._delivered: dict[tuple[str, str, str], deque[str]] = {}
        self._tasks: list[asyncio.Task] = []

    # ---- running ----

    def start(self) -> None:
        for kind in self.selectors:
            for ns in self._namespaces or [None]:
                self._synced[(kind, ns)] = asyncio.Event()
                self._tasks.append(asyncio.create_task(self._follow(kind, ns), name=f"watch {kind} {ns}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _follow(self, kind: str, ns: str | None) -> None:
        """LIST, then WATCH from its resourceVersion for ever; LIST again after 410 Gone or a failure."""
        selector, delay = self.selectors[kind], RETRY_SECONDS[0]
        while True:
            try:
                items, rv = await self._kube.list_all(kind, ns, selector)
                self._replace(kind, ns, items, notify=self._synced[(kind, ns)].is_set())
                self._synced[(kind, ns)].set()
                delay = RETRY_SECONDS[0]
                while rv is not None:
                    rv = await self._watch_once(kind, ns, selector, rv)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if unreachable(e):
                    # the API server is away (restarting, or cut off): LIST again the moment it answers,
                    # not after a back-off, so that no reconcile acts on this cache longer than it must
                    log.warning("watching %s (namespace %s) failed: %r; listing again once the API "
                                "server answers", kind, ns, e)  # fmt: skip
                    while not await self._kube.answers():
                        await asyncio.sleep(RETRY_SECONDS[0])
                    continue
                log.warning(  # it answered, with an error (a missing CRD: it may come): a bit later
                    "watching %s (namespace %s) failed: %r; listing again in %.0f s", kind, ns, e, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_SECONDS[1])

    async def _watch_once(self, kind: str, ns: str | None, selector: str, rv: str) -> str | None:
        """One watch request; the resourceVersion to resume from, or None when a LIST is needed (410)."""
        async with contextlib.aclosing(self._kube.watch(kind, ns, selector, rv, WATCH_SECONDS)) as events:
            async for event, obj in events:
                if event == "ERROR":
                    if obj.get("code") == 410:  # our resourceVersion is too old: start over with a LIST
                        return None
                    raise RuntimeError(f"watch of {kind} ended with an error: {obj.get('message', obj)}")
                rv = resource_version(obj) or rv
                if event != "BOOKMARK":
                    self._apply(kind, event, obj)
        return rv

    # ---- keeping ----

    def _replace(self, kind: str, ns: str | None, items: list[dict[str, Any]], notify: bool) -> None:
        objects = self._objects[kind]
        fresh = {(o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in items}
        for key in [k for k in objects if ns is None or k[0] == ns]:
            if key not in fresh:
                gone = objects.pop(key)
                self._delivered.pop((kind, *key), None)
                if notify:
                    self._on_change("DELETED", gone)
        for key, obj in fresh.items():
            before = objects.get(key)
            objects[key] = obj
            self._deliver(kind, key, obj)
            if notify and (before is None or resource_version(before) != resource_version(obj)):
                self._on_change("MODIFIED" if before else "ADDED", obj)

    def _apply(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        if event == "DELETED":
            self._objects[kind].pop(key, None)
            self._written.pop((kind, *key), None)
            self._delivered.pop((kind, *key), None)
        else:
            self._objects[kind][key] = obj
            self._deliver(kind, key, obj)
            if self._written.get((kind, *key)) == resource_version(obj):
                return  # the echo of the operator's own write: nothing new to act on
        self._on_change(event, obj)

    def _deliver(self, kind: str, key: Key, obj: dict[str, Any]) -> None:
        self._delivered.setdefault((kind, *key), deque(maxlen=DELIVERED_KEPT)).append(resource_version(obj))

    def stored(self, obj: dict[str, Any]) -> None:
        """What the API server answered to the operator's own write: cached at once (a reconcile right after
        sees it), and its watch event is not reported as a change. Unless the watch has delivered that very
        version already: the answer and the watch travel apart, and the watch may be past it by now (another
        writer's change, e.g. a Service's status that a load balancer set); caching the answer then would
        put an older object over a newer one that no event would ever correct. (Resource versions are
        compared for equality only, as the API asks of clients:
        https://kubernetes.io/docs/reference/using-api/api-concepts/#resource-versions.)"""
        kind = obj.get("kind", "")
        if kind not in self._objects or not self._covers(obj["metadata"].get("namespace")):
            return
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if resource_version(obj) in self._delivered.get((kind, *key), ()):
            return
        self._objects[kind][key] = obj
        self._written[(kind, *key)] = resource_version(obj)

    def forget(self, obj: dict[str, Any]) -> None:
        """An object the operator deleted: gone from the cache at once (its watch event confirms it)."""
        kind, meta = obj.get("kind", ""), obj["metadata"]
        if kind in self._objects:
            self._objects[kind].pop((meta.get("namespace", ""), meta["name"]), None)
            self._written.pop((kind, meta.get("namespace", ""), meta["name"]), None)
            self._delivered.pop((kind, meta.get("namespace", ""), meta["name"]), None)

    # ---- reading ----

    def _covers(self, ns: str | None) -> bool:
        return self._namespaces is None or ns in self._namespaces

    def watches(self, kind: str, ns: str | None) -> bool:
        return kind in self._objects and bool(self._tasks) and self._covers(ns)

    async def _synced_for(self, kind: str, ns: str | None) -> None:
        await self._synced[(kind, None if self._namespaces is None else ns)].wait()

    async def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        await self._synced_for(kind, ns)
        obj = self._objects[kind].get((ns, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, kind: str, ns: str, selector: str) -> list[dict[str, Any]] | None:
        """The cached objects of a kind in `ns` matching `selector`; None for a selector it cannot read."""
        matches = selector_matcher(selector)
        if matches is None:
            return None
        await self._synced_for(kind, ns)
        return [
            copy.deepcopy(o)
            for (n, _), o in sorted(self._objects[kind].items())
            if n == ns and matches(o["metadata"].get("labels") or {})
        ]

    async def synced(self) -> None:
        """Until every kind's first list has arrived (a new leader's view is whole)."""
        await asyncio.gather(*(e.wait() for e in self._synced.values()))

    def models(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for o in self._objects[spec.KIND].values()]
