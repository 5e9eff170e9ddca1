"""The front door (`neuronfleet serve --role router --unified PEER...`): the public endpoint of a model served
by unified pods of any engine (ours, vLLM, TGI, SGLang) that may scale to zero or run more than one pod. It
loads no model code (with `--model`, the model's tokenizer only, to cut prompts into the token blocks the pods
cache, chat template applied as they apply it): every request but its own `/health`, `/ready` and `/metrics`
(OpenAI `/v1/...`, TGI `/generate`, `/generate_stream`, `/info`, ...) goes as is (method, path, query,
headers but hop-by-hop ones, body) to the ready pod the routing policy chooses (`prefix_routing`: by
default the one with the lowest expected time to first token, its wait for a slot plus the prefill of the
prompt's prefix it does not hold, from the pods' load, their slots (`--routing-pod-slots`) and this router's
timings of them), and its answer comes back as it comes, chunk by chunk (server-sent events stream).
A body that is not bounded JSON (`api_requests.decode_json`: too deep, NaN, a lone surrogate...; multipart
bodies excepted) is refused here with 400 (422 on TGI's routes), whatever engine the pods run.

Pods are found and probed as the other routers find theirs (`peers.PeerSet`: URLs or DNS names of a headless
Service, or the static peer map; re-resolved and probed every `--peer-probe-interval` seconds with `GET
/ready`, or `GET /health` for an engine without /ready). At zero (no pod ready) requests are held
(`holding.Hold`, `--hold-requests`) until one is. A pod that fails before its answer starts (no connection, a
reset, a 5xx: a 503 while draining, or a 408) is counted as failing and the request goes to another ready pod,
or is held again (also when every pod failed it while one still counts ready: the next probe round decides,
within the hold's bound). A pod that answers 429 (its admission found it full: `engine/admission.py`) is not
failing: the request goes to another, and when every pod is full the client gets the last 429 at once, with
its Retry-After, never held. A whole (not streamed) answer is read before it is passed on, so a pod that dies
while sending it is such a failure too (the request is sent again). An OpenAI completion or chat streamed to
the client, or a TGI `/generate_stream` (or `POST /` streamed), is resumed on another pod when its pod dies
after the stream started (a reset, its end before the answer's, an error event), from the prompt and the
tokens already sent, at most `--max-resumes` times (`resume.resumable` says which carrier:
`resume.StreamResume`, the pods asked for their tokens' ids, `return_token_ids`: the client sees one stream,
no token repeated or missing, exact for greedy requests where the pods return the ids;
`resume.TgiStreamResume`, from the text sent: near at the seam; a resume that finds every pod full or failing
waits for one within the hold's bound, since its client holds half an answer). Any other stream that breaks
after it started ends cut (the client sees it cut, never a clean end).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aiohttp
import yarl
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from neuronfleet.runtime.engine import admission
from neuronfleet.runtime.routing.holding import PROBE_EVERY, Hold, HoldRejected
from neuronfleet.runtime.routing.kv_event_index import Subscriptions, advertised, peers_publish
from neuronfleet.runtime.routing.peers import Peer, PeerSet, PeerWatch, resolve_peers
from neuronfleet.runtime.routing.prefix_routing import Dispatch, Routing, RoutingMetrics, request_prompt
from neuronfleet.runtime.routing.resume import CarriedStream, StreamBroken, resumable, with_token_ids
from neuronfleet.runtime.routing.slot_queue import QUEUE_BUCKETS, SlotQueue, pods_full
from neuronfleet.runtime.serving.api_requests import decode_json
from neuronfleet.runtime.serving.errors import InvalidRequest, Overloaded, openai_error_body, tgi_error_body
from neuronfleet.runtime.serving.http_app import HttpApp

if TYPE_CHECKING:  # (imported by the command only when --model is given: without it, no tokenizer is loaded)
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PEER_FAILURES = (aiohttp.ClientError, OSError, TimeoutError)
OWN_PATHS = ("/health", "/ready", "/metrics")
# hop-by-hop headers (RFC 9110 section 7.6.1) and those the two connections set for themselves
NOT_FORWARDED = frozenset(
    h.lower()
    for h in ("Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
              "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length")
)  # fmt: skip


class PodRefused(Exception):
    """A pod answered 5xx (503: draining) or 429 (full: `busy`, not failing) before its answer started: the
    request may go to another."""

    def __init__(self, why: str, busy: bool = False) -> None:
        super().__init__(why)
        self.busy = busy


class StreamCut(Exception):
    """A resumable stream broke after the client's answer started (`out`): it may go on on another pod.
    `broke` false: not a break, one choice of several ended and the next goes on in an attempt of its own."""

    def __init__(self, why: str, out: web.StreamResponse, broke: bool = True) -> None:
        super().__init__(why)
        self.out, self.broke = out, broke


class FrontDoor(HttpApp):
    """The HTTP app and its unified peers; `serve()` (serving.server) runs it and drains it on SIGTERM."""

    def __init__(
        self, unified: Sequence[str], *, model_name: str = "", probe_interval: float = 2.0,
        peer_timeout: float = 60.0, max_body_bytes: int = 1 << 20, hold_requests: int = 0,
        hold_seconds: float = 300.0, wake_url: str | None = None, wake_token: str | None = None,
        routing: Routing | None = None, tokenizer: Tokenizer | None = None, peer_kv_events: str | None = None,
        max_resumes: int = 2, max_queue_wait: float = 0.0, router_queue: bool = True,
    ) -> None:  # fmt: skip
        """`wake_token`: the model's internal token, sent with each wake (`holding.Hold`) and the key to its
        pods' KV-cache events (`kv_event_index.Subscriptions`). `max_resumes`: the most times one stream is
        resumed on another pod (0: never). `router_queue`: while every ready pod's slots are taken, requests
        wait here for one (`slot_queue`), within `max_queue_wait` seconds (0: no bound)."""
        if not unified:
            raise ValueError(
                "--role router --unified needs at least one unified pod: http://host:port or dns://name:port"
            )
        resolve_peers(unified)  # malformed specs fail at start-up
        super().__init__(model_name, max_body_bytes, CollectorRegistry())
        self.unified = PeerSet("unified", unified)
        # by the token blocks the pods cache where the model's tokenizer is given (--model), else by the
        # prompt's text
        self.tokenizer = tokenizer
        self.routing = dataclasses.replace(routing or Routing(), by_tokens=tokenizer is not None)
        # what each pod holds, from the KV-cache events it publishes (with a tokenizer: they name token ids):
        # where its ready answer says (ours), else at --peer-kv-events of its own address (vLLM's)
        if peer_kv_events is not None and tokenizer is None:
            raise ValueError("--peer-kv-events needs --model: the events name token ids")
        self.peer_events = peers_publish(peer_kv_events)
        self.subscriptions = Subscriptions(secret=wake_token) if tokenizer is not None else None
        self.routing.events = self.subscriptions
        self.peer_timeout = peer_timeout
        # the paths whose pods answered 400 to the `return_token_ids` the router added (SGLang's streamed
        # chats, `resume.IDS_REFUSED`): asked without it since, their streams resume from the text
        self.ids_refused: set[str] = set()
        # the pods whose ready answer says they continue a constrained answer under its grammar (ours:
        # `constrain_final_message`): a constrained chat stream is resumed only where every ready pod does
        self.continue_constraints: set[str] = set()
        self.max_resumes = max_resumes
        # bytes as they come from a pod: no decompression
        self.watch = PeerWatch((self.unified,), self._probe, probe_interval, auto_decompress=False)
        self.hold = Hold(hold_requests, hold_seconds, wake_url=wake_url, wake_token=wake_token,
                         role="unified", ready=lambda: self.unified.ready > 0, refresh=self.watch.refresh,
                         draining=self.refusing)  # fmt: skip
        self.queue = SlotQueue(max_queue_wait, enabled=router_queue)
        self.backend = self  # what serve() drains
        self.forwarded = 0  # requests sent to a pod and not finished
        self.on_startup.append(self._start)
        self.on_cleanup.append(self._close)
        labels = self.labels = {"model_name": model_name}
        Gauge("vllm:num_requests_running", "Requests forwarded to a pod and not finished.", ["model_name"],
              registry=self.registry).labels(**labels).set_function(lambda: self.forwarded)  # fmt: skip
        self.watch.register_metrics(self.registry, model_name)
        self.retries = Counter(
            "neuronfleet:router_retries",
            "Requests moved to another pod: before their answer started or while a whole answer was read "
            "(retry), or a stream resumed from the token ids sent (resume: exact for greedy requests) or "
            "from the text sent (resume_text).", ["model_name", "kind"], registry=self.registry,
        )  # fmt: skip
        self.hold.register_metrics(self.registry, model_name)
        self.registry.register(RoutingMetrics(model_name, {"unified": self.routing}))
        Gauge("vllm:num_requests_waiting", "Requests held until a pod is ready, and those waiting for a "
              "slot while every pod's are taken.", ["model_name"],
              registry=self.registry).labels(**labels).set_function(
                  lambda: self.hold.held + self.queue.queued)  # fmt: skip
        self.queue_seconds = Histogram(
            "neuronfleet:router_queue_seconds", "Seconds requests waited at the front door for a slot, every "
            "ready pod's being taken (0: none waited).", ["model_name"], buckets=QUEUE_BUCKETS,
            registry=self.registry,
        ).labels(**labels)  # fmt: skip

    # ---- what serve() uses ----

    @property
    def num_requests(self) -> int:
        return self.in_flight

    def shutdown(self) -> None:
        self.watch.stop()
        if self.subscriptions is not None:
            self.subscriptions.close()

    def routes(self) -> list[web.RouteDef]:
        return [web.route("*", "/{tail:.*}", self._forward)]  # every path but the base's own

    # ---- peers ----

    async def _start(self, app: web.Application) -> None:
        await self.watch.start()

    async def _close(self, app: web.Application) -> None:
        await self.watch.close()
        await self.hold.close()

    async def _probe(self, peers: PeerSet, url: str) -> None:
        """`GET /ready` answers 200 while the pod takes requests (ours, and TGI's); an engine without it
        (404: vLLM, SGLang) is asked `GET /health`."""
        timeout = aiohttp.ClientTimeout(total=self.peer_timeout)
        why, said = "", (None, None)
        try:
            for path in ("/ready", "/health"):
                async with self.watch.client().get(f"{url}{path}", timeout=timeout) as r:
                    body = await r.read()
                    status, why = r.status, f"{path} answered {r.status}"
                if status == 200 and path == "/ready":  # ours says where it publishes its KV-cache events
                    answer = _json(body)
                    said = advertised(answer)
                    if isinstance(answer, dict) and answer.get("constrain_final_message") is True:
                        self.continue_constraints.add(url)
                    else:
                        self.continue_constraints.discard(url)
                if status != 404:
                    break
        except PEER_FAILURES as e:
            status, why = 0, f"probe failed: {e or type(e).__name__}"
        if status == 200:
            peers.succeeded(url)
            self.queue.freed()  # (a pod back in rotation has room)
            if self.subscriptions is not None:
                self.subscriptions.follow(url, *(said if said[0] else self.peer_events))
        else:
            peers.failed(url, why)

    def _pods_continue_grammars(self) -> bool:
        """Every ready pod continues a constrained answer under its grammar (`continue_constraints`)."""
        ready = [p.url for p in self.unified.peers.values() if p.ready]
        return bool(ready) and all(url in self.continue_constraints for url in ready)

    def _pick(self, tried: set[str], blocks: list[int]) -> Peer | None:
        """The ready pod not tried yet that the routing policy chooses for a prompt of these blocks;
        without holding, the least loaded of any pods as a last resort."""
        self.routing.observe(self.unified.peers.values())
        ranked = self.unified.ranked(exclude=tried)
        ready = [p for p in ranked if p.ready]
        if ready:
            peer = self.routing.pick(ready, blocks, time.monotonic())
        elif ranked and not self.hold.enabled:
            peer = ranked[0]
        else:
            return None
        tried.add(peer.url)
        return peer

    def _ready_slots(self) -> list[tuple[int, int]]:
        """The ready pods' (load, slots): slots as their status says, else --routing-pod-slots (0:
        unknown)."""
        return [(p.score, self.routing.slots(p)) for p in self.unified.peers.values() if p.ready]

    def _full(self) -> bool:
        return pods_full(self._ready_slots())

    def _retry_after(self) -> int:
        """Seconds until a slot is expected to free (at least 1)."""
        return admission.next_slot(self.routing.pool.answer_seconds, sum(s for _, s in self._ready_slots()))

    async def _wait_for_slot(self) -> float:
        """Where every ready pod's slots are taken (or requests already wait), the request waits in turn for
        one (`slot_queue`), refused where its expected wait passes the bound; the seconds it waited."""
        pods = self._ready_slots()
        if self.queue.enabled and (self.queue.queued or pods_full(pods)):
            ahead = sum(load for load, _ in pods) + self.queue.queued
            self.queue.admit(ahead, sum(s for _, s in pods), self.routing.pool.answer_seconds)
        return await self.queue.turn(self._full, self._retry_after)

    # ---- endpoints ----

    def not_ready(self) -> str | None:
        """Ready while some pod is ready (its last probe answered), or always with holding (it takes requests
        at zero)."""
        return None if self.hold.enabled or self.unified.ready > 0 else "no unified pod"

    def error(self, path: str, status: int, message: str) -> web.Response:
        return self._error(path, status, message)

    @staticmethod
    def _error(path: str, status: int, message: str, retry_after: int | None = None) -> web.Response:
        """An error of the front door itself, in the format of the API `path` belongs to."""
        headers = {"Retry-After": str(retry_after or 1)} if status in (429, 503) else None
        body = (
            openai_error_body(status, message) if path.startswith("/v1/") else tgi_error_body(status, message)
        )
        return web.json_response(body, status=status, headers=headers)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if self.refusing():
            return self._error(path, 503, "the front door is shutting down and takes no new requests")
        body = await request.read()  # (read by the middleware, within its limits)
        value = None
        if body and not request.content_type.startswith("multipart/"):
            try:  # a body no pod could take is refused here, whatever engine is behind (api_requests)
                value = decode_json(body)
            except InvalidRequest as e:
                return self._error(path, e.http_status(tgi=not path.startswith("/v1/")), str(e))
        await self.watch.refresh_if_stale()
        prompt = request_prompt(path, body, self.tokenizer) if request.method == "POST" else None
        blocks = self.routing.blocks(prompt) if request.method == "POST" else []
        resume = None  # a stream that may go on on another pod when its pod dies
        client_body, asked_ids = body, False  # the client's body; whether the router asked for token ids
        if (
            self.max_resumes
            and request.method == "POST"
            and (carrier := resumable(path, value, self._pods_continue_grammars()))
        ):
            ids = prompt if isinstance(prompt, list) else None
            resume = carrier(path, value, ids, self.tokenizer)  # type: ignore[arg-type]
            asked_ids = path not in self.ids_refused and not resume.client_ids
            if asked_ids:
                body = json.dumps(with_token_ids(value, path)).encode()  # type: ignore[arg-type]
        target, out = request.raw_path, None  # the path sent; the client's answer once it started
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
        held = self.hold.request()
        held_until = time.monotonic() + self.hold.seconds  # (a request every pod fails: held this long)
        tried: set[str] = set()
        failures: list[str] = []
        refused: tuple[int, bytes, dict] | None = None  # the last pod's 429 or 5xx, passed on at the end
        while True:
            try:
                await held.wait()
            except HoldRejected as e:
                if out is not None:  # a resume held past the bound: the client's stream ends cut
                    log.warning("%s %s: no pod to resume the stream on (%s)", request.method, path, e)
                    return _cut(request, out)
                return self._error(path, e.status, str(e), e.retry_after)
            if out is None and not tried:  # a new request (not a retry, nor a resume): late binding
                try:
                    self.queue_seconds.observe(await self._wait_for_slot())
                except Overloaded as e:
                    return self._error(path, e.http_status(tgi=not path.startswith("/v1/")), str(e),
                                       e.retry_after)  # fmt: skip
            peer = self._pick(tried, blocks)
            if peer is None:
                busy = refused is not None and refused[0] == 429
                if out is None and busy:  # every pod is full (its admission's 429): refused at once
                    return _passed_on(refused)  # type: ignore[arg-type]
                # held again within the request's bound: every pod failed it (holding), or a resumed stream
                # found every pod failing or full (its client holds half an answer: it waits for room)
                if (self.hold.enabled or out is not None) and time.monotonic() < held_until:
                    tried.clear()
                    if self.unified.ready or busy:  # one still counted ready (its probe answered before it
                        await asyncio.sleep(PROBE_EVERY)  # went), or full: the next probe round says
                        await self.watch.refresh()
                    continue
                if out is not None:  # a stream resumed on no pod: it ends cut
                    log.warning("%s %s: no pod to resume the stream on (%s)", request.method, path, failures)
                    return _cut(request, out)
                if refused is not None:
                    return _passed_on(refused)
                why = "; ".join(failures) or f"{', '.join(self.unified.specs)} resolve to no address"
                return self._error(path, 503, f"no unified pod could serve the request: {why}")
            if failures and out is None:
                self.retries.labels(**self.labels, kind="retry").inc()
            # timed for the routing (not a resumed attempt: its prompt is another)
            dispatch = self.routing.dispatched(peer, blocks, time.monotonic()) if out is None else None
            peer.in_flight += 1
            self.forwarded += 1
            try:
                try:
                    response = await self._send(peer, request, target, headers, body)
                    if response.status == 400 and asked_ids and out is None:
                        said = await response.read()
                        response.release()
                        if b"return_token_ids" not in said:  # the client's own error
                            return web.Response(status=400, body=said, headers=_answer_headers(response))
                        # the pods refuse the ids asked (SGLang's streamed chats): asked again without them,
                        # the stream resumes from its text
                        self.ids_refused.add(path)
                        log.warning("%s %s: the pods refuse return_token_ids here (%s): asked without it "
                                    "from now on", request.method, path, said[:300])  # fmt: skip
                        body, asked_ids = client_body, False
                        tried.discard(peer.url)
                        continue
                    # draining, full or failing: another pod may take it (a full one is not failing). A 408:
                    # the front door sends each request whole at once, so a pod that timed its headers out
                    # failed (one whose drain stopped reading a new connection), not the client
                    if response.status >= 500 or response.status in (408, 429):
                        refused = (response.status, await response.read(), _answer_headers(response))
                        response.release()
                        raise PodRefused(f"answered {response.status}", busy=response.status == 429)
                except (*PEER_FAILURES, PodRefused) as e:  # before the answer started
                    if not (isinstance(e, PodRefused) and e.busy):
                        self.unified.failed(peer.url, str(e))
                    failures.append(f"{peer.url}: {e or type(e).__name__}")
                    log.warning(
                        "%s %s: pod %s failed (%s); trying another", request.method, path, peer.url, e
                    )
                    continue
                try:
                    return await self._answer(request, peer, response, blocks, resume, out, dispatch)
                except StreamCut as e:
                    out = e.out
                    if e.broke:
                        failures.append(f"{peer.url}: {e}")
                    following = resume.after_break(self.max_resumes) if resume is not None else None
                    if following is None:
                        log.warning("%s %s: pod %s failed mid-stream (%s); the client's answer ends cut",
                                    request.method, path, peer.url, e)  # fmt: skip
                        return _cut(request, out)
                    if isinstance(following, bytes):  # every token was sent: only the finish was lost
                        await out.write(following)
                        await out.write_eof()
                        return out
                    assert resume is not None
                    kind, target, next_body = following
                    body = json.dumps(next_body).encode()
                    self.retries.labels(**self.labels, kind=kind).inc()
                    log.log(logging.WARNING if e.broke else logging.INFO,
                            "%s %s: pod %s %s (%s); %s after %d tokens", request.method, path, peer.url,
                            "failed mid-stream" if e.broke else "ended a choice", e, kind,
                            resume.before)  # fmt: skip
                    tried, refused = ({peer.url} if e.broke else set()), None
                    held_until = time.monotonic() + self.hold.seconds  # the resume's own bound
            finally:
                peer.in_flight -= 1
                self.forwarded -= 1
                self.queue.freed()

    async def _send(
        self, peer: Peer, request: web.Request, target: str, headers: dict, body: bytes
    ) -> aiohttp.ClientResponse:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.peer_timeout)
        url = yarl.URL(f"{peer.url}{target}", encoded=True)  # path and query as sent
        return await self.watch.client().request(request.method, url, headers=headers, data=body or None,
                                            timeout=timeout, allow_redirects=False)  # fmt: skip

    async def _answer(
        self, request: web.Request, peer: Peer, response: aiohttp.ClientResponse, blocks: list[int],
        resume: CarriedStream | None = None, out: web.StreamResponse | None = None,
        dispatch: Dispatch | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        """The pod's answer: a whole one read first (a pod that dies while sending it is PodRefused: the
        request goes to another), a stream passed on as it comes. A resumable stream (`resume`) goes through
        it event by event, into the client's answer `out` where an earlier pod started it; its break is
        StreamCut. Any other stream that breaks cuts the client's connection. Once the answer is whole the
        pod's cache holds the prompt, and not before: a burst of requests with one new long prefix is spread
        by load, not piled on the pod still computing it (a stream's first bytes say nothing of that: servers
        send the role chunk before the prompt is computed). A `dispatch` is timed for the routing: its
        answer's end, and a stream's first token (`_first_token_events`)."""
        self.unified.succeeded(peer.url)
        try:
            streamed = response.headers.get("Content-Type", "").startswith("text/event-stream")
            if out is not None and (response.status >= 300 or not streamed):  # a resume the pod refused
                said = (await response.read())[:300].decode(errors="replace")
                self.unified.failed(peer.url, said)
                raise StreamCut(f"the resumed request was answered {response.status}: {said}", out)
            if not streamed:
                try:
                    data = await response.read()
                except PEER_FAILURES as e:
                    raise PodRefused(f"the answer broke off: {e or type(e).__name__}") from None
                if response.status < 300:
                    self.routing.sent(peer.url, blocks, time.monotonic())
                    if dispatch is not None:
                        self.routing.answered(dispatch, time.monotonic())
                return web.Response(status=response.status, reason=response.reason, body=data,
                                    headers=_answer_headers(response))  # fmt: skip
            if out is None:
                out = web.StreamResponse(status=response.status, reason=response.reason,
                                         headers=_answer_headers(response))  # fmt: skip
                await out.prepare(request)
            events, first_token = 0, _first_token_events(request.path)
            try:
                async for chunk in response.content.iter_any():
                    if dispatch is not None and events < first_token:  # (events end in a blank line)
                        events += chunk.count(b"\n\n") + chunk.count(b"\r\n\r\n")
                        if events >= first_token and response.status < 300:
                            self.routing.first_token(dispatch, time.monotonic())
                    data = chunk if resume is None else resume.feed(chunk)
                    if request.transport is None or request.transport.is_closing():
                        return out  # the client left: its request ends here (the pod's answer released)
                    await out.write(data)
                if resume is not None:
                    resume.ended()
            except (*PEER_FAILURES, StreamBroken) as e:
                why = f"{e or type(e).__name__}"
                if request.transport is None or request.transport.is_closing():
                    return out  # the client left (a write to it failed)
                if resume is not None and isinstance(e, StreamBroken) and not resume.broke():
                    raise StreamCut(why, out, broke=False) from None  # (a choice ended; the pod is well)
                self.unified.failed(peer.url, why)
                if resume is not None:
                    raise StreamCut(why, out) from None
                log.warning("%s %s: pod %s failed mid-answer (%s); the client's answer ends cut",
                            request.method, request.path, peer.url, why)  # fmt: skip
                return _cut(request, out)
            if response.status < 300:
                self.routing.sent(peer.url, blocks, time.monotonic())
                if dispatch is not None:
                    self.routing.answered(dispatch, time.monotonic())
            await out.write_eof()
            return out
        finally:
            response.release()


def _first_token_events(path: str) -> int:
    """The server-sent events of a stream up to its first token: a chat's second (the first says the role,
    sent before the prompt is computed by our pods), any other's first (a completion's, TGI's)."""
    return 2 if path.endswith("/chat/completions") else 1


def _cut(request: web.Request, out: web.StreamResponse) -> web.StreamResponse:
    """The client's answer ends cut (its connection closed), never with a clean end."""
    if request.transport is not None:
        request.transport.close()
    return out


def _passed_on(refused: tuple[int, bytes, dict]) -> web.Response:
    """A pod's refusal (429, 5xx) as the client's answer, with a Retry-After where the pod gave none."""
    status, body, headers = refused
    if status in (429, 503) and not any(k.lower() == "retry-after" for k in headers):
        headers = {**headers, "Retry-After": "1"}
    return web.Response(status=status, body=body, headers=headers)


def _json(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _answer_headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in NOT_FORWARDED}
