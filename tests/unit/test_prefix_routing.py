"""KV-cache-aware routing's pure parts (runtime/routing/prefix_routing.py): the policy as a table (prefix,
load, overload, ties, least-loaded), priced (expected wait for a slot against prefill saved, the saturated
case of issue 50) and by the load margin where it cannot be priced, the pods' timings (EWMAs), block names
(chained: equal names mean equal prefixes), the canonical prompt text of each API, the prefix index's bounds
and expiry, and a router's routing that times its pods and forgets a pod that left the rotation or
restarted."""

from __future__ import annotations

import dataclasses
import json
import types
from collections import Counter
from dataclasses import dataclass

import pydantic
import pytest

from neuronfleet.cli import build_parser
from neuronfleet.contract import ServeConfig
from neuronfleet.runtime.routing import prefix_routing as pr
from neuronfleet.runtime.routing.prefix_routing import Candidate


def c(pod: str, load: int, held: int) -> Candidate:
    return Candidate(pod, load, held)


@pytest.mark.parametrize(
    ("candidates", "policy", "margin", "want"),
    [
        # nobody holds any of it: the least loaded (the ranking's first)
        ([c("a", 0, 0), c("b", 1, 0)], "kv-aware", 2, ("a", "load")),
        # the holder within the margin wins over a less loaded pod
        ([c("a", 0, 0), c("b", 2, 5)], "kv-aware", 2, ("b", "prefix")),
        # ... not past it: overloaded, the least loaded instead
        ([c("a", 0, 0), c("b", 3, 5)], "kv-aware", 2, ("a", "overload")),
        # the longest held prefix among those within the margin
        ([c("a", 0, 1), c("b", 1, 4), c("c", 1, 3)], "kv-aware", 2, ("b", "prefix")),
        # a longer prefix on an overloaded pod loses to a shorter one within the margin
        ([c("a", 0, 0), c("b", 1, 2), c("c", 5, 9)], "kv-aware", 2, ("b", "prefix")),
        # equal prefixes: the lower load, then the ranking's order
        ([c("a", 1, 3), c("b", 0, 3)], "kv-aware", 2, ("b", "prefix")),
        ([c("a", 0, 3), c("b", 0, 3)], "kv-aware", 2, ("a", "prefix")),
        # margin 0: only a holder as idle as the least loaded
        ([c("a", 0, 0), c("b", 1, 5)], "kv-aware", 0, ("a", "overload")),
        # least-loaded ignores what is held
        ([c("a", 0, 0), c("b", 0, 9)], "least-loaded", 2, ("a", "load")),
    ],
)
def test_the_policy(candidates, policy, margin, want):
    index, reason = pr.choose(candidates, policy, margin)
    assert (candidates[index].pod, reason) == want


def test_no_candidate_is_an_error():
    with pytest.raises(ValueError, match="no candidate"):
        pr.choose([], "kv-aware", 2)


def priced(
    pod: str, load: int, held: int, answer: float | None = 8.0, prefill: float | None = 0.001,
    contention: float | None = None,
):  # fmt: skip
    """A candidate of 4 slots with timings: 8 s a request on a slot, 1 ms of prefill a token."""
    return Candidate(pod, load, held, slots=4, answer_seconds=answer, prefill_per_token=prefill,
                     contention=contention)  # fmt: skip


# The saturated case (issue 50: 12 conversations over 3 pods of 4 slots): every slot full, the pod holding
# the conversation (60 of its 64 blocks, 960 tokens) with 2 more waiting, another pod with none waiting. The
# margin rule (2) took the holder; priced, the holder's wait is 3 x 8 s / 4 = 6 s against 1 x 8 s / 4 = 2 s:
# 4 s more, against 960 tokens of prefill saved.
SATURATED = [priced("a", 4, 0), priced("b", 5, 0), priced("held", 6, 60)]


@pytest.mark.parametrize(
    ("candidates", "blocks", "want"),
    [
        # the margin rule chose the holder here (6 is within 2 of 4); at 1 ms a token the prefill saved
        # (0.96 s) is worth less than the 4 s more of wait: the pod whose slot frees first
        (SATURATED, 64, ("a", "overload")),
        # at 10 ms a token the prefill saved (9.6 s) is worth more than the wait: the holder
        ([priced(x.pod, x.load, x.held, prefill=0.01) for x in SATURATED], 64, ("held", "prefix")),
        # a free slot elsewhere (no wait) against the holder's 2 s wait for its first slot to free
        ([priced("a", 3, 0), priced("held", 4, 60)], 64, ("a", "overload")),
        # ... the holder with a free slot too: it wins, whatever its load over the others
        ([priced("a", 0, 0), priced("held", 3, 60)], 64, ("held", "prefix")),
        # a shorter held prefix on a pod with room beats a longer one behind a queue
        ([priced("a", 2, 30), priced("held", 7, 60)], 64, ("a", "overload")),
        # equal costs: the ranking's order (the lower load)
        ([priced("a", 1, 60), priced("b", 2, 60)], 64, ("a", "prefix")),
        # a pod that prefills faster may beat the holder with its own speed
        (
            [priced("fast", 0, 0, prefill=0.0001), priced("held", 0, 10, prefill=0.01)],
            64,
            ("fast", "overload"),
        ),
        # no pod holds any of it: the one with a free slot (a full pod's wait priced in)
        ([priced("a", 4, 0), priced("b", 0, 0)], 64, ("b", "load")),
        # not priced (no timing of answers, a pod full): the margin rule decides, as before
        ([priced(x.pod, x.load, x.held, answer=None) for x in SATURATED], 64, ("held", "prefix")),
        # ... as where the slots are unknown
        ([Candidate(x.pod, x.load, x.held) for x in SATURATED], 64, ("held", "prefix")),
        # ... or the prefill unmeasured
        ([priced(x.pod, x.load, x.held, prefill=None) for x in SATURATED], 64, ("held", "prefix")),
        # every slot free: no wait to time, and the holder saves its prefill
        ([priced("a", 0, 0, answer=None), priced("held", 2, 60, answer=None)], 64, ("held", "prefix")),
        # what a request running beside costs, measured (0.2 s each): a few blocks held (32 tokens, 32 ms)
        # on a pod running 2 requests (0.4 s more) lose to an idle pod; its whole history (960 tokens) wins
        (
            [priced("held", 2, 4, contention=0.2), priced("idle", 0, 2, contention=0.2)],
            24,
            ("idle", "overload"),
        ),
        (
            [priced("held", 2, 60, contention=0.2), priced("idle", 0, 0, contention=0.2)],
            64,
            ("held", "prefix"),
        ),
        # unmeasured: no contention priced, and the few blocks held win
        ([priced("held", 2, 4), priced("idle", 0, 2)], 24, ("held", "prefix")),
    ],
)
def test_the_priced_policy(candidates, blocks, want):
    index, reason = pr.choose(candidates, "kv-aware", 2, blocks)
    assert (candidates[index].pod, reason) == want


def home_of(key: int, pods: str) -> str:
    return max(pods, key=lambda pod: pr.home_rank(key, pod))


def test_a_prompt_no_pod_holds_goes_home_whatever_the_rankings_order():
    key = 0x5EED
    home = home_of(key, "abc")
    for order in ("abc", "cba", "bca"):
        candidates = [priced(p, 0, 0) for p in order]
        index, reason = pr.choose(candidates, "kv-aware", 2, 64, home=key)
        assert (candidates[index].pod, reason) == (home, "load")
        # unpriced too, among the least loaded
        unpriced = [Candidate(p, 1, 0) for p in order]
        index, reason = pr.choose(unpriced, "kv-aware", 2, 64, home=key)
        assert (unpriced[index].pod, reason) == (home, "load")


def test_homes_spread_prompts_over_the_pods():
    homes = [home_of(key, ("pod-a", "pod-b", "pod-c")) for key in range(3000)]
    shares = sorted(homes.count(p) / len(homes) for p in ("pod-a", "pod-b", "pod-c"))
    assert shares[0] > 0.28 and shares[-1] < 0.39, shares


KEY = 0xC0FFEE
HOME = home_of(KEY, ("a", "b"))
AWAY = "b" if HOME == "a" else "a"


@pytest.mark.parametrize(
    ("candidates", "want"),
    [
        # neither holds it, the other measured 10% faster: a tie, so home
        ([priced(AWAY, 0, 0, prefill=0.0009), priced(HOME, 0, 0)], (HOME, "load")),
        # ... twice as fast is not a tie: the faster pod
        ([priced(AWAY, 0, 0, prefill=0.0005), priced(HOME, 0, 0)], (AWAY, "load")),
        # home has no free slot (a wait to price in): the pod with one
        ([priced(AWAY, 0, 0), priced(HOME, 4, 0)], (AWAY, "load")),
        # ... nor a free slot on a busier pod: its running requests share its steps, the idle pod takes it
        ([priced(AWAY, 0, 0), priced(HOME, 1, 0)], (AWAY, "load")),
        # a pod holding more of it within the tie keeps it (the holder is never left for home)
        ([priced(AWAY, 0, 2, prefill=0.0011), priced(HOME, 0, 0)], (AWAY, "prefix")),
        # unpriced: home only among the least loaded
        ([Candidate(AWAY, 0, 0), Candidate(HOME, 1, 0)], (AWAY, "load")),
    ],
)
def test_ties_go_home(candidates, want):
    index, reason = pr.choose(candidates, "kv-aware", 2, 64, home=KEY)
    assert (candidates[index].pod, reason) == want


def test_a_routing_sends_a_conversation_every_cache_dropped_back_to_its_pod():
    """Through `Routing.pick`: with the index forgotten (a TTL passed, an eviction), the same prompt goes to
    the pod it went to first, not to the ranking's first."""

    @dataclass
    class P:
        url: str
        score: int = 0
        slots: int = 4

    routing = pr.Routing("kv-aware", by_tokens=True)
    prompt = list(range(320))
    blocks = routing.blocks(prompt)
    pods = [P("http://pod-0"), P("http://pod-1"), P("http://pod-2")]
    first = routing.pick(pods, blocks, 0.0).url
    for ranked in (pods, pods[::-1], pods[1:] + pods[:1]):
        routing.index.forget(first)
        assert routing.pick(ranked, blocks, 1.0).url == first


def filled(candidate: Candidate, cached: int) -> Candidate:
    return dataclasses.replace(candidate, cached=cached)


@pytest.mark.parametrize(
    ("candidates", "want"),
    [
        # a prompt of 64 blocks no pod holds: home's cache holds 65 blocks more than the other's, so the
        # emptier cache takes it, priced or not
        ([filled(priced(AWAY, 0, 0), 100), filled(priced(HOME, 0, 0), 165)], (AWAY, "load")),
        ([Candidate(AWAY, 0, 0, cached=100), Candidate(HOME, 0, 0, cached=165)], (AWAY, "load")),
        # ... within a prompt's blocks of each other (both full, at cache pressure): home
        ([filled(priced(AWAY, 0, 0), 100), filled(priced(HOME, 0, 0), 164)], (HOME, "load")),
        ([Candidate(AWAY, 0, 0, cached=100), Candidate(HOME, 0, 0, cached=164)], (HOME, "load")),
        # room never outweighs load, nor a held prefix
        ([filled(priced(AWAY, 1, 0), 0), filled(priced(HOME, 0, 0), 500)], (HOME, "load")),
        ([filled(priced(AWAY, 0, 0), 0), filled(priced(HOME, 0, 8), 500)], (HOME, "prefix")),
    ],
)
def test_of_tied_pods_the_emptier_caches_take_a_prompt_none_holds(candidates, want):
    index, reason = pr.choose(candidates, "kv-aware", 2, 64, home=KEY)
    assert (candidates[index].pod, reason) == want


def test_new_conversations_fill_the_pods_caches_evenly():
    """Ten conversations open on three idle pods (the first turn of each, 64 blocks, none held anywhere),
    through `Routing.pick` and what it sent: no pod gets more than four, where their homes alone would have
    given one pod five or more for most sets of ten (63%), and a cache of four conversations drops one."""

    @dataclass
    class P:
        url: str
        score: int = 0
        slots: int = 4

    pods = [P(f"http://pod-{i}") for i in range(3)]
    crowded = 0
    for trial in range(20):
        routing = pr.Routing("kv-aware", by_tokens=True)
        placed, by_home = Counter(), Counter()
        for conversation in range(10):
            blocks = routing.blocks([100_000 * trial + 1000 * conversation + t for t in range(1024)])
            pod = routing.pick(pods, blocks, 0.0).url
            routing.sent(pod, blocks, 0.0)
            placed[pod] += 1
            by_home[max(pods, key=lambda p: pr.home_rank(blocks[0], p.url)).url] += 1
        assert max(placed.values()) <= 4, placed
        crowded += max(by_home.values()) >= 5
    assert crowded >= 5  # (the same prompts by home alone)


@pytest.mark.parametrize(
    ("load", "slots", "answer", "want"),
    [
        (3, 4, None, 0.0),  # a free slot: no wait, timed or not
        (4, 4, 8.0, 2.0),  # first in line: one of 4 slots frees every 2 s
        (6, 4, 8.0, 6.0),  # third in line
        (6, 4, None, None),  # full and untimed
        (1, 0, 8.0, None),  # slots unknown
    ],
)
def test_the_expected_wait_for_a_slot(load, slots, answer, want):
    assert pr.expected_wait(load, slots, answer) == want


def test_timings_are_ewmas_and_the_prefill_is_the_slope_past_the_fixed_part():
    timings = pr.PodTimings(weight=0.5)
    assert (timings.answer_seconds, timings.prefill_per_token, timings.first_token_seconds(10)) == (None,) * 3
    timings.answered(4.0)
    timings.answered(8.0)
    timings.answered(-1.0)  # a clock that went back: not counted
    assert (timings.answers, timings.answer_seconds) == (2, 6.0)
    # one size of uncached prompt: the ratio stands in (the fixed 0.1 s counted as prefill)
    timings.first_token(0.1 + 0.002 * 100, 100)
    assert timings.prefill_per_token == pytest.approx(0.003)
    # sizes that differ: the slope, 2 ms a token, the fixed 0.1 s its intercept
    for tokens in (1000, 16, 500, 32, 2000, 48):
        timings.first_token(0.1 + 0.002 * tokens, tokens)
    assert timings.prefill_per_token == pytest.approx(0.002)
    assert timings.first_token_seconds(300) == pytest.approx(0.1 + 0.002 * 300)  # the line, fixed part too
    # slower now: the average follows
    for _ in range(30):
        for tokens in (1000, 16):
            timings.first_token(0.1 + 0.004 * tokens, tokens)
    assert timings.prefill_per_token == pytest.approx(0.004, rel=0.01)
    with pytest.raises(ValueError, match=r"EWMA weight is in \(0, 1\]"):
        pr.PodTimings(weight=0)


def test_a_pod_is_priced_with_the_requests_it_runs_beside():
    # a free slot: beside its 2 running requests (2 x 0.2 s) and 24 blocks of prefill (384 tokens at 1 ms)
    assert pr.expected_ttft(priced("a", 2, 0, contention=0.2), 24) == pytest.approx(0.384 + 0.4)
    # full, 2 waiting: its turn in (6 - 4 + 1) x 8 s / 4 = 6 s, then beside its other 3 slots, not its queue
    assert pr.expected_ttft(priced("a", 6, 0, contention=0.2), 24) == pytest.approx(6 + 0.384 + 0.6)
    # slots unknown and unpriced: None
    assert pr.expected_ttft(Candidate("a", 2, 0, contention=0.2), 24) is None


def full_cache(candidate: Candidate, cached: int = 1000, capacity: int = 1000) -> Candidate:
    return dataclasses.replace(candidate, cached=cached, capacity=capacity)


@pytest.mark.parametrize(
    ("candidates", "want"),
    [
        # a conversation of 64 blocks whose pod holds 60 but is full (first in line: 8 s / 4 = 2 s), and an
        # idle pod: its 64 blocks of prefill (2.05 s at 2 ms a token) cost less than the wait: it moves
        ([priced("home", 4, 60, prefill=0.002), priced("away", 3, 0, prefill=0.002)], ("away", "overload")),
        # ... but where the caches are full its copy pushes 64 blocks of other prompts out of the idle pod,
        # to be computed again (2.05 s more), against 4 at home: it stays
        (
            [
                full_cache(priced("home", 4, 60, prefill=0.002)),
                full_cache(priced("away", 3, 0, prefill=0.002)),
            ],
            ("home", "prefix"),
        ),
        # room left in the idle pod's cache: nothing pushed out, it moves
        (
            [
                full_cache(priced("home", 4, 60, prefill=0.002)),
                full_cache(priced("away", 3, 0, prefill=0.002), cached=500),
            ],
            ("away", "overload"),
        ),
    ],
)
def test_where_the_caches_are_full_a_move_is_priced_with_what_its_copy_pushes_out(candidates, want):
    index, reason = pr.choose(candidates, "kv-aware", 2, 64)
    assert (candidates[index].pod, reason) == want


def test_the_blocks_a_pod_pushes_out_to_store_a_prompt():
    assert pr.evicted(Candidate("a", 0, 0, cached=990, capacity=1000), 64) == 54
    assert pr.evicted(Candidate("a", 0, 0, cached=1000, capacity=1000), 64) == 64
    assert pr.evicted(Candidate("a", 0, 0, cached=10, capacity=1000), 64) == 0
    assert pr.evicted(Candidate("a", 0, 0, cached=5000, capacity=0), 64) == 0  # capacity unknown


def test_the_contention_of_the_requests_on_a_pod_is_fitted_beside_the_prefill():
    timings = pr.PodTimings(weight=0.2)
    # the loads all alike (idle): no contention measured; the tokens' line as before
    for tokens in (1000, 16, 500, 32):
        timings.first_token(0.1 + 0.002 * tokens, tokens, load=0)
    assert timings.contention is None and timings.prefill_per_token == pytest.approx(0.002)
    # then with 0 to 3 requests on the pod, each adding 0.15 s: the plane's slopes, the fixed part apart
    for _ in range(10):
        for tokens, load in ((1000, 0), (16, 3), (500, 1), (32, 2), (2000, 3), (48, 0)):
            timings.first_token(0.1 + 0.002 * tokens + 0.15 * load, tokens, load=load)
    assert timings.prefill_per_token == pytest.approx(0.002, rel=1e-6)
    assert timings.contention == pytest.approx(0.15, rel=1e-6)
    assert timings.first_token_seconds(300, 2) == pytest.approx(0.1 + 0.002 * 300 + 0.15 * 2)
    # a load that speeds requests up is noise: no contention (0), the prefill refitted alone
    noisy = pr.PodTimings(weight=0.2)
    for _ in range(10):
        for tokens, load in ((1000, 0), (16, 3), (500, 1), (32, 2)):
            noisy.first_token(0.5 + 0.002 * tokens - 0.05 * load, tokens, load=load)
    assert noisy.contention == 0.0 and noisy.prefill_per_token > 0
    # the same load every time (slots always full at 3 beside): unknown, not guessed
    same = pr.PodTimings()
    for tokens in (1000, 16, 500, 32):
        same.first_token(0.7 + 0.002 * tokens, tokens, load=3)
    assert same.contention is None and same.first_token_seconds(0, 3) == pytest.approx(0.7)


def test_the_router_times_each_pods_contention_from_the_loads_its_requests_found():
    routing = pr.Routing(pod_slots=4)
    peer = types.SimpleNamespace(url="http://a", score=0, slots=0)
    now = 0.0
    for _ in range(8):
        for load, tokens in ((0, 160), (2, 16), (1, 320), (3, 48)):
            peer.score = load
            blocks = list(range(tokens // pr.BLOCK_TOKENS))
            dispatch = routing.dispatched(peer, blocks, now)
            routing.first_token(dispatch, now + 0.05 + 0.001 * tokens + 0.1 * load)
            now += 10
    candidate = routing.candidate(types.SimpleNamespace(url="http://a", score=2, slots=0), [], now)
    assert candidate.contention == pytest.approx(0.1, rel=1e-3)
    assert candidate.prefill_per_token == pytest.approx(0.001, rel=1e-3)
    # a pod not timed yet is priced with the pool's
    assert routing.candidate(types.SimpleNamespace(url="http://b", score=0, slots=0), [], now).contention == (
        pytest.approx(0.1, rel=1e-3)
    )


def test_block_names_are_chained_and_only_whole_blocks_count():
    a = pr.text_blocks("x" * 64 + "y" * 64 + "z" * 10)
    b = pr.text_blocks("x" * 64 + "y" * 64 + "w" * 64)
    assert len(a) == 2 and len(b) == 3 and b[:2] == a  # a shared prefix: the same first names
    assert pr.text_blocks("q" * 64 + "y" * 64)[1] != a[1]  # the same block after another one: another name
    assert pr.token_blocks(list(range(40))) == pr.token_blocks(list(range(32)))  # 2 whole blocks of 16
    assert pr.token_blocks(list(range(15))) == []


def test_a_conversations_next_turn_starts_with_its_earlier_text():
    turn1 = [{"role": "system", "content": "Be brief." * 20}, {"role": "user", "content": "Hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    text1 = pr.prompt_text("/v1/chat/completions", json.dumps({"messages": turn1}).encode())
    text2 = pr.prompt_text("/v1/chat/completions", json.dumps({"messages": turn2}).encode())
    assert text2.startswith(text1) and text1.startswith("<system>Be brief.")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]}]
    assert pr.prompt_text("/v1/chat/completions", json.dumps({"messages": parts}).encode()) == "<user>Hi\n"


@pytest.mark.parametrize(
    ("path", "body", "want"),
    [
        ("/v1/completions", {"prompt": "Once"}, "Once"),
        ("/v1/completions", {"prompt": ["Once"]}, "Once"),
        ("/v1/completions", {"prompt": [1, 2, 3]}, "1 2 3"),
        ("/v1/completions", {"prompt": ["a", "b"]}, None),  # a batch: no one prefix
        ("/generate", {"inputs": "Once"}, "Once"),
        ("/generate_stream", {"inputs": "Once"}, "Once"),
        ("/v1/chat/completions", {"messages": "not a list"}, None),
        ("/v1/models", {}, None),
    ],
)
def test_the_prompt_text_of_each_api(path, body, want):
    assert pr.prompt_text(path, json.dumps(body).encode()) == want


def test_a_body_that_is_not_json_has_no_prompt():
    assert pr.prompt_text("/v1/chat/completions", b"{not json") is None
    assert pr.prompt_text("/v1/chat/completions", b"[1]") is None
    assert pr.prompt_text("/v1/chat/completions", b"") is None


def test_the_index_is_bounded_keeps_shared_prefixes_longest_and_ages_out():
    index = pr.PrefixIndex(capacity_blocks=4, ttl=100)
    index.sent("a", [1, 2, 3], now=0)
    assert index.held("a", [1, 2, 3, 4], now=1) == 3
    assert index.held("b", [1], now=1) == 0
    index.sent("a", [1, 5, 6], now=2)  # 5 blocks now, 4 kept: the oldest tail (3) goes, the shared 1 stays
    assert index.occupancy("a") == 4
    assert index.held("a", [1, 2, 3], now=3) == 2 and index.held("a", [1, 5, 6], now=3) == 3
    assert index.held("a", [1, 5], now=103) == 0  # older than the ttl
    index.sent("a", [7], now=200)  # what aged out is dropped on the next write
    assert index.occupancy("a") == 1
    index.forget("a")
    assert index.occupancy("a") == 0
    with pytest.raises(ValueError, match="at least one block"):
        pr.PrefixIndex(capacity_blocks=0)


@dataclass
class Pod:  # what Routing.pick reads of a peers.Peer
    url: str
    score: int = 0
    healthy: bool = True
    identity: str | None = "1"


def test_routing_follows_the_prefix_and_forgets_a_pod_that_left_or_restarted():
    routing = pr.Routing(policy="kv-aware", load_margin=2, cache_tokens=10_000)
    pods = [Pod("a"), Pod("b")]
    routing.observe(pods)
    blocks = routing.blocks("s" * 640)
    assert len(blocks) == 10
    first = routing.pick(pods, blocks, now=0)
    assert first.url == "a" and routing.decisions == {"load": 1}
    routing.sent("a", blocks, now=0)
    pods = [Pod("b"), Pod("a", score=1)]  # b is less loaded now: the prefix still wins within the margin
    assert routing.pick(pods, blocks, now=1).url == "a"
    assert routing.decisions == {"load": 1, "prefix": 1} and routing.hit_ratio() == pytest.approx(0.5)
    pods = [Pod("b"), Pod("a", score=1, identity="2")]  # a restarted: its cache is empty
    routing.observe(pods)
    assert routing.pick(pods, blocks, now=2).url == "b"
    routing.sent("a", blocks, now=3)
    routing.observe([Pod("b"), Pod("a", score=1, identity="2", healthy=False)])  # out of rotation: forgotten
    assert routing.index.occupancy("a") == 0
    routing.sent("a", blocks, now=5)
    routing.observe([Pod("b")])  # no longer listed: forgotten
    assert routing.index.occupancy("a") == 0


@dataclass
class Peer:  # what Routing reads of a peers.Peer, with its slots (0: its probes do not say)
    url: str
    score: int = 0
    slots: int = 0
    healthy: bool = True
    identity: str | None = "1"


def test_routing_times_its_pods_and_prices_them_once_measured():
    routing = pr.Routing(cache_tokens=100_000, pod_slots=4)
    pods = [Peer("a", score=4), Peer("b", score=5), Peer("held", score=6)]  # every slot full
    routing.observe(pods)
    blocks = routing.blocks("s" * 64 * 64)
    routing.sent("held", blocks[:60], now=0)
    # nothing measured: the margin rule, the holder within 2 of the least loaded
    assert routing.pick(pods, blocks, now=1).url == "held" and routing.decisions == {"prefix": 1}
    # one pod timed while it had a free slot (its probes say 8 slots): 8 s an answer, 1 ms a token past
    # a fixed 0.05 s; the pool's timings stand in for the others
    free = Peer("b", score=1, slots=8)
    for n, uncached in enumerate((64, 1024, 256, 512)):
        dispatch = routing.dispatched(free, routing.blocks("t" * 4 * uncached + "u" * n * 64), now=10.0)
        assert not dispatch.queued
        routing.first_token(dispatch, now=10.05 + 0.001 * dispatch.uncached_tokens)
        routing.answered(dispatch, now=18.0)
    assert routing.timings["b"].answer_seconds == pytest.approx(8.0)
    assert routing.pool.prefill_per_token == pytest.approx(0.001)
    assert "a" not in routing.timings and routing.candidate(pods[0], blocks, 2).answer_seconds == 8.0
    # a request that found no free slot says nothing of the pod's speed
    queued = routing.dispatched(pods[2], blocks, now=20.0)
    assert queued.queued and queued.uncached_tokens == 4 * 16
    routing.answered(queued, now=100.0)
    routing.first_token(queued, now=100.0)
    assert "held" not in routing.timings and routing.pool.answer_seconds == pytest.approx(8.0)
    # priced: the holder's 4 s more of wait against 0.96 s of prefill saved
    assert routing.pick(pods, blocks, now=21).url == "a" and routing.decisions["overload"] == 1
    # a queued request's first token says nothing of the prefill, but from it to its end it held its slot,
    # after the prefill expected of its uncached tokens (the pool's line: 0.05 s + 1 ms x 64): counted
    queued = routing.dispatched(pods[2], blocks, now=30.0)
    routing.first_token(queued, now=90.0)
    routing.answered(queued, now=93.0)
    assert routing.timings["held"].answer_seconds == pytest.approx(3.0 + 0.05 + 0.064)
    assert routing.timings["held"].first_tokens == 0 and routing.pool.answers == 5
    assert routing.pool.answer_seconds == pytest.approx(8.0 + 0.2 * (3.114 - 8.0))
    # a pod no longer listed loses its timings (the pool keeps them)
    routing.observe([Peer("a"), Peer("c")])
    assert routing.timings == {} and routing.pool.answers == 5


def test_least_loaded_routing_keeps_no_index_and_bad_knobs_are_refused():
    routing = pr.Routing(policy="least-loaded")
    assert routing.blocks("s" * 640) == []
    with pytest.raises(ValueError, match="expected one of kv-aware, least-loaded"):
        pr.Routing(policy="random")
    with pytest.raises(ValueError, match="load margin -1"):
        pr.Routing(load_margin=-1)
    with pytest.raises(ValueError, match="cache tokens 0"):
        pr.Routing(cache_tokens=0)
    with pytest.raises(ValueError, match=r"pod slots -1: expected 0 \(unknown\) or more"):
        pr.Routing(pod_slots=-1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/m", "--routing", "least-loaded"], "--routing: for --role router, not unified"),
        (
            ["--model", "/m", "--role", "decode", "--routing-load-margin", "1"],
            "for --role router, not decode",
        ),
        (["--role", "router", "--unified", "http://a:1", "--routing-load-margin", "-1"], r"\(0 or more\)"),
        (["--role", "router", "--unified", "http://a:1", "--routing-cache-tokens", "0"], r"\(1 or more\)"),
        (["--role", "router", "--unified", "http://a:1", "--routing-pod-slots", "-1"], "unknown, or more"),
    ],
)
def test_routing_flags_off_a_router_or_out_of_range_are_refused(argv, message):
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(pydantic.ValidationError, match=message):
        ServeConfig.from_namespace(args)


def test_a_bad_policy_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["serve", "--role", "router", "--unified", "http://a:1", "--routing", "random"]
        )
    assert "invalid choice: 'random' (choose from 'kv-aware', 'least-loaded')" in capsys.readouterr().err


CONVERSATION = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And of "}, {"type": "text", "text": "Italy?"}]},
]


@pytest.mark.real_model
def test_a_front_doors_token_ids_are_what_hugging_faces_chat_template_gives(smollm2_dir):
    """The contract with the pods' side: a front door with the model's tokenizer cuts a request into the
    token ids the pods compute and cache for it, the ids Hugging Face's `apply_chat_template` gives (what
    vLLM renders a chat with, and our engine too); a completion's prompt and TGI's inputs as the tokenizer
    encodes them. So the blocks it names are the blocks the pods' KV-cache events name."""
    from transformers import AutoTokenizer

    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    ours, theirs = Tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [{**m, "content": "And of Italy?"} if isinstance(m["content"], list) else m for m in CONVERSATION]
    for turns in (CONVERSATION[1:2], CONVERSATION[:2], CONVERSATION):
        body = json.dumps({"model": "m", "messages": turns}).encode()
        messages = texts if turns is CONVERSATION else turns  # (HF's template takes text contents)
        want = theirs.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert pr.prompt_ids("/v1/chat/completions", body, ours) == list(want)
    prompt = "The capital of France is"
    completion = json.dumps({"model": "m", "prompt": prompt}).encode()
    assert pr.prompt_ids("/v1/completions", completion, ours) == theirs(prompt)["input_ids"]
    generate = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": 4}}).encode()
    assert pr.prompt_ids("/generate", generate, ours) == theirs(prompt)["input_ids"]
    assert pr.prompt_ids("/v1/completions", json.dumps({"prompt": [5, 6, 7]}).encode(), ours) == [5, 6, 7]
    # a request a pod would refuse, or that is not one, has no ids: it is routed by load alone
    refused = json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}).encode()
    assert pr.prompt_ids("/v1/chat/completions", refused, ours) is None
    assert pr.prompt_ids("/v1/chat/completions", b"{not json", ours) is None
    assert pr.prompt_ids("/v1/models", b"", ours) is None
    # a conversation's next turn starts with the blocks of its earlier turns
    routing = pr.Routing(by_tokens=True)
    first = routing.blocks(pr.prompt_ids("/v1/chat/completions", json.dumps(
        {"messages": CONVERSATION[:2]}).encode(), ours))  # fmt: skip
    later = routing.blocks(pr.prompt_ids("/v1/chat/completions", json.dumps(
        {"messages": CONVERSATION}).encode(), ours))  # fmt: skip
    assert first and later[: len(first) - 1] == first[:-1]


@pytest.mark.real_model
@pytest.mark.parametrize("where", ["chat_template.jinja", "named templates"])
def test_the_chat_template_is_found_where_hugging_face_finds_it(smollm2_dir, tmp_path, where):
    """A chat_template.jinja file outranks tokenizer_config.json's template (as transformers loads them), and
    a list of named templates gives the one named default: the rendering equals transformers'."""
    import shutil

    from transformers import AutoTokenizer

    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(smollm2_dir / name, folder / name)
    template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    if where == "chat_template.jinja":
        (folder / "chat_template.jinja").write_text(template)
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = [{"name": "tool_use", "template": "{{ 'unused' }}"},
                                   {"name": "default", "template": template}]  # fmt: skip
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    messages = [m for m in CONVERSATION if isinstance(m["content"], str)]
    want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages) == want and want.startswith("[system] You answer")
