"""The built-in autoscaler's decision: signals per pod + current replicas + policy + history + now -> desired
replicas per role, with the reason and the signal values used (what status and the Event show).

Pure: no I/O and no clock (the caller passes `now`, the pods' scraped loads and the last decision's history).
The rules, each against a failure other autoscalers' users report:
- the demand is absolute, `ceil(load / target)` over the role's total load (HPA's formula, with Knative's
  "total concurrency / target"), so a tick repeats, never adds to, the last one;
- pods Pending, starting or warming count as capacity on the way: while a role has any, it does not scale up
  again (the backlog they will absorb is not new demand: one spike = one scale-up, llm-d inference-sim #1109);
- scale-up acts at once; scale-down only after its stabilisation window (the highest demand in the window
  wins, as HPA's scaleDown.stabilizationWindowSeconds) and only to a count whose pods stay under target with
  the load redistributed, `load / (N - k) <= target * (1 - tolerance)` (no 2 <-> 1 oscillation, Dynamo #9294);
- a pod with missing or stale metrics freezes scale-down, never scale-up (aibrix #1032);
- pods Pending past the deadline are reported (`Decision.stuck`), are not capacity, do not block
  scale-down; while any is stuck, and for `stuck_retry` after the last one was seen, the role does not scale
  up (no retry loop, Dynamo #14251);
- after a scale-up, the next one waits until its pods serve and are warm, is confirmed on two ticks, and is
  not taken while the load falls (the backlog they drain is not new demand); with a queue (the load is over
  capacity, not by how much) a step at most doubles, as HPA's default scale-up policy;
- scale-up and scale-down both leave loads within `tolerance` of target alone (HPA's tolerance, 0.1);
- a just-ready pod's samples within `warmup` are not load (Dynamo #12430);
- prefill and decode are decided together, each on its own signal, then the prefill:decode ratio is kept in
  bounds by raising the short side (never by starving one);
- scale to zero after `idle` seconds without a request; at zero, requests held at the front door scale to 1
  at once; the measured cold start decides how early a rising load scales up (the load extrapolated over one
  cold start).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from .pod_metrics import Names, PodLoad

Signal = Literal["queue", "occupancy", "kv", "ttft", "itl"]
SIGNALS = ("queue", "occupancy", "kv", "ttft", "itl")
LATENCY_SIGNALS = ("ttft", "itl")  # p90 seconds, not additive: scaled by the replicas that produced them
PodState = Literal["pending", "starting", "ready"]


@dataclass(frozen=True)
class RolePolicy:
    """One role's bounds and signal; `target` is per replica (waiting requests, occupancy, KV share, or the
    p90 SLO in seconds for ttft/itl)."""

    min: int
    max: int
    signal: Signal
    target: float

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"signal {self.signal!r} is not one of {', '.join(SIGNALS)}")
        if not 0 <= self.min <= self.max or self.max < 1:
            raise ValueError(f"replicas min {self.min} / max {self.max}: need 0 <= min <= max and max >= 1")
        if not self.target > 0:
            raise ValueError(f"target {self.target} of {self.signal} must be above 0")


@dataclass(frozen=True)
class Policy:
    """What the spec says about scaling, in the decision's own terms (built from spec.autoscaling)."""

    roles: Mapping[str, RolePolicy]  # {"unified": ...} or {"prefill": ..., "decode": ...}
    scale_up_window: float = 0.0  # seconds a higher demand must hold before acting (0: at once)
    scale_down_window: float = 300.0  # seconds of lower demand before scaling down
    tolerance: float = 0.1  # scale up past target * (1 + tolerance); down to target * (1 - tolerance)
    scale_to_zero: bool = False
    idle: float = 600.0  # seconds without a request before zero
    ratio: tuple[float, float] | None = None  # prefill:decode replicas bounds, e.g. (0.5, 2.0)
    pending_deadline: float = 600.0  # a pod Pending longer is stuck (no capacity)
    stuck_retry: float = 1800.0  # after a stuck scale-up, seconds before scaling up past the serving pods
    stale_after: float = 60.0  # a scrape older than this is stale
    warmup: float = 30.0  # a just-ready pod's first seconds are not load
    cold_start: float = 0.0  # measured seconds from scale-up to serving; the lead of the extrapolation
    slots: int = 1  # per pod, to turn held requests into occupancy
    dry_run: bool = False
    metrics: Mapping[str, Names] = field(default_factory=dict)  # per role, its pods' metric names (ours)

    def __post_init__(self) -> None:
        roles = set(self.roles)
        if roles not in ({"unified"}, {"prefill", "decode"}):
            raise ValueError(f"roles {sorted(roles)}: expected ['unified'] or ['decode', 'prefill']")
        for name in ("scale_up_window", "scale_down_window", "idle", "pending_deadline", "stuck_retry",
                     "stale_after", "warmup", "cold_start"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} must be 0 or more seconds")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance {self.tolerance} must be in [0, 1)")
        if self.scale_to_zero and any(r.min for r in self.roles.values()):
            raise ValueError("scale_to_zero needs min 0 for every role")
        if self.ratio is not None:
            if len(self.ratio) != 2:
                raise ValueError(
                    f"ratio {self.ratio}: expected (low, high) prefill replicas per decode replica"
                )
            low, high = self.ratio
            if not 0 < low <= high:
                raise ValueError(f"ratio bounds {self.ratio}: need 0 < low <= high (prefill per decode)")
            if roles != {"prefill", "decode"}:
                raise ValueError("ratio bounds apply to prefill and decode roles only")
        if self.slots < 1:
            raise ValueError(f"slots {self.slots} must be at least 1")


@dataclass(frozen=True)
class Pod:
    """One serving pod as observed: its role, state, when it entered that state, and its last scrape."""

    name: str
    role: str
    state: PodState  # pending: not scheduled; starting: compiling/loading/not ready; ready
    since: float  # created (pending/starting) or became ready (ready)
    scraped_at: float | None = None
    load: PodLoad | None = None


@dataclass(frozen=True)
class Demand:
    at: float
    role: str
    want: int  # the unclamped-by-window demand of that tick
    load: float  # the role's total load in its signal's units (latency: p90)
    settled: bool = True  # no pod of the role was on the way or warming up at that tick


@dataclass(frozen=True)
class History:
    """What the decision remembers between ticks; the caller keeps the returned one for the next call."""

    demands: tuple[Demand, ...] = ()
    since: float | None = None  # first tick
    busy_at: float | None = None  # last tick that saw a request anywhere
    stuck_until: Mapping[str, float] = field(default_factory=dict)
    last: Mapping[str, tuple[float, int, int]] = field(default_factory=dict)  # role -> (at, from, to)


@dataclass(frozen=True)
class Decision:
    desired: dict[str, int]
    current: dict[str, int]
    reasons: dict[str, str]
    signals: dict[str, dict[str, float]]  # role -> the values used (for status and the Event)
    stuck: dict[str, int]  # role -> pods Pending past the deadline: the caller sets a condition
    act: bool  # a change to apply (False when unchanged, or in dry run)
    history: History

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def decide(
    pods: list[Pod], current: Mapping[str, int], policy: Policy, history: History, now: float, held: float = 0
) -> Decision:
    """Desired replicas per role. `held`: requests held at the front door (the router's gauge or its push)."""
    if set(current) != set(policy.roles):
        raise ValueError(
            f"current replicas name roles {sorted(current)}; the policy has {sorted(policy.roles)}"
        )
    negative = {role: n for role, n in current.items() if n < 0}
    if negative:
        raise ValueError(f"current replicas {negative} must be 0 or more")
    unknown = {p.role for p in pods} - set(policy.roles)
    if unknown:
        raise ValueError(
            f"pods of roles {sorted(unknown)} the policy does not scale ({sorted(policy.roles)})"
        )
    since = now if history.since is None else history.since
    busy = held > 0 or any(p.load is not None and p.load.busy and _fresh(p, policy, now) for p in pods)
    busy_at = now if busy else history.busy_at
    idle_for = now - (busy_at if busy_at is not None else since)
    stuck_until = dict(history.stuck_until)
    desired, reasons, signals, stuck, demands = {}, {}, {}, {}, []
    for role, rp in policy.roles.items():
        mine = [p for p in pods if p.role == role]
        want, info = _demand(role, mine, rp, policy, now, history, held)
        stuck[role] = int(info["stuck"])
        if stuck[role]:  # the retry pause runs from the last tick that saw a pod stuck
            stuck_until[role] = now + policy.stuck_retry
        demands.append(Demand(now, role, want, info["load"], not (info["coming"] or info["warming"])))
        desired[role], reasons[role] = _settle(
            role, want, current[role], info, rp, policy, history, now, since, stuck_until, idle_for, held
        )
        signals[role] = info
    stuck_until = {r: t for r, t in stuck_until.items() if t > now}
    if policy.ratio is not None:
        desired, reasons = _keep_ratio(desired, reasons, policy)
    window = max(policy.scale_down_window, policy.scale_up_window, policy.cold_start)
    kept = tuple(d for d in (*history.demands, *demands) if d.at >= now - window)
    last = dict(history.last)
    for role in desired:
        if desired[role] != current[role]:
            last[role] = (now, current[role], desired[role])
    new = History(kept, since, busy_at, stuck_until, last)
    changed = desired != dict(current)
    return Decision(desired, dict(current), reasons, signals, stuck, changed and not policy.dry_run, new)


def deletion_costs(decision: Decision, pods: list[Pod]) -> dict[str, int]:
    """For a decision that scales a role down: each of its ready, measured pods' deletion cost, the requests
    it runs and queues, so that the Deployment's scale-down takes the idlest pods first (the ReplicaSet
    controller deletes the lower `controller.kubernetes.io/pod-deletion-cost` first) and the pods serving
    requests keep serving them. A pod not ready goes first anyway; one without metrics is left as it is."""
    down = {role for role, n in decision.desired.items() if n < decision.current.get(role, 0)}
    return {
        p.name: math.ceil(p.load.running + p.load.waiting)
        for p in pods
        if p.role in down and p.state == "ready" and p.load is not None
    }


def _fresh(pod: Pod, policy: Policy, now: float) -> bool:
    return pod.scraped_at is not None and pod.load is not None and now - pod.scraped_at <= policy.stale_after


def _value(load: PodLoad, signal: str) -> float | None:
    return {
        "queue": load.waiting,
        "occupancy": load.occupancy,
        "kv": load.kv_usage,
        "ttft": load.ttft_p90,
        "itl": load.itl_p90,
    }[signal]


def _demand(
    role: str, pods: list[Pod], rp: RolePolicy, policy: Policy, now: float, history: History, held: float
) -> tuple[int, dict[str, float]]:
    """(replicas the load asks for, the values used). Only ready, warm pods with fresh metrics are load."""
    ready = [p for p in pods if p.state == "ready"]
    warming = [p for p in ready if now - p.since < policy.warmup]
    measured = [p for p in ready if p not in warming and _fresh(p, policy, now)]
    stale = [p for p in ready if p not in warming and not _fresh(p, policy, now)]
    stuck = [p for p in pods if p.state == "pending" and now - p.since > policy.pending_deadline]
    coming = [p for p in pods if p.state != "ready" and p not in stuck]
    values = [v for p in measured if (v := _value(p.load, rp.signal)) is not None]
    waiting = sum(p.load.waiting for p in measured)
    running = sum(p.load.running for p in measured)
    # held requests are demand for the role that takes new requests first (prefill, or unified)
    front = role in ("unified", "prefill")
    extra = {"queue": held, "occupancy": held / policy.slots}.get(rp.signal, 0.0) if front else 0.0
    if rp.signal in LATENCY_SIGNALS:
        total = max(values) if values else 0.0  # the worst pod's p90: the SLO holds for every pod
        want = math.ceil(len(ready) * total / rp.target - 1e-9) if values else 0
    else:
        total = sum(values) + extra
        want = math.ceil(total / rp.target - 1e-9)
    lead = _lead(role, total, history, policy, now) if rp.signal not in LATENCY_SIGNALS else 0.0
    if lead > total:
        want = max(want, math.ceil(lead / rp.target - 1e-9))
    info = {
        "load": round(total, 6),
        "perReplica": round(total / max(len(ready), 1), 6)
        if rp.signal not in LATENCY_SIGNALS
        else round(total, 6),
        "target": rp.target,
        "projected": round(lead, 6),
        "held": held if front else 0.0,
        "waiting": waiting,
        "running": running,
        "ready": len(measured),
        "warming": len(warming),
        "stale": len(stale),
        "coming": len(coming),
        "stuck": len(stuck),
    }
    return want, info


def _lead(role: str, total: float, history: History, policy: Policy, now: float) -> float:
    """The load one cold start from now, extrapolated over the demands of the last cold start when they rose
    on each of at least three ticks (a ramp, not noise) over at least half of it; 0 when there is no cold
    start or no ramp."""
    if policy.cold_start <= 0:
        return 0.0
    past = [d for d in history.demands if d.role == role and now - d.at <= policy.cold_start and d.at < now]
    if len(past) < 3 or now - past[0].at < policy.cold_start / 2:
        return 0.0
    loads = [d.load for d in past] + [total]
    if any(b <= a for a, b in itertools.pairwise(loads)):
        return 0.0
    return total + (total - past[0].load) / (now - past[0].at) * policy.cold_start


def _settle(
    role: str, want: int, current: int, info: dict[str, float], rp: RolePolicy, policy: Policy,
    history: History, now: float, since: float, stuck_until: Mapping[str, float], idle_for: float,
    held: float,
) -> tuple[int, str]:  # fmt: skip
    """The replicas to set for one role now, and why."""
    floor = rp.min if policy.scale_to_zero and idle_for >= policy.idle and not held else max(rp.min, 1)
    want = min(max(want, floor), rp.max)
    if want > current:
        if held and current == 0:
            return want, f"requests held at the front door ({held:g}) with no replica: scale up at once"
        per = max(info["load"], info["projected"]) / (1 if rp.signal in LATENCY_SIGNALS else max(current, 1))
        if current and per <= rp.target * (1 + policy.tolerance):
            return current, (
                f"demand {want} > {current}, but {rp.signal} {per:g} per replica is within the tolerance "
                f"{policy.tolerance:g} of target {rp.target:g}"
            )
        if info["stuck"]:  # the replicas already ask for them: asking for more would only add Pending pods
            return current, (
                f"demand {want} > {current}; {int(info['stuck'])} pod(s) Pending past the deadline: waiting "
                "for capacity, not asking for more"
            )
        if role in stuck_until and now < stuck_until[role]:
            return current, (
                f"demand {want} > {current}, but a scale-up stayed Pending past the deadline: "
                f"no scale-up past the serving pods until {stuck_until[role]:g}"
            )
        if info["coming"] or info["warming"]:
            return current, (
                f"demand {want} > {current}, but {int(info['coming'] + info['warming'])} pod(s) are on the "
                "way (Pending, loading or warming up): their capacity is counted"
            )
        if _after_scale_up(history, role, current):
            prev = next((d for d in reversed(history.demands) if d.role == role), None)
            if prev is None or not prev.settled or prev.want <= current:
                return current, (
                    f"demand {want} > {current} seen once since the last scale-up's pods arrived: "
                    "confirming on the next tick"
                )
            if info["load"] < prev.load:
                return current, (
                    f"demand {want} > {current}, but the load falls ({prev.load:g} -> {info['load']:g}): "
                    "the pods there drain the backlog"
                )
        if policy.scale_up_window and not _held_for(
            history, role, now, policy.scale_up_window, lambda w: w > current
        ):
            return current, f"demand {want} > {current}, held less than the scale-up window"
        if rp.signal != "queue" and info["waiting"] and current and want > 2 * current:
            # a queue says the load is over the pods' capacity, not by how much (its depth is a backlog, not a
            # rate): at most double per step, as HPA's default scale-up policy (100% per period)
            return 2 * current, _because(rp, info, "up", current, 2 * current) + " (queued: at most doubling)"
        return want, _because(rp, info, "up", current, want)
    if want < current:
        if info["stale"]:
            return current, f"scale-down frozen: {int(info['stale'])} pod(s) without fresh metrics"
        if info["warming"]:
            return current, f"scale-down frozen: {int(info['warming'])} pod(s) warming up"
        if now - since < policy.scale_down_window:
            return current, f"demand {want} < {current}, the scale-down window has not been observed yet"
        recent = [
            d.want for d in history.demands if d.role == role and d.at >= now - policy.scale_down_window
        ]
        target = min(max([want, *recent]), current)
        target = max(target, floor)
        if target >= current:
            return current, f"demand {want} < {current}, but higher demand within the scale-down window"
        target = _survivors(target, current, info, rp, policy)
        if target >= current:
            return current, (
                f"demand {want} < {current}, but {current - 1} pod(s) would be over "
                f"{rp.target:g} * (1 - {policy.tolerance:g}) with the load redistributed"
            )
        if target == 0:
            return 0, f"idle for {idle_for:g}s >= {policy.idle:g}s: scale to zero"
        return target, _because(rp, info, "down", current, target)
    return current, f"{rp.signal} {info['perReplica']:g} per replica against target {rp.target:g}: steady"


def _survivors(target: int, current: int, info: dict[str, float], rp: RolePolicy, policy: Policy) -> int:
    """The fewest replicas in [target, current] that stay under target * (1 - tolerance) carrying the load.
    A queue counts the requests running now too: those the survivors' slots cannot hold would queue (full
    pods with an empty queue are not idle; scaling them down makes the queue that scales them back up)."""
    if info["load"] == 0 and info["running"] == 0:
        return target
    bound = rp.target * (1 - policy.tolerance)
    for n in range(max(target, 1), current):
        # a p90 scales by N / (N - k) with the load redistributed; an additive load divides by the survivors
        if rp.signal in LATENCY_SIGNALS:
            per = info["load"] * (info["ready"] or 1) / n
        elif rp.signal == "queue":
            per = (info["load"] + max(0.0, info["running"] - n * policy.slots)) / n
        else:
            per = info["load"] / n
        if per <= bound:
            return n
    return current


def _after_scale_up(history: History, role: str, current: int) -> bool:
    last = history.last.get(role)
    return last is not None and last[2] == current and last[2] > last[1]


def _held_for(history: History, role: str, now: float, window: float, ok) -> bool:
    """Whether the settled demands of the last `window` seconds (0: the last tick) all pass `ok`."""
    mine = [d for d in history.demands if d.role == role]
    past = [d for d in mine if d.at >= now - window] if window else mine[-1:]
    return bool(past) and past[0].at <= now - window + 1e-9 and all(d.settled and ok(d.want) for d in past)


def _because(rp: RolePolicy, info: dict[str, float], way: str, current: int, to: int) -> str:
    what = f"{rp.signal} {info['perReplica']:g} per replica against target {rp.target:g}"
    if info["projected"] > info["load"]:
        what += f" (projected {info['projected']:g} one cold start ahead)"
    if info["held"]:
        what += f", {info['held']:g} held at the front door"
    return f"scale {way} {current} -> {to}: {what}"


def _keep_ratio(desired: dict[str, int], reasons: dict[str, str], policy: Policy) -> tuple[dict, dict]:
    """Prefill per decode within policy.ratio, by raising the short side (up to its max)."""
    low, high = policy.ratio
    p, d = desired["prefill"], desired["decode"]
    out, why = dict(desired), dict(reasons)
    if d and p < math.ceil(d * low - 1e-9):
        out["prefill"] = min(math.ceil(d * low - 1e-9), policy.roles["prefill"].max)
        why["prefill"] += f"; raised to {out['prefill']} to keep prefill:decode >= {low:g}"
    elif p and (not d or p / d > high):
        out["decode"] = min(math.ceil(p / high - 1e-9), policy.roles["decode"].max)
        why["decode"] += f"; raised to {out['decode']} to keep prefill:decode <= {high:g}"
    return out, why
