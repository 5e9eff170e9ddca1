"""The built-in autoscaler's shell (autoscaling provider builtin): every `scaling.TICK_SECONDS`, for each
NeuronModel it scales, read every ready serving pod's `/metrics`, decide with `autoscaler.decide` (pure) and
the history it keeps in memory per model, and when the decision changes the replicas: write it to
`status.autoscaling` (the autoscaler is the only writer of the replicas of the models it scales), post an
Event (Normal ScaledUp / ScaledDown with the reason and the signal values; Warning ScaleUpStuck for pods
Pending past the deadline), count it in the operator's metrics and enqueue the model's reconcile, which sets
the Deployments' replicas from that status. In dry run the decision goes to `status.autoscaling.lastDecision`
only.

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
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from . import autoscaler, kube, metrics, pod_metrics, scaling, validation
from .builders import LABEL_PREFIX

SCRAPE_TIMEOUT = 5.0  # seconds for one pod's /metrics
SCRAPES_AT_ONCE = 8
SERVICE_LABEL = "kubernetes.io/service-name"  # an EndpointSlice's Service (set by its controller)

log = logging.getLogger(__name__)
Key = tuple[str, str]


def seconds(timestamp: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 timestamp as the API server writes them (2026-01-02T03:04:05Z)."""
    if not timestamp:
        return None
    return float(calendar.timegm(time.strptime(timestamp[:19], "%Y-%m-%dT%H:%M:%S")))


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

    def __init__(self, client: kube.Kube, enqueue: Callable[[Key], None], models: Callable[[], list]) -> None:
        self.client, self.enqueue, self.models = client, enqueue, models
        self._history: dict[Key, autoscaler.History] = {}
        self._scrapes: dict[Key, tuple[float, pod_metrics.Scrape]] = {}  # (ns, pod) -> last good scrape
        self._ready_since: dict[Key, float] = {}
        self._stuck: set[Key] = set()
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._limit = asyncio.Semaphore(SCRAPES_AT_ONCE)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="autoscaler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.tick()
            await asyncio.sleep(max(0.0, scaling.TICK_SECONDS - (time.monotonic() - started)))

    async def tick(self) -> None:
        """One decision for every model the builtin autoscaler scales; a model's failure is logged and the
        others go on."""
        seen = set()
        for body in self.models():
            key = (body["metadata"]["namespace"], body["metadata"]["name"])
            seen.add(key)
            try:
                await self.model(body)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("autoscaling %s/%s failed; trying again next tick", *key)
        for key in [k for k in self._history if k not in seen]:
            self._history.pop(key)

    async def model(self, body: dict[str, Any]) -> autoscaler.Decision | None:
        spec, errors = validation.parse(body)
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if spec is None or errors or not scaling.builtin(spec):
            self._history.pop(key, None)
            return None
        status = body.get("status") or {}
        if not status.get("compileHash"):
            return None  # nothing serves yet: the first pods come from the compile
        ns, name = key
        policy = scaling.policy(spec)
        current = scaling.decided_replicas(spec, status) or scaling.start_replicas(spec)
        pods = await self._pods(body, policy)
        now = time.time()
        history = self._history.get(key, autoscaler.History())
        decision = autoscaler.decide(pods, current, policy, history, now)
        self._history[key] = decision.history
        for role, n in decision.desired.items():
            metrics.AUTOSCALER_DESIRED.labels(ns, name, role).set(n)
        await self._report(body, policy, decision, now)
        return decision

    async def _pods(self, body: dict[str, Any], policy: autoscaler.Policy) -> list[autoscaler.Pod]:
        """The model's serving pods of the scaled roles (of every set: a retiring set's pods still carry
        load), each with its state and, when ready, its load."""
        meta = body["metadata"]
        ns, label = meta["namespace"], f"{LABEL_PREFIX}/model={meta['name']}"
        found = await self.client.list("Pod", ns, label)
        mine = [
            p
            for p in found
            if (p["metadata"].get("labels") or {}).get(f"{LABEL_PREFIX}/role") in policy.roles
            and not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        where: dict[str, str] = {}
        # the only live reads (pods and Services come from the caches): none while no pod is ready, so a
        # model without serving pods costs no request
        for svc in await self.client.list("Service", ns, label) if any(map(_is_ready, mine)) else []:
            slices = await self.client.list("EndpointSlice", ns, f"{SERVICE_LABEL}={svc['metadata']['name']}")
            where.update(addresses(slices))
        now = time.time()
        ready = [p for p in mine if pod_state(p) == "ready" and p["metadata"]["name"] in where]
        loads = await asyncio.gather(*(self._scrape(ns, p["metadata"]["name"], where, policy) for p in ready))
        by_name = {p["metadata"]["name"]: r for p, r in zip(ready, loads, strict=True)}
        out, alive = [], set()
        for p in mine:
            pname, role = p["metadata"]["name"], p["metadata"]["labels"][f"{LABEL_PREFIX}/role"]
            alive.add((ns, pname))
            state = pod_state(p)
            created = seconds(p["metadata"].get("creationTimestamp")) or now
            if state == "ready":
                since = self._ready_since.setdefault((ns, pname), now)
            else:
                self._ready_since.pop((ns, pname), None)
                since = created
            scraped_at, load = by_name.get(pname, (None, None))
            out.append(autoscaler.Pod(pname, role, state, since, scraped_at, load))
        for gone in [k for k in self._ready_since if k[0] == ns and k not in alive]:
            self._ready_since.pop(gone)
            self._scrapes.pop(gone, None)
        return out

    async def _scrape(
        self, ns: str, pod: str, where: dict[str, str], policy: autoscaler.Policy
    ) -> tuple[float | None, pod_metrics.PodLoad | None]:
        """(when, load) of one pod's /metrics; its last good scrape's time and load when this one fails."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT))
        before = self._scrapes.get((ns, pod))
        try:
            async with self._limit, self._session.get(f"http://{where[pod]}/metrics") as response:
                response.raise_for_status()
                text = await response.text()
            scrape = pod_metrics.read(text)
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
        self, body: dict[str, Any], policy: autoscaler.Policy, decision: autoscaler.Decision, now: float
    ) -> None:
        """Status, Event, metrics and the reconcile for a decision that changes the replicas; ScaleUpStuck
        once when pods first stay Pending past the deadline."""
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

    async def _event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        log.info("%s %s: %s", type_, reason, message)
        try:
            await self.client.post_event(body, type_, reason, message)
        except (kube.KubeError, aiohttp.ClientError, OSError, TimeoutError) as e:
            log.warning("the event %s could not be posted: %r", reason, e)  # only the event is lost
