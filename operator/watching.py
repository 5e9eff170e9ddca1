"""What kopf watches for the operator, and the operator's reads answered from it.

kopf watches the NeuronModels and every child kind the operator makes (labelled neuronfleet.dev/model, the
selector sent to the API server with each LIST and WATCH) but Secrets, and keeps each kind in a `@kopf.index`:
a child under its model (a per-model lookup, not a scan), under its own name, and a pod also under its
Job's name. `Observed` answers the reconciles' reads (`get`, `list`, through `kube.Kube`) from those indexes,
so a reconcile reads memory, not the API server, and its `@kopf.on.event` handler turns each change into
`on_change(event type, object)` (the operator queues the model). Secrets are read by name
(`reconcile.apply_secret`): a LIST or WATCH of Secrets, which RBAC cannot narrow to a label, would need the
right to read every Secret of the cluster.

What kopf lacks, and this module adds (small, and named for it):
- a check of the watch (`check_live`): the models and their Jobs listed live now and then (by the leader:
  triggers.CHECK_SECONDS), and a version the watch never delivered read and reported as a change;
- read-your-writes: the API server's answer to the operator's own write is read at once (`stored`,
  `forget`) until kopf delivers a newer event for that object, and the watch's echo of that write is not
  reported as a change (the write's answer and the watch travel apart: an answer the watch is already past
  is not put over what it delivered);
- a re-list told from changes: after a watch whose resourceVersion expired (410 Gone) kopf lists again and
  delivers every object anew; an object delivered again at a version already seen is not a change;
- objects deleted while no watch ran: a re-list cannot report them (kopf's indexes keep them). After kopf
  re-lists (an object delivered again), every watched kind is listed live once; an indexed object missing
  from it is hidden from reads and reported as deleted. (A kind re-listed alone whose every object went
  meanwhile delivers nothing to notice: found out at the next re-list of any kind.) One whose name was made
  again meanwhile is in that list by name: kopf, keying its indexes by uid, keeps both; the old one, found
  beside the new one when that is delivered, is never read again (`_latest`).

Reads wait until kopf has indexed every kind's first list (kopf holds every handler back until then; the
first event delivered says so).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any

import kopf

from . import spec

if TYPE_CHECKING:
    from .node_watch import NodeWatch

log = logging.getLogger(__name__)

CHILD_LABEL = "neuronfleet.dev/model"  # builders.LABEL_PREFIX + "/model"; every child carries it
JOB_LABEL = "job-name"  # set by the Job controller on its pods
# kind -> (group, version, plural) of what kopf watches
WATCHED: dict[str, tuple[str, str, str]] = {
    spec.KIND: (spec.GROUP, spec.VERSION, spec.PLURAL),
    "Pod": ("", "v1", "pods"),  # serving pods' states (crash loops, unschedulable), the compile pod's report
    "Job": ("batch", "v1", "jobs"),
    "Deployment": ("apps", "v1", "deployments"),
    "Service": ("", "v1", "services"),
    "ConfigMap": ("", "v1", "configmaps"),
    "PersistentVolumeClaim": ("", "v1", "persistentvolumeclaims"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
    "ResourceClaimTemplate": ("resource.k8s.io", "v1", "resourceclaimtemplates"),  # DRA (devices.py)
}
CHILD_KINDS = tuple(kind for kind in WATCHED if kind != spec.KIND)
# kopf's own calls beyond RBAC_RULES, in cluster mode only (a ClusterRole): it watches the
# CustomResourceDefinitions, so a NeuronModel CRD installed (or replaced) after the operator started is
# served (https://kopf.readthedocs.io/en/stable/scopes/). Namespaced, kopf scans nothing (no cluster-wide
# right at all)
KOPF_RULES: dict[tuple[str, str], tuple[str, ...]] = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): ("list", "watch"),
}
DELIVERED_KEPT = 8  # versions remembered per object: a write's answer is rarely more than a few events behind
RELIST_QUIET = 2.0  # seconds without a re-listed object after which a re-list is taken to be over
CONFIRM_RETRY = 1.0  # seconds between live reads of a written object while the API server does not answer
RELIST_LONGEST = 10.0
LIVE_CHECKED = (spec.KIND, "Job")  # what a leader checks against a live list (`check_live`): a model, and the
# compile Job it waits on  # a sweep's longest wait (kopf re-listing again and again: every watch expiring)

Key = tuple[str, str]  # namespace, name
OnChange = Callable[[str, dict[str, Any]], None]
LiveList = Callable[[str, str | None], Awaitable[list[dict[str, Any]]]]
LiveGet = Callable[[str, str, str], Awaitable[dict[str, Any] | None]]

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


def _equals(selector: str, label: str) -> str | None:
    """The value `selector` requires of `label` (`label=v` or `label==v` among its terms), or None."""
    for term in selector.split(","):
        m = _TERM.match(term)
        if m and m["key"] == label and m["op"] in ("=", "==") and not m["neg"]:
            return m["value"]
    return None


def index_id(kind: str) -> str:
    """The kopf index of a kind (a handler id, and the keyword its handlers receive it by)."""
    return "nf_" + kind.lower()


def index_keys(kind: str, obj: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Where an object is found: by name; a child also by its model; a pod also by its Job."""
    meta = obj.get("metadata") or {}
    ns, labels = meta.get("namespace", ""), meta.get("labels") or {}
    keys = [("name", ns, meta.get("name", ""))]
    if kind != spec.KIND and labels.get(CHILD_LABEL):
        keys.append(("model", ns, labels[CHILD_LABEL]))
    if kind == "Pod" and labels.get(JOB_LABEL):
        keys.append(("job", ns, labels[JOB_LABEL]))
    return keys


def resource_version(obj: dict[str, Any]) -> str:
    return (obj.get("metadata") or {}).get("resourceVersion", "")


def _snapshot(kind: str, body: Any) -> dict[str, Any]:
    """What kopf delivered as a plain dict, with its kind (list items carry it too: kopf adds it), as kept
    (a copy: kopf's body is not held on to; every read hands out a deep copy, `get`, `list`, `models`)."""
    obj = kept(dict(body))
    obj.setdefault("kind", kind)
    return obj


# what no reconcile reads, and a real cluster puts on objects: the server's field ownership (often a third of
# an object; controller-runtime's caches strip it alike, cache.TransformStripManagedFields) and kubectl's copy
# of the applied object (client-side apply), a second copy of a NeuronModel's spec
_UNREAD_METADATA = ("managedFields",)
_UNREAD_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",)
_SHARED_STRING = 96  # strings up to this length are shared between the objects kept (interned)


def kept(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as the operator keeps it: a copy without what no reconcile reads (`_UNREAD_METADATA`,
    `_UNREAD_ANNOTATIONS`), its keys and short strings shared with every other object kept. A parsed object
    holds its own copy of each key ("metadata", "name", "image" ...) and value ("apps/v1", a model's uid in
    each child's ownerReferences, its labels): sharing them halves what 1000 models' objects hold (90 to 46
    MiB for 10,600 objects measured with tracemalloc; 12 microseconds an object)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if k not in _UNREAD_METADATA}
        notes = meta.get("annotations")
        if isinstance(notes, dict) and any(k in notes for k in _UNREAD_ANNOTATIONS):
            meta["annotations"] = {k: v for k, v in notes.items() if k not in _UNREAD_ANNOTATIONS}
        obj = {**obj, "metadata": meta}
    return _shared(obj)


def _shared(value: Any) -> Any:
    """A deep copy of parsed JSON with its keys and short strings interned."""
    if isinstance(value, dict):
        return {sys.intern(k): _shared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shared(v) for v in value]
    if isinstance(value, str) and len(value) <= _SHARED_STRING:
        return sys.intern(value)
    return value


class Observed:
    """The objects the reconciles read: kopf's indexes of the watched kinds, with read-your-writes, re-lists
    told from changes, and objects deleted while no watch ran found out (see the module's docstring)."""

    def __init__(self, namespaces: list[str] | None, on_change: OnChange | None = None) -> None:
        self._namespaces = namespaces
        self.on_change: OnChange = on_change or (lambda event, obj: None)
        # a live LIST of a kind's watched objects in a namespace (None: all): the sweep after a re-list
        self.live_list: LiveList | None = None
        self.live_get: LiveGet | None = None  # a live read by name: what the sweep would hide, confirmed
        self.nodes: NodeWatch | None = None  # what the nodes offer, where they are read (node_watch)
        self._indexes: dict[str, Any] = {}  # kind -> kopf.Index (attached once kopf has made them)
        self._synced: asyncio.Event | None = None
        # (kind, ns, name) -> the object the operator wrote, until kopf delivers that object again
        self._written: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._gone: set[tuple[str, str, str]] = set()  # deleted by the operator or found gone; hidden
        self._replaced: set[str] = set()  # uids of objects kopf keeps that a new one of their name replaced
        # (kind, ns, name) -> the last resourceVersions delivered, and when the last one was
        self._delivered: dict[tuple[str, str, str], tuple[str, ...]] = {}  # (a tuple: a deque costs 0.6 KiB)
        self._delivered_at: dict[tuple[str, str, str], float] = {}
        self._relisting: float | None = None  # when kopf's re-lists began (a sweep is due after them)
        self._relisted_last = 0.0  # when a re-list last delivered an object
        self._written_at: dict[tuple[str, str, str], float] = {}  # when the operator last wrote or deleted it
        self._tasks: set[asyncio.Task] = set()

    # ---- kopf's side ----

    def register(self, registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings) -> None:
        """kopf's indexes and event handlers for every watched kind; the children's watches carry the
        label selector, so the API server sends only the operator's children."""
        for kind, (group, version, plural) in WATCHED.items():
            where = {"group": group, "version": version, "plural": plural, "registry": registry}
            labels = None if kind == spec.KIND else {CHILD_LABEL: kopf.PRESENT}
            kopf.index(**where, id=index_id(kind), param=kind, labels=labels)(self._index)
            kopf.on.event(**where, id=f"nf_{kind.lower()}_event", param=kind, labels=labels)(self._event)
            if labels:
                settings.watching.label_selectors[(group, version, plural)] = CHILD_LABEL

    def attach(self, indices: dict[str, Any]) -> None:
        """The indexes kopf made (its handlers' keyword arguments, e.g. the start-up handler's)."""
        self._indexes = {kind: indices[index_id(kind)] for kind in WATCHED}

    @staticmethod
    async def _index(body: Any, param: str, **_: Any) -> dict[tuple[str, str, str], dict[str, Any]]:
        # (async: kopf runs a plain function in a thread, a hop per object that a re-list pays thousands of)
        obj = _snapshot(param, body)
        return dict.fromkeys(index_keys(param, obj), obj)

    async def _event(self, type: str | None, body: Any, param: str, **kwargs: Any) -> None:
        if not self._indexes:
            self.attach(kwargs)
        self.synced_event().set()  # kopf delivers events only once every kind's first list is indexed
        self.delivered(param, type, _snapshot(param, body))

    def delivered(self, kind: str, event: str | None, obj: dict[str, Any]) -> None:
        """kopf delivered an object (event None: listed) after indexing it: reported to `on_change`
        unless it is the echo of the operator's own write or a re-list's copy of a version already seen."""
        meta = obj["metadata"]
        key = (kind, meta.get("namespace", ""), meta["name"])
        rv, seen = resource_version(obj), self._delivered.get(key)
        again = seen is not None and rv in seen  # a version delivered before (a re-list's copy)
        written = self._written.pop(key, None)
        self._gone.discard(key)
        if event != "DELETED":
            self._note_replaced(kind, key, meta.get("uid"))
        if event is None and seen is not None:
            self._relisted(kind)  # delivered before: this is a re-list
        if event == "DELETED":
            self._delivered.pop(key, None)
            self._delivered_at.pop(key, None)
            self._written_at.pop(key, None)
        else:
            if not again:
                self._delivered[key] = (*(seen or ())[1 - DELIVERED_KEPT :], rv)
            self._delivered_at[key] = time.monotonic()
            if again:
                return  # a re-list's copy of what was delivered already
            if written is not None and resource_version(written) == rv:
                return  # the echo of the operator's own write: nothing new to act on
        self.on_change("MODIFIED" if event is None and seen is not None else event or "ADDED", obj)

    def _note_replaced(self, kind: str, key: tuple[str, str, str], uid: str | None) -> None:
        """Where kopf's index holds other objects of this one's name (other uids), they were deleted while no
        watch ran: never read again, even once this one goes (kopf keeps them: no DELETED came for them)."""
        store = (self._indexes.get(kind) or {}).get(("name", key[1], key[2]))
        if store is not None and len(store) > 1:
            for other in store:
                if (other_uid := (other.get("metadata") or {}).get("uid")) not in (None, uid):
                    self._replaced.add(other_uid)

    # ---- objects deleted while no watch ran ----

    def _relisted(self, kind: str) -> None:
        now = time.monotonic()
        self._relisted_last = now
        if self._relisting is None:
            self._relisting = now
            self._later(self._sweep(), "re-list sweep")

    async def _sweep(self) -> None:
        """Once kopf's re-lists are over (none delivered an object for RELIST_QUIET seconds), every watched
        kind is listed live once; an indexed object that list lacks, and that kopf has not delivered since,
        was deleted while no watch ran: hidden, and reported deleted. Every kind, not only those seen
        re-listed: a kind whose every object went meanwhile re-lists without delivering any."""
        began = self._relisting or time.monotonic()
        while (now := time.monotonic()) - self._relisted_last < RELIST_QUIET and now - began < RELIST_LONGEST:
            await asyncio.sleep(RELIST_QUIET / 2)
        self._relisting = None
        if self.live_list is None:
            return
        for kind in WATCHED:
            listed_at = time.monotonic()
            try:
                live = {
                    (o["metadata"].get("namespace", ""), o["metadata"]["name"])
                    for ns in self._namespaces or [None]
                    for o in await self.live_list(kind, ns)
                }
            except Exception as e:  # the API server away again: its next re-list sweeps again
                if getattr(e, "status", None) == 404:  # a kind the cluster does not serve (DRA before 1.34)
                    continue
                log.warning("listing %s after a re-list failed: %r", kind, e)
                return
            index = self._indexes.get(kind) or {}
            for how, ns, name in list(index):
                key = (kind, ns, name)
                if how != "name" or (ns, name) in live or key in self._gone:
                    continue
                if self._delivered_at.get(key, 0.0) >= listed_at:
                    continue  # delivered since the list began: made meanwhile
                if kind != "Pod" and self.live_get is not None:  # (pods are listed, never read by name)
                    try:  # read by name before it is hidden: a list and a create may cross (a name made anew)
                        if await self.live_get(kind, ns, name) is not None:
                            continue
                    except Exception as e:
                        log.warning("reading %s %s/%s after a re-list failed: %r", kind, ns, name, e)
                        return
                    if key in self._gone or self._delivered_at.get(key, 0.0) >= listed_at:
                        continue
                gone = self._indexed(kind, ns, name)
                log.info("%s %s/%s was deleted while no watch ran: forgotten", kind, ns, name)
                self._gone.add(key)
                self._delivered.pop(key, None)
                self._delivered_at.pop(key, None)
                if gone is not None:
                    self.on_change("DELETED", gone)

    async def check_live(self, kinds: Iterable[str] = LIVE_CHECKED) -> int:
        """The objects of `kinds` listed live and compared with what the reads answer: one whose version
        differs, or that the reads do not have, and that nothing was delivered for since the list began, is a
        change the watch never delivered (CI's chaos runs: a model made anew never reconciled, a Job's
        completion never seen, each leaving its model stuck until the resync). It is read as listed (as a
        write's answer is, until the watch delivers a newer version) and reported as a change. How many were;
        0 where the API server does not answer (the next check tries again)."""
        if self.live_list is None:
            return 0
        found = 0
        for kind in kinds:
            listed_at = time.monotonic()
            try:
                live = [o for ns in self._namespaces or [None] for o in await self.live_list(kind, ns)]
            except Exception as e:
                log.warning("listing %s to check the watch failed: %r", kind, e)
                return found
            for listed in live:
                obj = _snapshot(kind, listed)
                meta = obj["metadata"]
                key = (kind, meta.get("namespace", ""), meta["name"])
                if max(self._delivered_at.get(key, 0.0), self._written_at.get(key, 0.0)) >= listed_at:
                    continue  # delivered, written or deleted since the list began: what is read is as new
                current = self._current(kind, key[1], key[2], self._indexed(kind, key[1], key[2]))
                if current is not None and resource_version(current) == resource_version(obj):
                    continue
                log.info("%s %s/%s is at version %s, which the watch never delivered (it holds %s): read as "
                         "listed", kind, key[1], key[2], resource_version(obj),
                         resource_version(current) if current is not None else "none")  # fmt: skip
                self._written[key] = obj
                self._gone.discard(key)
                found += 1
                self.on_change("ADDED" if current is None else "MODIFIED", obj)
        return found

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- the operator's own writes ----

    def _covers(self, ns: str | None) -> bool:
        return self._namespaces is None or ns in self._namespaces

    def stored(self, obj: dict[str, Any], sent: float | None = None) -> None:
        """What the API server answered to the operator's own write, sent at `sent` (monotonic): read at
        once, and its watch event is not reported as a change. Unless kopf has delivered that very version
        already: the answer and the watch travel apart, and the watch may be past it by now (another
        writer's change, e.g. a Service's status that a load balancer set). Where kopf delivered another
        version of the object while the write was on its way, which of the two is newer cannot be told
        (kopf batches an object's events that come close together, so the answer's own version may never be
        delivered: a Job created and completed at once, its ADDED folded into the completion): the answer is
        read, and the object is read live once (`_confirm`); an answer the cluster is already past is
        dropped, and what the watch delivered is read (had it stayed, no later event would correct it).
        (Resource versions are compared for equality only, as the API asks of clients:
        https://kubernetes.io/docs/reference/using-api/api-concepts/#resource-versions.)"""
        kind = obj.get("kind", "")
        if kind not in WATCHED or not self._covers(obj["metadata"].get("namespace")):
            return
        key = (kind, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if resource_version(obj) in self._delivered.get(key, ()):
            return
        self._written[key] = written = kept(obj)
        self._written_at[key] = time.monotonic()
        self._gone.discard(key)
        if self._delivered_since(key, sent):
            self._later(self._confirm(key, written), "confirm a write")

    def forget(self, obj: dict[str, Any], sent: float | None = None) -> None:
        """An object the operator deleted: hidden at once (kopf's event confirms it). Where kopf delivered
        the object while the deletion was on its way (made again meanwhile?), it is read live once, and shown
        again if it is there."""
        kind, meta = obj.get("kind", ""), obj["metadata"]
        if kind in WATCHED:
            key = (kind, meta.get("namespace", ""), meta["name"])
            self._written.pop(key, None)
            self._written_at[key] = time.monotonic()
            self._gone.add(key)
            if self._delivered_since(key, sent):
                self._later(self._confirm(key, None), "confirm a deletion")

    def _delivered_since(self, key: tuple[str, str, str], sent: float | None) -> bool:
        return sent is not None and self._delivered_at.get(key, 0.0) >= sent

    def _later(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` on a task of this loop, kept until it ends (`stop` cancels it)."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _confirm(self, key: tuple[str, str, str], written: dict[str, Any] | None) -> None:
        """The object read live after a write whose answer crossed a delivery: an answer (`written`) the
        cluster is past is dropped (the watch's is read); a deleted object found again is shown again. Only
        while nothing was delivered since (a delivery settles it); read again until the API server answers."""
        if self.live_get is None:
            return
        kind, ns, name = key
        while True:
            if not (self._written.get(key) is written if written is not None else key in self._gone):
                return  # settled by a delivery meanwhile
            try:
                live = await self.live_get(kind, ns, name)
                break
            except Exception as e:  # the API server away: read again (no later delivery may come to settle
                # it: a Job completed at once is not delivered again; CI's chaos run, a model left compiling)
                log.warning("reading %s %s/%s after a write failed (again in %.0f s): %r", kind, ns, name,
                            CONFIRM_RETRY, e)  # fmt: skip
                await asyncio.sleep(CONFIRM_RETRY)
        if written is not None and self._written.get(key) is written:
            if live is None or resource_version(live) != resource_version(written):
                del self._written[key]  # past it (or gone): what the watch delivered is read
        elif written is None and key in self._gone and live is not None:
            self._gone.discard(key)  # made again: read as the watch delivered it

    # ---- reading ----

    def synced_event(self) -> asyncio.Event:
        if self._synced is None:
            self._synced = asyncio.Event()
        return self._synced

    async def synced(self) -> None:
        """Until kopf has indexed every kind's first list (a new leader's view is whole)."""
        await self.synced_event().wait()

    def watches(self, kind: str, ns: str | None) -> bool:
        return kind in WATCHED and self._covers(ns)

    def _indexed(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        store = (self._indexes.get(kind) or {}).get(("name", ns, name))
        return self._latest(kind, ns, name, store) if store else None

    def _latest(self, kind: str, ns: str, name: str, objs: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
        """Of the objects kopf's index holds under one name, the one delivered last. Mostly one; two where the
        name was deleted and made again while no watch ran: kopf keys its indexes by uid, and the re-list
        delivers the new object without a DELETED event for the old one, which stays (an old model read
        instead of the new one: its pass, finding the old status current, wrote nothing, and the new model
        never got a status)."""
        objs = list(objs)
        if len(objs) > 1 or self._replaced:
            objs = [o for o in objs if (o.get("metadata") or {}).get("uid") not in self._replaced]
        if len(objs) <= 1:
            return objs[0] if objs else None
        last = (self._delivered.get((kind, ns, name)) or ("",))[-1]
        return next((o for o in objs if resource_version(o) == last), objs[-1])

    def _current(
        self, kind: str, ns: str, name: str, indexed: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        key = (kind, ns, name)
        if key in self._gone:
            return None
        return self._written.get(key, indexed)

    async def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        await self.synced()
        obj = self._current(kind, ns, name, self._indexed(kind, ns, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, kind: str, ns: str, selector: str) -> list[dict[str, Any]] | None:
        """The objects of a kind in `ns` matching `selector`, looked up by model (or a pod's Job) where the
        selector names one; None for a selector it cannot read."""
        matches = selector_matcher(selector)
        if matches is None:
            return None
        await self.synced()
        index = self._indexes.get(kind) or {}
        if (model := _equals(selector, CHILD_LABEL)) is not None:
            found: Iterable[dict[str, Any]] = index.get(("model", ns, model)) or ()
        elif kind == "Pod" and (job := _equals(selector, JOB_LABEL)) is not None:
            found = index.get(("job", ns, job)) or ()
        else:
            found = [o for (how, n, _), s in list(index.items()) if how == "name" and n == ns for o in s]
        by_name: dict[str, list[dict[str, Any]]] = {}
        for o in found:
            by_name.setdefault(o["metadata"]["name"], []).append(o)
        objects = {name: self._latest(kind, ns, name, objs) for name, objs in by_name.items()}
        for (k, n, name), obj in self._written.items():
            if k == kind and n == ns:
                objects[name] = obj
        return [
            copy.deepcopy(current)
            for name, obj in sorted(objects.items())
            if (current := self._current(kind, ns, name, obj)) is not None
            and matches(current["metadata"].get("labels") or {})
        ]

    def models(self) -> list[dict[str, Any]]:
        index = self._indexes.get(spec.KIND) or {}
        return [
            copy.deepcopy(latest)
            for (_, ns, name), store in list(index.items())
            if store and (latest := self._latest(spec.KIND, ns, name, store)) is not None
        ]
