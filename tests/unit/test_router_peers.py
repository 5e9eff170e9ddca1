"""The router's view of its peers (pure): least loaded first, full pods after those with room, a pod out of
rotation after three failures and back after one good probe, a restart seen as a new identity, pods that
leave the DNS answer forgotten once idle."""

from __future__ import annotations

from neuronfleet.runtime.routing.peers import FAILS_TO_DROP, PeerSet


def status(identity: str, running: int = 0, waiting: int = 0, slots: int = 4) -> dict:
    return {"identity": identity, "running": running, "waiting": waiting, "slots": slots, "ready": True}


def test_the_least_loaded_pod_comes_first_and_full_pods_last():
    peers = PeerSet("decode", [])
    peers.update(["http://a", "http://b", "http://c"])
    peers.probed("http://a", status("a", running=3))
    peers.probed("http://b", status("b", running=1))
    peers.probed("http://c", status("c", running=4, waiting=2))  # full
    assert [p.url for p in peers.ranked()] == ["http://b", "http://a", "http://c"]
    # this router's own requests since the probe count too
    peers.peers["http://b"].in_flight += 3
    assert [p.url for p in peers.ranked()][:2] == ["http://a", "http://b"]
    assert [p.url for p in peers.ranked(exclude=["http://a"])] == ["http://b", "http://c"]


def test_equal_pods_are_taken_in_turn():
    peers = PeerSet("prefill", [])
    peers.update(["http://a", "http://b"])
    firsts = {peers.ranked()[0].url for _ in range(4)}
    assert firsts == {"http://a", "http://b"}


def test_a_failing_pod_leaves_rotation_and_comes_back_and_a_restart_is_noticed():
    peers = PeerSet("decode", [])
    peers.update(["http://a", "http://b"])
    peers.probed("http://a", status("a-1"))
    for _ in range(FAILS_TO_DROP - 1):
        peers.probed("http://a", None)
    assert peers.healthy == 2  # not yet
    peers.failed("http://a", "connection refused")
    assert peers.healthy == 1 and peers.ranked()[-1].url == "http://a"  # last resort only
    peers.probed("http://a", {**status("a-1"), "ready": False})
    assert peers.healthy == 1  # answering but not ready is not back
    peers.probed("http://a", status("a-2"))  # back, as a new process
    assert peers.healthy == 2 and peers.restarts == 1 and peers.peers["http://a"].failures == 0


def test_pods_that_leave_the_dns_answer_are_forgotten_once_idle():
    peers = PeerSet("decode", [])
    peers.update(["http://a", "http://b"])
    peers.peers["http://b"].in_flight = 1
    peers.update(["http://a"])
    assert set(peers.peers) == {"http://a", "http://b"}  # b still streams a request
    peers.peers["http://b"].in_flight = 0
    peers.update(["http://a", "http://c"])
    assert set(peers.peers) == {"http://a", "http://c"}


def test_the_kv_usage_a_router_reports_is_the_mean_over_its_pods_in_rotation():
    """What a router exports as vllm:kv_cache_usage_perc for an inference gateway's endpoint picker."""
    peers = PeerSet("decode", [])
    peers.update(["http://a", "http://b", "http://c"])
    assert peers.kv_usage() == 0.0  # none answered yet
    peers.probed("http://a", {**status("a"), "kv_usage": 0.2})
    peers.probed("http://b", {**status("b"), "kv_usage": 0.6})
    assert peers.kv_usage() == 0.4  # c never answered: not counted
    peers.probed("http://b", None)  # b's probe failed: out until it answers again
    assert peers.kv_usage() == 0.2
    peers.probed("http://c", status("c"))  # a pod whose status has no kv_usage: 0
    assert peers.kv_usage() == 0.1
