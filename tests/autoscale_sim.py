"""A simulator the autoscaler's decision is replayed through (shared by the tests, like tests/support.py).

A fluid model of one model's serving pods, one second at a time: requests arrive at a trace's rate (per
second), wait in the role's queue, and run in the ready pods' slots; a request holds a slot for `service`
seconds, so a pod serves `slots / service` requests per second. Pods go Pending -> starting -> ready after a
cold start (never, past the cluster's Neuron capacity); a just-ready pod reports warm-up samples (a latency
and occupancy spike) for its first seconds; a pod's metrics can go stale. At zero replicas arrivals are held
at the front door. Every `tick` seconds the real `decide` runs on what the pods report and its decision is
applied (Pending pods are removed first on scale-down, as the ReplicaSet controller ranks unassigned pods
first: kubernetes pkg/controller/controller_utils.go ActivePodsWithRanks, v1.31).

Nothing here decides: the decision is neuronfleet.operator.autoscaler's; this only models what it acts on.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from neuronfleet.operator.autoscaler import Decision, History, Pod, Policy, decide
from neuronfleet.operator.pod_metrics import PodLoad

TRACES = Path(__file__).resolve().parent / "data" / "autoscale"


@dataclass
class RoleModel:
    """How one role's pods serve: slots per pod and seconds a request holds a slot."""

    slots: int = 4
    service: float = 2.0  # seconds a request holds a slot (prefill: its prompt; decode: its tokens)
    latency: float = 0.2  # p90 of the role's latency signal when nothing waits (TTFT or ITL)

    @property
    def rate(self) -> float:  # requests per second one pod serves
        return self.slots / self.service


@dataclass
class SimPod:
    name: str
    role: str
    created: float
    ready_at: float | None  # None: stays Pending (no capacity)

    def state(self, now: float, cold_start: float) -> str:
        if self.ready_at is None:
            return "pending"
        if now >= self.ready_at:
            return "ready"
        return "pending" if now < self.created + cold_start / 3 else "starting"


@dataclass
class Sim:
    policy: Policy
    trace: Callable[[float], float]  # requests per second at time t
    roles: dict[str, RoleModel]
    cold_start: float = 60.0  # seconds from a pod's creation to ready
    tick: float = 15.0
    capacity: int = 1000  # pods the cluster can place (per role); more stay Pending
    warmup_spike: float = 10.0  # a just-ready pod's latency/occupancy report is this many times the real one
    warmup_seconds: float = 20.0
    initial: dict[str, int] | None = None
    noise: float = 0.0  # relative noise on the reported load (seeded)
    seed: int = 0
    stale: dict[str, float] = field(default_factory=dict)  # pod name -> time its metrics stop
    killed: dict[str, float] = field(
        default_factory=dict
    )  # pod name -> time it dies (its Deployment replaces it)

    def __post_init__(self) -> None:
        self.now = 0.0
        self.random = random.Random(self.seed)
        self.replicas = dict(self.initial or {r: self.policy.roles[r].min for r in self.roles})
        self.pods: list[SimPod] = []
        self.count = 0
        self.queue = {r: 0.0 for r in self.roles}  # requests in the role after this second's completions
        self.busy = {
            r: 0.0 for r in self.roles
        }  # requests in the role during this second (waiting + running)
        self.history = History()
        self.decisions: list[tuple[float, Decision]] = []
        self.samples: list[dict] = []
        for role, n in self.replicas.items():
            if n:  # start in the steady state of the first second's rate: rate * service in the role
                self.queue[role] = self.trace(0.0) * (self.roles[role].service - 1)
            for _ in range(n):
                self._add(role, ready_at=-self.warmup_seconds - 1)

    def _add(self, role: str, ready_at: float | None = None) -> None:
        placed = sum(1 for p in self.pods if p.role == role and p.ready_at is not None)
        if ready_at is None and placed < self.capacity:
            ready_at = self.now + self.cold_start
        self.count += 1
        self.pods.append(SimPod(f"{role}-{self.count}", role, self.now, ready_at))

    def _remove(self, role: str, n: int) -> None:
        mine = [p for p in self.pods if p.role == role]
        # unassigned (Pending) pods first, then not ready, then the newest ready
        order = sorted(
            mine,
            key=lambda p: (
                p.ready_at is not None,
                p.ready_at is not None and p.ready_at <= self.now,
                -p.created,
            ),
        )
        for pod in order[:n]:
            self.pods.remove(pod)

    def ready(self, role: str) -> list[SimPod]:
        return [p for p in self.pods if p.role == role and p.ready_at is not None and p.ready_at <= self.now]

    def step(self) -> None:
        """One second of arrivals and service, then a tick of the autoscaler when one is due."""
        rate = self.trace(self.now)
        for pod in [p for p in self.pods if self.killed.get(p.name) == self.now]:
            self.pods.remove(pod)
            self._add(pod.role)
        for role, model in self.roles.items():
            n = len(self.ready(role))
            self.busy[role] = self.queue[role] + rate
            done = min(self.busy[role], n * model.slots) / model.service
            left = self.busy[role] - done
            self.queue[role] = left if left > 0.01 else 0.0  # the last hundredth of a request is done
        self.samples.append(
            {
                "t": self.now,
                "rate": rate,
                "capacity": {r: len(self.ready(r)) * m.rate for r, m in self.roles.items()},
                "replicas": dict(self.replicas),
                "ready": {r: len(self.ready(r)) for r in self.roles},
                "queue": dict(self.queue),
            }
        )
        if self.now % self.tick == 0:
            self.autoscale()
        self.now += 1

    def _load(self, pod: SimPod, ready: int) -> PodLoad:
        model = self.roles[pod.role]
        total = self.busy[pod.role] / max(ready, 1)
        running = min(total, model.slots)
        waiting = total - running
        factor = 1 + self.noise * self.random.uniform(-1, 1)
        latency = model.latency * (1 + waiting / model.slots)
        if self.now - pod.ready_at < self.warmup_seconds:
            factor *= self.warmup_spike  # compile-cache misses, cold caches: not load
        return PodLoad(
            waiting=waiting * factor, running=min(running * factor, model.slots), slots=model.slots,
            kv_usage=min(running * factor / model.slots, 1.0), held=0.0,
            ttft_p90=latency * factor if total else None, itl_p90=latency * factor if total else None,
            requests=total,
        )  # fmt: skip

    def pod_signals(self) -> list[Pod]:
        out = []
        for p in self.pods:
            state = p.state(self.now, self.cold_start)
            if state != "ready":
                out.append(Pod(p.name, p.role, state, p.created))
                continue
            stale_from = self.stale.get(p.name)
            if stale_from is not None and self.now >= stale_from:
                out.append(Pod(p.name, p.role, "ready", p.ready_at, scraped_at=stale_from, load=None))
                continue
            load = self._load(p, len(self.ready(p.role)))
            out.append(Pod(p.name, p.role, "ready", p.ready_at, scraped_at=self.now, load=load))
        return out

    def held(self) -> float:
        front = "unified" if "unified" in self.roles else "prefill"
        return self.busy[front] if not self.ready(front) else 0.0

    def autoscale(self) -> None:
        decision = decide(self.pod_signals(), self.replicas, self.policy, self.history, self.now, self.held())
        self.history = decision.history
        self.decisions.append((self.now, decision))
        if decision.act:
            for role, n in decision.desired.items():
                have = self.replicas[role]
                for _ in range(n - have):
                    self._add(role)
                if n < have:
                    self._remove(role, have - n)
                self.replicas[role] = n

    def run(self, seconds: float) -> Sim:
        end = self.now + seconds
        while self.now < end:
            self.step()
        return self

    # ---- what a replay measures ----

    def changes(self, role: str) -> list[tuple[float, int, int]]:
        """(time, from, to) of every replica change the decisions made for a role."""
        return [(t, d.current[role], d.desired[role]) for t, d in self.decisions if d.act and d.changed
                and d.desired[role] != d.current[role]]  # fmt: skip

    def direction_changes(self, role: str) -> int:
        signs = [1 if to > frm else -1 for _, frm, to in self.changes(role)]
        return sum(1 for a, b in itertools.pairwise(signs) if a != b)

    def slo_attainment(self, role: str, start: float = 0.0) -> float:
        """Fraction of seconds from `start` on at which the arrival rate was within the ready capacity."""
        seen = [s for s in self.samples if s["t"] >= start]
        return sum(1 for s in seen if s["rate"] <= s["capacity"][role] + 1e-9) / len(seen)


def trace_from_file(name: str) -> tuple[dict, Callable[[float], float]]:
    """A trace from tests/data/autoscale/NAME.json: its header and the rate at time t (piecewise linear
    between its points, plus seeded noise when it has some)."""
    data = json.loads((TRACES / name).read_text())
    points = [(float(t), float(r)) for t, r in data["points"]]
    noise = float(data.get("noise", 0.0))
    jitter = random.Random(data.get("seed", 0))
    cache: dict[float, float] = {}

    def rate(t: float) -> float:
        if t not in cache:
            base = points[-1][1]
            for (t0, r0), (t1, r1) in itertools.pairwise(points):
                if t0 <= t < t1:
                    base = r0 + (r1 - r0) * (t - t0) / (t1 - t0)
                    break
            cache[t] = max(base * (1 + noise * jitter.uniform(-1, 1)), 0.0)
        return cache[t]

    return data, rate


def constant(rate: float) -> Callable[[float], float]:
    return lambda t: rate


def steps(*points: tuple[float, float]) -> Callable[[float], float]:
    """A rate that is points[i][1] from points[i][0] on."""

    def rate(t: float) -> float:
        value = 0.0
        for start, r in points:
            if t >= start:
                value = r
        return value

    return rate
