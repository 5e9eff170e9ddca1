"""The runtime's HTTP server (aiohttp) over a `Backend` (the local engine, or the router's remote backend).

OpenAI: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`; TGI: `POST /generate`,
`POST /generate_stream`, `POST /` (TGI's compat route), `GET /info`; `GET /health`, `GET /ready`,
`GET /metrics` (Prometheus, vLLM's metric names). Streams are server-sent events. Bad input gets a 4xx in the
API's own error format (a `ServingError` carries its status per API); a full queue, or an expected wait for
a slot past `--max-queue-wait`, gets 429 (OpenAI) or 503 (TGI) with Retry-After (`engine.admission`); a
draining server's refusals and hand-backs 503 with Retry-After, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from neuronfleet.contract import BODY_TIMEOUT, HEADER_TIMEOUT
from neuronfleet.runtime.serving import tool_calls
from neuronfleet.runtime.serving.api_requests import (
    OPENAI_DEFAULTS,
    ParsedRequest,
    decode_json,
    parse_openai_chat,
    parse_openai_completion,
    parse_tgi_generate,
)
from neuronfleet.runtime.serving.backend import Backend, RequestOutput, TokenLogprobs
from neuronfleet.runtime.serving.engine_metrics import LATENCY_BUCKETS
from neuronfleet.runtime.serving.errors import (
    Draining,
    InvalidRequest,
    ServingError,
    openai_error_body,
    tgi_error_body,
)
from neuronfleet.runtime.serving.http_app import HttpApp, QuietProbesAccessLog, Site
from neuronfleet.runtime.serving.sampling_params import SamplingDefaults

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "1"


class Metrics:
    """Prometheus metrics of the requests served, named as vLLM names them, plus neuronfleet's own; the
    backend's load gauges and its own metrics in the same registry."""

    def __init__(self, backend: Backend, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)
        for name, doc, read in backend.load_gauges():
            Gauge(name, doc, names, registry=self.registry).labels(**labels).set_function(read)
        buckets = LATENCY_BUCKETS

        def histogram(name: str, doc: str):
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens of a stream.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency.")

        def counter(name: str, doc: str):
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.success = Counter(
            "vllm:request_success", "Finished requests.", [*names, "finished_reason"], registry=self.registry
        )
        self.rejected = Counter(
            "neuronfleet:requests_rejected", "Requests refused.", [*names, "reason"], registry=self.registry
        )
        self.labels = labels
        backend.register_metrics(self.registry, model_name)


class RuntimeServer(HttpApp):
    """Routes HTTP requests to the backend."""

    def __init__(
        self,
        backend: Backend,
        model_name: str,
        *,
        max_body_bytes: int = 1 << 20,
        extra_routes: Sequence[web.RouteDef] = (),
        on_startup: Sequence[Callable[[web.Application], Awaitable[None]]] = (),
        sampling_defaults: SamplingDefaults = OPENAI_DEFAULTS,
    ) -> None:
        """`extra_routes`: a role's internal endpoints (kv.roles); `on_startup`: what they start;
        `sampling_defaults`: what an OpenAI request that leaves a sampling field out gets."""
        self.backend = backend
        self.sampling_defaults = sampling_defaults
        self.served = Metrics(backend, model_name)
        super().__init__(model_name, max_body_bytes, self.served.registry)
        self.extra_routes = list(extra_routes)
        self.on_startup.extend(on_startup)
        self.created = int(time.time())

    def advertised(self) -> dict:
        """A unified pod's KV-cache events endpoint (and replay endpoint), for the front door that follows
        them; what it can continue."""
        said = {"kv_events": getattr(self.backend, "kv_events_endpoint", None),
                "kv_events_replay": getattr(self.backend, "kv_events_replay", None),
                "kv_events_auth": getattr(self.backend, "kv_events_auth", None)}  # fmt: skip
        # and that it continues an answer under its grammar and its reading for tool calls (a chat's
        # `constrain_final_message`, a completion's and TGI's `constrained_prefix`), so a front door may
        # resume such a stream on it
        return {**{k: v for k, v in said.items() if v}, "constrain_final_message": True}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/info", self.info),
            web.post("/generate", self.tgi_generate),
            web.post("/generate_stream", self.tgi_generate_stream),
            web.post("/", self.tgi_compat),
            *self.extra_routes,
        ]

    def error(self, path: str, status: int, message: str) -> web.Response:
        return self._error(path, status, message, None)

    def refusal(self, path: str, error: ServingError) -> web.Response:
        """A body refused before its handler, answered and counted as the handlers' refusals are."""
        return self._refusal(error, tgi=not path.startswith("/v1/"))

    def _error(self, path: str, status: int, message: str, param: str | None) -> web.Response:
        """An error in the format of the API that `path` belongs to."""
        if path.startswith("/v1/"):
            return self._openai_error(status, message, param)
        return self._tgi_error(status, message)

    # ---- plain endpoints -----------------------------------------------------------------------------------

    def not_alive(self) -> str | None:
        return f"engine failed: {self.backend.error!r}" if self.backend.error is not None else None

    def not_ready(self) -> str | None:
        return None if self.backend.alive else "engine failed"

    async def models(self, request: web.Request) -> web.Response:
        limits = self.backend.limits
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "neuronfleet",
                        "max_model_len": limits.max_seq_len,
                    }
                ],
            }
        )

    async def info(self, request: web.Request) -> web.Response:
        limits = self.backend.limits
        return web.json_response(
            {
                "model_id": self.model_name,
                "model_dtype": limits.dtype,
                "model_dtype_auto": limits.dtype_auto,
                "model_quantization": limits.quantization,
                "model_weights_dtype": limits.weights_dtype or limits.dtype,
                "model_device_type": limits.device,
                "max_concurrent_requests": limits.slots,
                "max_input_tokens": limits.max_prompt_len,
                "max_total_tokens": limits.max_seq_len,
                "max_batch_total_tokens": limits.slots * limits.max_seq_len,
                "max_waiting_tokens": 0,
                "validation_workers": 1,
                "max_best_of": 1,
                "max_stop_sequences": 16,
                "version": _version(),
                "router": "neuronfleet",
                # what an OpenAI request that leaves a sampling field out gets (the model's generation
                # config, under --override-generation-config)
                "sampling_defaults": self.sampling_defaults.as_dict(),
            }
        )

    # ---- shared request handling ---------------------------------------------------------------------------

    async def _body(self, request: web.Request):
        """The request's JSON (read by the middleware within its limits); InvalidRequest naming what is wrong
        (`decode_json`)."""
        return decode_json(await request.read())

    def _prompt(self, parsed: ParsedRequest) -> str | list[int]:
        if parsed.messages is not None:
            tools = parsed.tools.functions if parsed.tools is not None else None
            return self.backend.tokenizer.encode_chat(
                parsed.messages, parsed.add_generation_prompt, parsed.continue_final_message, tools
            )
        return parsed.prompt  # type: ignore[return-value]

    async def _stream(self, parsed: ParsedRequest) -> AsyncIterator[RequestOutput]:
        """Start a request; InvalidRequest and QueueFull are raised before anything is sent."""
        if self.refusing():
            raise Draining("the server is shutting down and takes no new requests; send it elsewhere")
        gen = self.backend.generate(self._prompt(parsed), parsed.params)
        start = time.monotonic()
        try:
            first = await anext(gen)  # raises before the response starts when the request is refused
        except asyncio.CancelledError:  # the client left while the request waited for its first token
            self._count_finished("abort", start)
            raise
        self.served.ttft.observe(time.monotonic() - start)
        self.served.prompt_tokens.inc(first.prompt_tokens)
        return self._timed(first, gen, start)

    async def _timed(self, first: RequestOutput, gen, start: float) -> AsyncIterator[RequestOutput]:
        last = time.monotonic()
        out = first
        finished = False
        try:
            while True:
                self.served.generation_tokens.inc(len(out.token_ids))
                yield out
                if out.finished:
                    finished = True
                    self._count_finished(str(out.finish_reason), start)
                    return
                out = await anext(gen)
                now = time.monotonic()
                self.served.itl.observe(now - last)
                last = now
        finally:
            await gen.aclose()  # a client that went away aborts the request and frees its slot
            if not finished:
                self._count_finished("abort", start)

    def _count_finished(self, reason: str, start: float) -> None:
        self.served.e2e.observe(time.monotonic() - start)
        self.served.success.labels(**self.served.labels, finished_reason=reason).inc()

    async def _collect(self, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        """The whole answer of a non-streaming request."""
        result = None
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if result is None:
                    result = out
                else:
                    result.absorb(out)
        assert result is not None and result.finished
        return result

    # ---- OpenAI --------------------------------------------------------------------------------------------

    def _openai_error(
        self, status: int, message: str, param: str | None = None, retry_after: int | None = None
    ) -> web.Response:
        headers = {"Retry-After": str(retry_after or RETRY_AFTER_SECONDS)} if status in (429, 503) else None
        return web.json_response(openai_error_body(status, message, param), status=status, headers=headers)

    def _refusal(self, error: ServingError, tgi: bool) -> web.Response:
        """The response for a request refused or failed before its answer started."""
        status = error.http_status(tgi)
        self.served.rejected.labels(**self.served.labels, reason=error.reason).inc()
        if tgi:
            return self._tgi_error(status, str(error), error.retry_after)
        return self._openai_error(status, str(error), error.field_name, error.retry_after)

    async def _choices(self, parsed: ParsedRequest) -> list[AsyncIterator[RequestOutput]]:
        """Start a request's `n` choices: the first, and once its prompt is prefilled (its first token out),
        the others at once, which find that prompt in the prefix cache and copy its keys and values instead
        of computing them again (where prefix reuse is on). Choice i samples with the request's seed + i (the
        same request gives the same choices). A choice refused closes those started, and the request is
        refused."""
        slots = self.backend.limits.slots
        if parsed.n > slots:
            raise InvalidRequest(
                f"n must be at most {slots}, the sequences this server runs at once; got {parsed.n}", "n"
            )
        first = await self._stream(parsed)
        if parsed.n == 1:
            return [first]
        seed = parsed.params.seed

        def choice(i: int) -> ParsedRequest:
            params = dataclasses.replace(parsed.params, seed=None if seed is None else (seed + i) % 2**63)
            return dataclasses.replace(parsed, params=params)

        started = await asyncio.gather(*(self._stream(choice(i)) for i in range(1, parsed.n)),
                                       return_exceptions=True)  # fmt: skip
        refused = next((s for s in started if isinstance(s, BaseException)), None)
        if refused is not None:
            for stream in [first, *started]:
                if not isinstance(stream, BaseException):
                    await stream.aclose()  # (frees its slot)
            raise refused
        return [first, *started]  # type: ignore[list-item]

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            parse = parse_openai_chat if chat else parse_openai_completion
            parsed = parse(body, self.sampling_defaults)
            model = body.get("model")
            if model is not None and model != self.model_name:
                return self._openai_error(
                    404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model"
                )
            choices = await self._choices(parsed)
        except ServingError as e:
            return self._refusal(e, tgi=False)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if parsed.stream:
            return await self._openai_sse(request, choices, rid, created, chat, parsed)
        results = await asyncio.gather(*(self._collect(c) for c in choices), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if isinstance(failed, ServingError):
            return self._refusal(failed, tgi=False)
        if failed is not None:
            raise failed
        prompt_tokens, completion_tokens = results[0].prompt_tokens, sum(r.completion_tokens for r in results)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
        answers = []
        reads_calls = parsed.tools is not None and parsed.tools.parsed
        for index, result in enumerate(results):
            logprobs = self._logprobs(chat, result.token_ids, result.logprobs, 0)[0]
            answer: dict = {"index": index}
            reason = str(result.finish_reason)
            if chat:
                content, calls = (
                    tool_calls.split_calls(result.text, parsed.answer_prefix)
                    if reads_calls
                    else (result.text, [])
                )
                answer["message"] = {"role": "assistant", "content": content}
                if calls:  # the answer called tools (OpenAI: finish_reason tool_calls where it ended itself)
                    answer["message"].update(
                        content=content or None, tool_calls=[c.as_openai() for c in calls]
                    )
                    reason = "tool_calls" if reason == "stop" else reason
            else:
                answer["text"] = result.text
            answer.update(logprobs=logprobs, finish_reason=reason)
            if parsed.return_token_ids:
                answer["token_ids"] = list(result.token_ids)
            answers.append(answer)
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": answers,
                "usage": usage,
            }
        )

    async def _openai_sse(self, request, choices, rid: str, created: int, chat: bool, parsed: ParsedRequest):
        include_usage = parsed.include_usage
        # with return_token_ids (vLLM's extension) the first event also carries the prompt's token ids (a
        # chat's on the event, a completion's on its choice), as the engine computes them
        prompt_ids = None
        if parsed.return_token_ids:
            prompt = self._prompt(parsed)
            prompt_ids = self.backend.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage=None, **extra) -> bytes:
            data = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": choices,
                **extra,
            }
            if include_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

        if chat:
            for index in range(len(choices)):
                role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}  # fmt: skip
                ids = {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}
                await resp.write(chunk([role], **ids))
                prompt_ids = None
        last: dict[int, RequestOutput] = {}
        # per choice, tokens whose log probabilities are not sent yet: they ride on the next event written (a
        # token whose text is held back, part of a character, writes none), with the completion's text offset
        pending_ids: dict[int, list[int]] = {i: [] for i in range(len(choices))}
        pending: dict[int, list[TokenLogprobs]] = {i: [] for i in range(len(choices))}
        offset = dict.fromkeys(range(len(choices)), 0)
        # a chat whose answer is read for tool calls: its text split as it comes (a call is sent whole, in
        # `delta.tool_calls`, once its block closes), and the calls sent so far
        calls = {i: tool_calls.CallStream(parsed.answer_prefix) for i in range(len(choices))}
        reads_calls = chat and parsed.tools is not None and parsed.tools.parsed
        try:
            async with contextlib.aclosing(_merged(choices)) as outputs:
                async for index, out in outputs:
                    last[index] = out
                    reason = str(out.finish_reason) if out.finish_reason else None
                    if out.logprobs is not None:
                        pending_ids[index] += out.token_ids
                        pending[index] += out.logprobs
                    text, called = out.text, []
                    if reads_calls:
                        text, done = calls[index].feed(out.text)
                        text += calls[index].end() if reason else ""
                        called = [c.as_openai(calls[index].calls - len(done) + k) for k, c in enumerate(done)]
                        reason = "tool_calls" if reason == "stop" and calls[index].calls else reason
                    if not (text or called or reason or (parsed.return_token_ids and out.token_ids)):
                        continue
                    logprobs, offset[index] = self._logprobs(
                        chat, pending_ids[index], pending[index] or None, offset[index]
                    )
                    pending_ids[index], pending[index] = [], []
                    if chat:
                        delta: dict = {"content": text} if text else {}
                        if called:
                            delta["tool_calls"] = called
                        choice = {
                            "index": index,
                            "delta": delta,
                            "logprobs": logprobs,
                            "finish_reason": reason,
                        }
                    else:
                        choice = {
                            "index": index,
                            "text": out.text,
                            "logprobs": logprobs,
                            "finish_reason": reason,
                        }
                    if parsed.return_token_ids:
                        choice["token_ids"] = list(out.token_ids)
                        if prompt_ids is not None:
                            choice["prompt_token_ids"], prompt_ids = prompt_ids, None
                    await resp.write(chunk([choice]))
        except ServingError as e:  # the stream has started: the error is its last event, with its own status
            err = openai_error_body(e.status, str(e))
            await resp.write(f"data: {json.dumps(err)}\n\n".encode())
        if include_usage and last:
            prompt_tokens = next(iter(last.values())).prompt_tokens
            completion_tokens = sum(out.completion_tokens for out in last.values())
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
            await resp.write(chunk([], usage))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _logprobs(
        self, chat: bool, ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None, offset: int
    ) -> tuple[dict | None, int]:
        """The tokens' log probabilities as a choice's `logprobs` (None where the request asked for none),
        and the text offset after them (`chat_logprobs`, `completion_logprobs`)."""
        if logprobs is None:
            return None, offset
        if chat:
            return chat_logprobs(self.backend.tokenizer, ids, logprobs), offset
        return completion_logprobs(self.backend.tokenizer, ids, logprobs, offset)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    # ---- TGI -----------------------------------------------------------------------------------------------

    def _tgi_error(self, status: int, message: str, retry_after: int | None = None) -> web.Response:
        headers = {"Retry-After": str(retry_after or RETRY_AFTER_SECONDS)} if status in (429, 503) else None
        return web.json_response(tgi_error_body(status, message), status=status, headers=headers)

    async def _tgi_start(self, request: web.Request, force_stream: bool | None):
        try:
            parsed = parse_tgi_generate(await self._body(request))
            stream = parsed.stream if force_stream is None else force_stream
            return parsed, stream, await self._stream(parsed)
        except ServingError as e:
            return self._refusal(e, tgi=True), None, None

    async def _tgi_complete(self, request: web.Request, compat: bool) -> web.StreamResponse:
        parsed, stream, outputs = await self._tgi_start(request, None if compat else False)
        if outputs is None:
            return parsed
        if stream:
            return await self._tgi_sse(request, parsed, outputs)
        try:
            result = await self._collect(outputs)
        except ServingError as e:
            return self._refusal(e, tgi=True)
        eos = self.backend.eos_ids
        finish = _tgi_finish_reason(result.finish_reason, result.token_ids, eos)
        body = {"generated_text": result.text}
        if parsed.details:
            logprobs = result.logprobs or [None] * len(result.token_ids)
            body["details"] = {
                "finish_reason": finish,
                "generated_tokens": result.completion_tokens,
                "seed": parsed.params.seed,
                "prefill": [],
                "tokens": [self._tgi_token(t, lp) for t, lp in zip(result.token_ids, logprobs, strict=True)],
            }
            if parsed.params.logprobs:  # top_n_tokens: the most likely tokens at each step
                body["details"]["top_tokens"] = [self._tgi_top(lp) for lp in logprobs]
        return web.json_response([body] if compat else body)

    async def _tgi_sse(self, request: web.Request, parsed: ParsedRequest, outputs) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        eos = self.backend.eos_ids
        text, tokens = [], []
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    text.append(out.text)
                    tokens += out.token_ids
                    token_id = out.token_ids[-1] if out.token_ids else 0
                    logprob = out.logprobs[-1] if out.logprobs else None
                    token = {**self._tgi_token(token_id, logprob), "text": out.text}
                    event = {"index": len(tokens), "token": token, "generated_text": None, "details": None}
                    if parsed.params.logprobs:
                        event["top_tokens"] = self._tgi_top(logprob)
                    if out.finished:
                        event["generated_text"] = "".join(text)
                        event["details"] = {
                            "finish_reason": _tgi_finish_reason(str(out.finish_reason), tokens, eos),
                            "generated_tokens": out.completion_tokens,
                            "seed": parsed.params.seed,
                        }
                    await resp.write(f"data:{json.dumps(event, ensure_ascii=False)}\n\n".encode())
        except ServingError as e:  # the stream has started: the error is its last event
            await resp.write(f"data:{json.dumps({'error': str(e), 'error_type': 'generation'})}\n\n".encode())
        await resp.write_eof()
        return resp

    def _tgi_token(self, token_id: int, logprob: TokenLogprobs | None) -> dict:
        """A token as TGI's answers give it: id, text, log probability (None where it was not computed),
        whether it is special (an end of sequence)."""
        text = self.backend.tokenizer.decode([token_id], skip_special_tokens=False)
        return {"id": token_id, "text": text, "logprob": None if logprob is None else logprob.logprob,
                "special": token_id in self.backend.eos_ids}  # fmt: skip

    def _tgi_top(self, logprob: TokenLogprobs | None) -> list[dict]:
        """The most likely tokens at a step (`top_n_tokens`), most likely first, as TGI's tokens."""
        return [self._tgi_token(i, TokenLogprobs(v)) for i, v in (logprob.top if logprob else ())]

    async def tgi_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._tgi_complete(request, compat=False)

    async def tgi_generate_stream(self, request: web.Request) -> web.StreamResponse:
        parsed, _, outputs = await self._tgi_start(request, True)
        if outputs is None:
            return parsed
        return await self._tgi_sse(request, parsed, outputs)

    async def tgi_compat(self, request: web.Request) -> web.StreamResponse:
        return await self._tgi_complete(request, compat=True)


async def serve(
    server: HttpApp, host: str, port: int, grace_period: float, header_timeout: float = HEADER_TIMEOUT,
    body_timeout: float = BODY_TIMEOUT,
) -> None:  # fmt: skip
    """Serve until SIGTERM or SIGINT, then drain (http_app: requests arriving on open connections are served
    with `Connection: close`, idle connections closed, new requests refused only in the grace period's last
    tenth; the engine hands back at once, with 503 and Retry-After, the waiting requests it would not finish
    in time) until no request runs and no connection is open, or `grace_period` seconds; then any request
    still running is handed back (503 where its answer has not started), and the backend stops. A client has
    `header_timeout` seconds for a request's headers and `body_timeout` for its body (http_app)."""
    server.header_timeout, server.body_timeout = header_timeout, body_timeout
    # handler_cancellation: a client that leaves cancels its handler, which aborts its request.
    # auto_decompress off: a body with a Content-Encoding is refused (415) as it came, never inflated
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log_class=QuietProbesAccessLog,
                           auto_decompress=False)  # fmt: skip
    await runner.setup()
    await Site(runner, host, port, server).start()
    log.info("serving %s on http://%s:%d", server.model_name, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.start_drain(grace_period)
    drain = getattr(server.backend, "drain", None)
    if drain is not None:  # the engine hands back what it would not finish in time (engine.admission)
        drain(grace_period)
    log.info("draining: serving the open connections' requests for up to %.0f s", grace_period)
    deadline = loop.time() + grace_period
    # a request counts from its handler's start (parsing, the chat template, a router's prefill) to its end,
    # not only while the backend holds it
    while server.backend.num_requests or server.in_flight or runner.server.connections:
        if loop.time() >= deadline:
            log.warning("grace period over; ending the requests still in flight")
            break
        server.close_idle(runner.server.connections)
        await asyncio.sleep(0.05)
    server.backend.shutdown()
    await runner.cleanup()


def _tgi_finish_reason(reason: str, tokens: list[int], eos) -> str:
    if reason == "stop":
        return "eos_token" if tokens and tokens[-1] in eos else "stop_sequence"
    return "length" if reason == "length" else reason


def _version() -> str:
    from neuronfleet import __version__

    return __version__


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of a request's choices as they come, each with its choice's index; a choice's error is
    raised (the others are closed, freeing their slots)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for out in stream:
                    await queue.put((index, out))
        except Exception as e:  # (its error reaches the reader, which raises it)
            await queue.put((index, e))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            index, item = await queue.get()
            if item is None:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def chat_logprobs(tokenizer, ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict:
    """A chat choice's `logprobs`: `content`, one entry per token (its text, log probability, bytes and the
    most likely tokens' entries), as OpenAI's chat API gives them."""

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": tokenizer.decode([token_id], skip_special_tokens=False), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token_id))}  # fmt: skip

    content = [
        {**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
        for t, lp in zip(ids, logprobs, strict=True)
    ]
    return {"content": content}


def completion_logprobs(
    tokenizer, ids: Sequence[int], logprobs: Sequence[TokenLogprobs], offset: int
) -> tuple[dict, int]:
    """A completion choice's `logprobs`, OpenAI's legacy lists (`tokens`, `token_logprobs`, `top_logprobs` by
    token text, `text_offset` into the completion's text from `offset`), and the offset after them."""
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    tops = [{tokenizer.decode([i], skip_special_tokens=False): v for i, v in lp.top} for lp in logprobs]
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": tops if any(tops) else None,
        "text_offset": offsets,
    }, offset
