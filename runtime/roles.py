"""The internal endpoints of the prefill and decode roles (docs/disaggregation.md), as aiohttp routes that
a runtime server adds to its app. Every internal endpoint requires the per-model bearer token; a call
without it gets 401 and changes nothing.

- decode: `POST /internal/reserve` leases a KV staging region and answers with the transfer agent's
  metadata; `POST /internal/decode` waits for the prefill pod's verified writes, imports them into a free slot
  (whose prefill then computes only the last prompt token) and streams the tokens as JSON lines.
- prefill: `POST /internal/prefill` runs a prompt and writes its KV cache, layer by layer, into the decode
  pod's lease; it answers with the first token once every write was verified.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .engine import AsyncEngine
from .kv_transfer import Descriptor, TransferError
from .leases import LeasePool, NoRegionFree
from .sampling_params import SamplingParams


def _authorized(request: web.Request, token: str) -> None:
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise web.HTTPUnauthorized(
            reason="the internal endpoints need the model's token (Authorization: Bearer)"
        )


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps({"error": "the body must be a JSON object"}),
                                 content_type="application/json")  # fmt: skip
    return body


class KVMetrics:
    """The handoff's metrics, in the server's registry: bytes and seconds of transfers, fallbacks by reason,
    leases (active, expired)."""

    def __init__(self, registry: CollectorRegistry | None, model_name: str, leases: LeasePool | None = None):
        registry = registry or CollectorRegistry()
        labels = {"model_name": model_name}
        self.bytes = Counter(
            "neuronfleet:kv_transfer_bytes", "KV cache bytes received.", ["model_name"], registry=registry
        ).labels(**labels)
        self.seconds = Histogram(
            "neuronfleet:kv_transfer_seconds", "Time to hand a request's KV cache over (all layers).",
            ["model_name"], buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30), registry=registry,
        ).labels(**labels)  # fmt: skip
        self.fallbacks = Counter(
            "neuronfleet:kv_fallbacks", "Requests the decode pod prefilled itself, by reason.",
            ["model_name", "reason"], registry=registry,
        )  # fmt: skip
        self.labels = labels
        if leases is not None:
            for name, doc, fn in (
                (
                    "neuronfleet:kv_leases_active",
                    "KV staging regions leased now.",
                    lambda: len(leases.leases),
                ),
                (
                    "neuronfleet:kv_lease_expiries",
                    "Leases that expired before their handoff.",
                    lambda: leases.expired,
                ),
            ):
                Gauge(name, doc, ["model_name"], registry=registry).labels(**labels).set_function(fn)

    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(**self.labels, reason=reason).inc()


class DecodeRole:
    """Leases and the handoff into this pod's engine."""

    def __init__(
        self, engine: AsyncEngine, agent, leases: LeasePool, token: str, wait_seconds: float = 30.0,
        metrics: KVMetrics | None = None,
    ):  # fmt: skip
        self.engine, self.agent, self.leases, self.token = engine, agent, leases, token
        self.wait_seconds = wait_seconds
        self.metrics = metrics or KVMetrics(None, "model", leases)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/internal/reserve", self.reserve), web.post("/internal/decode", self.decode)]

    async def reserve(self, request: web.Request) -> web.Response:
        _authorized(request, self.token)
        body = await _json(request)
        try:
            lease = self.leases.reserve(str(body.get("request")), int(body.get("prompt_tokens", 0)))
        except NoRegionFree as e:
            return web.json_response({"error": str(e)}, status=503, headers={"Retry-After": "1"})
        except (TypeError, ValueError) as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(
            {
                "lease": lease.lease_id,
                "region": lease.region,
                "agent": self.agent.metadata(),
                "expires_in": self.leases.ttl,
                "layers": self.leases.shape[0],
            }
        )

    async def decode(self, request: web.Request) -> web.StreamResponse:
        _authorized(request, self.token)
        body = await _json(request)
        lease_id, rid, ids = body.get("lease"), str(body.get("request")), body.get("prompt_ids")
        if not isinstance(ids, list) or not ids:
            return web.json_response(
                {"error": "prompt_ids must be a non-empty list of token ids"}, status=400
            )
        try:  # the client's sampling parameters as the router parsed them (dataclasses.asdict)
            given = dict(body.get("params") or {})
            params = SamplingParams(**{**given, "stop": tuple(given.get("stop") or ())})
        except (TypeError, ValueError) as e:
            self.leases.release(lease_id)  # nothing will use it: free it now, not at expiry
            return web.json_response({"error": f"params: {e}"}, status=400)
        imported, started = False, asyncio.get_running_loop().time()
        try:
            for layer in range(self.leases.shape[0]):
                await self.agent.wait_notification(f"{rid}:{layer}", timeout=self.wait_seconds)
            kv = self.leases.kv(lease_id)
            imported = await self.engine.call(lambda e: e.import_prefix(ids, kv)) is not None
            if imported:
                self.metrics.bytes.inc(kv.numel() * kv.element_size())
                self.metrics.seconds.observe(asyncio.get_running_loop().time() - started)
            else:
                self.metrics.fallback("no_free_slot")
        except TransferError:  # the handoff never completed: the request prefills here (slower, correct)
            self.metrics.fallback("transfer_timeout")
        except KeyError:
            self.metrics.fallback("lease_expired")
        finally:
            self.leases.release(lease_id)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        async for out in self.engine.generate(ids, params, request_id=rid):
            line = {
                "token_ids": out.token_ids,
                "text": out.text,
                "finished": out.finished,
                "imported": imported,
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
            }
            if out.finished:
                line["finish_reason"] = str(out.finish_reason)
            await response.write(json.dumps(line).encode() + b"\n")
        await response.write_eof()
        return response


class PrefillRole:
    """Runs prompts and pushes their KV caches into decode pods' leases."""

    def __init__(self, engine: AsyncEngine, agent, token: str, timeout: float = 30.0) -> None:
        self.engine, self.agent, self.token, self.timeout = engine, agent, token, timeout

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/internal/prefill", self.prefill)]

    async def prefill(self, request: web.Request) -> web.Response:
        _authorized(request, self.token)
        body = await _json(request)
        ids, rid, remote, region = (
            body.get("prompt_ids"),
            str(body.get("request")),
            body.get("agent"),
            body.get("region"),
        )
        if not isinstance(ids, list) or not ids or not isinstance(remote, dict) or not region:
            return web.json_response({"error": "prompt_ids, agent and region are required"}, status=400)
        first, kv = await self.engine.call(lambda e: e.prefill_and_export(ids))
        per_layer = kv[0].numel() * kv.element_size()
        transfers = []
        for layer in range(kv.shape[0]):  # layer by layer, each notified as `<request>:<layer>`
            where = Descriptor(region, layer * per_layer, per_layer)
            transfers.append(self.agent.write_nowait(remote, kv[layer].contiguous(), where, f"{rid}:{layer}"))
        try:
            await asyncio.gather(*(t.wait(self.timeout) for t in transfers))
        except TransferError as e:
            return web.json_response({"error": f"the KV transfer failed: {e}"}, status=502)
        return web.json_response({"first_token": first, "bytes": per_layer * len(transfers)})
