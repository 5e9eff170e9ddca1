"""The router role: the model's public endpoint when prefill and decode run in separate pods. It offers the
HTTP server the same backend surface as a local engine (tokenizer, limits, generate...), and runs each
request as the exchange of docs/disaggregation.md: reserve a KV lease on a decode pod, have a prefill pod
run the prompt and push its KV cache into it, then stream the decode pod's tokens. A decode pod that fails
before streaming is replaced by the next one; when no pod can serve, the request fails clearly.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import socket
from collections.abc import AsyncIterator, Callable, Sequence

import aiohttp

from .engine import EngineFailed, Limits, RequestOutput
from .sampling_params import InvalidRequest, SamplingParams
from .scheduler import FinishReason
from .tokenizer import Tokenizer


def resolve_peers(specs: Sequence[str]) -> list[str]:
    """Peer URLs: http://host:port as given; dns://name:port becomes one URL per address the name resolves to
    (every pod behind a headless Service). A name that does not resolve contributes none."""
    out: list[str] = []
    for spec in specs:
        if spec.startswith("dns://"):
            host, _, port = spec.removeprefix("dns://").rpartition(":")
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except (socket.gaierror, ValueError):
                continue
            for family, _, _, _, address in infos:
                ip = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                url = f"http://{ip}:{address[1]}"
                if url not in out:
                    out.append(url)
        elif spec.startswith(("http://", "https://")):
            out.append(spec.rstrip("/"))
        else:
            raise ValueError(f"peer {spec!r}: use http://host:port or dns://name:port")
    return out


class RemoteBackend:
    """A backend whose requests run on prefill and decode peers (http://host:port, or dns://name:port
    re-resolved for every request, so pods behind a headless Service come and go)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int],
        limits: Limits,
        prefill: Sequence[str],
        decode: Sequence[str],
        token: str,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("--role router needs at least one --prefill and one --decode peer URL")
        self.tokenizer, self.eos_ids, self.limits = tokenizer, eos_ids, limits
        self.prefill_specs, self.decode_specs = list(prefill), list(decode)
        resolve_peers([*prefill, *decode])  # malformed specs fail at start-up
        self.headers = {"Authorization": f"Bearer {token}"}
        self.error: BaseException | None = None
        self.alive = True
        self.in_flight = 0
        self._ids = itertools.count()
        self._turn = itertools.count()  # round-robin over prefill pods
        self._session: aiohttp.ClientSession | None = None

    # ---- the backend surface the HTTP server uses ----

    @property
    def num_requests(self) -> int:
        return self.in_flight

    @property
    def num_pending(self) -> int:
        return 0

    def load_gauges(self) -> list[tuple[str, str, Callable[[], float]]]:
        return [("vllm:num_requests_running", "Requests routed and not finished.", lambda: self.in_flight)]

    def add_step_observer(self, observer) -> None:
        """A router takes no engine steps."""

    def shutdown(self) -> None:
        self.alive = False

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequest("the prompt is empty; send at least one token", "prompt")
        if len(ids) > self.limits.max_prompt_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; the longest this deployment accepts is "
                f"{self.limits.max_prompt_len}",
                "prompt",
            )
        room = self.limits.max_seq_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequest(
                f"max_tokens {params.max_tokens} plus the prompt's {len(ids)} tokens exceeds the slot length "
                f"{self.limits.max_seq_len}; at most {room} new tokens fit",
                "max_tokens",
            )

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check(ids, params)
        rid = request_id or f"route-{next(self._ids)}"
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=None)
            )
        self.in_flight += 1
        try:
            failures = []
            decode_pods = resolve_peers(self.decode_specs)
            if not decode_pods:
                raise EngineFailed(
                    f"no decode pod is reachable ({', '.join(self.decode_specs)} resolve to none)"
                )
            for decode in decode_pods:  # the first decode pod that reserves serves the request
                try:
                    async for out in self._run(decode, rid, ids, params):
                        yield out
                    return
                except (aiohttp.ClientError, OSError, RuntimeError) as e:
                    failures.append(f"{decode}: {e}")
            raise EngineFailed("no decode pod could serve the request: " + "; ".join(failures))
        finally:
            self.in_flight -= 1

    async def _run(self, decode: str, rid: str, ids: list[int], params: SamplingParams):
        s = self._session
        assert s is not None
        async with s.post(
            f"{decode}/internal/reserve", json={"request": rid, "prompt_tokens": len(ids)}
        ) as r:
            if r.status != 200:
                raise RuntimeError(f"reserve answered {r.status}")
            lease = await r.json()
        prefill_pods = resolve_peers(self.prefill_specs)
        push = {"request": rid, "prompt_ids": ids, "agent": lease["agent"], "region": lease["region"]}
        if prefill_pods:  # none: the decode pod prefills itself after its wait
            prefill = prefill_pods[next(self._turn) % len(prefill_pods)]
            try:
                async with s.post(f"{prefill}/internal/prefill", json=push) as r:
                    await r.read()  # a failed push is not fatal: the decode pod prefills itself
            except (aiohttp.ClientError, OSError):
                pass
        body = {
            "lease": lease["lease"],
            "request": rid,
            "prompt_ids": ids,
            "params": dataclasses.asdict(params),
        }
        async with s.post(f"{decode}/internal/decode", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"decode answered {r.status}")
            async for line in r.content:
                if not line.strip():
                    continue
                item = json.loads(line)
                reason = item.get("finish_reason")
                yield RequestOutput(
                    request_id=rid,
                    token_ids=item["token_ids"],
                    text=item["text"],
                    finish_reason=FinishReason(reason) if reason else None,
                    prompt_tokens=item.get("prompt_tokens", len(ids)),
                    completion_tokens=item.get("completion_tokens", 0),
                )
