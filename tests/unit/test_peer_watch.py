"""`PeerWatch`: a router's peer sets resolved and probed now and every interval, a failing round that does not
end the loop, and a round on demand only when the last is old or a role has no pod yet."""

from __future__ import annotations

import asyncio

from support import wait_until_async

from neuronfleet.runtime.routing.peers import PeerSet, PeerWatch


def test_start_probes_every_peer_of_every_set_now_and_again_after_a_failed_round():
    prefill = PeerSet("prefill", ["http://p1:8000"])
    decode = PeerSet("decode", ["http://d1:8000", "http://d2:8000"])
    probed: list[str] = []

    async def probe(peers: PeerSet, url: str) -> None:
        probed.append(url)
        if len(probed) <= 3:  # the first round: every probe records a failure
            peers.failed(url, "refused")
        elif url == "http://d2:8000" and len(probed) <= 6:
            raise RuntimeError("a probe that breaks its round")
        else:
            peers.succeeded(url)

    async def scenario() -> None:
        watch = PeerWatch((prefill, decode), probe, interval=0.01)
        await watch.start()
        assert sorted(probed) == ["http://d1:8000", "http://d2:8000", "http://p1:8000"]
        # the second round raises; the loop goes on and a third round records every peer healthy
        await wait_until_async(lambda: len(probed) >= 9, "a round after the failed one")
        await wait_until_async(lambda: prefill.healthy == 1 and decode.healthy == 2, "every peer healthy")
        await watch.close()
        assert not watch.running
        done = len(probed)
        await asyncio.sleep(0.05)
        assert len(probed) == done  # stopped: no more rounds

    asyncio.run(scenario())


def test_a_round_on_demand_only_when_the_last_is_old_or_a_set_is_empty():
    decode = PeerSet("decode", ["http://d1:8000"])
    empty = PeerSet("prefill", [])  # a role none of whose pods is found
    rounds: list[int] = []

    async def probe(peers: PeerSet, url: str) -> None:
        rounds.append(1)

    async def scenario() -> None:
        watch = PeerWatch((decode,), probe, interval=3600.0)
        await watch.refresh_if_stale()  # never refreshed: a round
        await watch.refresh_if_stale()  # fresh: none
        assert len(rounds) == 1
        both = PeerWatch((decode, empty), probe, interval=3600.0)
        await both.refresh()
        await both.refresh_if_stale()  # fresh, but a set has no pod: look again
        assert len(rounds) == 3
        await watch.close()
        await both.close()

    asyncio.run(scenario())


def test_the_healthy_gauge_counts_each_roles_peers_in_rotation():
    from prometheus_client import CollectorRegistry

    prefill = PeerSet("prefill", [])
    decode = PeerSet("decode", [])
    prefill.update(["http://p1"])
    decode.update(["http://d1", "http://d2"])

    async def probe(peers: PeerSet, url: str) -> None:
        pass

    registry = CollectorRegistry()
    PeerWatch((prefill, decode), probe, interval=1.0).register_metrics(registry, "m")

    def healthy(role: str) -> float | None:
        labels = {"model_name": "m", "role": role}
        return registry.get_sample_value("neuronfleet:router_peers_healthy", labels)

    assert (healthy("prefill"), healthy("decode")) == (1.0, 2.0)
    for _ in range(3):  # three failures take a peer out of rotation
        decode.failed("http://d2", "refused")
    assert (healthy("prefill"), healthy("decode")) == (1.0, 1.0)
