"""STAND-INS for third-party engines' prefill and decode servers: NOT vLLM and NOT SGLang, but small aiohttp
servers written from their documented prefill/decode protocols (the sources are in
runtime/routing/pd_protocols.py's docstring), so that tests can drive neuronfleet's router against them and
see every request it sends. They generate no real text: an answer's tokens are `<name>-0 <name>-1 ...`.

    python tests/standins/engines.py --engine vllm|sglang --role prefill|decode --host H --port P --name N
        --record FILE [--side-port S] [--bootstrap-port B] [--advertise-host A] [--model M]
        [--max-model-len L] [--no-kv-params] [--die-mid-stream]

Every request is appended to FILE (one JSON object a line) before it is answered: the server's name, the path,
the X-Request-Id header, the body, and the answer (its status and JSON body, or the text it streamed).

What each stand-in checks, as the engine would:
- the model name (404 otherwise) and the length: prompt words + max_tokens over --max-model-len is a 400;
- vLLM (NixlConnector): a prefill server asked with kv_transfer_params.do_remote_decode keeps "KV blocks" for
  the request and answers kv_transfer_params naming them, its engine and its side channel (--side-port, as
  VLLM_NIXL_SIDE_CHANNEL_PORT); a decode server given kv_transfer_params reads those blocks from that side
  channel (the prefill stand-in lets each be read once, by the request id it made them for) and fails (500)
  when it cannot; given none, it prefills the prompt itself and says so in its record (`prefilled_here`);
- vLLM with `--kv-events-port P --tokenizer DIR`: a prefill server publishes KV-cache events as vLLM 0.24.0
  does with `--kv-events-config` (vllm/distributed/kv_events.py of the vllm-0.24.0 sdist: a ZeroMQ PUB socket,
  frames topic / 8-byte big-endian sequence / msgpack `KVEventBatch`, the batch an array [ts, events,
  data_parallel_rank], each event a map tagged `type`), encoded with msgspec as vLLM encodes it: a prompt it
  prefills is tokenized with Hugging Face's tokenizer and chat template (what vLLM renders a chat with) and
  each whole block of `--block-size` tokens not stored yet is a `BlockStored` (its hash: the stand-in's own);
- SGLang: a streamed chat asking `return_token_ids` is a 400, as from SGLang 0.5.17 (the router must not ask
  it there); a prefill server takes the request's bootstrap room; a decode server asks the bootstrap server at
  bootstrap_host:bootstrap_port (the prefill stand-in's --bootstrap-port) for that room, waiting for it a few
  seconds, and fails (500) when the room never comes.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOM_WAIT = 10.0  # seconds a decode stand-in waits for its room to reach the prefill stand-in


class EventPublisher:
    """vLLM's KV-cache events, as its ZMQ publisher sends them (see the module's docstring)."""

    def __init__(self, host: str, port: int, tokenizer_dir: str, block_size: int) -> None:
        import msgspec
        import zmq
        from transformers import AutoTokenizer

        class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
            ts: float
            events: list
            data_parallel_rank: int | None = None

        class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
            block_hashes: list[int]
            parent_block_hash: int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None

        self.batch, self.stored = EventBatch, BlockStored
        self.encoder = msgspec.msgpack.Encoder()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.block_size = block_size
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.bind(f"tcp://{host}:{port}")
        self.seq = 0
        self.held: set[int] = set()

    def prompt_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            messages = [{**m, "content": m["content"] if isinstance(m["content"], str) else "".join(
                p.get("text", "") for p in m["content"])} for m in body["messages"]]  # fmt: skip
            return list(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False))  # fmt: skip
        return self.tokenizer(body["prompt"])["input_ids"]

    def prefilled(self, body: dict, chat: bool) -> None:
        """The prompt's whole blocks are in the cache now: those not stored before are published."""
        ids, size, parent, events = self.prompt_ids(body, chat), self.block_size, None, []
        for start in range(0, len(ids) - len(ids) % size, size):
            tokens = ids[start : start + size]
            digest = hashlib.sha256(repr((parent, tokens)).encode()).digest()
            block = int.from_bytes(digest[:8], "big")
            if block not in self.held:
                self.held.add(block)
                stored = self.stored(block_hashes=[block], parent_block_hash=parent, token_ids=tokens,
                                     block_size=size, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip
                events.append(stored)
            parent = block
        if events:
            payload = self.encoder.encode(self.batch(ts=time.time(), events=events, data_parallel_rank=0))
            self.socket.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
            self.seq += 1


class StandIn:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine_id = f"{args.name}-engine"
        self.events = None
        if args.kv_events_port:
            self.events = EventPublisher(args.host, args.kv_events_port, args.tokenizer, args.block_size)
        self.blocks: dict[tuple[int, ...], str] = {}  # vLLM prefill: KV blocks kept -> the request id
        self.rooms: dict[int, asyncio.Event] = {}  # SGLang prefill: bootstrap rooms seen
        self.record_file = Path(args.record)

    def record(self, request: web.Request, body, answer: dict, **extra) -> None:
        entry = {
            "name": self.args.name,
            "path": request.path,
            "request_id": request.headers.get("X-Request-Id"),
            "body": body,
            "answer": answer,
            **extra,
        }
        with self.record_file.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    # ---- the OpenAI routes ----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, chat=True)

    async def serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        refusal = self.refusal(body, chat)
        if refusal is not None:
            status, error = refusal
            self.record(request, body, {"status": status, "json": error})
            return web.json_response(error, status=status)
        extra: dict = {}
        tokens = int(body.get("max_tokens") or 16)
        kv_params = None
        if self.args.engine == "vllm" and self.args.role == "prefill":
            kv_params = self.keep_blocks(body, request.headers.get("X-Request-Id"))
            if self.events is not None:
                self.events.prefilled(body, chat)
        elif self.args.engine == "vllm":
            failed = await self.read_blocks(body, request.headers.get("X-Request-Id"), extra)
            if failed:
                self.record(request, body, {"status": 500, "json": failed}, **extra)
                return web.json_response(failed, status=500)
        elif self.args.role == "prefill":
            self.rooms.setdefault(int(body["bootstrap_room"]), asyncio.Event()).set()
        else:
            failed = await self.meet_prefill(body)
            if failed:
                self.record(request, body, {"status": 500, "json": failed})
                return web.json_response(failed, status=500)
        words = [f"{self.args.name}-{i}" for i in range(tokens)]
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(8)
        if body.get("stream"):
            return await self.stream(request, body, chat, rid, words, extra)
        text = " ".join(words)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            if chat else {"index": 0, "text": text, "finish_reason": "length"}
        )  # fmt: skip
        usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                  "created": int(time.time()), "model": self.args.model, "choices": [choice],
                  "usage": usage}  # fmt: skip
        if kv_params is not None:
            answer["kv_transfer_params"] = kv_params
        self.record(request, body, {"status": 200, "json": answer}, **extra)
        return web.json_response(answer)

    async def stream(self, request, body, chat: bool, rid: str, words: list[str], extra: dict):
        self.record(request, body, {"status": 200, "stream_text": " ".join(words)}, **extra)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        for i, word in enumerate(words):
            piece = word if i == 0 else " " + word
            reason = "length" if i == len(words) - 1 else None
            choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": reason} if chat
                      else {"index": 0, "text": piece, "finish_reason": reason})  # fmt: skip
            chunk = {"id": rid, "object": kind, "created": int(time.time()), "model": self.args.model,
                     "choices": [choice]}  # fmt: skip
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.args.die_mid_stream and i == 1:
                await response.drain()
                os._exit(1)  # the process dies mid-stream, as a pod does
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def refusal(self, body: dict, chat: bool) -> tuple[int, dict] | None:
        if body.get("model") != self.args.model:
            message = f"The model `{body.get('model')}` does not exist."
            return 404, {
                "error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}
            }
        if self.args.engine == "sglang" and chat and body.get("stream") and body.get("return_token_ids"):
            # SGLang 0.5.17 to 0.5.23 (serving_chat.py, _convert_to_internal_request; see
            # tests/data/resume-fields-vllm0.16.0-0.24.0-sglang0.5.16-0.5.23.json)
            message = "return_token_ids is not supported with streaming on /v1/chat/completions"
            return 400, {"object": "error", "message": message, "type": "BadRequest", "code": 400}
        if chat:
            prompt = " ".join(str(m.get("content", "")) for m in body.get("messages") or [])
        else:
            prompt = str(body.get("prompt", ""))
        asked = len(prompt.split()) + int(body.get("max_tokens") or 16)
        if asked > self.args.max_model_len:
            message = (f"This model's maximum context length is {self.args.max_model_len} tokens. "
                       f"However, you requested {asked} tokens.")  # fmt: skip
            return 400, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        return None

    # ---- vLLM: the KV blocks a prefill keeps and a decode reads ----

    def keep_blocks(self, body: dict, request_id: str | None) -> dict | None:
        asked = body.get("kv_transfer_params") or {}
        if not asked.get("do_remote_decode") or self.args.no_kv_params:
            return None  # an ordinary request (or a server started without the connector): nothing kept
        blocks = tuple(secrets.randbelow(1 << 20) for _ in range(3))
        self.blocks[blocks] = str(request_id)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": list(blocks), "remote_host": self.args.advertise_host or self.args.host,
                "remote_port": self.args.side_port, "tp_size": 1}  # fmt: skip

    async def give_blocks(self, request: web.Request) -> web.Response:
        """The side channel: the blocks of a request, read once, by the request id they were kept for."""
        asked = await request.json()
        blocks = tuple(asked.get("blocks") or ())
        if asked.get("engine") != self.engine_id or self.blocks.get(blocks) != asked.get("request_id"):
            return web.json_response({"error": "no such blocks for that engine and request"}, status=404)
        del self.blocks[blocks]
        return web.json_response({"read": list(blocks)})

    async def read_blocks(self, body: dict, request_id: str | None, extra: dict) -> dict | None:
        kv = body.get("kv_transfer_params")
        if not kv or not kv.get("do_remote_prefill"):
            extra["prefilled_here"] = True  # what vLLM's decode server does without a remote prefill
            return None
        url = f"http://{kv['remote_host']}:{kv['remote_port']}/standin/blocks"
        asked = {"engine": kv["remote_engine_id"], "blocks": kv["remote_block_ids"], "request_id": request_id}
        why = await _failure("POST", url, asked)
        return None if why is None else _internal_error(f"KV transfer from {url} failed: {why}")

    # ---- SGLang: the bootstrap room a decode meets its prefill in ----

    async def room(self, request: web.Request) -> web.Response:
        room = int(request.match_info["room"])
        try:
            await asyncio.wait_for(self.rooms.setdefault(room, asyncio.Event()).wait(), ROOM_WAIT)
        except TimeoutError:
            return web.json_response({"error": f"room {room} never came"}, status=404)
        return web.json_response({"room": room})

    async def meet_prefill(self, body: dict) -> dict | None:
        try:
            url = f"http://{body['bootstrap_host']}:{int(body['bootstrap_port'])}/standin/room/{int(body['bootstrap_room'])}"
        except (KeyError, TypeError, ValueError) as e:
            return {"error": {"message": f"a decode server needs bootstrap_host, _port and _room: {e}",
                              "type": "BadRequestError", "param": None, "code": 400}}  # fmt: skip
        why = await _failure("GET", url)
        return None if why is None else _internal_error(f"bootstrap at {url} failed: {why}")


def _internal_error(message: str) -> dict:
    return {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}


async def _failure(method: str, url: str, body: dict | None = None) -> str | None:
    """Why a call to the paired stand-in failed (its answer other than 200, or the connection's error), or
    None when it answered 200."""
    try:
        async with aiohttp.ClientSession() as s, s.request(method, url, json=body) as r:
            return None if r.status == 200 else await r.text()
    except (aiohttp.ClientError, OSError) as e:
        return str(e)


async def main(args: argparse.Namespace) -> None:
    standin = StandIn(args)
    app = web.Application()
    app.add_routes([
        web.get("/health", lambda r: web.Response(text="")),
        web.post("/v1/completions", standin.completions),
        web.post("/v1/chat/completions", standin.chat),
        web.post("/standin/blocks", standin.give_blocks),
        web.get("/standin/room/{room}", standin.room),
    ])  # fmt: skip
    runner = web.AppRunner(app)
    await runner.setup()
    for port in (args.port, args.side_port, args.bootstrap_port):
        if port:
            await web.TCPSite(runner, args.host, port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--side-port", type=int, default=0, help="vLLM prefill: the side channel's port")
    parser.add_argument("--bootstrap-port", type=int, default=0, help="SGLang prefill: the bootstrap port")
    parser.add_argument(
        "--advertise-host",
        default="",
        help="vLLM prefill: the remote_host its answers name (VLLM_NIXL_SIDE_CHANNEL_HOST; default --host)",
    )
    parser.add_argument("--name", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--model", default="m")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument(
        "--no-kv-params",
        action="store_true",
        help="vLLM prefill: answer without kv_transfer_params (a server without the connector)",
    )
    parser.add_argument(
        "--die-mid-stream", action="store_true", help="exit after a streamed answer's 2nd chunk"
    )
    parser.add_argument("--kv-events-port", type=int, default=0, help="vLLM prefill: publish KV-cache events")
    parser.add_argument("--tokenizer", default="", help="with --kv-events-port: the model folder's tokenizer")
    parser.add_argument("--block-size", type=int, default=16, help="with --kv-events-port: tokens a block")
    asyncio.run(main(parser.parse_args()))
