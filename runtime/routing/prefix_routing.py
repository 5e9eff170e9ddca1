"""KV-cache-aware routing, pure: which pod a request goes to, from how much of its prompt each pod is expected
to hold in its prefix cache, each pod's load and slots, and how fast the router has measured it to be.

What a pod holds (approximate: learnt from what this router sent where, so it works for every engine): a
prompt is cut into blocks (BLOCK_TOKENS token ids where the router tokenizes, else BLOCK_CHARS characters of
its canonical text, `prompt_text`), each named by a chained hash (a block's name covers every block before
it, so one lookup per block says how long a prefix a pod holds). `PrefixIndex` keeps per pod an LRU of block
names, bounded by the pod's cache (`capacity_blocks`) and aged out after `ttl` seconds; a pod that left the
rotation or restarted (a new identity) starts empty.

The policy (`choose`, policy `kv-aware`) prices each candidate pod: its expected time to first token is the
expected wait for a slot plus the prefill of the prompt's blocks it does not hold plus what the requests
running on it add (`expected_ttft`), from its load, its slots and its measured timings (`PodTimings`: seconds
a request holds a slot, prefill seconds per token, seconds per request running beside); the lowest wins. Ties
(the least loaded of the pods with a free slot within NEAR_TIE of the lowest cost, or, unpriced, the least
loaded where no pod holds any of it; of those, the emptiest caches) go to the prompt's home pod: a rendezvous
hash of its first block no pod holds, so a conversation that every cache dropped goes back where it was, not
to a pod measured a little faster. Until a pod has timings the pool's stand in; where a cost cannot be priced
(no timings yet, or a pod's slots unknown) the old rule decides: a pod more than `load_margin` requests above
the least loaded is passed over, of the rest the one holding the longest prefix wins. Each decision has a
reason: `prefix` (a pod holding the longest prefix was chosen), `load` (no pod held any of it), `overload` (a
pod held more of it but its wait, or slower prefill, priced it out; by the old rule: it was over the margin).
Policy `least-loaded` always takes the least loaded pod (reason `load`).
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from neuronfleet.contract import ROUTING_CACHE_TOKENS, ROUTING_LOAD_MARGIN, RoutingPolicy
from neuronfleet.runtime.engine import admission
from neuronfleet.runtime.serving.api_requests import (
    decode_json,
    parse_openai_chat,
    parse_openai_completion,
    parse_tgi_generate,
)
from neuronfleet.runtime.serving.errors import InvalidRequest

POLICIES = get_args(RoutingPolicy)
BLOCK_TOKENS = 16  # token ids per block where the router tokenizes (the engines' own block size)
BLOCK_CHARS = 64  # characters per block of a prompt's text (about 16 tokens of English)
CHARS_PER_TOKEN = 4  # for a cache given in tokens, held as blocks of characters
TTL_SECONDS = 600.0  # what a pod was sent this long ago is assumed gone from its cache
REASONS = ("prefix", "load", "overload")
# expected times to first token within this share of the lowest are a tie (the spread of a pod's measured
# timings on a busy machine): a pod measured faster by less than that does not take a prompt from its home
NEAR_TIE = 0.25


def chained(blocks: Iterable[bytes], parent: int | None = None) -> list[int]:
    """The blocks' names: each an 8-byte hash of the previous name (the parent's, for the first; none at a
    prompt's start) and the block."""
    names, previous = [], b"" if parent is None else parent.to_bytes(8, "little")
    for block in blocks:
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        names.append(int.from_bytes(previous, "little"))
    return names


def token_blocks(ids: Sequence[int], size: int = BLOCK_TOKENS, parent: int | None = None) -> list[int]:
    """The names of a token sequence's whole blocks (a part-filled last block is not cached as a block),
    following the block named `parent` (None: the sequence starts a prompt)."""
    whole = len(ids) - len(ids) % size
    return chained((struct.pack(f"<{size}q", *ids[i : i + size]) for i in range(0, whole, size)), parent)


def text_blocks(text: str, size: int = BLOCK_CHARS) -> list[int]:
    """The names of a text's whole blocks of `size` characters."""
    whole = len(text) - len(text) % size
    return chained(text[i : i + size].encode() for i in range(0, whole, size))


def prompt_text(path: str, body: bytes) -> str | None:
    """A request's prompt as one canonical text, the same for the same prompt however it is sent: a chat's
    messages in order, each as `<role>content` with a part list's texts joined (a conversation's next turn
    starts with its earlier turns' text); a completion's prompt; TGI's `inputs`. None for a body that is not
    such a request (it is routed by load alone)."""
    try:
        request = decode_json(body)
    except InvalidRequest:
        return None
    if not isinstance(request, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = request.get("messages")
        if not isinstance(messages, list):
            return None
        return "".join(
            f"<{m.get('role', '')}>{_content(m.get('content'))}\n" for m in messages if isinstance(m, dict)
        )
    if path.endswith("/completions"):
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:  # one prompt in a list
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):  # token ids
            return " ".join(map(str, prompt))
        return prompt if isinstance(prompt, str) else None
    if path in ("/generate", "/generate_stream") or path == "/":
        inputs = request.get("inputs")
        return inputs if isinstance(inputs, str) else None
    return None


def prompt_ids(path: str, body: bytes, tokenizer: Any) -> list[int] | None:
    """A request's prompt as the token ids a serving pod computes and caches for it (`tokenizer`: the
    model's, `serving.tokenizer.Tokenizer`): a chat's messages through the model's chat template, as the
    pods render it (Hugging Face's `apply_chat_template`: vLLM's and ours); a completion's prompt or TGI's
    `inputs` encoded with the special tokens. What KV-cache events name. None for a body that is not such a
    request, or one a pod would refuse (it is routed by load alone, and refused there)."""
    try:
        request = decode_json(body)
        if path.endswith("/chat/completions"):
            chat = parse_openai_chat(request)
            return tokenizer.encode_chat(chat.messages, tools=chat.tools.functions if chat.tools else None)
        if path.endswith("/completions"):
            prompt = parse_openai_completion(request).prompt
        elif path in ("/generate", "/generate_stream", "/"):
            prompt = parse_tgi_generate(request).prompt
        else:
            return None
    except (ValueError, TypeError, LookupError):  # (a refused request's InvalidRequest is a ValueError)
        return None
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return list(prompt) if prompt is not None else None


def request_prompt(path: str, body: bytes, tokenizer: Any = None) -> str | list[int] | None:
    """What a router cuts a request's blocks from: its token ids as the pods compute them where the router
    has the model's tokenizer (`prompt_ids`), else its canonical text (`prompt_text`)."""
    return prompt_text(path, body) if tokenizer is None else prompt_ids(path, body, tokenizer)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the texts, in order
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


class PrefixIndex:
    """Per pod, the block names it is expected to hold: an LRU of at most `capacity_blocks`, each aged out
    `ttl` seconds after it was last sent there. Times are the caller's (monotonic seconds)."""

    def __init__(self, capacity_blocks: int, ttl: float = TTL_SECONDS) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a pod's prefix cache holds at least one block (got {capacity_blocks})")
        self.capacity, self.ttl = capacity_blocks, ttl
        self.pods: dict[str, OrderedDict[int, float]] = {}

    def held(self, pod: str, blocks: Sequence[int], now: float) -> int:
        """How many leading blocks of a prompt the pod is expected to hold."""
        entry = self.pods.get(pod)
        n = 0
        if entry:
            for name in blocks:
                sent = entry.get(name)
                if sent is None or now - sent > self.ttl:
                    break
                n += 1
        return n

    def sent(self, pod: str, blocks: Sequence[int], now: float) -> None:
        """The pod was sent a prompt of these blocks: it holds them now. The first blocks are marked most
        recent (touched last), so the LRU drops a long prompt's tail before the prefix that others share."""
        entry = self.pods.setdefault(pod, OrderedDict())
        for name in reversed(blocks):
            entry[name] = now
            entry.move_to_end(name)
        while len(entry) > self.capacity:
            entry.popitem(last=False)
        while entry and now - next(iter(entry.values())) > self.ttl:
            entry.popitem(last=False)

    def forget(self, pod: str) -> None:
        self.pods.pop(pod, None)

    def occupancy(self, pod: str) -> int:
        """Blocks the pod is expected to hold."""
        return len(self.pods.get(pod) or ())


EWMA_WEIGHT = 0.2  # a new measurement's weight in a pod's timings (about the last 5 to 10 requests)


@dataclass
class PodTimings:
    """One pod's (or the pool's) measured timings, as exponentially weighted moving averages (pure; the
    routers feed them). `answered(seconds)`: a request that found a free slot held it this long, from when it
    was sent to its answer's end (`answer_seconds`). `first_token(seconds, uncached_tokens, load)`: a request
    that found a free slot had its first token this long after it was sent, with this many prompt tokens not
    held by the pod and `load` other requests on it. Those are fitted with a weighted least-squares plane:
    time to first token = fixed + prefill_per_token x uncached tokens + contention x load. So the fixed part
    of each request (the connection, scheduling, a first decode step) is its intercept, not counted as
    prefill, and `contention` is what each request already on the pod adds (a free slot is not free compute:
    the pod's running requests share its steps, and a prompt waits for the one being prefilled). While the
    loads seen are all about the same (spread under one request) the contention is unknown (None) and the
    line through uncached tokens alone stands in; while the uncached counts are all about the same (spread
    under a block) the slope is unknown and the ratio of the means stands in (an upper bound: it counts the
    fixed part as prefill). A slope the fit finds below 0 (noise) is taken as 0 and the other refitted
    alone."""

    weight: float = EWMA_WEIGHT
    answers: int = 0
    answer_seconds: float | None = None
    first_tokens: int = 0
    # EW means of uncached tokens (x), the load (l), seconds to first token (y), their squares and products
    _x: float = field(init=False, default=0.0)
    _l: float = field(init=False, default=0.0)
    _y: float = field(init=False, default=0.0)
    _xx: float = field(init=False, default=0.0)
    _ll: float = field(init=False, default=0.0)
    _xl: float = field(init=False, default=0.0)
    _xy: float = field(init=False, default=0.0)
    _ly: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"an EWMA weight is in (0, 1] (got {self.weight})")

    def answered(self, seconds: float) -> None:
        if seconds < 0:
            return
        self.answers += 1
        a = self.answer_seconds
        self.answer_seconds = seconds if a is None else a + self.weight * (seconds - a)

    def first_token(self, seconds: float, uncached_tokens: int, load: int = 0) -> None:
        if seconds < 0 or uncached_tokens < 0 or load < 0:
            return
        x, n, y = float(uncached_tokens), float(load), seconds
        w = 1.0 if not self.first_tokens else self.weight
        self.first_tokens += 1
        for name, value in (("_x", x), ("_l", n), ("_y", y), ("_xx", x * x), ("_ll", n * n), ("_xl", x * n),
                            ("_xy", x * y), ("_ly", n * y)):  # fmt: skip
            mean = getattr(self, name)
            setattr(self, name, mean + w * (value - mean))

    def _plane(self) -> tuple[float, float, float | None] | None:
        """The fitted (fixed seconds, seconds per uncached token, seconds per request on the pod or None where
        the loads seen do not vary); None before any first token was timed, or where the ratio of the means
        has no tokens to stand on."""
        if not self.first_tokens:
            return None
        sxx, sll = self._xx - self._x * self._x, self._ll - self._l * self._l
        sxl, sxy, sly = (
            self._xl - self._x * self._l,
            self._xy - self._x * self._y,
            self._ly - self._l * self._y,
        )
        tokens_vary, loads_vary = sxx >= BLOCK_TOKENS * BLOCK_TOKENS, sll >= 0.25  # a block; a request
        if tokens_vary and loads_vary and (det := sxx * sll - sxl * sxl) > 1e-9 * sxx * sll:
            slope, contention = (sll * sxy - sxl * sly) / det, (sxx * sly - sxl * sxy) / det
            if slope >= 0 and contention >= 0:
                return self._y - slope * self._x - contention * self._l, slope, contention
            if slope < 0:  # (noise) no prefill cost seen: the load alone
                contention = max(0.0, sly / sll)
                return self._y - contention * self._l, 0.0, contention
            slope = max(0.0, sxy / sxx)  # no contention seen (0): the tokens alone
            return self._y - slope * self._x, slope, 0.0
        if tokens_vary:
            slope = max(0.0, sxy / sxx)
            return self._y - slope * self._x, slope, None
        return (0.0, self._y / self._x, None) if self._x > 0 else None

    def first_token_seconds(self, uncached_tokens: int, load: int = 0) -> float | None:
        """The expected seconds from sending a request that finds a free slot to its first token, with this
        many uncached prompt tokens and `load` requests on the pod (the fitted plane: its fixed part, its
        prefill and its contention); None before any was timed."""
        plane = self._plane()
        if plane is None:
            return None
        fixed, per_token, contention = plane
        return max(0.0, fixed + per_token * uncached_tokens + (contention or 0.0) * load)

    @property
    def prefill_per_token(self) -> float | None:
        """Prefill seconds per uncached prompt token; None before any first token was timed."""
        plane = self._plane()
        return None if plane is None else plane[1]

    @property
    def contention(self) -> float | None:
        """Seconds each request already on the pod adds to a new one's first token; None until measured."""
        plane = self._plane()
        return None if plane is None else plane[2]


@dataclass(frozen=True)
class Candidate:
    """A pod the request may go to: its load (running and waiting requests, with this router's own since its
    last probe), how many leading blocks of the request it is expected to hold, its slots (0: unknown), its
    timings (None: not measured): seconds a request holds a slot, prefill seconds per token, seconds each
    request running on it adds to a new one's first token (`contention`); how many blocks it is expected to
    hold in all (`cached`: its cache's fill) and at most (`capacity`; 0: unknown)."""

    pod: str
    load: int
    held: int
    slots: int = 0
    answer_seconds: float | None = None
    prefill_per_token: float | None = None
    cached: int = 0
    contention: float | None = None
    capacity: int = 0


def expected_wait(load: int, slots: int, answer_seconds: float | None) -> float | None:
    """Seconds a request sent now waits for a slot of a pod with `load` requests and `slots` slots, each
    request holding its slot `answer_seconds` on average: none while a slot is free; else it is the
    (load - slots + 1)-th in line, and the pod's slots free one every answer_seconds / slots seconds on
    average (each slot once per answer_seconds), so it waits (load - slots + 1) x answer_seconds / slots, as
    a pod's own admission estimates it (`admission.expected_wait`). None where the slots, or the timing of a
    full pod, are unknown."""
    if slots <= 0:
        return None
    if load < slots:
        return 0.0
    if answer_seconds is None:
        return None
    return admission.expected_wait(load, slots, answer_seconds)


def expected_ttft(candidate: Candidate, blocks: int) -> float | None:
    """A candidate's expected cost of a prompt of `blocks` whole blocks, in seconds: its time to first token
    (the wait for a slot, the prefill of the blocks it does not hold, BLOCK_TOKENS tokens each: a block of
    text is as many tokens, BLOCK_CHARS / CHARS_PER_TOKEN, and the contention of the requests it will run
    beside: those running on it, at most its other slots' worth, where measured), and, where its cache is
    full, the prefill of the blocks the new ones push out (`evicted`: what it holds for other prompts is
    computed again when they come back, taken to come back as often as this one does). The tokens past the
    last whole block are the same on every pod and left out. None where it cannot be priced."""
    wait = expected_wait(candidate.load, candidate.slots, candidate.answer_seconds)
    if wait is None or candidate.prefill_per_token is None:
        return None
    beside = min(candidate.load, candidate.slots - 1) if candidate.slots > 0 else candidate.load
    uncached = max(0, blocks - candidate.held)
    return (
        wait
        + (uncached + evicted(candidate, uncached)) * BLOCK_TOKENS * candidate.prefill_per_token
        + (candidate.contention or 0.0) * beside
    )


def evicted(candidate: Candidate, stored: int) -> int:
    """Blocks of other prompts a pod drops to store `stored` new ones: those past its capacity (0 where its
    capacity is unknown). At cache pressure a prompt sent away from the pod holding its prefix is stored
    twice, and its copy pushes out another prompt's blocks: so a conversation moves only when the wait it
    leaves behind is worth more than both prefills."""
    if candidate.capacity <= 0:
        return 0
    return max(0, min(stored, candidate.cached + stored - candidate.capacity))


def home_rank(key: int, pod: str) -> int:
    """A pod's rank for a prompt whose first unheld block is named `key` (rendezvous hashing): the highest
    ranked pod is the prompt's home. Every router ranks alike, pods spread prompts evenly, and a pod that
    leaves moves only the prompts it was home to."""
    digest = hashlib.blake2b(key.to_bytes(8, "little") + pod.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def roomiest(candidates: Sequence[Candidate], tied: list[int], blocks: int) -> list[int]:
    """Of tied candidates (indices), those whose caches are the emptiest: holding at most this prompt's
    `blocks` more than the least filled. A prompt no pod holds is a new conversation's or a dropped one's,
    and the cache it lands in keeps it for its next turns: placed on the emptier caches, the pods' caches
    fill evenly and no pod drops what its later turns need while another has room (placed by its home
    alone, 10 conversations on 3 pods put 5 or more on one pod 63% of the time). Where the caches are about
    as full (all of them, at cache pressure), every tied pod stays, and home decides."""
    least = min(candidates[i].cached for i in tied)
    return [i for i in tied if candidates[i].cached <= least + max(blocks, 1)]


def choose(
    candidates: Sequence[Candidate], policy: str, load_margin: int, blocks: int = 0, home: int | None = None
) -> tuple[int, str]:
    """Which candidate takes a request of `blocks` whole prompt blocks (an index into `candidates`, which come
    least loaded first as the load ranking orders them) and why (REASONS). Priced (`expected_ttft`): the
    lowest expected time to first token; where any candidate cannot be priced, the old rule with
    `load_margin` (the module's docstring).

    Ties go to the prompt's home pod (`home_rank` of `home`, the name of the first block no pod holds; None:
    the ranking's order): priced, the pods with a free slot whose cost is within NEAR_TIE of the lowest,
    holding the most of the prompt among them, the least loaded of those (a pod's free slot is not free
    compute: its running requests share the pod's steps, so home never takes load from a less loaded pod),
    the emptiest caches of those (`roomiest`); unpriced, the least loaded where no pod holds any of it, the
    emptiest caches of those. So a
    conversation whose blocks every cache has dropped goes back to the pod it went to before (which may
    still hold them, and holds them alone), instead of to whichever pod measured a few milliseconds faster."""
    if not candidates:
        raise ValueError("no candidate pod")
    if policy == "least-loaded":
        return 0, "load"
    most = max(c.held for c in candidates)
    costs = [expected_ttft(c, max(blocks, most)) for c in candidates]
    if all(cost is not None for cost in costs):
        best = min(range(len(candidates)), key=lambda i: (costs[i], i))
        if home is not None:
            near = [i for i, c in enumerate(candidates)
                    if c.load < c.slots and costs[i] <= costs[best] * (1 + NEAR_TIE)]  # fmt: skip
            if near:
                held = max(candidates[i].held for i in near)
                near = [i for i in near if candidates[i].held == held]
                load = min(candidates[i].load for i in near)
                near = roomiest(candidates, [i for i in near if candidates[i].load == load], blocks)
                best = max(near, key=lambda i: home_rank(home, candidates[i].pod))
        if not most:
            return best, "load"
        return best, "prefix" if candidates[best].held == most else "overload"
    floor = min(c.load for c in candidates)
    if not most:
        least = roomiest(candidates, [i for i, c in enumerate(candidates) if c.load == floor], blocks)
        if home is None:
            return least[0], "load"
        return max(least, key=lambda i: home_rank(home, candidates[i].pod)), "load"
    within = [i for i, c in enumerate(candidates) if c.held and c.load <= floor + load_margin]
    if not within:
        return 0, "overload"
    return max(within, key=lambda i: (candidates[i].held, -candidates[i].load, -i)), "prefix"


@dataclass
class Dispatch:
    """A request a router sent to a pod (`Routing.dispatched`), for its timings: when, with how many prompt
    tokens the pod was not expected to hold, whether it found no free slot, the pod's load when it was sent,
    and when its first token came.
    A queued request's time to first token includes its wait, so it says nothing of the pod's prefill and is
    not counted; the time it held its slot is counted: from its first token to its end, plus the prefill
    expected before it (`PodTimings.first_token_seconds`). At saturation, where nearly every request queues,
    that keeps a pod's answer time current, which the waits are priced with."""

    pod: str
    at: float
    uncached_tokens: int
    queued: bool
    load: int = 0  # the pod's requests when it was sent (not counting it)
    first_at: float | None = None


@dataclass
class Routing:
    """A router's routing for one role's pods: the policy, its knobs and the prefix index, the pods' timings
    (`timings` per pod, `pool` over them all: what stands in for a pod not measured yet), and what it decided
    (`decisions` by reason; `blocks_asked` and `blocks_held` over every request with a prompt). `pod_slots`:
    a pod's slots where its probes do not say them (the front door's pods; 0: unknown). The router times its
    requests: `dispatched` when one is sent, `first_token` and `answered` as its answer comes.
    `dataclasses.replace` makes another with the same knobs and nothing learnt."""

    policy: str = "kv-aware"
    load_margin: int = ROUTING_LOAD_MARGIN
    cache_tokens: int = ROUTING_CACHE_TOKENS
    ttl: float = TTL_SECONDS
    by_tokens: bool = False  # blocks of token ids (the router tokenizes), else of characters
    pod_slots: int = 0
    decisions: Counter = field(init=False, default_factory=Counter)
    blocks_asked: int = field(init=False, default=0)
    blocks_held: int = field(init=False, default=0)
    identities: dict[str, str | None] = field(init=False, default_factory=dict)
    events: Any = field(init=False, default=None)  # kv_event_index.Subscriptions, for pods that publish
    timings: dict[str, PodTimings] = field(init=False, default_factory=dict)
    pool: PodTimings = field(init=False, default_factory=PodTimings)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
        if self.load_margin < 0:
            raise ValueError(f"routing load margin {self.load_margin}: expected 0 or more requests")
        if self.cache_tokens < 1:
            raise ValueError(f"routing cache tokens {self.cache_tokens}: expected 1 or more")
        if self.pod_slots < 0:
            raise ValueError(f"routing pod slots {self.pod_slots}: expected 0 (unknown) or more")
        per_block = BLOCK_TOKENS if self.by_tokens else BLOCK_CHARS / CHARS_PER_TOKEN
        self.index = PrefixIndex(max(1, int(self.cache_tokens / per_block)), self.ttl)

    def blocks(self, prompt: str | Sequence[int] | None) -> list[int]:
        """A prompt's block names ([] for none, or under policy least-loaded, which needs none)."""
        if prompt is None or self.policy == "least-loaded":
            return []
        return token_blocks(prompt) if self.by_tokens else text_blocks(prompt)  # type: ignore[arg-type]

    def observe(self, peers: Iterable[Any]) -> None:
        """What it knew of a pod (`peers.Peer`: url, identity, healthy) out of rotation or restarted (a new
        identity) is dropped, and of one no longer listed."""
        seen = set()
        for peer in peers:
            seen.add(peer.url)
            if not peer.healthy or self.identities.get(peer.url, peer.identity) != peer.identity:
                self.index.forget(peer.url)
            self.identities[peer.url] = peer.identity
        for url in [u for u in self.index.pods if u not in seen]:
            self.index.forget(url)
            self.identities.pop(url, None)
        for url in [u for u in self.timings if u not in seen]:
            del self.timings[url]
        if self.events is not None:
            for url in [u for u in self.events.pods if u not in seen]:
                self.events.forget(url)

    def _published(self, pod: str) -> Any:
        """What the pod's KV-cache events say it holds (`kv_event_index.PodBlocks`), once they have said
        anything; else None (learnt from what this router sent it)."""
        published = self.events.pods.get(pod) if self.events is not None else None
        return published if published is not None and published.batches else None

    def held(self, pod: str, blocks: Sequence[int], now: float) -> int:
        """How many leading blocks the pod holds: as its KV-cache events say where it publishes them, else
        as learnt from what this router sent it."""
        published = self._published(pod)
        return published.held(blocks) if published is not None else self.index.held(pod, blocks, now)

    def occupancy(self, pod: str) -> int:
        """Blocks the pod holds (as `held` knows it)."""
        published = self._published(pod)
        return len(published.names) if published is not None else self.index.occupancy(pod)

    def slots(self, peer: Any) -> int:
        """A pod's slots: as its probes say (`peers.Peer.slots`), else `pod_slots` (0: unknown)."""
        return getattr(peer, "slots", 0) or self.pod_slots

    def candidate(self, peer: Any, blocks: Sequence[int], now: float) -> Candidate:
        """What the policy knows of a pod (`peers.Peer`: url, score, slots) for a prompt of these blocks: its
        own timings where measured, else the pool's."""
        own = self.timings.get(peer.url)
        answer = own.answer_seconds if own is not None and own.answers else self.pool.answer_seconds
        timed = self._prefill_timings(peer.url)
        prefill, contention = timed.prefill_per_token, timed.contention
        return Candidate(peer.url, peer.score, self.held(peer.url, blocks, now), self.slots(peer), answer,
                         prefill if prefill is not None else self.pool.prefill_per_token,
                         self.occupancy(peer.url),
                         contention if contention is not None else self.pool.contention,
                         self.index.capacity)  # fmt: skip

    def _prefill_timings(self, pod: str) -> PodTimings:
        """The timings a pod's prefill is priced with: its own once one of its first tokens was timed, else
        the pool's."""
        own = self.timings.get(pod)
        return own if own is not None and own.first_tokens else self.pool

    def pick(self, ranked: Sequence[Any], blocks: Sequence[int], now: float) -> Any:
        """Of pods in the load ranking's order (`peers.Peer`: url, score, slots), the one to send a request of
        these blocks to; counted by reason."""
        candidates = [self.candidate(p, blocks, now) for p in ranked]
        most = max((c.held for c in candidates), default=0)
        home = blocks[min(most, len(blocks) - 1)] if blocks else None
        index, reason = choose(candidates, self.policy, self.load_margin, len(blocks), home)
        self.decisions[reason] += 1
        if blocks:
            self.blocks_asked += len(blocks)
            self.blocks_held += candidates[index].held
        return ranked[index]

    def sent(self, pod: str, blocks: Sequence[int], now: float) -> None:
        if blocks:
            self.index.sent(pod, blocks, now)

    def dispatched(self, peer: Any, blocks: Sequence[int], now: float) -> Dispatch:
        """A request of these blocks is being sent to the pod now (before the router counts it in flight
        there): what its timings will be read against. It queues where the pod's load fills its known
        slots."""
        slots = self.slots(peer)
        uncached = (len(blocks) - self.held(peer.url, blocks, now)) * BLOCK_TOKENS
        return Dispatch(peer.url, now, uncached, slots > 0 and peer.score >= slots, peer.score)

    def first_token(self, dispatch: Dispatch, now: float) -> None:
        """The request's first token came now (a stream's, or a prefill pod's whole answer)."""
        dispatch.first_at = now
        if not dispatch.queued:
            for timings in (self.timings.setdefault(dispatch.pod, PodTimings()), self.pool):
                timings.first_token(now - dispatch.at, dispatch.uncached_tokens, dispatch.load)

    def answered(self, dispatch: Dispatch, now: float) -> None:
        """The request's answer ended now: it held its slot since it was sent where it found one free; a
        queued one since its first token, and the prefill before it (where its first token was seen and the
        pod's, or the pool's, prefill is timed)."""
        held = now - dispatch.at
        if dispatch.queued:
            prefill = self._prefill_timings(dispatch.pod).first_token_seconds(dispatch.uncached_tokens)
            if dispatch.first_at is None or prefill is None:
                return
            held = now - dispatch.first_at + prefill
        for timings in (self.timings.setdefault(dispatch.pod, PodTimings()), self.pool):
            timings.answered(held)

    def hit_ratio(self) -> float:
        """The share of requested prompt blocks the chosen pods were expected to hold, since the start."""
        return self.blocks_held / self.blocks_asked if self.blocks_asked else 0.0


class RoutingMetrics:
    """A Prometheus collector of a router's routing, per role: decisions by reason, prompt blocks asked and
    held (their ratio too), each pod's expected cache occupancy in blocks, and the timings the policy prices
    each pod with (where measured: answer, prefill per token, contention)."""

    def __init__(self, model_name: str, routings: dict[str, Routing]) -> None:
        self.model_name, self.routings = model_name, routings

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels, name = ["model_name", "role"], "neuronfleet:router_"
        decisions = CounterMetricFamily(
            name + "routing_decisions", "Requests routed, by reason: prefix (a pod holding the longest "
            "prefix was chosen), load (no pod held any of it), overload (a pod holding more of it was too "
            "busy: its expected wait cost more than the prefill it saves, or it was over the load margin).",
            labels=[*labels, "reason"],
        )  # fmt: skip
        asked = CounterMetricFamily(name + "prefix_blocks_asked", "Prompt blocks of the requests routed.",
                                    labels=labels)  # fmt: skip
        held = CounterMetricFamily(name + "prefix_blocks_held", "Prompt blocks the chosen pods were "
                                   "expected to hold.", labels=labels)  # fmt: skip
        ratio = GaugeMetricFamily(name + "prefix_hit_ratio", "Blocks held over blocks asked, since the "
                                  "router started.", labels=labels)  # fmt: skip
        cached = GaugeMetricFamily(name + "pod_cached_blocks", "Prompt blocks each pod is expected to hold "
                                   "in its prefix cache.", labels=[*labels, "pod"])  # fmt: skip
        answer = GaugeMetricFamily(name + "pod_answer_seconds", "Seconds a request holds a slot of each "
                                   "pod, as this router timed them (moving average).",
                                   labels=[*labels, "pod"])  # fmt: skip
        prefill = GaugeMetricFamily(name + "pod_prefill_seconds_per_token", "Prefill seconds per prompt "
                                    "token each pod did not hold, as this router timed them (moving "
                                    "average).",
                                    labels=[*labels, "pod"])  # fmt: skip
        contention = GaugeMetricFamily(name + "pod_contention_seconds", "Seconds each request running on a "
                                       "pod adds to a new one's time to first token, as this router timed "
                                       "them (moving average).", labels=[*labels, "pod"])  # fmt: skip
        for role, routing in self.routings.items():
            for reason in REASONS:
                decisions.add_metric([self.model_name, role, reason], routing.decisions[reason])
            asked.add_metric([self.model_name, role], routing.blocks_asked)
            held.add_metric([self.model_name, role], routing.blocks_held)
            ratio.add_metric([self.model_name, role], routing.hit_ratio())
            published = routing.events.pods if routing.events is not None else {}
            for pod in sorted({*routing.index.pods, *published}):
                cached.add_metric([self.model_name, role, pod], routing.occupancy(pod))
            for pod, timings in sorted(routing.timings.items()):
                if timings.answer_seconds is not None:
                    answer.add_metric([self.model_name, role, pod], timings.answer_seconds)
                if (per_token := timings.prefill_per_token) is not None:
                    prefill.add_metric([self.model_name, role, pod], per_token)
                if (beside := timings.contention) is not None:
                    contention.add_metric([self.model_name, role, pod], beside)
        yield from (decisions, asked, held, ratio, cached, answer, prefill, contention)
