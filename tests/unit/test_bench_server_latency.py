"""bench/server_latency.py's measures: latencies from streamed chunk times, and the output tokens/s of the
whole run against the same while every client had a request to send (the run's drain left out)."""

from __future__ import annotations

import pytest
from support import bench_module

bench = bench_module("server_latency")


def test_ttft_and_gaps_come_from_the_chunk_times():
    r = bench.RequestResult(sent=10.0, chunk_times=[10.5, 10.6, 10.9], tokens=3)
    assert r.ttft == pytest.approx(0.5)
    assert r.gaps == pytest.approx([0.1, 0.3])


def test_tokens_by_a_time_count_each_chunk_as_its_share_of_the_usage():
    r = bench.RequestResult(sent=0.0, chunk_times=[1.0, 2.0, 3.0, 4.0], tokens=8)  # two tokens a chunk
    assert [r.tokens_by(t) for t in (0.5, 1.0, 2.5, 4.0, 9.0)] == [0, 2, 4, 8, 8]


def test_a_drain_lowers_the_whole_runs_rate_but_not_the_busy_one():
    # Two clients at 10 tokens/s each until t=10, when the first runs out of requests; the other streams
    # alone for 10 s more.
    level = bench.LevelResult("ours", 2, start=0.0, end=20.0, steady_end=10.0)
    level.requests = [
        bench.RequestResult(0.0, [0.1 * i for i in range(1, 101)], tokens=100),  # 0.1 .. 10.0
        bench.RequestResult(0.0, [0.1 * i for i in range(1, 201)], tokens=200),  # 0.1 .. 20.0
    ]
    s = level.summary()
    assert s["tokens_per_s"] == pytest.approx(15.0)  # 300 tokens in 20 s
    assert s["steady_tokens_per_s"] == pytest.approx(20.0)  # 200 tokens in the first 10 s


def test_a_one_at_a_time_server_has_the_same_rate_either_way():
    # Two clients, four requests of 100 tokens, served one after the other at 10 tokens/s: the first client's
    # requests run 0-10 s and 20-30 s, the second's 10-20 s and 30-40 s; at 30 s the first finds none left.
    def served(start: float):
        return bench.RequestResult(0.0, [start + 0.1 * i for i in range(1, 101)], tokens=100)

    level = bench.LevelResult("peer", 2, start=0.0, end=40.0, steady_end=30.0)
    level.requests = [served(0.0), served(10.0), served(20.0), served(30.0)]
    s = level.summary()
    assert s["tokens_per_s"] == pytest.approx(10.0)
    assert s["steady_tokens_per_s"] == pytest.approx(10.0)
