"""The router role: the model's public endpoint when prefill and decode run in separate pods. It offers the
HTTP server the same `Backend` surface as a local engine (tokenizer, limits, generate...), and runs each
request as the exchange of docs/disaggregation.md: reserve a KV lease on a decode pod, have a prefill pod
run the prompt and push its KV cache into it, then stream the decode pod's tokens.

It knows its peers (`PeerSet`) from URLs or DNS names of headless Services, probes them (`/internal/status`:
identity and load), drops a peer after three failed probes or requests and re-adds it when it answers again,
notices a restart by its new identity, and picks the least loaded pods. The text the client sees is made
here from the decode pods' token ids (`TextOutput`), so when a decode pod fails the request goes on — on
another decode pod, from the prompt plus the tokens already sent — and the client sees one stream; a request
every decode pod failed (a lone decode pod killed mid-stream) is tried again at the next probe rounds, held
while none is ready, until its replacement or restart serves it, within the hold's bound; only when no pod can
serve it does it fail, with a clear error. A resume is a stream that broke after its attempt sent tokens;
`--max-resumes` bounds those, not the attempts that failed before their first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from neuronfleet.runtime.engine import admission
from neuronfleet.runtime.engine.text_output import TextOutput
from neuronfleet.runtime.routing.holding import PROBE_EVERY, Hold
from neuronfleet.runtime.routing.kv_event_index import Subscriptions, advertised
from neuronfleet.runtime.routing.peers import Peer, PeerSet, PeerWatch, resolve_peers
from neuronfleet.runtime.routing.prefix_routing import Routing, RoutingMetrics
from neuronfleet.runtime.serving.backend import FinishReason, Limits, RequestOutput, TokenLogprobs, check_fits
from neuronfleet.runtime.serving.engine_metrics import protocol_info
from neuronfleet.runtime.serving.errors import (
    HandedBack,
    Overloaded,
    ServingError,
    Unavailable,
)
from neuronfleet.runtime.serving.output_constraints import OutputConstraint
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class PeerFailed(Exception):
    """A decode pod failed this attempt (an error answer, a broken stream): the request moves to another."""


class PeerBusy(PeerFailed):
    """The decode pod has no staging region or slot free now (503); another may, or this one soon."""


class StreamBroken(PeerFailed):
    """The decode pod's stream ended before its request finished."""


@dataclasses.dataclass
class RoomWait:
    """How long a request waits for room when every decode pod is full: until `limit` seconds pass in which
    the decode pods make none (no request starts or ends its decode stream, each of which may free a staging
    region or a slot), however long the wait is in all. A fixed deadline would fail requests of a long queue
    that is moving, as on a loaded machine; a wait with no end would hide decode pods that are stuck."""

    limit: float
    since: float  # when the wait began, or when the decode pods last made room
    progress: int  # the count of decode streams started or ended then

    def goes_on(self, now: float, progress: int) -> bool:
        if progress != self.progress:
            self.since, self.progress = now, progress
        return now - self.since < self.limit


class NoPeerAvailable(Unavailable):
    """No decode pod could serve the request (answered as 503)."""


class PeerRefused(ServingError):
    """A peer refused the request itself (400, 413, 422): no other pod would take it either. The client gets
    the peer's status in its API's format (an invalid request: OpenAI 400, TGI 422), the peer's message and
    the field at fault, as a unified pod would answer, never a 500 (which clients retry)."""

    def __init__(self, status: int, message: str, field_name: str | None = None) -> None:
        super().__init__(message)
        self.status, self.field_name = status, field_name
        self.tgi_status = 422 if status == 400 else status
        self.reason = "body_too_large" if status == 413 else "invalid"  # as the unified server counts them


PASSED_THROUGH = (400, 413, 422)  # a peer's refusals of the request itself: the client's to see and fix


async def _refusal(r: aiohttp.ClientResponse, step: str) -> None:
    """Raise for a peer's answer other than 200: busy (503) is worth another pod, a refusal of the request
    is final (passed through), anything else (401: a token mismatch, 404: not a pod of that role) is the
    peer's failure."""
    if r.status == 200:
        return
    try:
        body = await r.json()
        error, param = body.get("error"), body.get("param")
    except (ValueError, AttributeError, aiohttp.ContentTypeError):
        error, param = await r.text(), None
    if r.status == 503:
        raise PeerBusy(f"{step} answered 503: {error}")
    if r.status in PASSED_THROUGH:
        raise PeerRefused(r.status, str(error), param if isinstance(param, str) else None)
    raise PeerFailed(f"{step} answered {r.status}: {error}")


class RemoteBackend:
    """A backend whose requests run on prefill and decode peers."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int],
        limits: Limits,
        prefill: Sequence[str],
        decode: Sequence[str],
        token: str,
        *,
        probe_interval: float = 2.0,
        kv_timeout: float = 30.0,
        peer_timeout: float = 60.0,
        busy_timeout: float = 30.0,
        local_prefill_below: int = 0,
        hold_requests: int = 0,
        hold_seconds: float = 300.0,
        wake_url: str | None = None,
        routing: Routing | None = None,
        max_resumes: int = 2,
        max_queue_wait: float = 0.0,
    ) -> None:
        """`kv_timeout`: how long a prefill and its push may take; `peer_timeout`: the longest silence within
        a decode pod's stream, or before a peer answers a status probe, before it counts as failed (a busy
        peer is slow, not gone: refused connections fail at once); `busy_timeout`: how long a request waits
        for a decode pod with room when all are full and none makes room (`RoomWait`); prompts shorter than
        `local_prefill_below` tokens are prefilled on their decode pod (a handoff costs more than it saves for
        them); `hold_requests`, `hold_seconds`, `wake_url`: requests held while no decode pod is ready
        (`holding.Hold`; 0: none); `routing`: how a prefill pod is chosen (by the prompt's token blocks: a
        pod that holds a prefix prefills only the rest; decode pods by load, as they receive the whole KV
        cache); `max_queue_wait`: the longest a request may be expected to wait for a decode slot (0: no
        bound): past it it is refused at once, and one that has waited that long for room is refused then
        (`Overloaded`, with Retry-After; `admission`, from the decode pods' slots and the decode streams'
        durations measured here)."""
        if not prefill or not decode:
            raise ValueError("--role router needs at least one --prefill and one --decode peer URL")
        self.tokenizer, self.eos_ids, self.limits = tokenizer, eos_ids, limits
        resolve_peers([*prefill, *decode])  # malformed specs fail at start-up
        self.prefill, self.decode = PeerSet("prefill", prefill), PeerSet("decode", decode)
        self.routing = dataclasses.replace(routing or Routing(), by_tokens=True)
        self.subscriptions = Subscriptions(secret=token)  # prefill pods that publish KV-cache events
        self.routing.events = self.subscriptions
        auth = {"Authorization": f"Bearer {token}"}
        self.watch = PeerWatch((self.prefill, self.decode), self._probe, probe_interval, headers=auth)
        self.kv_timeout = kv_timeout
        self.peer_timeout, self.busy_timeout = peer_timeout, busy_timeout
        self.local_prefill_below = local_prefill_below
        self.max_resumes = max_resumes  # the most times one request's stream moves to another decode pod
        self.decode_progress = 0  # decode streams seen starting or ending: each may free a region or a slot
        self.max_queue_wait = max_queue_wait
        self.service = admission.ServiceTimes()  # seconds a decode stream held its slot, lately
        self._decoding: dict[str, float] = {}  # decode streams now: attempt id -> when it started
        self.hand_back_from: float | None = None  # (monotonic) while draining: when waiting ones go back
        self.error: BaseException | None = None
        self.stages = {"reserve": 0, "prefill": 0, "decode": 0}  # requests in each step of the exchange now
        self.in_flight = 0
        self.retries: Counter | None = None
        self._ids = itertools.count()
        self.hold = Hold(hold_requests, hold_seconds, wake_url=wake_url, wake_token=token, role="decode",
                         ready=lambda: self.decode.ready > 0, refresh=self.watch.refresh)  # fmt: skip

    # ---- the backend surface the HTTP server uses ----

    @property
    def alive(self) -> bool:
        """Ready to serve: some decode pod is in rotation (until then the router's /ready says no, so the
        Service sends it nothing), or always with holding (requests at zero wait for a decode pod)."""
        return self.watch.running and (self.decode.healthy > 0 or self.hold.enabled)

    @property
    def num_requests(self) -> int:
        return self.in_flight

    @property
    def num_pending(self) -> int:
        return self.stages["reserve"]

    def load_gauges(self) -> list[tuple[str, str, Callable[[], float]]]:
        """The gauges an inference gateway's endpoint picker reads (docs/gateway.md), for a router: running:
        requests routed and not finished that are past both of these; waiting: those held at zero or
        reserving a slot on a decode pod; KV usage: the mean of its decode pods' at their last probes."""
        return [
            ("vllm:num_requests_running", "Requests routed and not finished, past the hold and the reserve.",
             lambda: self.in_flight - self.hold.held - self.stages["reserve"]),
            ("vllm:num_requests_waiting", "Requests held or finding a decode pod.",
             lambda: self.hold.held + self.stages["reserve"]),
            ("vllm:kv_cache_usage_perc", "Mean share of KV cache in use on the decode pods (1 = full).",
             self.decode.kv_usage),
        ]  # fmt: skip

    def register_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        """The router's own metrics: its queue by step, healthy peers and restarts by role, retries."""
        labels = {"model_name": model_name}
        stage = Gauge(
            "neuronfleet:router_requests",
            "Requests in each step of the exchange (reserve: finding a decode pod; prefill: being prefilled "
            "and pushed; decode: streaming).",
            ["model_name", "stage"],
            registry=registry,
        )
        for name in self.stages:
            stage.labels(**labels, stage=name).set_function(lambda name=name: self.stages[name])
        restarts = Gauge(
            "neuronfleet:router_peer_restarts", "Peers seen back with a new identity, by role.",
            ["model_name", "role"], registry=registry,
        )  # fmt: skip
        self.watch.register_metrics(registry, model_name)
        for peers in (self.prefill, self.decode):
            restarts.labels(**labels, role=peers.role).set_function(lambda p=peers: p.restarts)
        self.retries = Counter(
            "neuronfleet:router_retries",
            "Requests moved to another decode pod, before their stream began (retry) or during it (resume).",
            ["model_name", "kind"],
            registry=registry,
        )
        self._labels = labels
        self.hold.register_metrics(registry, model_name)
        registry.register(RoutingMetrics(model_name, {"prefill": self.routing}))
        protocol_info(registry, model_name, self.limits.slots, self.limits.max_seq_len)  # one decode pod's

    async def start(self, app=None) -> None:
        """Resolve and probe the peers now and every `probe_interval` seconds."""
        await self.watch.start()

    def drain(self, grace_period: float) -> None:
        """The router drains: a request still waiting for a decode slot near the end of `grace_period` (its
        last tenth, at least a second) is handed back (503 with Retry-After) before the router stops."""
        self.hand_back_from = time.monotonic() + grace_period - max(1.0, grace_period / 10)

    def shutdown(self) -> None:
        self.watch.stop()
        self.hold.shutdown()
        self.subscriptions.close()

    # ---- peers ----

    async def _probe(self, peers: PeerSet, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.peer_timeout)
        try:
            async with self.watch.client().get(f"{url}/internal/status", timeout=timeout) as r:
                status = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            status = None
        peers.probed(url, status)
        if status is not None and peers is self.prefill:  # what it holds, from its KV-cache events
            self.subscriptions.follow(url, *advertised(status))

    # ---- requests ----

    def _retried(self, kind: str) -> None:
        if self.retries is not None:
            self.retries.labels(**self._labels, kind=kind).inc()

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_fits(self.limits, len(ids), params.max_tokens)
        rid = request_id or f"route-{next(self._ids)}"
        await self.watch.refresh_if_stale()  # no probe loop (tests), an old round, or a role not found yet
        self._admit()
        arrived = time.monotonic()
        self.in_flight += 1
        generated: list[int] = []  # sent to the client: a resumed request continues after them
        text = TextOutput(self.tokenizer, ids, params.stop)
        failures: list[str] = []
        tried: set[str] = set()
        room: RoomWait | None = None  # from when every decode pod was first found full
        attempt = resumes = 0
        held = self.hold.request()
        tried_until = arrived + self.hold.seconds  # (a request every decode pod fails: tried again this long)
        try:
            while True:
                await held.wait()  # at once, unless holding is on and no decode pod is ready
                candidates = self.decode.ranked(exclude=tried)
                if self.hold.enabled:
                    candidates = [p for p in candidates if p.ready]
                if not candidates and self.hold.enabled and self.decode.ready == 0:
                    tried.clear()  # every decode pod failed it: held again until one is ready
                    continue
                if not candidates and (self.hold.enabled or generated) and time.monotonic() < tried_until:
                    # every decode pod failed it while one still counts ready (its probe answered before it
                    # went), or a stream under way found no pod: the next probe round says, within the bound
                    tried.clear()
                    await asyncio.sleep(PROBE_EVERY)
                    await self.watch.refresh()
                    continue
                if not candidates:
                    why = "; ".join(failures) or f"{', '.join(self.decode.specs)} resolve to no address"
                    raise NoPeerAvailable(f"no decode pod could serve the request: {why}")
                peer = candidates[0]
                tried.add(peer.url)
                rest = None if params.max_tokens is None else params.max_tokens - len(generated)
                sent_before = len(generated)
                try:
                    part = dataclasses.replace(
                        params, max_tokens=rest, constraint=_continued(params, generated, self.tokenizer)
                    )
                    async for token, reason, logprobs in self._run(
                        peer, f"{rid}.{attempt}", ids + generated, part
                    ):
                        out = None
                        if token is not None:
                            generated.append(token)
                            out = self._accept(rid, ids, generated, text, params, token)
                            out.logprobs = None if logprobs is None else [logprobs]
                            if out.finished:
                                yield out
                                return
                        if reason is not None:  # the pod finished for a reason the text did not show
                            out = out or RequestOutput(request_id=rid, token_ids=[], text="",
                                                       prompt_tokens=len(ids))  # fmt: skip
                            out.text += text.flush()
                            out.finish_reason, out.completion_tokens = FinishReason(reason), len(generated)
                            yield out
                            return
                        if out is not None:
                            yield out
                    raise StreamBroken("the stream ended before the request finished")
                except PeerRefused:
                    raise
                except PeerBusy as e:
                    failures.append(f"{peer.url}: {e}")
                    if len(tried) == len(self.decode.peers):  # every pod is full: wait while they make room
                        now = time.monotonic()
                        waited = now - arrived
                        if self.max_queue_wait and not generated and waited > self.max_queue_wait:
                            raise Overloaded(  # (a stream already started waits on: it is resumed)
                                f"the request waited {waited:.0f} s for a decode slot, past the bound of "
                                f"{self.max_queue_wait:g} s (--max-queue-wait); retry later",
                                retry_after=self._retry_after(),
                            ) from None
                        if self.hand_back_from is not None and not generated and now >= self.hand_back_from:
                            raise HandedBack(
                                "the router is shutting down and no decode pod made room for the request in "
                                "its grace period; send it again",
                                retry_after=1,
                            ) from None
                        room = room or RoomWait(self.busy_timeout, now, self.decode_progress)
                        if room.goes_on(now, self.decode_progress):
                            await asyncio.sleep(0.25)
                            tried.clear()
                            failures.clear()
                except (aiohttp.ClientError, OSError, TimeoutError, PeerFailed) as e:
                    failures.append(f"{peer.url}: {e or type(e).__name__}")
                    self.decode.failed(peer.url, str(e))
                    # a resume: a stream that broke after this attempt sent tokens (an attempt that failed
                    # before its first token, a resume's too, is a retry and spends no resume)
                    kind = "resume" if len(generated) > sent_before else "retry"
                    resumes += kind == "resume"
                    if resumes > self.max_resumes:
                        raise Unavailable(
                            f"the decode pod {peer.url} failed mid-stream ({e or type(e).__name__}) and the "
                            f"stream was resumed {self.max_resumes} times already (--max-resumes)"
                        ) from None
                    log.warning("request %s: decode pod %s failed (%s); %s on another pod after %d tokens",
                                rid, peer.url, e or type(e).__name__, kind, len(generated))  # fmt: skip
                    self._retried(kind)
                attempt += 1
        finally:
            self.in_flight -= 1

    def _decode_slots(self) -> int:
        """The decode slots in rotation, as the pods' last probes said."""
        return sum(p.slots for p in self.decode.peers.values() if p.healthy)

    def _slot_seconds(self) -> float | None:
        now = time.monotonic()
        return admission.slot_seconds(self.service.mean(), [now - t for t in self._decoding.values()])

    def _retry_after(self) -> int:
        """Seconds until a decode slot is expected to free (at least 1)."""
        return admission.next_slot(self._slot_seconds(), self._decode_slots())

    def _admit(self) -> None:
        """Overloaded when a new request's expected wait for a decode slot passes the bound: the requests this
        router carries (held ones aside) ahead of it, on the decode pods' slots (`admission.refusal`)."""
        slots = self._decode_slots()
        if not self.max_queue_wait or not slots:
            return
        ahead, seconds = self.in_flight - self.hold.held, self._slot_seconds()
        refused = admission.refusal(ahead, slots, seconds, self.max_queue_wait, self.service.spread())
        if refused is not None:
            wait, retry = refused
            raise Overloaded(
                f"the request would likely wait {wait:.0f} s for a decode slot, past the bound of "
                f"{self.max_queue_wait:g} s (--max-queue-wait): {ahead} requests are ahead on {slots} decode "
                f"slots, each serving one in {seconds:.1f} s; retry after {retry} s",
                retry_after=retry,
            )

    def _accept(
        self, rid: str, ids: list[int], generated: list[int], text: TextOutput, params: SamplingParams,
        token: int,
    ) -> RequestOutput:  # fmt: skip
        """One generated token as the client sees it: EOS and stop strings end the request here, by the
        engine's own rules (the decode pods apply them too, but only to their own part)."""

        piece, reason = text.accept(
            token,
            eos=token in self.eos_ids and not params.ignore_eos,
            last=params.max_tokens is not None and len(generated) >= params.max_tokens,
        )
        return RequestOutput(request_id=rid, token_ids=[token], text=piece, finish_reason=reason,
                             prompt_tokens=len(ids), completion_tokens=len(generated))  # fmt: skip

    async def _run(self, decode: Peer, rid: str, ids: list[int], params: SamplingParams):
        """One attempt on one decode pod: yields (token or None, the pod's finish reason or None, the token's
        log probabilities where the request asked for them)."""
        s = self.watch.client()
        decode.in_flight += 1
        try:
            if len(ids) < self.local_prefill_below:  # short: no lease, no push
                lease, kv = {"lease": None}, "local"
            else:
                lease = await self._reserve(decode, rid, len(ids))
                kv = await self._push(rid, ids, lease)
            body = {
                "lease": lease["lease"],
                "request": rid,
                "prompt_ids": ids,
                "params": dataclasses.asdict(params),
                "kv": kv,
            }
            silence = aiohttp.ClientTimeout(total=None, sock_connect=self.peer_timeout,
                                            sock_read=self.peer_timeout + self.kv_timeout)  # fmt: skip
            self.stages["decode"] += 1
            streaming, served = False, False
            try:
                async with s.post(f"{decode.url}/internal/decode", json=body, timeout=silence) as r:
                    await _refusal(r, "decode")
                    self.decode.succeeded(decode.url)
                    streaming = True
                    self._decoding[rid] = time.monotonic()
                    self.decode_progress += 1  # the lease's region is the slot's now
                    async for line in r.content:
                        if not line.strip():
                            continue
                        item = json.loads(line)
                        if item.get("error"):
                            raise PeerFailed(f"the request failed on the decode pod: {item['error']}")
                        tokens, reason = item["token_ids"], item.get("finish_reason")
                        served = served or bool(reason)
                        logprobs = _logprobs(item.get("logprobs"), len(tokens))
                        for i, token in enumerate(tokens):
                            yield token, reason if i == len(tokens) - 1 else None, logprobs[i]
                        if not tokens and reason:
                            yield None, reason, None
            finally:
                self.stages["decode"] -= 1
                self.decode_progress += streaming  # its slot is free again
                started = self._decoding.pop(rid, None)
                if served and started is not None:  # a stream the pod finished: its slot's time
                    self.service.served(time.monotonic() - started)
        finally:
            decode.in_flight -= 1

    async def _reserve(self, decode: Peer, rid: str, tokens: int) -> dict:
        self.stages["reserve"] += 1
        try:
            async with self.watch.client().post(
                f"{decode.url}/internal/reserve", json={"request": rid, "prompt_tokens": tokens},
                timeout=aiohttp.ClientTimeout(total=self.peer_timeout),
            ) as r:  # fmt: skip
                await _refusal(r, "reserve")
                return await r.json()
        finally:
            self.stages["reserve"] -= 1

    async def _push(self, rid: str, ids: list[int], lease: dict) -> str | dict:
        """Have a prefill pod run the prompt and push its KV cache into the lease: "ready", or why not (the
        decode pod then prefills itself and counts the reason)."""
        candidates = [p for p in self.prefill.ranked() if p.healthy]
        if not candidates:
            return {"failed": "no_prefill_pod", "detail": "no prefill pod is in rotation"}
        self.routing.observe(self.prefill.peers.values())
        blocks = self.routing.blocks(ids)
        peer = self.routing.pick(candidates, blocks, time.monotonic())
        dispatch = self.routing.dispatched(peer, blocks, time.monotonic())  # (timed: prefill and push)
        push = {"request": rid, "prompt_ids": ids, "agent": lease["agent"], "region": lease["region"],
                "key": lease.get("key")}  # fmt: skip
        self.stages["prefill"] += 1
        peer.in_flight += 1
        try:
            async with self.watch.client().post(
                f"{peer.url}/internal/prefill", json=push,
                timeout=aiohttp.ClientTimeout(total=2 * self.kv_timeout + 5),  # room for its queue, the
                # prefill and its push's own deadline: past that the pod is hung
            ) as r:  # fmt: skip
                answer = await r.json()
            if r.status == 200:
                self.prefill.succeeded(peer.url)
                now = time.monotonic()
                self.routing.sent(peer.url, blocks, now)
                self.routing.first_token(dispatch, now)  # its answer is the prompt's first token, pushed
                self.routing.answered(dispatch, now)
                return "ready"
            return {"failed": answer.get("reason", "prefill_failed"), "detail": answer.get("error", "")}
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            self.prefill.failed(peer.url, str(e))
            log.warning("request %s: prefill pod %s failed: %s", rid, peer.url, e or type(e).__name__)
            return {"failed": "prefill_failed", "detail": f"{peer.url}: {e or type(e).__name__}"}
        finally:
            self.stages["prefill"] -= 1
            peer.in_flight -= 1


def _continued(params: SamplingParams, generated: list[int], tokenizer) -> OutputConstraint | None:
    """A constrained request's constraint for an attempt that continues after `generated` (the tokens the
    client has): its grammar reads their text first."""
    if params.constraint is None or not generated:
        return params.constraint
    done = tokenizer.decode(generated, skip_special_tokens=False)
    return dataclasses.replace(params.constraint, prefix=params.constraint.prefix + done)


def _logprobs(given: Any, tokens: int) -> list[TokenLogprobs | None]:
    """A decode pod's line's log probabilities ([logprob, [[id, logprob], ...]] per token), one per token."""
    if not isinstance(given, list) or len(given) != tokens:
        return [None] * tokens
    return [TokenLogprobs(float(lp), tuple((int(i), float(v)) for i, v in top)) for lp, top in given]
