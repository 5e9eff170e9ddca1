"""The internal endpoints of the prefill and decode roles (docs/disaggregation.md), as aiohttp routes that
a runtime server adds to its app. Every internal endpoint requires the per-model bearer token; a call
without it gets 401 and changes nothing.

- decode: `POST /internal/reserve` leases a KV staging region and answers with the transfer agent's
  metadata and the lease's key (only writes that hold it land: the router hands it to the prefill pod it
  chooses); `POST /internal/decode` waits for the prefill pod's verified writes, imports them into a free slot
  (whose prefill then computes only the last prompt token) and streams the tokens as JSON lines.
- prefill: `POST /internal/prefill` runs a prompt and writes its KV cache, layer by layer, into the decode
  pod's lease; it answers with the first token once every write was verified, or 502 with the reason
  (`corrupt`, `refused`, `transfer_timeout`, `transfer_failed`) that the decode pod then counts.
- both: `GET /internal/status` answers the pod's identity (its transfer agent's name, new at every start),
  role and load, for the router's health checks and its choice of pods.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from neuronfleet.runtime.engine.engine import AsyncEngine
from neuronfleet.runtime.kv.kv_transfer import (
    KEY_BYTES,
    Descriptor,
    IntegrityError,
    TransferError,
    TransferTimeout,
)
from neuronfleet.runtime.kv.leases import LeasePool, NoRegionFree
from neuronfleet.runtime.serving.api_requests import decode_json
from neuronfleet.runtime.serving.backend import check_fits
from neuronfleet.runtime.serving.errors import EngineFailed, InvalidRequest, QueueFull
from neuronfleet.runtime.serving.output_constraints import OutputConstraint
from neuronfleet.runtime.serving.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# why a decode pod prefilled a request itself (neuronfleet:kv_fallbacks{reason}); the first four come from the
# prefill pod through the router
FALLBACK_REASONS = (
    "corrupt", "refused", "transfer_timeout", "transfer_failed", "prefill_failed", "prefill_busy",
    "no_prefill_pod", "lease_expired", "no_free_slot",
)  # fmt: skip


def _authorized(request: web.Request, token: str) -> None:
    # (aiohttp keeps a header's bytes that are not UTF-8 as surrogates: compared as the bytes that came)
    given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        raise web.HTTPUnauthorized(
            reason="the internal endpoints need the model's token (Authorization: Bearer)"
        )


def _lease_key(given: object) -> bytes | None:
    """A lease key as the reserve answer gives it (hex), or None when it is not one."""
    try:
        key = bytes.fromhex(given) if isinstance(given, str) else b""
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None


async def _json(request: web.Request) -> dict[str, Any]:
    """The body, a JSON object (bounded: `api_requests.decode_json`), or InvalidRequest."""
    body = decode_json(await request.read())
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", "body")
    return body


def _invalid(e: InvalidRequest) -> web.Response:
    """A refused body, as the router reads it (and passes it on to its client)."""
    return web.json_response({"error": str(e), "param": e.field_name}, status=400)


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string", name)
    return value


def _token_ids(body: dict[str, Any]) -> list[int]:
    ids = body.get("prompt_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise InvalidRequest("prompt_ids must be a non-empty list of token ids (integers)", "prompt_ids")
    return ids


class KVMetrics:
    """The handoff's metrics, in the server's registry: bytes and seconds of transfers, fallbacks by reason,
    leases (active, expired), and the role's queue (requests waiting for their KV cache or their prefill)."""

    def __init__(
        self, registry: CollectorRegistry | None, model_name: str, leases: LeasePool | None = None,
        role: str = "decode",
    ):  # fmt: skip
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
        self.queued = 0  # requests in the role's queue: waiting for KV (decode) or being prefilled (prefill)
        Gauge(
            "neuronfleet:role_queue_requests", "Requests in the role's own queue: decode pods count those "
            "waiting for their KV cache, prefill pods those being prefilled and pushed.",
            ["model_name", "role"], registry=registry,
        ).labels(**labels, role=role).set_function(lambda: self.queued)  # fmt: skip
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

    def fallback(self, reason: str, request_id: str, detail: str = "") -> None:
        log.warning("request %s: prefilling on the decode pod (%s) %s", request_id, reason, detail)
        self.fallbacks.labels(**self.labels, reason=reason).inc()


def _status(engine: AsyncEngine, agent, role: str, **extra) -> dict[str, Any]:
    slots = engine.limits.slots
    return {
        "identity": agent.name,
        "role": role,
        "model": agent.model_id,
        "slots": slots,
        "running": engine.num_requests - engine.num_pending,
        "waiting": engine.num_pending,
        "kv_usage": engine.kv_usage,  # a router reports its decode pods' mean (vllm:kv_cache_usage_perc)
        "ready": engine.alive,
        **({"kv_events": engine.kv_events_endpoint} if engine.kv_events_endpoint else {}),
        **({"kv_events_replay": engine.kv_events_replay} if engine.kv_events_replay else {}),
        **({"kv_events_auth": engine.kv_events_auth} if engine.kv_events_auth else {}),
        **extra,
    }


async def _chain(first, rest):
    yield first
    async for out in rest:
        yield out


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
        return [
            web.post("/internal/reserve", self.reserve),
            web.post("/internal/decode", self.decode),
            web.get("/internal/status", self.status),
        ]

    async def status(self, request: web.Request) -> web.Response:
        _authorized(request, self.token)
        self.leases.sweep()
        free = len(self.leases.free)
        return web.json_response(_status(self.engine, self.agent, "decode", leases_free=free))

    async def reserve(self, request: web.Request) -> web.Response:
        _authorized(request, self.token)
        try:
            body = await _json(request)
            rid, tokens = _text(body, "request"), body.get("prompt_tokens")
            if type(tokens) is not int:
                raise InvalidRequest("prompt_tokens must be an integer", "prompt_tokens")
            check_fits(self.engine.limits, tokens, None)  # the refusal a unified pod gives, passed on as is
            lease = self.leases.reserve(rid, tokens)
        except NoRegionFree as e:
            return web.json_response({"error": str(e)}, status=503, headers={"Retry-After": "1"})
        except InvalidRequest as e:
            return _invalid(e)
        except (TypeError, ValueError) as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(
            {
                "lease": lease.lease_id,
                "region": lease.region,
                "key": lease.key.hex(),  # for the prefill pod this router chooses, and no one else
                "agent": self.agent.metadata(),
                "expires_in": self.leases.ttl,
                "layers": self.leases.shape[0],
            }
        )

    async def _take_kv(self, lease_id, rid: str, ids: list[int], kv_state) -> bool:
        """Import the handed-over KV cache into a free slot; False (counted, logged) when the request must
        prefill here instead. `kv_state` is what the router learned from the prefill pod: "ready", or
        {"failed": reason, "detail": ...}; or "local" for a prompt the router sends no prefill pod (short)."""
        if kv_state == "local":
            return False
        if isinstance(kv_state, dict):
            reason = str(kv_state.get("failed"))
            self.metrics.fallback(reason if reason in FALLBACK_REASONS else "transfer_failed", rid,
                                  str(kv_state.get("detail", "")))  # fmt: skip
            return False
        started = asyncio.get_running_loop().time()
        try:
            self.leases.kv(lease_id)  # still live?
            for layer in range(self.leases.shape[0]):
                await self.agent.wait_notification(f"{rid}:{layer}", timeout=self.wait_seconds)
            kv = self.leases.kv(lease_id)
        except TransferError as e:  # the handoff never completed: the request prefills here (slower, correct)
            self.metrics.fallback("transfer_timeout", rid, str(e))
            return False
        except KeyError as e:
            self.metrics.fallback("lease_expired", rid, str(e))
            return False
        if await self.engine.call(lambda e: e.import_prefix(ids, kv)) is None:
            self.metrics.fallback("no_free_slot", rid)
            return False
        self.metrics.bytes.inc(kv.numel() * kv.element_size())
        self.metrics.seconds.observe(asyncio.get_running_loop().time() - started)
        return True

    async def decode(self, request: web.Request) -> web.StreamResponse:
        _authorized(request, self.token)
        try:
            body = await _json(request)
            lease_id, kv = body.get("lease"), body.get("kv", "ready")
            if lease_id is not None and not isinstance(lease_id, str):
                raise InvalidRequest(
                    "lease must be the reserve answer's lease id (a string) or null", "lease"
                )
            if kv not in ("ready", "local") and not isinstance(kv, dict):
                raise InvalidRequest('kv must be "ready", "local" or {"failed": reason}', "kv")
        except InvalidRequest as e:
            return _invalid(e)
        try:
            rid, ids = _text(body, "request"), _token_ids(body)
            # the client's sampling parameters as the router parsed them (dataclasses.asdict)
            given = body.get("params") or {}
            if not isinstance(given, dict):
                raise InvalidRequest("params must be an object of sampling parameters", "params")
            stop = given.get("stop") or ()
            if not isinstance(stop, list | tuple):
                raise InvalidRequest("params: stop must be a list of strings", "params")
            constraint = given.get("constraint")
            if constraint is not None and not isinstance(constraint, dict):
                raise InvalidRequest(
                    "params: constraint must be an object {kind, grammar, field, prefix}", "params"
                )
            if constraint is not None:
                constraint = OutputConstraint(**constraint)
            params = SamplingParams(**{**given, "stop": tuple(stop), "constraint": constraint})
        except InvalidRequest as e:
            self.leases.release(lease_id)  # nothing will use it: free it now, not at expiry
            return _invalid(e)
        except (TypeError, ValueError) as e:  # (SamplingParams given a name it does not take)
            self.leases.release(lease_id)
            return _invalid(InvalidRequest(f"params: {e}", "params"))
        self.metrics.queued += 1
        try:
            imported = await self._take_kv(lease_id, rid, ids, kv)
        finally:
            self.metrics.queued -= 1
            self.leases.release(lease_id)
            self.agent.discard_notifications(f"{rid}:")  # of a push that failed half-way
        outputs = self.engine.generate(ids, params, request_id=rid)
        try:  # refusals come before the first output, while an HTTP status can still say so
            first = await anext(outputs)
        except InvalidRequest as e:  # the router passes it on to its client as it is
            return web.json_response({"error": str(e), "param": e.field_name}, status=400)
        except (QueueFull, EngineFailed) as e:
            return web.json_response({"error": str(e)}, status=503, headers={"Retry-After": "1"})
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        async for out in _chain(first, outputs):
            line = {
                "token_ids": out.token_ids,
                "text": out.text,
                "finished": out.finished,
                "imported": imported,
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
            }
            if out.logprobs is not None:  # one [logprob, [[id, logprob], ...]] per token
                line["logprobs"] = [[lp.logprob, [list(t) for t in lp.top]] for lp in out.logprobs]
            if out.finished:
                line["finish_reason"] = str(out.finish_reason)
            if out.error:
                line["error"] = out.error
            await response.write(json.dumps(line).encode() + b"\n")
        await response.write_eof()
        return response


class PrefillRole:
    """Runs prompts and pushes their KV caches into decode pods' leases."""

    def __init__(
        self, engine: AsyncEngine, agent, token: str, timeout: float = 30.0, metrics: KVMetrics | None = None
    ) -> None:
        self.engine, self.agent, self.token, self.timeout = engine, agent, token, timeout
        self.metrics = metrics or KVMetrics(None, "model", role="prefill")

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/internal/prefill", self.prefill), web.get("/internal/status", self.status)]

    async def status(self, request: web.Request) -> web.Response:
        _authorized(request, self.token)
        return web.json_response(_status(self.engine, self.agent, "prefill", queued=self.metrics.queued))

    async def prefill(self, request: web.Request) -> web.Response:
        _authorized(request, self.token)
        try:
            body = await _json(request)
            ids, rid, remote, region, key = (
                _token_ids(body),
                _text(body, "request"),
                body.get("agent"),
                _text(body, "region"),
                _lease_key(body.get("key")),
            )
            if not isinstance(remote, dict):
                raise InvalidRequest("agent must be the decode pod's agent (an object)", "agent")
            # a prompt the engine would refuse (too long, ids outside the vocabulary), said as a unified pod
            # says it (checked here, on the event loop, as AsyncEngine.generate checks)
            self.engine.engine.make_request(ids, SamplingParams(max_tokens=1))
        except InvalidRequest as e:
            return _invalid(e)
        if key is None:
            why = f"key must be the lease key of the decode pod's reserve answer ({2 * KEY_BYTES} hex digits)"
            return web.json_response({"error": why}, status=400)
        self.metrics.queued += 1
        try:
            return await self._prefill(rid, ids, remote, region, key)
        finally:
            self.metrics.queued -= 1

    async def _prefill(self, rid: str, ids: list[int], remote: dict, region: str, key: bytes) -> web.Response:
        into = self.agent.export_buffer  # the keys and values go straight into memory the agent sends from
        try:
            first, kv = await self.engine.call(lambda e: e.prefill_and_export(ids, into=into))
        except QueueFull as e:
            return web.json_response({"error": str(e), "reason": "prefill_busy"}, status=503)
        try:
            return await self._push(rid, kv, remote, Descriptor(region, 0, 0, key), first)
        finally:
            self.agent.release_export(kv)

    async def _push(
        self, rid: str, kv: torch.Tensor, remote: dict, lease: Descriptor, first: int
    ) -> web.Response:
        per_layer = kv[0].numel() * kv.element_size()
        transfers = []
        for layer in range(kv.shape[0]):  # layer by layer, each notified as `<request>:<layer>`
            where = Descriptor(lease.region, layer * per_layer, per_layer, lease.key)
            transfers.append(self.agent.write_nowait(remote, kv[layer].contiguous(), where, f"{rid}:{layer}"))
        try:
            await asyncio.gather(*(t.wait(self.timeout) for t in transfers))
        except TransferError as e:
            if isinstance(e, IntegrityError):
                reason = "corrupt" if "checksum" in str(e) else "refused"
            else:  # stalled or broken: later pushes to that pod start on a fresh connection
                reason = "transfer_timeout" if isinstance(e, TransferTimeout) else "transfer_failed"
                self.agent.abandon(remote, str(e))
            log.warning("request %s: the KV push failed (%s): %s", rid, reason, e)
            return web.json_response({"error": f"the KV transfer failed: {e}", "reason": reason}, status=502)
        return web.json_response({"first_token": first, "bytes": per_layer * len(transfers)})
