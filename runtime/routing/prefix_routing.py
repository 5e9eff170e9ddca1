"""KV-cache-aware routing, pure: which pod a request goes to, from how much of its prompt each pod is expected
to hold in its prefix cache and from each pod's load.

What a pod holds (approximate: learnt from what this router sent where, so it works for every engine): a
prompt is cut into blocks (BLOCK_TOKENS token ids where the router tokenizes, else BLOCK_CHARS characters of
its canonical text, `prompt_text`), each named by a chained hash (a block's name covers every block before
it, so one lookup per block says how long a prefix a pod holds). `PrefixIndex` keeps per pod an LRU of block
names, bounded by the pod's cache (`capacity_blocks`) and aged out after `ttl` seconds; a pod that left the
rotation or restarted (a new identity) starts empty.

The policy (`choose`, policy `kv-aware`): among the pods a router may send the request to, the least loaded
sets the floor; a pod more than `load_margin` requests above it is passed over (overloaded); of the rest, the
one holding the longest prefix wins (ties: the lower load, then the load ranking's order). With no pod holding
a block of it, or only overloaded ones, the least loaded wins. Each decision has a reason: `prefix` (a held
prefix chose the pod), `load` (no pod held any of it), `overload` (the pods holding it were too busy). Policy
`least-loaded` always takes the least loaded pod (reason `load`).
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from neuronfleet.contract import ROUTING_CACHE_TOKENS, ROUTING_LOAD_MARGIN, RoutingPolicy
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
            return tokenizer.encode_chat(parse_openai_chat(request).messages)
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


@dataclass(frozen=True)
class Candidate:
    """A pod the request may go to: its load (running and waiting requests, with this router's own since its
    last probe) and how many leading blocks of the request it is expected to hold."""

    pod: str
    load: int
    held: int


def choose(candidates: Sequence[Candidate], policy: str, load_margin: int) -> tuple[int, str]:
    """Which candidate takes the request (an index into `candidates`, which come least loaded first as the
    load ranking orders them) and why (REASONS)."""
    if not candidates:
        raise ValueError("no candidate pod")
    if policy == "least-loaded" or not any(c.held for c in candidates):
        return 0, "load"
    floor = min(c.load for c in candidates)
    within = [i for i, c in enumerate(candidates) if c.held and c.load <= floor + load_margin]
    if not within:
        return 0, "overload"
    return max(within, key=lambda i: (candidates[i].held, -candidates[i].load, -i)), "prefix"


@dataclass
class Routing:
    """A router's routing for one role's pods: the policy, its knobs and the prefix index, and what it
    decided (`decisions` by reason; `blocks_asked` and `blocks_held` over every request with a prompt).
    `dataclasses.replace` makes another with the same knobs and nothing learnt."""

    policy: str = "kv-aware"
    load_margin: int = ROUTING_LOAD_MARGIN
    cache_tokens: int = ROUTING_CACHE_TOKENS
    ttl: float = TTL_SECONDS
    by_tokens: bool = False  # blocks of token ids (the router tokenizes), else of characters
    decisions: Counter = field(init=False, default_factory=Counter)
    blocks_asked: int = field(init=False, default=0)
    blocks_held: int = field(init=False, default=0)
    identities: dict[str, str | None] = field(init=False, default_factory=dict)
    events: Any = field(init=False, default=None)  # kv_event_index.Subscriptions, for pods that publish

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
        if self.load_margin < 0:
            raise ValueError(f"routing load margin {self.load_margin}: expected 0 or more requests")
        if self.cache_tokens < 1:
            raise ValueError(f"routing cache tokens {self.cache_tokens}: expected 1 or more")
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

    def pick(self, ranked: Sequence[Any], blocks: Sequence[int], now: float) -> Any:
        """Of pods in the load ranking's order (`peers.Peer`: url, score), the one to send a request of these
        blocks to; counted by reason."""
        candidates = [Candidate(p.url, p.score, self.held(p.url, blocks, now)) for p in ranked]
        index, reason = choose(candidates, self.policy, self.load_margin)
        self.decisions[reason] += 1
        if blocks:
            self.blocks_asked += len(blocks)
            self.blocks_held += candidates[index].held
        return ranked[index]

    def sent(self, pod: str, blocks: Sequence[int], now: float) -> None:
        if blocks:
            self.index.sent(pod, blocks, now)

    def hit_ratio(self) -> float:
        """The share of requested prompt blocks the chosen pods were expected to hold, since the start."""
        return self.blocks_held / self.blocks_asked if self.blocks_asked else 0.0


class RoutingMetrics:
    """A Prometheus collector of a router's routing, per role: decisions by reason, prompt blocks asked and
    held (their ratio too), and each pod's expected cache occupancy in blocks."""

    def __init__(self, model_name: str, routings: dict[str, Routing]) -> None:
        self.model_name, self.routings = model_name, routings

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels, name = ["model_name", "role"], "neuronfleet:router_"
        decisions = CounterMetricFamily(
            name + "routing_decisions", "Requests routed, by reason: prefix (a held prefix chose the pod), "
            "load (no pod held any of it), overload (the pods holding it were too busy).",
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
        for role, routing in self.routings.items():
            for reason in REASONS:
                decisions.add_metric([self.model_name, role, reason], routing.decisions[reason])
            asked.add_metric([self.model_name, role], routing.blocks_asked)
            held.add_metric([self.model_name, role], routing.blocks_held)
            ratio.add_metric([self.model_name, role], routing.hit_ratio())
            published = routing.events.pods if routing.events is not None else {}
            for pod in sorted({*routing.index.pods, *published}):
                cached.add_metric([self.model_name, role, pod], routing.occupancy(pod))
        yield from (decisions, asked, held, ratio, cached)
