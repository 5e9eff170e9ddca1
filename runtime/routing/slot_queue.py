"""Late binding at the front door: while every ready pod's slots are taken, a request waits here, in arrival
order, for the first slot to free, and only then is its pod chosen.

Sent at once, a request would wait in the queue of the pod chosen when it arrived, and stay there while
another pod frees a slot first: the pods' queues drift apart (answers differ in length), so at saturation some
pods idle while others have requests waiting, and a kv-aware policy that sends a prompt to the pod holding its
prefix deepens that pod's queue further. Held here, a request is placed when a slot frees, on the pods as they
are then. (llm-d's EPP holds the excess at the gateway for the same reason, "scheduling regret": once in a
model server's queue a request cannot move; https://llm-d.ai/docs/architecture/core/router/epp/flow-control,
read 2026-12-07.)

A pod is full where its slots are known (its status, else the router's `--routing-pod-slots`) and its load
(`peers.Peer.score`: running and waiting, with this router's own since the last probe) reaches them; a pod
whose slots are unknown is never full, so before them nothing waits here. Bounded as the pods bound their own
queues (`admission`, `--max-queue-wait`): a request whose expected wait, behind the requests in the pods and
those waiting here, passes the bound is refused at once (OpenAI 429, TGI 503, with Retry-After), and one that
has waited that long is refused then. Waiters are woken oldest first when a request of this router ends and
when a probe round finds a pod ready, and each looks again every RECHECK seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable

from neuronfleet.runtime.engine import admission
from neuronfleet.runtime.serving.errors import Overloaded

RECHECK = 0.5  # seconds between a waiter's own looks, should no wake-up reach it
# seconds waited, for the histogram
QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)


def pods_full(pods: Iterable[tuple[int, int]]) -> bool:
    """Whether every pod, as (load, slots), has its slots taken: False with no pod, or any whose slots are
    unknown (0)."""
    pods = list(pods)
    return bool(pods) and all(slots > 0 and load >= slots for load, slots in pods)


class SlotQueue:
    """The requests waiting for a slot, oldest first. `bound`: the longest expected or actual wait, in seconds
    (0: none); `enabled` False: nothing ever waits (`--no-router-queue`)."""

    def __init__(self, bound: float, enabled: bool = True) -> None:
        if bound < 0:
            raise ValueError(f"a queue's bound is 0 (none) or more seconds (got {bound})")
        self.bound, self.enabled = bound, enabled
        self._waiters: deque[asyncio.Event] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def admit(self, ahead: int, slots: int, seconds: float | None) -> None:
        """Refuses (`errors.Overloaded`: OpenAI 429, TGI 503, as a pod's admission does) a request that finds
        `ahead` requests in the pods and here, on `slots` slots in all, each held `seconds` on average (None:
        not measured yet: admitted), when its expected wait passes the bound."""
        if slots < 1:
            return
        refused = admission.refusal(ahead, slots, seconds, self.bound)
        if refused is not None:
            wait, retry = refused
            raise Overloaded(
                f"every pod's slots are taken and the request would likely wait {wait:.0f} s for one, past "
                f"the bound of {self.bound:g} s (--max-queue-wait): {ahead} requests are ahead on {slots} "
                f"slots, each held {seconds:.1f} s; retry after {retry} s",
                retry,
            )

    async def turn(self, full: Callable[[], bool], retry_after: Callable[[], int]) -> float:
        """Waits until this request is the oldest waiting and `full()` is False (at once where none waits and
        a slot is free); the seconds waited. Overloaded once it has waited the bound (`retry_after()`: the
        seconds to say)."""
        if not self.enabled or (not self._waiters and not full()):
            return 0.0
        me = asyncio.Event()
        self._waiters.append(me)
        start = time.monotonic()
        try:
            while self._waiters[0] is not me or full():
                waited = time.monotonic() - start
                if self.bound and waited >= self.bound:
                    raise Overloaded(
                        f"the request waited {waited:.0f} s for a slot, every pod's slots taken, past the "
                        f"bound of {self.bound:g} s (--max-queue-wait); retry later",
                        retry_after(),
                    )
                me.clear()
                timeout = RECHECK if not self.bound else min(RECHECK, self.bound - waited)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), timeout)
            return time.monotonic() - start
        finally:
            self._waiters.remove(me)
            self.freed()  # the next in line looks: more than one slot may be free

    def freed(self) -> None:
        """A slot may have freed (a request ended, or a probe round said the pods' loads): the oldest waiter
        looks."""
        if self._waiters:
            self._waiters[0].set()
