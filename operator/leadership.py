"""Leader election on a `coordination.k8s.io/v1` Lease, decided without I/O: what a candidate does with the
Lease it just read (`step`), and whether a leader may still act (`Leading.acting`).

The rules are client-go's leaderelection package (the one controller-runtime's managers use): the holder
renews every `retry_period`; a candidate takes the Lease only once its record (holder, renew time,
transitions) has not changed for `lease_duration` by the candidate's own clock, so clocks need not agree;
a holder that has not renewed for `renew_deadline` stops acting, which is before anyone may take the Lease
(`renew_deadline` < `lease_duration`): never two writers. A holder that stops on purpose releases the Lease
(an empty holder), so that another takes it at once. The defaults are controller-runtime's
(pkg/manager: LeaseDuration 15 s, RenewDeadline 10 s, RetryPeriod 2 s).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD = 15.0, 10.0, 2.0
JITTER = 1.2  # client-go's JitterFactor: renew_deadline must exceed JITTER * retry_period


@dataclass(frozen=True)
class Timing:
    lease_duration: float = LEASE_DURATION
    renew_deadline: float = RENEW_DEADLINE
    retry_period: float = RETRY_PERIOD

    def problems(self) -> list[str]:
        """Why these timings could let two leaders act at once (client-go refuses them too)."""
        out = []
        if not self.lease_duration > self.renew_deadline:
            out.append(
                f"the lease duration ({self.lease_duration:g} s) must be longer than the renew deadline "
                f"({self.renew_deadline:g} s)"
            )
        if not self.renew_deadline > JITTER * self.retry_period:
            out.append(
                f"the renew deadline ({self.renew_deadline:g} s) must be longer than {JITTER:g} x the retry "
                f"period ({self.retry_period:g} s)"
            )
        if min(self.lease_duration, self.renew_deadline, self.retry_period) <= 0:
            out.append("every timing must be positive")
        return out


@dataclass
class Seen:
    """A candidate's memory of the Lease: its record when last seen changed, and when (monotonic seconds)."""

    record: tuple | None = None
    at: float = 0.0


@dataclass(frozen=True)
class Step:
    """What to do now: `write` the Lease (create it when `create`), or nothing; `leading` says whether this
    candidate holds it once the write succeeds (a failed write: it does not)."""

    write: dict[str, Any] | None = None
    create: bool = False
    leading: bool = False
    holder: str = ""  # who holds it (after the write)


def micro_time(at: datetime.datetime) -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds)."""
    return at.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record(lease: dict[str, Any] | None) -> tuple | None:
    if lease is None:
        return None
    s = lease.get("spec") or {}
    return (s.get("holderIdentity") or "", s.get("renewTime"), s.get("leaseTransitions", 0))


def step(
    lease: dict[str, Any] | None, me: str, seen: Seen, now: float, wall: datetime.datetime, timing: Timing,
    *, namespace: str, name: str,
) -> Step:  # fmt: skip
    """The candidate `me`'s move on reading `lease` (None: there is none) at monotonic `now` and wall-clock
    `wall`; `seen` is updated in place."""
    current = record(lease)
    if current != seen.record:
        seen.record, seen.at = current, now
    stamp = micro_time(wall)
    if lease is None:
        body = {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"holderIdentity": me, "leaseDurationSeconds": int(timing.lease_duration),
                     "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": 0},
        }  # fmt: skip
        return Step(write=body, create=True, leading=True, holder=me)
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    if holder == me:  # renew
        new = {**spec, "renewTime": stamp, "leaseDurationSeconds": int(timing.lease_duration)}
        return Step(write={**lease, "spec": new}, leading=True, holder=me)
    if holder and now - seen.at < timing.lease_duration:
        return Step(holder=holder)  # another holds it, and has renewed lately (as this candidate saw it)
    transitions = int(spec.get("leaseTransitions") or 0) + 1
    new = {**spec, "holderIdentity": me, "acquireTime": stamp, "renewTime": stamp,
           "leaseDurationSeconds": int(timing.lease_duration), "leaseTransitions": transitions}  # fmt: skip
    return Step(write={**lease, "spec": new}, leading=True, holder=me)


def released(lease: dict[str, Any]) -> dict[str, Any]:
    """The Lease given up by its holder (on a clean stop): no holder, so that a candidate takes it at once."""
    spec = {**(lease.get("spec") or {}), "holderIdentity": None, "leaseDurationSeconds": 1}
    return {**lease, "spec": spec}


@dataclass
class Leading:
    """A candidate's own view of its leadership: since when (monotonic) its last successful renew was."""

    renewed_at: float | None = None  # when the last renew that succeeded was sent

    def acting(self, now: float, timing: Timing) -> bool:
        """It may act (reconcile, scale, answer wake calls, write) now: it renewed less than
        `renew_deadline` ago. Past that it stops, before anyone may take the Lease."""
        return self.renewed_at is not None and now - self.renewed_at < timing.renew_deadline
