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
    """Pods of one slot each, as the front door sees them: its requests take the slots they are placed on."""

    def __init__(self, count: int) -> None:
        self.load = [0] * count

    def full(self) -> bool:
        return pods_full((load, 1) for load in self.load)

    def place(self) -> int:
        pod = self.load.index(0)
        self.load[pod] += 1
        return pod


def test_requests_wait_while_every_slot_is_taken_and_are_placed_oldest_first_as_slots_free():
    async def run() -> list[tuple[str, int]]:
        pods, queue, placed = Pods(2), SlotQueue(bound=0), []

        async def request(name: str) -> None:
            await queue.turn(pods.full, lambda: 1)
            placed.append((name, pods.place()))

        first = [asyncio.create_task(request(n)) for n in ("a", "b")]
        await asyncio.gather(*first)  # two free slots: placed at once
        later = [asyncio.create_task(request(n)) for n in ("c", "d", "e")]
        for _ in range(5):
            await asyncio.sleep(0)
        assert queue.queued == 3 and len(placed) == 2  # every slot taken: nothing more placed
        pods.load[1] -= 1  # pod 1's answer ends
        queue.freed()
        while len(placed) < 3:
            await asyncio.sleep(0)
        assert queue.queued == 2
        pods.load[0] -= 1
        pods.load[1] -= 1  # both end at once: both slots go, in order
        queue.freed()
        while len(placed) < 5:
            await asyncio.sleep(0)
        await asyncio.gather(*later)
        return placed

    placed = asyncio.run(run())
    assert [name for name, _ in placed] == ["a", "b", "c", "d", "e"]
    assert placed[2] == ("c", 1)  # the oldest waiter, on the pod that freed
    assert sorted(pod for _, pod in placed[3:]) == [0, 1]


def test_a_newcomer_does_not_pass_the_requests_already_waiting_even_with_a_slot_free():
    async def run() -> list[str]:
        pods, queue, order = Pods(1), SlotQueue(bound=0), []
        pods.place()

        async def request(name: str) -> None:
            await queue.turn(pods.full, lambda: 1)
            order.append(name)
            pods.place()

        waiting = asyncio.create_task(request("old"))
        await asyncio.sleep(0)
        pods.load[0] = 0  # the slot frees, and before the old request looks a new one comes
        newcomer = asyncio.create_task(request("new"))
        queue.freed()
        await asyncio.sleep(0)
        assert order == ["old"] or not order
        while not order:
            await asyncio.sleep(0)
        pods.load[0] = 0
        queue.freed()
        await asyncio.gather(waiting, newcomer)
        return order

    assert asyncio.run(run()) == ["old", "new"]


def test_a_waiter_that_goes_away_leaves_the_line_and_the_next_one_gets_the_slot():
    async def run() -> list[str]:
        pods, queue, order = Pods(1), SlotQueue(bound=0), []
        pods.place()

        async def request(name: str) -> None:
            await queue.turn(pods.full, lambda: 1)
            order.append(name)

        gone, stays = asyncio.create_task(request("gone")), asyncio.create_task(request("stays"))
        await asyncio.sleep(0)
        gone.cancel()  # its client disconnected
        await asyncio.wait([gone])
        assert queue.queued == 1
        pods.load[0] = 0
        queue.freed()
        await stays
        return order

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
