"""The router in front of an engine's own prefill and decode servers (`neuronfleet serve --role router
--peer-protocol vllm|sglang`): an OpenAI HTTP endpoint that speaks the engine's P/D protocol
(`runtime/routing/pd_protocols.py`) to its peers, with no model files: the engines tokenize, check and answer.
With `--model` (vLLM) it reads the model's tokenizer only, to cut prompts into the token blocks the servers
cache, and with `--peer-kv-events` it subscribes to each prefill server's KV-cache events (vLLM's
`--kv-events-config`, `kv_event_index`) to know what each holds instead of guessing from what it sent.

Peers are found and kept as our own router does (`peers.PeerSet`: URLs or DNS names of headless Services,
re-resolved and probed every `--peer-probe-interval` seconds, here with the engines' `GET /health`; three
failed probes or requests take a pod out of rotation, one good probe puts it back). Failures, as for our own
P/D (docs/disaggregation.md): a prefill server that fails (no connection, a 5xx, 408 or 429, or an answer the
protocol cannot continue from) is retried on another one; a decode server that fails before its answer
starts is retried on another one, the exchange started over (a new prefill: the KV cache the first one kept
was meant for the failed decode); a peer that refuses the request itself (a 4xx) is answered to the client as
is; no server of a role left is a 503 in the OpenAI format that names each failure. Never a silently degraded
request: a request is never sent to a decode server without its prefill. A streamed OpenAI answer whose
decode server dies after it started (a reset, its end before the answer's, an error event) is resumed with
another exchange, from the prompt and the tokens already sent (`resume.StreamResume`; the servers are asked
for their tokens' ids, `return_token_ids`), at most `--max-resumes` times: the client sees one stream; past
that bound its last event is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from neuronfleet.runtime.routing import pd_protocols as pd
from neuronfleet.runtime.routing.holding import Hold, HoldRejected
from neuronfleet.runtime.routing.kv_event_index import Subscriptions, peers_publish
from neuronfleet.runtime.routing.peers import Peer, PeerSet, PeerWatch, resolve_peers
from neuronfleet.runtime.routing.prefix_routing import Routing, RoutingMetrics, request_prompt
from neuronfleet.runtime.routing.resume import StreamBroken, StreamResume, resumable, with_token_ids
from neuronfleet.runtime.serving.errors import openai_error_body
from neuronfleet.runtime.serving.http_app import HttpApp

if TYPE_CHECKING:  # (imported by the command only with --model: without it, no tokenizer is loaded)
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PEER_FAILURES = (aiohttp.ClientError, OSError, TimeoutError)


class PeerFailed(Exception):
    """A peer could not serve this request (the pod's failure, not the request's)."""


class NoPod(Exception):
    """No server of a role could serve the request (answered 503, or held again when holding is on)."""


class Refused(Exception):
    """A peer refused the request itself: its answer is the client's."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(status)
        self.status, self.body, self.content_type = status, body, content_type


class StreamCut(Exception):
    """A resumable stream broke after the client's answer started: it may go on with another exchange."""


@dataclasses.dataclass
class Carry:
    """One client's streamed answer across the exchanges that serve it."""

    resume: StreamResume | None = None
    out: web.StreamResponse | None = None  # the client's answer, once it started
    cut: str = ""  # why its last decode server's stream broke


class EngineRouter(HttpApp):
    """The HTTP app and its peers; `serve()` (serving.server) runs it and drains it on SIGTERM."""

    def __init__(
        self, protocol: str, prefill: Sequence[str], decode: Sequence[str], *, model_name: str,
        bootstrap_port: int | None = None, probe_interval: float = 2.0, peer_timeout: float = 60.0,
        max_body_bytes: int = 1 << 20, hold_requests: int = 0, hold_seconds: float = 300.0,
        wake_url: str | None = None, wake_token: str | None = None, routing: Routing | None = None,
        tokenizer: Tokenizer | None = None, peer_kv_events: str | None = None, max_resumes: int = 2,
    ) -> None:  # fmt: skip
        """`wake_token`: the model's internal token, sent with each wake (`holding.Hold`). `max_resumes`: the
        most times one stream is resumed with another exchange (0: never)."""
        if protocol not in pd.PROTOCOLS:
            raise ValueError(f"--peer-protocol {protocol!r}: this router speaks {', '.join(pd.PROTOCOLS)}")
        if not prefill or not decode:
            raise ValueError("--role router needs at least one --prefill and one --decode peer URL")
        if protocol == "sglang" and bootstrap_port is None:
            raise ValueError("--peer-protocol sglang needs --bootstrap-port (the prefill servers')")
        resolve_peers([*prefill, *decode])  # malformed specs fail at start-up
        super().__init__(model_name, max_body_bytes, CollectorRegistry())
        self.protocol, self.bootstrap_port = protocol, bootstrap_port
        self.prefill, self.decode = PeerSet("prefill", prefill), PeerSet("decode", decode)
        # each role by the prompt's blocks: a prefill server that holds the prefix computes less, and a
        # decode server keeps a conversation's turns in its own prefix cache. Blocks of the token ids the
        # servers cache where the model's tokenizer is given (--model), else of the prompt's text
        if peer_kv_events is not None and tokenizer is None:
            raise ValueError("--peer-kv-events needs --model: the events name token ids")
        self.tokenizer, self.peer_events = tokenizer, peers_publish(peer_kv_events)
        routing = dataclasses.replace(routing or Routing(), by_tokens=tokenizer is not None)
        self.routings = {role: dataclasses.replace(routing) for role in ("prefill", "decode")}
        # what each prefill server holds, from the KV-cache events it publishes (vLLM's --kv-events-config)
        self.subscriptions = Subscriptions() if peer_kv_events is not None else None
        self.routings["prefill"].events = self.subscriptions
        self.peer_timeout = peer_timeout
        self.max_resumes = max_resumes
        self.watch = PeerWatch((self.prefill, self.decode), self._probe, probe_interval)
        self.backend = self  # what serve() drains
        self._background: set[asyncio.Task] = set()
        self.on_startup.append(self._start)
        self.on_cleanup.append(self._close)
        labels = {"model_name": model_name}
        self.watch.register_metrics(self.registry, model_name)
        self.registry.register(RoutingMetrics(model_name, self.routings))
        self.retries = Counter(
            "neuronfleet:router_retries",
            "Requests moved to another prefill or decode server (prefill, decode: before the answer "
            "started), or a stream resumed with another exchange from the token ids sent (resume: exact for "
            "greedy requests) or from the text sent (resume_text).", ["model_name", "kind"],
            registry=self.registry,
        )  # fmt: skip
        self.labels = labels
        self.hold = Hold(
            hold_requests, hold_seconds, wake_url=wake_url, wake_token=wake_token, role="prefill and decode",
            refresh=self.watch.refresh, ready=lambda: bool(self.prefill.ready and self.decode.ready),
            draining=self.refusing,
        )  # fmt: skip
        self.hold.register_metrics(self.registry, model_name)
        # the load an inference gateway's endpoint picker reads (docs/gateway.md): requests streaming from
        # a decode server, and requests held until the servers are ready
        Gauge("vllm:num_requests_running", "Requests streaming from a decode server.", ["model_name"],
              registry=self.registry).labels(**labels).set_function(
            lambda: sum(p.in_flight for p in self.decode.peers.values()))  # fmt: skip
        Gauge("vllm:num_requests_waiting", "Requests held until the servers are ready.", ["model_name"],
              registry=self.registry).labels(**labels).set_function(lambda: self.hold.held)  # fmt: skip

    # ---- what serve() uses ----

    @property
    def num_requests(self) -> int:
        return self.in_flight

    def shutdown(self) -> None:
        self.watch.stop()
        if self.subscriptions is not None:
            self.subscriptions.close()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models), web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
        ]  # fmt: skip

    def error(self, path: str, status: int, message: str) -> web.Response:
        """Every error in the OpenAI format (the only API this router speaks)."""
        return self._error(status, message)

    @staticmethod
    def _error(status: int, message: str, param: str | None = None, retry_after: int = 1) -> web.Response:
        headers = {"Retry-After": str(retry_after)} if status in (429, 503) else None
        return web.json_response(openai_error_body(status, message, param), status=status, headers=headers)

    # ---- peers ----

    async def _start(self, app: web.Application) -> None:
        await self.watch.start()

    async def _close(self, app: web.Application) -> None:
        self.watch.stop()
        await self.hold.close()
        for task in list(self._background):
            task.cancel()
        await self.watch.close()

    async def _probe(self, peers: PeerSet, url: str) -> None:
        """The engines' liveness endpoint: `GET /health` answers 200 while the server can serve."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.peer_timeout)
            async with self.watch.client().get(f"{url}/health", timeout=timeout) as r:
                ok, why = r.status == 200, f"/health answered {r.status}"
        except PEER_FAILURES as e:
            ok, why = False, f"/health failed: {e or type(e).__name__}"
        if ok:
            peers.succeeded(url)
            if peers is self.prefill and self.subscriptions is not None:  # at the server's own address
                self.subscriptions.follow(url, *self.peer_events)
        else:
            peers.failed(url, why)

    def _pick(self, peers: PeerSet, tried: set[str], blocks: list[int] | None = None) -> Peer | None:
        """The next server to try: of those in rotation, the one the routing policy chooses for a prompt of
        these blocks (None: any, the least loaded); servers out of rotation last (a last resort)."""
        ranked = peers.ranked(exclude=tried)
        healthy = [p for p in ranked if p.healthy]
        if healthy and blocks is not None:
            routing = self.routings[peers.role]
            routing.observe(peers.peers.values())
            peer = routing.pick(healthy, blocks, time.monotonic())
        elif ranked:
            peer = ranked[0]
        else:
            return None
        tried.add(peer.url)
        return peer

    def _sent(self, peers: PeerSet, peer: Peer, blocks: list[int]) -> None:
        """The server took a prompt of these blocks: its cache holds them now."""
        self.routings[peers.role].sent(peer.url, blocks, time.monotonic())

    def _retried(self, kind: str) -> None:
        self.retries.labels(**self.labels, kind=kind).inc()

    async def _post(
        self, peers: PeerSet, peer: Peer, path: str, body: dict, headers: dict, read_timeout: float | None
    ) -> aiohttp.ClientResponse:
        """POST to a peer: its response when the protocol may go on (2xx); Refused for its 4xx; PeerFailed
        (the pod counted as failing) for anything else."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.peer_timeout, sock_read=read_timeout)
        peer.in_flight += 1
        try:
            response = await self.watch.client().post(
                f"{peer.url}{path}", json=body, headers=headers, timeout=timeout
            )
            if response.status < 400:
                peers.succeeded(peer.url)
                return response
            text = await response.read()
            response.release()
            if pd.passed_through(response.status):
                ctype = response.headers.get("Content-Type", "application/json")
                raise Refused(response.status, text, ctype)
            raise PeerFailed(f"{peer.url} answered {response.status}: {text[:300].decode(errors='replace')}")
        except PEER_FAILURES as e:
            peers.failed(peer.url, str(e))
            raise PeerFailed(f"{peer.url}: {e or type(e).__name__}") from None
        except PeerFailed as e:
            peers.failed(peer.url, str(e))
            raise
        finally:
            peer.in_flight -= 1

    # ---- endpoints ----

    def not_ready(self) -> str | None:
        """Ready while some prefill and some decode server is in rotation (a request needs both), or always
        with holding (the router then takes requests at zero and holds them)."""
        missing = [p.role for p in (self.prefill, self.decode) if p.healthy == 0]
        return f"no {' or '.join(missing)} server" if missing and not self.hold.enabled else None

    async def models(self, request: web.Request) -> web.StreamResponse:
        """The decode servers' model list (they serve the model under the name clients use)."""
        tried: set[str] = set()
        failures: list[str] = []
        while (peer := self._pick(self.decode, tried)) is not None:
            try:
                async with self.watch.client().get(f"{peer.url}/v1/models", timeout=aiohttp.ClientTimeout(
                        total=self.peer_timeout)) as r:  # fmt: skip
                    body = await r.read()
                    return web.Response(status=r.status, body=body, content_type="application/json")
            except PEER_FAILURES as e:
                self.decode.failed(peer.url, str(e))
                failures.append(f"{peer.url}: {e or type(e).__name__}")
        return self._error(503, pd.no_pod_message("decode", failures, self.decode.specs))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/chat/completions")

    async def _route(self, request: web.Request, path: str) -> web.StreamResponse:
        if self.refusing():
            return self._error(
                503, "the router is shutting down and takes no new requests; send it elsewhere"
            )
        raw = await request.read()  # (read by the middleware, within its limits)
        try:
            body = pd.client_body(raw)
        except ValueError as e:
            return self._error(400, str(e), "body")
        await self.watch.refresh_if_stale()
        prompt = request_prompt(path, raw, self.tokenizer)
        blocks = self.routings["prefill"].blocks(prompt)
        exchange = self._vllm if self.protocol == "vllm" else self._sglang
        carry = Carry()
        if self.max_resumes and resumable(path, body):  # ids: the router's tokenizer's, else the server's
            ids = prompt if isinstance(prompt, list) else None
            carry.resume = StreamResume(path, body, ids, self.tokenizer)
            body = with_token_ids(body, path, self.protocol)
        held = self.hold.request()
        while True:
            try:
                await held.wait()  # at once unless holding is on and no server of a role is ready
                return await exchange(request, path, body, blocks, carry)
            except HoldRejected as e:
                if carry.out is not None:
                    return await _end_with_error(carry.out, 503, str(e))
                return self._error(e.status, str(e), retry_after=e.retry_after)
            except Refused as e:
                if carry.out is not None:
                    said = e.body[:300].decode(errors="replace")
                    return await _end_with_error(
                        carry.out, e.status, f"the resumed request was refused: {said}"
                    )
                return web.Response(status=e.status, body=e.body, headers={"Content-Type": e.content_type})
            except NoPod as e:
                if not self.hold.enabled or (self.prefill.ready and self.decode.ready):
                    if carry.out is not None:
                        return await _end_with_error(carry.out, 503, f"{carry.cut}; {e}")
                    return self._error(503, str(e))
            except StreamCut as e:
                resume, out, carry.cut = carry.resume, carry.out, str(e)
                assert resume is not None and out is not None
                resumes = resume.resumes
                following = resume.after_break(self.max_resumes)
                if following is None:
                    return await _end_with_error(out, 502, f"{e}; resumed {resume.resumes} times already")
                if isinstance(following, bytes):  # every token was sent: only the finish was lost
                    await out.write(following)
                    await out.write_eof()
                    return out
                kind, path, body = following
                self._retried(kind)
                log.log(logging.WARNING if resume.resumes > resumes else logging.INFO,
                        "%s; %s with another exchange after %d tokens", e, kind, resume.before)  # fmt: skip

    async def _vllm(
        self, request: web.Request, path: str, body: dict, blocks: list[int], carry: Carry
    ) -> web.StreamResponse:
        """Prefill (retried over the prefill servers), then decode; a decode server that fails before its
        answer starts: the exchange again, with another one."""
        tried: set[str] = set()
        failures: list[str] = []
        for attempt in itertools.count():
            decode = self._pick(self.decode, tried, blocks)
            if decode is None:
                raise NoPod(pd.no_pod_message("decode", failures, self.decode.specs))
            rid = f"nf-{uuid.uuid4().hex}"  # one per exchange: the prefill's KV cache is kept under it
            headers = {pd.REQUEST_ID_HEADER: rid}
            kv, prefill_url = await self._vllm_prefill(path, body, headers, blocks)
            if attempt:
                self._retried("decode")
            try:
                decode_body = pd.vllm_decode_body(body, kv, prefill_url)
                response = await self._post(self.decode, decode, path, decode_body, headers,
                                            self.peer_timeout if pd.streams(body) else None)  # fmt: skip
                self._sent(self.decode, decode, blocks)
                return await self._answer(request, decode, response, carry)
            except PeerFailed as e:
                failures.append(str(e))
                log.warning("request %s: decode server failed (%s); starting over on another one", rid, e)
        raise AssertionError("unreachable")

    async def _vllm_prefill(
        self, path: str, body: dict, headers: dict, blocks: list[int]
    ) -> tuple[dict, str]:
        """The prefill server's `kv_transfer_params` and URL, from the first prefill server that gives them;
        NoPod when none does."""
        tried: set[str] = set()
        failures: list[str] = []
        while (peer := self._pick(self.prefill, tried, blocks)) is not None:
            if failures:
                self._retried("prefill")
            try:
                prefill_body = pd.vllm_prefill_body(body)
                response = await self._post(
                    self.prefill, peer, path, prefill_body, headers, self.peer_timeout
                )
                try:
                    kv = pd.vllm_kv_params(await response.json(content_type=None))
                    self._sent(self.prefill, peer, blocks)
                    return kv, peer.url
                except (ValueError, *PEER_FAILURES) as e:  # not JSON, no kv_transfer_params, a broken read
                    self.prefill.failed(peer.url, str(e))
                    raise PeerFailed(f"{peer.url}: {e}") from None
                finally:
                    response.release()
            except PeerFailed as e:
                failures.append(str(e))
                log.warning("request %s: prefill server failed (%s)", headers[pd.REQUEST_ID_HEADER], e)
        raise NoPod(pd.no_pod_message("prefill", failures, self.prefill.specs))

    async def _sglang(
        self, request: web.Request, path: str, body: dict, blocks: list[int], carry: Carry
    ) -> web.StreamResponse:
        """The same request to a prefill and a decode server at once, paired by the bootstrap fields. The
        prefill server's outcome is awaited first: when it fails the decode server would wait for a KV cache
        that never comes, so its request is cancelled and both start over (a new room)."""
        tried_prefill: set[str] = set()
        tried_decode: set[str] = set()
        failures: list[str] = []
        prefill = decode = None
        while True:
            prefill = prefill or self._pick(self.prefill, tried_prefill, blocks)
            if prefill is None:
                raise NoPod(pd.no_pod_message("prefill", failures, self.prefill.specs))
            decode = decode or self._pick(self.decode, tried_decode, blocks)
            if decode is None:
                raise NoPod(pd.no_pod_message("decode", failures, self.decode.specs))
            sent = pd.sglang_body(body, pd.bootstrap_host(prefill.url), self.bootstrap_port, pd.new_room())
            read = (
                self.peer_timeout if pd.streams(body) else None
            )  # a whole answer comes after all its tokens
            loop = asyncio.get_running_loop()
            to_decode = loop.create_task(self._post(self.decode, decode, path, sent, {}, read))
            try:  # a prefill server answers once the prompt is prefilled: longer silence is a failure
                prefilled = await self._post(self.prefill, prefill, path, sent, {}, self.peer_timeout)
            except (PeerFailed, Refused, asyncio.CancelledError) as e:  # cancelled: the client left
                await _cancel(to_decode)
                if not isinstance(e, PeerFailed):
                    raise
                failures.append(str(e))
                log.warning("room %d: prefill server failed (%s); trying another", sent["bootstrap_room"], e)
                self._retried("prefill")
                prefill = None
                continue
            self._drain(prefilled)  # read to its end: a prefill server whose client leaves aborts the request
            self._sent(self.prefill, prefill, blocks)
            try:
                response = await to_decode
            except PeerFailed as e:
                failures.append(str(e))
                log.warning("room %d: decode server failed (%s); trying another", sent["bootstrap_room"], e)
                self._retried("decode")
                decode = None
                continue
            self._sent(self.decode, decode, blocks)
            try:
                return await self._answer(request, decode, response, carry)
            except PeerFailed as e:
                failures.append(str(e))
                self._retried("decode")
                decode = None

    def _drain(self, response: aiohttp.ClientResponse) -> None:
        async def drain() -> None:
            with contextlib.suppress(*PEER_FAILURES):
                await response.read()
            response.release()

        task = asyncio.get_running_loop().create_task(drain())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _answer(
        self, request: web.Request, decode: Peer, response: aiohttp.ClientResponse, carry: Carry
    ) -> web.StreamResponse:
        """The decode server's answer, as the client's: a whole one read first (a broken read is the pod's
        failure, retried), a stream passed on as it comes, event by event through `carry.resume` where it
        may be resumed (its break is then StreamCut; else its last event says it broke)."""
        ctype = response.headers.get("Content-Type", "application/json")
        streamed = ctype.startswith("text/event-stream")
        if not streamed:
            try:
                data = await response.read()
            except PEER_FAILURES as e:
                self.decode.failed(decode.url, str(e))
                raise PeerFailed(f"{decode.url}: the answer broke off: {e or type(e).__name__}") from None
            finally:
                response.release()
            if carry.out is not None:  # a resumed stream answered whole: not a continuation
                raise StreamCut(f"the decode server {decode.url} answered the resumed stream unstreamed")
            return web.Response(status=response.status, body=data, headers={"Content-Type": ctype})
        if carry.out is None:
            carry.out = web.StreamResponse(
                status=response.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"}
            )
            await carry.out.prepare(request)
        out, resume = carry.out, carry.resume
        try:
            async for chunk in response.content.iter_any():
                data = chunk if resume is None else resume.feed(chunk)
                if request.transport is None or request.transport.is_closing():
                    return out  # the client left: its request ends here
                await out.write(data)
            if resume is not None:
                resume.ended()
        except (*PEER_FAILURES, StreamBroken) as e:  # the stream has started
            if request.transport is None or request.transport.is_closing():
                return out  # the client left (a write to it failed)
            if resume is not None and isinstance(e, StreamBroken) and not resume.broke():
                raise StreamCut(str(e)) from None  # (a choice ended, the next goes on: the server is well)
            self.decode.failed(decode.url, str(e))
            message = f"the decode server {decode.url} failed mid-stream: {e or type(e).__name__}"
            log.warning(message)
            if resume is not None:
                raise StreamCut(message) from None
            await out.write(f"data: {json.dumps(openai_error_body(502, message))}\n\n".encode())
        finally:
            response.release()
        await out.write_eof()
        return out


async def _end_with_error(out: web.StreamResponse, status: int, message: str) -> web.StreamResponse:
    """A started stream that cannot go on: its last event is the error."""
    await out.write(f"data: {json.dumps(openai_error_body(status, message))}\n\n".encode())
    await out.write_eof()
    return out


async def _cancel(task: asyncio.Task) -> None:
    """Cancel a peer call; a response that already came is released."""
    task.cancel()
    try:
        response = await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # the caller itself is being cancelled: pass it on
        return
    except (PeerFailed, Refused):
        return
    response.release()
