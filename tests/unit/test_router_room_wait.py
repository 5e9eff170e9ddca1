"""How long a request waits at the router while every decode pod is full (`RoomWait`, pure): as long as the
decode pods keep making room, and no longer than the limit once they stop."""

from __future__ import annotations

from neuronfleet.runtime.routing.router import RoomWait


def test_with_no_decode_stream_starting_or_ending_the_wait_ends_at_the_limit():
    room = RoomWait(limit=30.0, since=100.0, progress=7)
    assert room.goes_on(100.25, 7)
    assert room.goes_on(129.9, 7)
    assert not room.goes_on(130.0, 7)


def test_a_queue_that_moves_is_waited_on_past_the_limit_and_a_stalled_one_is_not():
    room = RoomWait(limit=30.0, since=0.0, progress=0)
    # a long queue on a loaded machine: a stream starts or ends every 20 s, so a minute and more goes by
    for t, progress in ((20.0, 1), (40.0, 2), (60.0, 3), (80.0, 5)):
        assert room.goes_on(t, progress)
    assert room.goes_on(109.0, 5)  # 29 s since the last room made
    assert not room.goes_on(110.5, 5)  # then the pods stopped: it gives up 30 s after the last progress
