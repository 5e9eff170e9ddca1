"""bench/routing_trace.py's pure parts: reading a Mooncake trace (and refusing what is not one), conversations
and the excerpt, a request's prompt (blocks shared by id share their text, cut to fit), the working set and
the block size chosen for it, arrivals scaled to a rate; and the shipped excerpt itself."""

from __future__ import annotations

import json

import pytest
from support import bench_module

bench = bench_module("routing_trace")
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]


def line(ts: int, input_length: int, ids: list[int], output_length: int = 100) -> str:
    return json.dumps({"timestamp": ts, "input_length": input_length, "output_length": output_length,
                       "hash_ids": ids})  # fmt: skip


def test_a_trace_is_read_in_order_and_blank_lines_are_skipped():
    requests = bench.parse_trace([line(0, 1000, [0, 1]), "", line(5, 512, [0], 3)])
    assert requests == [bench.TraceRequest(0, 1000, 100, (0, 1)), bench.TraceRequest(5, 512, 3, (0,))]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "trace line 1: not JSON"),
        (json.dumps({"timestamp": 0, "input_length": 5}), "expected an object with timestamp"),
        (line(0, 10, []), "hash_ids a list of at least one"),
        (line(-1, 10, [0]), "whole numbers >= 0"),
        (line(0, 1025, [0, 1]), "does not fit 2 blocks of 512 tokens"),
        (line(0, 512, [0, 1]), "does not fit 2 blocks of 512 tokens"),
    ],
)
def test_what_is_not_a_trace_line_is_refused_saying_why(text, says):
    with pytest.raises(ValueError, match=says):
        bench.parse_trace([text])


def test_a_trace_going_back_in_time_is_refused():
    with pytest.raises(ValueError, match="timestamps must not go back"):
        bench.parse_trace([line(10, 10, [0]), line(5, 10, [1])])


def test_conversations_follow_the_longest_shared_prefix_and_the_excerpt_keeps_them_whole():
    requests = bench.parse_trace([
        line(0, 1500, [0, 1, 2]),        # opens conversation A
        line(1, 1000, [0, 3]),           # opens B (block 0 alone is everyone's)
        line(2, 2000, [0, 1, 2, 4]),     # continues A
        line(3, 1500, [0, 3, 5]),        # continues B
        line(4, 700, [0, 6]),            # opens C
        line(5, 2500, [0, 1, 2, 4, 7]),  # continues A's latest turn
    ])  # fmt: skip
    assert bench.conversations(requests) == [0, 1, 0, 1, 4, 0]
    assert bench.excerpt(requests, 2) == [0, 2, 4, 5]  # A and C: the 0th and 2nd conversations, whole
    assert bench.excerpt(requests, 1) == list(range(6))


def test_requests_sharing_block_ids_share_their_text_and_a_cut_block_is_its_beginning():
    scaling = bench.Scaling(block_tokens=8, max_input_tokens=100, max_output_tokens=32)
    a, b = bench.parse_trace([line(0, 1280, [0, 1, 2]), line(1, 1100, [0, 1, 9])])
    assert scaling.blocks(a) == [(0, 8), (1, 8), (2, 4)]  # 256 tokens left in the last block: 4 of 8
    assert scaling.blocks(b) == [(0, 8), (1, 8), (9, 2)]  # 76 left: ceil(76 x 8 / 512) = 2
    pa, pb = bench.prompt(a, scaling, 7, WORDS), bench.prompt(b, scaling, 7, WORDS)
    words_a, words_b = pa.split(" ")[1:], pb.split(" ")[1:]
    assert len(words_a) == 20 and len(words_b) == 18 and pa.startswith(" ")
    assert words_a[:16] == words_b[:16]  # blocks 0 and 1 shared
    assert (
        bench.block_text(7, 2, 4, WORDS)
        == bench.block_text(7, 2, 8, WORDS)[: len(bench.block_text(7, 2, 4, WORDS))]
    )
    assert bench.prompt(a, scaling, 8, WORDS) != pa  # another run's seed: other texts
    assert bench.prompt(a, scaling, 7, WORDS) == pa  # the same seed: the same text


def test_a_long_prompt_is_cut_at_the_blocks_that_fit_and_answers_are_scaled_and_capped():
    scaling = bench.Scaling(block_tokens=16, max_input_tokens=40, max_output_tokens=10)
    (r,) = bench.parse_trace([line(0, 5 * 512, [0, 1, 2, 3, 4], output_length=300)])
    assert scaling.blocks(r) == [(0, 16), (1, 16)]
    assert scaling.output_tokens(r) == 10  # 300 x 16 / 512 = 9.4 -> 10, the cap
    longer_blocks = bench.Scaling(block_tokens=32, max_input_tokens=400, max_output_tokens=32)
    assert longer_blocks.output_tokens(r) == 10  # answers scale alike in every regime: 16 tokens per 512
    (short,) = bench.parse_trace([line(0, 10, [0], output_length=1)])
    assert scaling.output_tokens(short) == 1 and scaling.blocks(short) == [(0, 1)]
    with pytest.raises(ValueError, match="block_tokens"):
        bench.Scaling(block_tokens=0, max_input_tokens=40, max_output_tokens=10)


def test_the_working_set_counts_each_block_once_and_the_block_size_follows_the_ratio_asked():
    requests = bench.parse_trace([line(0, 1024, [0, 1]), line(1, 1536, [0, 1, 2]), line(2, 1024, [0, 3])])
    scaling = bench.Scaling(block_tokens=10, max_input_tokens=1000, max_output_tokens=8)
    assert bench.working_set_tokens(requests, scaling) == 40  # blocks 0 1 2 3, 10 tokens each
    assert bench.block_tokens_for(requests, held_tokens=100, ratio=2.0, max_input_tokens=1000,
                                  max_output_tokens=8) == 50  # fmt: skip
    assert bench.block_tokens_for(requests, held_tokens=100, ratio=0.4, max_input_tokens=1000,
                                  max_output_tokens=8) == 10  # fmt: skip


def test_arrivals_keep_the_traces_gaps_scaled_to_the_rate():
    requests = bench.parse_trace([line(t, 10, [0]) for t in (1000, 1000, 3000, 9000)])
    assert bench.arrivals(requests, rate=1.0) == [0.0, 0.0, 0.75, 3.0]  # 3 requests after the first in 3 s
    assert bench.arrivals(requests, rate=3.0) == [0.0, 0.0, 0.25, 1.0]
    with pytest.raises(ValueError, match="rate must be > 0"):
        bench.arrivals(requests, rate=0)


def test_the_shipped_excerpt_is_a_trace_with_conversations_to_reuse():
    requests = bench.parse_trace(bench.TRACE.read_text().splitlines())
    assert len(requests) == 248 and all(r.hash_ids[0] == 0 for r in requests)
    assert len(set(bench.conversations(requests))) < len(requests)  # later turns reuse earlier ones
    assert bench.TRACE.stat().st_size < 100_000
