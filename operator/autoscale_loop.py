"""The built-in autoscaler's shell (autoscaling provider builtin): every `scaling.tick_seconds` (15 s unless
the operator's setting says otherwise), for each NeuronModel it scales, read every ready serving pod's
`/metrics`, decide with `autoscaler.decide` (pure) and
the history it keeps in memory per model, and when the decision changes the replicas: write it to
`status.autoscaling` (the autoscaler is the only writer of the replicas of the models it scales), post an
Event (Normal ScaledUp / ScaledDown with the reason and the signal values; Warning ScaleUpStuck for pods
Pending past the deadline), count it in the operator's metrics and enqueue the model's reconcile, which sets
the Deployments' replicas from that status. Before a scale-down, where the chart opts in
(rbac.podDeletionCost: it grants the pod patch), each pod's deletion cost is set so that the idlest go first.
In dry run the decision goes to `status.autoscaling.lastDecision` only.

Scale to zero (`front_door`): the loop also reads the model's ready router pods' `/metrics` for the requests
they hold (`neuronfleet:router_requests_held`) and passes their sum to the decision as `held` (at zero, held
requests scale to 1 at once); a router's wake (`wake`, POST /wake/NS/NAME) runs the model's decision at once,
counting at least one held request (the wake is the router's own word that it holds one). The cold start, from
a decision that scaled a role up to the first new pod of that role being Ready (its Ready condition's
lastTransitionTime, else when the pod cache first reported it ready), is kept in
`status.autoscaling.coldStartSeconds` and `.coldStartAt` and is the decision's `Policy.cold_start`.

Where a pod's `/metrics` is read: the address and the `http` port its Service's EndpointSlices give
(discovery.k8s.io/v1, https://kubernetes.io/docs/concepts/services-networking/endpoint-slices/), the way a
real cluster routes to a pod and Prometheus' `endpointslice` discovery finds its targets; in local mode the
process kubelet publishes the local port it mapped the container port to in the same slices. A scrape is
bounded in time (SCRAPE_TIMEOUT) and in number at once (SCRAPES_AT_ONCE); one that fails leaves the pod's
metrics stale (the decision then freezes scale-down, never scale-up).
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from . import autoscaler, front_door, kube, metrics, pod_metrics, scaling, validation
from .builders import LABEL_PREFIX

SCRAPE_TIMEOUT = 5.0  # seconds for one pod's /metrics
SCRAPES_AT_ONCE = 8
# the ReplicaSet controller deletes the pods with the lower cost first on a scale-down (Kubernetes >= 1.22:
# https://kubernetes.io/docs/concepts/workloads/controllers/replicaset/#pod-deletion-cost)
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# whether to set it: only where the chart grants the pod patch it takes (rbac.podDeletionCost, off by
# default: kube.OPT_IN_RULES); without it a scale-down still happens, the ReplicaSet controller choosing
POD_DELETION_COST_ENV = "NEURONFLEET_POD_DELETION_COST"
SERVICE_LABEL = "kubernetes.io/service-name"  # an EndpointSlice's Service (set by its controller)
WAKE_INTERVAL = 1.0  # seconds: a model's wakes closer together than this run one decision

log = logging.getLogger(__name__)
Key = tuple[str, str]
Scaled = tuple[float, frozenset[str]]  # a role's scale-up awaiting its first new pod: when, the pods then


def seconds(timestamp: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 timestamp as the API server writes them (2026-01-02T03:04:05Z)."""
    if not timestamp:
        return None
    return float(calendar.timegm(time.strptime(timestamp[:19], "%Y-%m-%dT%H:%M:%S")))


def pod_deletion_cost(environ: Any) -> bool:
    """Whether the operator may annotate pods (POD_DELETION_COST_ENV: true or false; unset: false)."""
    value = environ.get(POD_DELETION_COST_ENV, "").strip().lower()
    if value not in ("", "true", "false"):
        raise ValueError(f"{POD_DELETION_COST_ENV}={value!r}: expected true or false (the chart's "
                         "rbac.podDeletionCost)")  # fmt: skip
    return value == "true"


def iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def pod_state(pod: dict[str, Any]) -> autoscaler.PodState:
    """pending: not scheduled; ready: its Ready condition is True; starting: the rest (loading, compiling)."""
    conditions = {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or []}
    if (conditions.get("Ready") or {}).get("status") == "True":
        return "ready"
    if (conditions.get("PodScheduled") or {}).get("status") == "False":
        return "pending"
    return "starting"


def _is_ready(pod: dict[str, Any]) -> bool:
    return pod_state(pod) == "ready"


def ready_at(pod: dict[str, Any]) -> float | None:
    """When a ready pod became ready, as its Ready condition says (lastTransitionTime; local mode's pods have
    none)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") == "True":
            return seconds(c.get("lastTransitionTime"))
    return None


def cold_start(
    decided_at: float, known: frozenset[str], role: str, pods: list[autoscaler.Pod]
) -> tuple[float, float] | None:
    """(seconds, when) from a scale-up decided at `decided_at`, when the role's pods were `known`, to the
    first of its new pods being ready; None while none is."""
    ready = [p.since for p in pods if p.role == role and p.state == "ready" and p.name not in known]
    if not ready:
        return None
    first = min(ready)
    return max(0.0, first - decided_at), first


def addresses(slices: list[dict[str, Any]]) -> dict[str, str]:
    """Pod name -> `host:port` of its `http` port, from EndpointSlices (ready endpoints only)."""
    out = {}
    for s in slices:
        port = next((p.get("port") for p in s.get("ports") or [] if p.get("name") == "http"), None)
        for e in s.get("endpoints") or []:
            ref, addrs = e.get("targetRef") or {}, e.get("addresses") or []
            if port and addrs and ref.get("kind") == "Pod" and (e.get("conditions") or {}).get("ready", True):
                host = addrs[0]
                out[ref["name"]] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return out


class AutoscaleLoop:
    """The tick task and what it remembers: the decision's history per model, each pod's last scrape, when
    the loop first saw each pod ready (local pods' conditions carry no transition time) and which models
    have pods stuck Pending (ScaleUpStuck is posted once per episode)."""

    def __init__(
        self,
        client: kube.Kube,
        enqueue: Callable[[Key], None],
        models: Callable[[], list],
        every: float = scaling.TICK_SECONDS,
    ) -> None:
        """`every`: seconds between decisions (`neuronfleet operator --autoscale-interval`)."""
        self.client, self.enqueue, self.models, self.every = client, enqueue, models, every
        self._history: dict[Key, autoscaler.History] = {}
        self._scrapes: dict[Key, tuple[float, pod_metrics.Scrape]] = {}  # (ns, pod) -> last good scrape
        self._ready_since: dict[Key, float] = {}
        self._stuck: set[Key] = set()
        self._locks: dict[Key, asyncio.Lock] = {}  # one decision per model at once (tick or wake)
        self._woken: dict[Key, float] = {}  # when each model's last wake ran a decision
        self._cold: dict[Key, dict[str, Scaled]] = {}  # per model, role -> (scaled up at, its pods then)
        self._wakes: set[asyncio.Task] = set()
        self._pods_of: dict[Key, set[Key]] = {}  # model -> its pods this loop keeps something of
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._limit = asyncio.Semaphore(SCRAPES_AT_ONCE)
        self.mark_idlest = pod_deletion_cost(os.environ)  # a scale-down's pod-deletion-cost annotations

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="autoscaler")

    async def stop(self) -> None:
        for task in [self._task, *self._wakes]:
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in [self._task, *self._wakes] if t is not None), return_exceptions=True
        )
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.tick()
            await asyncio.sleep(max(0.0, self.every - (time.monotonic() - started)))

    async def tick(self) -> None:
        """One decision for every model the builtin autoscaler scales; a model's failure is logged and the
        others go on."""
        seen = set()
        for body in self.models():
            key = (body["metadata"]["namespace"], body["metadata"]["name"])
            seen.add(key)
            try:
                async with self._locks.setdefault(key, asyncio.Lock()):
                    await self.model(body)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("autoscaling %s/%s failed; trying again next tick", *key)
        for key in [k for k in self._history if k not in seen]:
            self._history.pop(key)
            self._cold.pop(key, None)
            self._woken.pop(key, None)
            if not (lock := self._locks.get(key)) or not lock.locked():
                self._locks.pop(key, None)
            for pod in self._pods_of.pop(key, set()):
                self._ready_since.pop(pod, None)
                self._scrapes.pop(pod, None)

    def wake(self, namespace: str, name: str) -> str:
        """A front door holds a request of this model: run its decision now. Returns what happened: started,
        running (one runs already: debounced), recent (one ran less than WAKE_INTERVAL ago) or unknown (no
        model of that name that the builtin autoscaler scales)."""
        key = (namespace, name)
        body = next(
            (m for m in self.models() if (m["metadata"]["namespace"], m["metadata"]["name"]) == key), None
        )
        spec, errors = validation.parse(body) if body is not None else (None, ["gone"])
        if spec is None or errors or not scaling.builtin(spec):
            return "unknown"
        lock = self._locks.setdefault(key, asyncio.Lock())
        if lock.locked():
            return "running"
        last = self._woken.get(key)
        if last is not None and time.monotonic() - last < WAKE_INTERVAL:
            return "recent"
        self._woken[key] = time.monotonic()

        async def decide() -> None:
            try:
                async with lock:
                    await self.model(body, woken=True)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the wake of %s/%s failed; the next tick decides", *key)

        task = asyncio.create_task(decide(), name=f"wake {namespace}/{name}")
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)
        return "started"

    def pod_changed(self, obj: dict[str, Any]) -> None:
        """The pod cache reports a child: a pod seen ready for the first time is ready from now (or from its
        Ready condition's time), so a cold start is measured to the watch, not to the next tick."""
        meta = obj.get("metadata") or {}
        model = (meta.get("labels") or {}).get(f"{LABEL_PREFIX}/model")
        ns = meta.get("namespace", "")
        if (
            obj.get("kind", "Pod") != "Pod"
            or (ns, model) not in self._history
            or meta.get("deletionTimestamp")
        ):
            return  # (only the models this loop decides for: the others' pods are not its business)
        if pod_state(obj) == "ready":
            pod = (ns, meta.get("name", ""))
            self._ready_since.setdefault(pod, ready_at(obj) or time.time())
            self._pods_of.setdefault((ns, model), set()).add(pod)

    async def model(self, body: dict[str, Any], woken: bool = False) -> autoscaler.Decision | None:
        spec, errors = validation.parse(body)
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if spec is None or errors or not scaling.builtin(spec):
            self._history.pop(key, None)
            return None
        status = body.get("status") or {}
        if not status.get("compileHash"):
            return None  # nothing serves yet: the first pods come from the compile
        ns, name = key
        auto = status.get("autoscaling") or {}
        policy = scaling.policy(spec, cold_start=float(auto.get("coldStartSeconds") or 0.0))
        current = scaling.decided_replicas(spec, status) or scaling.start_replicas(spec)
        pods, held = await self._pods(
            body, policy, front_door.holds(spec) or front_door.unified_front_door(spec)
        )
        now = time.time()
        await self._measure_cold_start(key, pods)
        if woken:
            held = max(held, 1.0)
        history = self._history.get(key, autoscaler.History())
        decision = autoscaler.decide(pods, current, policy, history, now, held=held)
        self._history[key] = decision.history
        if decision.act:
            self._track_cold_start(key, decision, pods, now)
        for role, n in decision.desired.items():
            metrics.AUTOSCALER_DESIRED.labels(ns, name, role).set(n)
        await self._report(body, policy, decision, pods, now)
        return decision

    async def _measure_cold_start(self, key: Key, pods: list[autoscaler.Pod]) -> None:
        """A scale-up's first new pod is ready: its cold start goes to status (and the next policy)."""
        for role, (at, known) in list(self._cold.get(key, {}).items()):
            measured = cold_start(at, known, role, pods)
            if measured is None:
                continue
            self._cold[key].pop(role)
            took, ready = measured
            log.info("cold start of %s/%s %s: %.1f s", *key, role, took)
            await self.client.patch_status(
                *key, {"autoscaling": {"coldStartSeconds": round(took, 1), "coldStartAt": iso(ready)}}
            )

    def _track_cold_start(
        self, key: Key, decision: autoscaler.Decision, pods: list[autoscaler.Pod], now: float
    ) -> None:
        """Remember when a role was scaled up and which of its pods existed then (the first scale-up of an
        episode counts); a scale-down of the role forgets it (its new pods may never come)."""
        pending = self._cold.setdefault(key, {})
        for role, n in decision.desired.items():
            if n > decision.current[role] and role not in pending:
                pending[role] = (now, frozenset(p.name for p in pods if p.role == role))
            elif n < decision.current[role]:
                pending.pop(role, None)

    async def _pods(
        self, body: dict[str, Any], policy: autoscaler.Policy, routers: bool = False
    ) -> tuple[list[autoscaler.Pod], float]:
        """The model's serving pods of the scaled roles (of every set: a retiring set's pods still carry
        load), each with its state and, when ready, its load; and, with `routers`, the requests its ready
        router pods hold (fresh scrapes only)."""
        meta = body["metadata"]
        ns, label = meta["namespace"], f"{LABEL_PREFIX}/model={meta['name']}"
        found = [
            p
            for p in await self.client.list("Pod", ns, label)
            if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        role_of = lambda p: (p["metadata"].get("labels") or {}).get(f"{LABEL_PREFIX}/role")  # noqa: E731
        mine = [p for p in found if role_of(p) in policy.roles]
        doors = [p for p in found if routers and role_of(p) == "router" and _is_ready(p)]
        where: dict[str, str] = {}
        # the only live reads (pods and Services come from kopf's indexes): none while no pod is ready, so a
        # model without serving pods (or front door) costs no request
        for svc in await self.client.list("Service", ns, label) if any(map(_is_ready, mine + doors)) else []:
            slices = await self.client.list("EndpointSlice", ns, f"{SERVICE_LABEL}={svc['metadata']['name']}")
            where.update(addresses(slices))
        now = time.time()
        ready = [p for p in mine if pod_state(p) == "ready" and p["metadata"]["name"] in where]
        doors = [p for p in doors if p["metadata"]["name"] in where]
        loads = await asyncio.gather(
            *(
                self._scrape(ns, p["metadata"]["name"], where, policy, policy.metrics.get(role_of(p)))
                for p in ready + doors
            )
        )
        by_name = {p["metadata"]["name"]: r for p, r in zip(ready + doors, loads, strict=True)}
        held = sum(
            load.held
            for p in doors
            for at, load in [by_name[p["metadata"]["name"]]]
            if load is not None and at is not None and now - at <= policy.stale_after
        )
        out, alive = [], set()
        for p in mine:
            pname, role = p["metadata"]["name"], p["metadata"]["labels"][f"{LABEL_PREFIX}/role"]
            alive.add((ns, pname))
            state = pod_state(p)
            created = seconds(p["metadata"].get("creationTimestamp")) or now
            if state == "ready":
                since = self._ready_since.setdefault((ns, pname), ready_at(p) or now)
            else:
                self._ready_since.pop((ns, pname), None)
                since = created
            scraped_at, load = by_name.get(pname, (None, None))
            out.append(autoscaler.Pod(pname, role, state, since, scraped_at, load))
        alive |= {(ns, p["metadata"]["name"]) for p in doors}
        for gone in self._pods_of.get((ns, meta["name"]), set()) - alive:  # this model's pods only
            self._ready_since.pop(gone, None)
            self._scrapes.pop(gone, None)
        self._pods_of[(ns, meta["name"])] = alive
        return out, held

    async def _scrape(
        self, ns: str, pod: str, where: dict[str, str], policy: autoscaler.Policy,
        names: pod_metrics.Names | None,
    ) -> tuple[float | None, pod_metrics.PodLoad | None]:  # fmt: skip
        """(when, load) of one pod's /metrics, read with its engine's metric `names` (None: ours); its last
        good scrape's time and load when this one fails."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT))
        before = self._scrapes.get((ns, pod))
        try:
            async with self._limit, self._session.get(f"http://{where[pod]}/metrics") as response:
                response.raise_for_status()
                text = await response.text()
            scrape = pod_metrics.read(text, names=names or pod_metrics.NEURONFLEET)
        except (aiohttp.ClientError, TimeoutError, OSError, pod_metrics.MetricsError) as e:
            log.info("reading /metrics of pod %s/%s failed: %r (its metrics go stale)", ns, pod, e)
            metrics.AUTOSCALER_SCRAPES.labels("failed").inc()
            if before is None:
                return None, None
            return before[0], pod_metrics.load(before[1], None, policy.slots)
        metrics.AUTOSCALER_SCRAPES.labels("ok").inc()
        now = time.time()
        self._scrapes[(ns, pod)] = (now, scrape)
        return now, pod_metrics.load(scrape, before[1] if before else None, policy.slots)

    async def _report(
        self, body: dict[str, Any], policy: autoscaler.Policy, decision: autoscaler.Decision,
        pods: list[autoscaler.Pod], now: float,
    ) -> None:  # fmt: skip
        """Status, Event, metrics and the reconcile for a decision that changes the replicas (a scale-down
        marks the idlest pods to go first); ScaleUpStuck once when pods first stay Pending past the
        deadline."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        stuck = {role: n for role, n in decision.stuck.items() if n}
        if stuck and key not in self._stuck:
            pods = ", ".join(f"{n} {role}" for role, n in stuck.items())
            await self._event(body, "Warning", "ScaleUpStuck", (
                f"{pods} pod(s) Pending longer than {policy.pending_deadline:g}s (no capacity?): not asking "
                "for more until they are scheduled; scale-down goes on"
            ))  # fmt: skip
        if bool(stuck) != (key in self._stuck):
            await self.client.patch_status(*key, {"autoscaling": {"stuck": stuck or None}})
        if stuck:
            self._stuck.add(key)
        else:
            self._stuck.discard(key)
        if not decision.changed:
            return
        record = {
            "from": decision.current,
            "to": decision.desired,
            "reason": "; ".join(
                f"{role}: {decision.reasons[role]}"
                for role in decision.desired
                if decision.desired[role] != decision.current[role]
            ),
            "at": iso(now),
            "signals": decision.signals,
        }
        up = any(decision.desired[r] > decision.current[r] for r in decision.desired)
        direction = "up" if up else "down"
        if policy.dry_run:
            last = ((body.get("status") or {}).get("autoscaling") or {}).get("lastDecision") or {}
            if last.get("to") != decision.desired:
                await self.client.patch_status(*key, {"autoscaling": {"lastDecision": record}})
                metrics.AUTOSCALER_DECISIONS.labels(direction, "true").inc()
                await self._event(body, "Normal", "DryRunScale", f"would scale: {record['reason']}")
            return
        if not up and self.mark_idlest:
            await self._mark_idlest(meta["namespace"], autoscaler.deletion_costs(decision, pods))
        await self.client.patch_status(
            *key, {"autoscaling": {"desired": decision.desired, "lastScale": record}}
        )
        metrics.AUTOSCALER_DECISIONS.labels(direction, "false").inc()
        values = "; ".join(
            f"{role}: " + ", ".join(f"{k}={v:g}" for k, v in decision.signals[role].items())
            for role in decision.desired
        )
        reason = "ScaledUp" if up else "ScaledDown"
        await self._event(body, "Normal", reason, f"{record['reason']} [{values}]")
        self.enqueue(key)

    async def _mark_idlest(self, namespace: str, costs: dict[str, int]) -> None:
        """Before a scale-down: each pod's deletion cost (its requests), so the Deployment removes the idlest;
        a pod that cannot be annotated (gone meanwhile) is skipped, the scale-down goes on."""
        for pod, cost in costs.items():
            try:
                await self.client.patch(
                    "Pod", namespace, pod, {"metadata": {"annotations": {DELETION_COST: str(cost)}}}
                )
            except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
                log.info("pod %s/%s: its deletion cost could not be set: %r", namespace, pod, e)

    async def _event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        log.info("%s %s: %s", type_, reason, message)
        try:
            await self.client.post_event(body, type_, reason, message)
        except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
            log.warning("the event %s could not be posted: %r", reason, e)  # only the event is lost
