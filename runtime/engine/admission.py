"""Admission by expected wait, and what a drain hands back (pure: numbers in, decisions out).

A request that would wait longer than a bound (`--max-queue-wait`) for a slot is refused at once with
Retry-After, instead of waiting for its client to time out. Its wait is estimated from the requests ahead of
it and the service rate measured: `ServiceTimes` follows the slot seconds of the requests served (from taking
a slot to finishing: prefill and decode together), the last few weighing most; with `slots` slots each serving
one request in `t` seconds on average, slots free at `slots / t` per second, and a request that finds `ahead`
requests (running or waiting) gets a slot after `expected_wait(ahead, slots, t)` seconds, give or take
`wait_spread` (from the spread of the service times measured): a request is admitted when its wait, with a
margin of two standard deviations, is within the bound, so few of those admitted wait past it; the engine
refuses those few when they reach it. Before any request has finished, the longest a running request has held
its slot so far stands in for `t` (`slot_seconds`): a lower bound that grows until a measure replaces it.

The engine (one pod's slots) and our prefill/decode router (the decode pods' slots, as it sees them) decide
with the same functions; the HTTP server answers the refusal (`errors.Overloaded`: OpenAI 429, TGI 503).

A draining pod keeps the requests it can finish before its grace period ends and hands the others back
(`drain_keeps`): running requests hold their slots until they finish, the waiting ones take the slots as they
free, in order, each for `t` seconds; those that would end past the deadline are handed back before they
start (a 503 with Retry-After, which our routers send to another pod).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

SERVICE_SPAN = 16  # served requests that weigh most in the measure: a pod that speeds up (its first steps
# record the decode graphs: slow) or slows down is followed within about as many requests


class ServiceTimes:
    """The slot seconds of the requests served: an exponentially weighted mean and standard deviation, the
    last `span` requests weighing most (alpha = 2 / (span + 1), the incremental form of Finch, "Incremental
    calculation of weighted mean and variance", 2009)."""

    def __init__(self, span: int = SERVICE_SPAN) -> None:
        if span < 1:
            raise ValueError(f"span must be at least 1, got {span}")
        self.alpha = 2 / (span + 1)
        self.count = 0
        self._mean = 0.0
        self._variance = 0.0

    def served(self, seconds: float) -> None:
        """One request held its slot `seconds` (from taking it to finishing)."""
        seconds = max(0.0, seconds)
        self.count += 1
        if self.count == 1:
            self._mean = seconds
            return
        diff = seconds - self._mean
        step = self.alpha * diff
        self._mean += step
        self._variance = (1 - self.alpha) * (self._variance + diff * step)

    def mean(self) -> float | None:
        """Seconds a request holds its slot, lately; None before any was served."""
        return self._mean if self.count else None

    def spread(self) -> float:
        """The standard deviation of the slot seconds, lately (0 before two were served)."""
        return math.sqrt(self._variance) if self.count > 1 else 0.0


def slot_seconds(measured: float | None, running_for: Sequence[float]) -> float | None:
    """The service time to estimate with: the measured mean, else the longest any running request has held
    its slot so far (each will hold it at least that long), else None (nothing known: no wait estimated)."""
    if measured is not None:
        return measured
    longest = max(running_for, default=0.0)
    return longest if longest > 0 else None


def expected_wait(ahead: int, slots: int, seconds: float | None) -> float:
    """Seconds a request that finds `ahead` requests (running or waiting, in order before it) waits for one
    of `slots` slots, each serving a request in `seconds` on average: 0 while a slot is free for it, else
    its place past the slots at `slots / seconds` slots freed per second."""
    if slots < 1:
        raise ValueError(f"slots must be at least 1, got {slots}")
    place = ahead + 1 - slots
    if place <= 0 or not seconds:
        return 0.0
    return place * seconds / slots


def wait_spread(ahead: int, slots: int, spread: float) -> float:
    """The standard deviation of that wait, for service times of standard deviation `spread`: the slots free
    as `slots` renewal processes together, so the time to the `place`-th slot freed varies as
    `sqrt(place) * spread / slots` (exact for exponential service times: the Gamma distribution)."""
    place = ahead + 1 - slots
    return math.sqrt(place) * spread / slots if place > 0 else 0.0


def retry_after(wait: float, bound: float) -> int:
    """Whole seconds after which a request refused for an expected `wait` over `bound` would wait no more
    than the bound, if no one else came: the queue ahead drains by `wait - bound` meanwhile (at least 1)."""
    return max(1, math.ceil(wait - bound))


def next_slot(seconds: float | None, slots: int) -> int:
    """Whole seconds until one of `slots` slots, each serving a request in `seconds` on average (None: not
    known), is expected to free: the Retry-After of a request that waited its bound (at least 1)."""
    return max(1, math.ceil((seconds or 0.0) / max(1, slots)))


MARGIN = 2.0  # standard deviations of the wait kept within the bound: about 98 in 100 admitted wait less


def refusal(
    ahead: int, slots: int, seconds: float | None, bound: float, spread: float = 0.0
) -> tuple[float, int] | None:
    """Whether a request arriving behind `ahead` is refused: (the wait it would likely see, Retry-After) when
    its expected wait with MARGIN standard deviations of it (`wait_spread`, from the service times' `spread`)
    passes `bound` (0: no bound), else None (admitted)."""
    wait = expected_wait(ahead, slots, seconds)
    likely_most = wait + MARGIN * wait_spread(ahead, slots, spread)
    if bound <= 0 or likely_most <= bound:
        return None
    return likely_most, retry_after(likely_most, bound)


def drain_keeps(remaining: Sequence[float], waiting: int, slots: int, seconds: float | None,
                time_left: float) -> int:  # fmt: skip
    """How many of `waiting` requests (in order) a draining engine can start and finish within `time_left`
    seconds: the `remaining` seconds of the running requests free their slots (a free slot: 0), each waiting
    request takes the first slot to free and holds it `seconds`; the first that would finish late, and every
    one behind it, is handed back. With no service time known, every waiting request is kept (the deadline
    hands back what is left)."""
    if seconds is None:
        return waiting
    free_at = [max(0.0, r) for r in remaining] + [0.0] * max(0, slots - len(remaining))
    heapq.heapify(free_at)
    for kept in range(waiting):
        done = heapq.heappop(free_at) + seconds
        if done > time_left:
            return kept
        heapq.heappush(free_at, done)
    return waiting
