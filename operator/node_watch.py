"""The operator's read of what the nodes offer (`node_offers` decides from it), where the chart grants it
(rbac.readNodes, the operator's --read-nodes or NEURONFLEET_READ_NODES): kopf watches the Nodes and, where
the cluster serves DRA (resource.k8s.io/v1), the ResourceSlices and DeviceClasses, cluster-wide, each in a
`@kopf.index` that keeps only what `node_offers` reads, not the object: per node its instance type, the
labels the operator's pods select on (the instance type's, the chart's LNC label) and the device plugins'
allocatable; per ResourceSlice its driver, node and device count; per DeviceClass its drivers. A few dozen
bytes a node, for clusters of thousands.

At rest the read sends no request (a watch is one long request per kind); nodes' own updates (the kubelet's
status every few minutes) queue nothing unless what a node offers changed. Such a change queues the models
of that node's instance type (every Neuron model for a DeviceClass's, or a slice of every node), once the
changes have been quiet for QUIET seconds (a node group growing by tens is one pass per model). A node
deleted while no watch ran stays in kopf's index until the operator restarts (kopf lists again after a
410 Gone but drops nothing): at worst it hides a missing device plugin, never reports one that is there.

Which kinds are watched is decided once, at start (`probe`): one LIST of at most one object per kind. A kind
the API server does not serve (404: DRA before Kubernetes 1.34) or refuses (403: the operator told to read
nodes without the right to) is not watched, and said in the log: kopf would wait for its first list for
ever, holding every handler back. Without Nodes there is no Schedulable condition at all.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import aiohttp
import kopf

from . import kube, login, node_offers

log = logging.getLogger(__name__)

READ_NODES_ENV = "NEURONFLEET_READ_NODES"  # the chart's rbac.readNodes
KINDS: dict[str, tuple[str, str, str]] = {  # kind -> (group, version, plural), the order they are read in
    "Node": ("", "v1", "nodes"),
    "ResourceSlice": ("resource.k8s.io", "v1", "resourceslices"),
    "DeviceClass": ("resource.k8s.io", "v1", "deviceclasses"),
}
QUIET = 1.0  # seconds without a change of what nodes offer before the models concerned are queued
QUIET_LONGEST = 10.0  # (changes that never pause: queued this long after the first)
PROBE_RETRY = 2.0  # seconds between tries of the start-up probe while the API server does not answer

Summary = tuple[str, Any]  # (the index key: instance type, node name or class name; what node_offers keeps)


def reads_nodes(environ: Mapping[str, str]) -> bool:
    """NEURONFLEET_READ_NODES: "true" or "false" (absent: false); anything else is a ValueError saying so."""
    value = environ.get(READ_NODES_ENV, "false").strip().lower()
    if value not in ("true", "false"):
        raise ValueError(
            f"{READ_NODES_ENV}={environ[READ_NODES_ENV]!r}: it is true or false (the chart's rbac.readNodes)"
        )
    return value == "true"


async def probe(credentials: login.Login) -> list[str]:
    """The kinds of KINDS the operator may list cluster-wide here (one LIST of at most one object each),
    trying again every PROBE_RETRY seconds while the API server does not answer; those it serves not, or
    refuses, are said in the log."""
    client = kube.Kube(credentials)
    try:
        readable: list[str] = []
        for kind in KINDS:
            while True:
                try:
                    answer = await client.readable(kind)
                    break
                except kube.KubeError as e:
                    log.warning("reading %s: the API server answered %s; trying again", kind, e)
                except (OSError, aiohttp.ClientError, TimeoutError) as e:
                    log.warning("reading %s: the API server does not answer (%r); trying again", kind, e)
                await asyncio.sleep(PROBE_RETRY)
            if answer:
                readable.append(kind)
            elif answer is None:
                log.info("the API server serves no %s: what it would say of the nodes is not read", kind)
            else:
                log.warning("the operator may not list %s (403): the chart's rbac.readNodes grants it; what "
                            "it would say of the nodes is not read", kind)  # fmt: skip
        return readable
    finally:
        await client.close()


def _index_id(kind: str) -> str:
    return "nf_offer_" + kind.lower()


class NodeWatch:
    """kopf's indexes of what the nodes offer, their `Offers`, and the changes that concern models."""

    def __init__(self, kinds: Collection[str], kept_labels: Iterable[str] = ()) -> None:
        """`kinds`: those of KINDS to watch (`probe`'s); `kept_labels`: node labels the operator's pods
        select on, beside the instance type's."""
        self.kinds = tuple(kind for kind in KINDS if kind in kinds)
        self.kept_labels = frozenset({node_offers.INSTANCE_TYPE, *(k for k in kept_labels if k)})
        # what is queued when what nodes offer changes: the instance types concerned (None: every one)
        self.on_change: Callable[[set[str] | None], None] = lambda instance_types: None
        self._indexes: dict[str, Any] = {}  # kind -> kopf.Index
        self._fresh: dict[tuple[str, str], Summary] = {}  # indexed, not yet seen by the event handler
        self._seen: dict[tuple[str, str], Summary] = {}  # (kind, name) -> what its last event delivered
        self._pending: set[str] | None = set()  # instance types changed (None: every one), not yet queued
        self._timer: asyncio.TimerHandle | None = None
        self._since: float | None = None  # when the first change not yet queued came
        # a node that joined less than node_offers.SETTLE_SECONDS ago: its type looked at again once older
        self._settled: dict[str, asyncio.TimerHandle] = {}

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """An index and an event handler for each watched kind (cluster-scoped: one watch each)."""
        for kind in self.kinds:
            group, version, plural = KINDS[kind]
            where = {"group": group, "version": version, "plural": plural, "registry": registry}
            kopf.index(**where, id=_index_id(kind), param=kind)(self._index)
            kopf.on.event(**where, id=f"nf_offer_{kind.lower()}_event", param=kind)(self._event)

    def attach(self, indices: Mapping[str, Any]) -> None:
        """The indexes kopf made (its handlers' keyword arguments)."""
        self._indexes = {kind: indices[_index_id(kind)] for kind in self.kinds}

    def offers(self) -> node_offers.Offers:
        """What the nodes offer now, read from kopf's indexes as they are (no copy)."""
        watched = self._indexes.get
        return node_offers.Offers(
            nodes=watched("Node") or {},
            kept_labels=self.kept_labels,
            slices=watched("ResourceSlice") if "ResourceSlice" in self.kinds else None,
            classes=watched("DeviceClass") if "DeviceClass" in self.kinds else None,
        )

    def stop(self) -> None:
        for timer in [self._timer, *self._settled.values()]:
            if timer is not None:
                timer.cancel()
        self._settled.clear()

    # ---- kopf's side ----

    def _summary(self, kind: str, body: Any) -> Summary:
        obj = dict(body)
        if kind == "Node":
            return node_offers.node_offer(obj, self.kept_labels)
        if kind == "ResourceSlice":
            return node_offers.slice_offer(obj)
        return node_offers.device_class_offer(obj)

    async def _index(self, body: Any, param: str, **_: Any) -> dict[str, Any]:
        # (async: kopf runs a plain function in a thread, a hop per object: a first list pays thousands)
        key, offer = summary = self._summary(param, body)
        self._fresh[(param, body["metadata"]["name"])] = summary
        return {key: offer}

    async def _event(self, type: str | None, body: Any, param: str, **kwargs: Any) -> None:
        if not self._indexes:
            self.attach(kwargs)
        name = body["metadata"]["name"]
        fresh = self._fresh.pop((param, name), None)
        before = self._seen.get((param, name))
        if type == "DELETED":
            self._seen.pop((param, name), None)
            now = None
        else:
            now = fresh or self._summary(param, body)
            self._seen[(param, name)] = now
        if param == "Node":
            self._settle(name, now)
        if (type is None and before is None) or now == before:
            return  # kopf's first list (the passes that follow read it whole), or nothing a model reads
        self._changed(param, [s for s in (before, now) if s is not None])

    def _changed(self, kind: str, summaries: list[Summary]) -> None:
        types: set[str] | None = set()
        for key, _ in summaries:
            if kind == "Node":
                types.add(key)  # type: ignore[union-attr]
            elif kind == "ResourceSlice" and key != node_offers.ALL_NODES:
                node = self._seen.get(("Node", key))
                if node is None:
                    types = None  # a node not seen: every model looks again
                    break
                types.add(node[0])  # type: ignore[union-attr]
            else:  # a DeviceClass, or a slice of every node
                types = None
                break
        if types is None or self._pending is None:
            self._pending = None
        else:
            self._pending |= types
        loop = asyncio.get_running_loop()
        self._since = self._since if self._since is not None else loop.time()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(min(loop.time() + QUIET, self._since + QUIET_LONGEST), self._flush)

    def _settle(self, name: str, summary: Summary | None) -> None:
        """A node that joined less than SETTLE_SECONDS ago lacks no device yet (node_offers.settling): its
        type is looked at again once it is older, whatever it registers meanwhile."""
        pending = self._settled.pop(name, None)
        if pending is not None:
            pending.cancel()
        if summary is None:
            return
        at = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        age = node_offers.seconds_between(summary[1].created, at)
        if age is None or age >= node_offers.SETTLE_SECONDS:
            return
        instance_type = summary[0]
        later = node_offers.SETTLE_SECONDS - age + 1

        def settled() -> None:
            self._settled.pop(name, None)
            self._changed("Node", [(instance_type, None)])

        self._settled[name] = asyncio.get_running_loop().call_later(later, settled)

    def _flush(self) -> None:
        pending, self._pending, self._timer, self._since = self._pending, set(), None, None
        self.on_change(None if pending is None else set(pending))
