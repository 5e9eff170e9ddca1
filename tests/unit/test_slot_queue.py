"""Late binding at the front door (`slot_queue`): which pods count as full, requests waiting for a slot in
arrival order and placed when one frees, and the bound (`--max-queue-wait`) at arrival and while waiting."""

from __future__ import annotations

import asyncio

import pytest

from neuronfleet.runtime.routing.slot_queue import SlotQueue, pods_full
from neuronfleet.runtime.serving.errors import Overloaded


@pytest.mark.parametrize(
    ("pods", "full"),
    [
        ([], False),  # no pod ready: the hold decides, not the queue
        ([(4, 4), (4, 4)], True),
        ([(5, 4), (4, 4)], True),  # (a pod's own queue counts in its load)
        ([(4, 4), (3, 4)], False),  # one slot free
        ([(9, 4), (9, 0)], False),  # a pod whose slots are unknown is never full
        ([(0, 0)], False),
    ],
)
def test_the_pods_are_full_when_every_one_has_its_known_slots_taken(pods, full):
    assert pods_full(pods) is full


class Pods:
    """Pods of one slot each, as the front door sees them, and its requests: each waits its turn in `queue`,
    then takes the first free slot (`placed`: in order, each request's name and pod)."""

    def __init__(self, count: int) -> None:
        self.load = [0] * count
        self.queue = SlotQueue(bound=0)
        self.placed: list[tuple[str, int]] = []

    def full(self) -> bool:
        return pods_full((load, 1) for load in self.load)

    def place(self) -> int:
        pod = self.load.index(0)
        self.load[pod] += 1
        return pod

    async def request(self, name: str) -> None:
        await self.queue.turn(self.full, lambda: 1)
        self.placed.append((name, self.place()))

    def names(self) -> list[str]:
        return [name for name, _ in self.placed]


def test_requests_wait_while_every_slot_is_taken_and_are_placed_oldest_first_as_slots_free():
    async def run() -> list[tuple[str, int]]:
        pods = Pods(2)
        first = [asyncio.create_task(pods.request(n)) for n in ("a", "b")]
        await asyncio.gather(*first)  # two free slots: placed at once
        later = [asyncio.create_task(pods.request(n)) for n in ("c", "d", "e")]
        for _ in range(5):
            await asyncio.sleep(0)
        assert pods.queue.queued == 3 and len(pods.placed) == 2  # every slot taken: nothing more placed
        pods.load[1] -= 1  # pod 1's answer ends
        pods.queue.freed()
        while len(pods.placed) < 3:
            await asyncio.sleep(0)
        assert pods.queue.queued == 2
        pods.load[0] -= 1
        pods.load[1] -= 1  # both end at once: both slots go, in order
        pods.queue.freed()
        while len(pods.placed) < 5:
            await asyncio.sleep(0)
        await asyncio.gather(*later)
        return pods.placed

    placed = asyncio.run(run())
    assert [name for name, _ in placed] == ["a", "b", "c", "d", "e"]
    assert placed[2] == ("c", 1)  # the oldest waiter, on the pod that freed
    assert sorted(pod for _, pod in placed[3:]) == [0, 1]


def test_a_newcomer_does_not_pass_the_requests_already_waiting_even_with_a_slot_free():
    async def run() -> list[str]:
        pods = Pods(1)
        pods.place()
        waiting = asyncio.create_task(pods.request("old"))
        await asyncio.sleep(0)
        pods.load[0] = 0  # the slot frees, and before the old request looks a new one comes
        newcomer = asyncio.create_task(pods.request("new"))
        pods.queue.freed()
        await asyncio.sleep(0)
        assert pods.names() in (["old"], [])
        while not pods.placed:
            await asyncio.sleep(0)
        pods.load[0] = 0
        pods.queue.freed()
        await asyncio.gather(waiting, newcomer)
        return pods.names()

    assert asyncio.run(run()) == ["old", "new"]


def test_a_waiter_that_goes_away_leaves_the_line_and_the_next_one_gets_the_slot():
    async def run() -> list[str]:
        pods = Pods(1)
        pods.place()
        gone, stays = asyncio.create_task(pods.request("gone")), asyncio.create_task(pods.request("stays"))
        await asyncio.sleep(0)
        gone.cancel()  # its client disconnected
        await asyncio.wait([gone])
        assert pods.queue.queued == 1
        pods.load[0] = 0
        pods.queue.freed()
        await stays
        return pods.names()

    assert asyncio.run(run()) == ["stays"]


def test_a_request_that_waited_the_bound_is_refused_with_retry_after():
    async def run() -> Overloaded:
        pods, queue = Pods(1), SlotQueue(bound=0.2)
        pods.place()  # and it never ends
        with pytest.raises(Overloaded) as e:
            await queue.turn(pods.full, lambda: 7)
        assert queue.queued == 0
        return e.value

    e = asyncio.run(run())
    assert e.retry_after == 7 and (e.status, e.tgi_status) == (429, 503)
    assert "waited 0 s for a slot" in str(e) and "--max-queue-wait" in str(e)


@pytest.mark.parametrize(
    ("ahead", "slots", "seconds", "refused"),
    [
        (12, 12, 10.0, False),  # the first in line: one slot's turn, 10 / 12 s
        (12 + 60, 12, 10.0, False),  # 61st in line: 61 x 10 / 12 = 51 s, within 60
        (12 + 80, 12, 10.0, True),  # 81st: 68 s
        (12 + 80, 12, None, False),  # nothing measured yet: admitted
        (500, 0, 10.0, False),  # slots unknown: admitted (the pods decide)
    ],
)
def test_a_request_whose_expected_wait_passes_the_bound_is_refused_at_once(ahead, slots, seconds, refused):
    queue = SlotQueue(bound=60.0)
    if not refused:
        queue.admit(ahead, slots, seconds)
        return
    with pytest.raises(Overloaded) as e:
        queue.admit(ahead, slots, seconds)
    assert "would likely wait 68 s" in str(e.value) and "92 requests are ahead on 12 slots" in str(e.value)
    assert e.value.retry_after == 8


def test_without_a_bound_nothing_is_refused_and_turned_off_nothing_waits():
    SlotQueue(bound=0).admit(10_000, 1, 100.0)
    off = SlotQueue(bound=60.0, enabled=False)
    assert asyncio.run(off.turn(lambda: True, lambda: 1)) == 0.0
    with pytest.raises(ValueError, match="0 \\(none\\) or more seconds"):
        SlotQueue(bound=-1)
