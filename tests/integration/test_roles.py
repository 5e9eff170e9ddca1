"""The prefill and decode roles' internal endpoints over HTTP (the test plays the router): 401 without the
model's token; reserve, prefill-and-push, decode streams exactly the unified tokens; a handoff that never
arrives falls back to prefilling on the decode pod, still exactly right."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from support import (
    CEILING,
    EXACT_DTYPE,
    EXACT_DTYPE_OPTIONS,
    free_port,
    metric,
    neuronfleet_command,
    post,
    running_server,
    structured_outputs_round,
    tool_call_round,
    unified_reference,
    wait_until,
    wait_until_async,
)

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import AsyncEngine, Engine
from neuronfleet.runtime.kv.kv_transfer import TcpAgent
from neuronfleet.runtime.kv.leases import LeasePool
from neuronfleet.runtime.kv.roles import DecodeRole, PrefillRole
from neuronfleet.runtime.serving.sampling_params import SamplingParams

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.real_model
def test_router_path_over_the_internal_endpoints(smollm2_dir):
    def make(slots: int, **kw) -> Engine:
        config = RuntimeConfig(slots=slots, max_seq_len=256, dtype=EXACT_DTYPE, **kw)
        return Engine.from_model_dir(str(smollm2_dir), config)

    unified = make(1, prefix_reuse=False)
    questions = ["What is the capital of France?", "Name a green vegetable."]
    prompts = [unified.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    want = [o.token_ids for o in unified.generate(prompts, SamplingParams(max_tokens=16))]

    async def main():
        with AsyncEngine(lambda: make(2)) as pe, AsyncEngine(lambda: make(4)) as de:
            c = de.engine.runner.model_config
            decode_agent = TcpAgent("decode-0", "smollm2", secret=TOKEN)
            prefill_agent = TcpAgent("prefill-0", "smollm2", secret=TOKEN)
            await decode_agent.start()
            leases = LeasePool(decode_agent, count=2, layers=c.num_layers, kv_heads=c.num_kv_heads,
                               head_dim=c.head_dim, max_tokens=256, dtype=de.engine.runner.dtype)  # fmt: skip
            decode_app, prefill_app = web.Application(), web.Application()
            decode_role = DecodeRole(de, decode_agent, leases, TOKEN, wait_seconds=2.0)
            decode_app.add_routes(decode_role.routes())
            prefill_app.add_routes(PrefillRole(pe, prefill_agent, TOKEN).routes())
            async with (
                TestClient(TestServer(decode_app)) as decode,
                TestClient(TestServer(prefill_app)) as prefill,
            ):
                # without the token nothing happens
                r = await decode.post("/internal/reserve", json={"request": "x", "prompt_tokens": 5})
                assert r.status == 401 and leases.leases == {}
                r = await prefill.post("/internal/prefill", json={})
                assert r.status == 401

                async def stream(body) -> tuple[list[int], bool]:
                    r = await decode.post("/internal/decode", json=body, headers=AUTH)
                    assert r.status == 200
                    lines = [json.loads(x) for x in (await r.text()).splitlines()]
                    return [t for line in lines for t in line["token_ids"]], lines[-1]["imported"]

                for i, ids in enumerate(prompts):
                    rid = f"r{i}"
                    r = await decode.post(
                        "/internal/reserve", json={"request": rid, "prompt_tokens": len(ids)}, headers=AUTH
                    )
                    lease = await r.json()
                    push = {
                        "request": rid,
                        "prompt_ids": ids,
                        "agent": lease["agent"],
                        "region": lease["region"],
                        "key": lease["key"],
                    }
                    r = await prefill.post("/internal/prefill", headers=AUTH, json=push)
                    assert r.status == 200 and (await r.json())["first_token"] == want[i][0]
                    tokens, imported = await stream(
                        {
                            "lease": lease["lease"],
                            "request": rid,
                            "prompt_ids": ids,
                            "params": {"max_tokens": 16},
                        }
                    )
                    assert imported and tokens == want[i]
                    assert leases.leases == {}  # released after the import
                # the client's sampling parameters travel with the request: seeded sampling reproduces
                sampled = {"max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7, "stop": ["zzz"]}
                r = await decode.post(
                    "/internal/reserve",
                    json={"request": "s1", "prompt_tokens": len(prompts[0])},
                    headers=AUTH,
                )
                lease = await r.json()
                push = {
                    "request": "s1",
                    "prompt_ids": prompts[0],
                    "agent": lease["agent"],
                    "region": lease["region"],
                    "key": lease["key"],
                }
                assert (await prefill.post("/internal/prefill", headers=AUTH, json=push)).status == 200
                tokens, imported = await stream(
                    {"lease": lease["lease"], "request": "s1", "prompt_ids": prompts[0], "params": sampled}
                )
                expected = unified.generate([prompts[0]], SamplingParams(**{**sampled, "stop": ("zzz",)}))[0]
                assert imported and tokens == expected.token_ids
                bad = {"lease": "x", "request": "b", "prompt_ids": [1], "params": {"top_p": 7}}
                r = await decode.post("/internal/decode", headers=AUTH, json=bad)
                assert r.status == 400 and "top_p" in (await r.json())["error"]
                # a handoff that never arrives: the decode pod prefills itself, and the answer is the same
                tokens, imported = await stream(
                    {
                        "lease": "lease-404",
                        "request": "r9",
                        "prompt_ids": prompts[1],
                        "params": {"max_tokens": 16},
                    }
                )
                assert not imported and tokens == want[1]
                # a short prompt the router prefills on the decode pod (--local-prefill-below): no lease
                fallbacks = de_metrics_total(decode_role)
                tokens, imported = await stream(
                    {"lease": None, "request": "r10", "prompt_ids": prompts[0], "params": {"max_tokens": 16},
                     "kv": "local"}
                )  # fmt: skip
                assert not imported and tokens == want[0] and de_metrics_total(decode_role) == fallbacks
            await decode_agent.stop()
            await prefill_agent.stop()

    asyncio.run(main())


@pytest.mark.real_model
def test_serve_roles_from_the_command_line(smollm2_dir, tmp_path):
    """`neuronfleet serve --role prefill|decode` as the operator starts them: the token from a file, the KV
    receiver started with the server; a handoff through them decodes the unified tokens; 401 without it."""
    import urllib.request

    (tmp_path / "token").write_text(TOKEN + "\n")
    options = ("--slots", "2", "--max-seq-len", "256", "--internal-token-file", str(tmp_path / "token"),
               *EXACT_DTYPE_OPTIONS)  # fmt: skip
    unified = unified_reference(smollm2_dir)
    ids = unified.tokenizer.encode_chat([{"role": "user", "content": "Name a red fruit."}])
    want = unified.generate([ids], SamplingParams(max_tokens=12))[0].token_ids
    with (
        running_server(smollm2_dir, "--role", "decode", "--kv-wait", "1", *options) as (decode, _),
        running_server(smollm2_dir, "--role", "prefill", *options) as (prefill, _),
    ):
        code, body, _ = post(decode, "/internal/reserve", {"request": "r1", "prompt_tokens": len(ids)})
        assert code == 401 and "the model's token" in body["error"]
        code, lease, _ = post(decode, "/internal/reserve", {"request": "r1", "prompt_tokens": len(ids)}, AUTH)
        assert code == 200 and lease["agent"]["transport"] == "tcp"
        push = {
            "request": "r1",
            "prompt_ids": ids,
            "agent": lease["agent"],
            "region": lease["region"],
            "key": lease["key"],
        }
        code, pushed, _ = post(prefill, "/internal/prefill", push, AUTH)
        assert code == 200 and pushed["first_token"] == want[0]
        body = json.dumps(
            {"lease": lease["lease"], "request": "r1", "prompt_ids": ids, "params": {"max_tokens": 12}}
        )
        req = urllib.request.Request(
            decode + "/internal/decode", data=body.encode(), headers=AUTH, method="POST"
        )
        with urllib.request.urlopen(req, timeout=CEILING) as r:
            lines = [json.loads(x) for x in r.read().splitlines()]
        assert [t for line in lines for t in line["token_ids"]] == want and lines[-1]["imported"]


@pytest.mark.real_model
def test_router_prefill_and_decode_answer_like_a_unified_server(smollm2_tools_dir, tmp_path):
    """The whole disaggregated path from the command line: the official openai client talks to the router,
    which reserves on the decode pod, has the prefill pod push the KV cache, and streams the decode pod's
    tokens; greedy answers equal the unified engine's, for several concurrent requests; structured outputs,
    log probabilities, n choices and tool calls cross the hand-off (a model whose template takes tools)."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    (tmp_path / "token").write_text(TOKEN)
    common = ("--max-seq-len", "768", "--internal-token-file", str(tmp_path / "token"), *EXACT_DTYPE_OPTIONS)
    unified = unified_reference(smollm2_tools_dir)
    questions = ["What is the capital of France?", "Name a green vegetable.", "Say hello in Spanish."]
    chats = [unified.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    want = [o.text for o in unified.generate(chats, SamplingParams(max_tokens=16))]
    with (
        running_server(smollm2_tools_dir, "--role", "decode", "--slots", "4", *common) as (decode, _),
        running_server(smollm2_tools_dir, "--role", "prefill", "--slots", "2", *common) as (prefill, _),
        running_server(
            smollm2_tools_dir, "--role", "router", "--prefill", prefill, "--decode", dns(decode), *common
        ) as (router, _),
    ):
        client = OpenAI(base_url=router + "/v1", api_key="unused")

        def ask(q: str) -> str:
            resp = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0
            )
            return resp.choices[0].message.content

        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, questions)) == want
        # the decode pod samples every token: a constraint and log probabilities cross the hand-off with the
        # request, and equal the unified engine's (float32)
        structured_outputs_round(router)
        first = [{"role": "user", "content": questions[0]}]
        got = client.chat.completions.create(model="smollm2", messages=first, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=3)  # fmt: skip
        (ref,) = unified.generate([chats[0]], SamplingParams(max_tokens=8, logprobs=3))
        entries = got.choices[0].logprobs.content
        assert [e.logprob for e in entries] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=2e-3)
        assert [[t.token for t in e.top_logprobs] for e in entries] == [
            [unified.tokenizer.decode([i], skip_special_tokens=False) for i, _ in lp.top]
            for lp in ref.logprobs
        ]
        # n choices: each its own sequence through the hand-off, greedy ones the unified engine's answer
        two = client.chat.completions.create(
            model="smollm2", messages=first, max_tokens=16, temperature=0, n=2
        )
        assert [c.message.content for c in two.choices] == [want[0]] * 2
        # tool calls (the router renders the template with the tools; a required call is constrained)
        tool_call_round(router)


def test_a_router_without_peers_or_token_refuses_to_start(smollm2_dir, tmp_path):
    import subprocess

    (tmp_path / "token").write_text(TOKEN)
    base = [*neuronfleet_command(), "serve", "--model", str(smollm2_dir), "--role", "router"]
    run = subprocess.run(
        [*base, "--internal-token-file", str(tmp_path / "token")], capture_output=True, text=True
    )
    assert run.returncode == 2 and "needs at least one --prefill and one --decode peer URL" in run.stderr
    run = subprocess.run([*base, "--decode", "http://127.0.0.1:1"], capture_output=True, text=True)
    assert run.returncode == 2 and "needs the model's internal token" in run.stderr


def test_a_pod_that_cannot_run_its_kv_transport_refuses_to_start_saying_what_is_missing(
    smollm2_dir, tmp_path
):
    """Over EFA (NIXL's LIBFABRIC backend) without libfabric (this machine has none), or with a NIXL
    backend named for tcp: exit 2 before the model loads, the message naming what is missing or wrong."""
    import subprocess

    from neuronfleet.runtime.kv.nixl_transfer import libfabric_version

    (tmp_path / "token").write_text(TOKEN)
    base = [*neuronfleet_command(), "serve", "--model", str(smollm2_dir), "--role", "decode",
            "--internal-token-file", str(tmp_path / "token")]  # fmt: skip
    cases = [
        (
            ["--kv-transport", "tcp", "--kv-nixl-backend", "ucx"],
            "--kv-nixl-backend is for --kv-transport nixl",
        )
    ]
    if libfabric_version() is None:
        for transport in (
            ["--kv-transport", "efa"],
            ["--kv-transport", "nixl", "--kv-nixl-backend", "libfabric"],
        ):
            cases.append((transport, "needs libfabric (libfabric.so.1): none is installed"))
    for options, message in cases:
        run = subprocess.run([*base, *options], capture_output=True, text=True)
        assert run.returncode == 2 and message in run.stderr, (options, run.stderr[-500:])


def de_metrics_total(role: DecodeRole) -> float:
    """Fallbacks the decode role counted, all reasons."""
    samples = [s for m in role.metrics.fallbacks.collect() for s in m.samples]
    return sum(s.value for s in samples if s.name.endswith("_total"))


def dns(url: str) -> str:
    """http://127.0.0.1:PORT -> dns://localhost:PORT, resolved per request like a headless Service."""
    return "dns://localhost:" + url.rsplit(":", 1)[1]


def test_peers_resolve_from_urls_and_dns_names():
    from neuronfleet.runtime.routing.router import resolve_peers

    assert resolve_peers(["http://10.0.0.5:8000/"]) == ["http://10.0.0.5:8000"]
    assert "http://127.0.0.1:8000" in resolve_peers(["dns://localhost:8000"])
    assert resolve_peers(["dns://no-such-service.invalid:8000"]) == []
    with pytest.raises(ValueError, match="use http://host:port or dns://name:port"):
        resolve_peers(["10.0.0.5:8000"])


def test_kv_events_cross_a_real_socket_and_a_restarted_publisher_is_learnt_again(tmp_path_factory):
    """Our publisher and a router's subscription over ZeroMQ: batches arrive in order and build the pod's
    index; a publisher started again (its sequence back at 0) makes the subscriber forget and relearn."""
    import tempfile

    from neuronfleet.contract import KvEventsConfig
    from neuronfleet.runtime.engine.kv_event_publisher import KvEventPublisher
    from neuronfleet.runtime.engine.kv_events import BlockStored
    from neuronfleet.runtime.routing.kv_event_index import Subscriptions
    from neuronfleet.runtime.routing.prefix_routing import token_blocks

    folder = tempfile.mkdtemp(prefix="nf-kv", dir="/tmp")  # an ipc path must be short
    config = KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{folder}/pod.sock")
    tokens = list(range(100, 164))

    async def scenario() -> None:
        subs = Subscriptions()
        publisher = KvEventPublisher(config)
        try:
            subs.follow("http://127.0.0.1:1", publisher.endpoint)
            pod = subs.pods["http://127.0.0.1:1"]
            blocks = token_blocks(tokens)
            # a PUB socket drops what it sends before the subscriber is connected: publish until one lands
            for _ in range(200):
                publisher.publish([BlockStored([1], None, tokens[:16], 16)])
                await asyncio.sleep(0.05)
                if pod.batches:
                    break
            publisher.publish([BlockStored([2, 3], 1, tokens[16:48], 16)])
            await wait_until_async(lambda: pod.held(blocks) == 3, "the second batch applied")
            assert subs.gaps == 0
            publisher.close()
            publisher = KvEventPublisher(config)  # the pod restarted: its sequence starts at 0 again
            for _ in range(200):
                publisher.publish([BlockStored([7], None, tokens[:16], 16)])
                await asyncio.sleep(0.05)
                if subs.gaps:
                    break
            await wait_until_async(lambda: pod.held(blocks) == 1, "the restarted pod's block alone")
            assert subs.gaps == 1
        finally:
            subs.close()
            publisher.close()

    asyncio.run(scenario())


def test_kv_events_reach_only_the_models_own_subscribers():
    """The events name every cached block's token ids, so every client's prompt: published with the model's
    secret they are encrypted, and a subscriber (or a replay request) without the model's key receives nothing
    while the model's own router follows them; without a secret a pod publishes on this machine only."""
    import zmq

    from neuronfleet.contract import KvEventsConfig
    from neuronfleet.runtime.engine.kv_event_publisher import KvEventPublisher, curve_keys
    from neuronfleet.runtime.engine.kv_events import BlockStored
    from neuronfleet.runtime.routing.kv_event_index import Subscriptions, advertised
    from neuronfleet.runtime.routing.prefix_routing import token_blocks

    port, replay_port = free_port(), free_port()
    config = KvEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{replay_port}")  # fmt: skip
    with pytest.raises(ValueError, match="no authentication: give the model's secret"):
        KvEventPublisher(config)
    tokens = list(range(100, 116))

    async def scenario() -> None:
        publisher = KvEventPublisher(config, secret=TOKEN, bind_host="127.0.0.1")
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}" and publisher.auth == "curve"
        status = {"kv_events": publisher.endpoint, "kv_events_replay": publisher.replay_endpoint,
                  "kv_events_auth": publisher.auth}  # fmt: skip
        ours, keyless = Subscriptions(secret=TOKEN), Subscriptions()
        ctx = zmq.Context()
        eavesdropper = ctx.socket(zmq.SUB)  # a plain subscriber, as the probe's was
        eavesdropper.setsockopt(zmq.SUBSCRIBE, b"")
        eavesdropper.connect(publisher.endpoint)
        impostor = ctx.socket(zmq.SUB)  # a CURVE client with keys of its own (it knows the server's key)
        theirs = curve_keys("another model's secret")
        impostor.curve_serverkey = curve_keys(TOKEN).server_public
        impostor.curve_publickey, impostor.curve_secretkey = theirs.client_public, theirs.client_secret
        impostor.setsockopt(zmq.SUBSCRIBE, b"")
        impostor.connect(publisher.endpoint)
        replay = ctx.socket(zmq.DEALER)  # and one asking the replay endpoint for the history
        replay.connect(publisher.replay_endpoint)
        try:
            ours.follow("http://127.0.0.1:1", *advertised(status))
            keyless.follow("http://127.0.0.1:1", *advertised(status))
            assert "http://127.0.0.1:1" not in keyless.pods  # (it says why, once)
            pod = ours.pods["http://127.0.0.1:1"]
            for _ in range(200):  # a PUB socket drops what it sends before a subscriber is connected
                publisher.publish([BlockStored([1], None, tokens, 16)])
                await asyncio.sleep(0.05)
                if pod.batches:
                    break
            await wait_until_async(lambda: pod.held(token_blocks(tokens)) == 1, "the model's router follows")
            # (a DEALER with no peer whose handshake passed would block a send: it has no one to deliver to)
            with contextlib.suppress(zmq.Again):
                replay.send_multipart((b"", (0).to_bytes(8, "big")), flags=zmq.NOBLOCK)
            await asyncio.sleep(0.5)
            for sock in (eavesdropper, impostor, replay):
                assert sock.poll(0) == 0  # nothing received: no batch, no history
        finally:
            for sock in (eavesdropper, impostor, replay):
                sock.close(linger=0)
            ctx.term()
            ours.close()
            publisher.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("buffered", [100, 1], ids=["replayed", "beyond-the-buffer"])
def test_a_router_that_joins_late_asks_the_pods_replay_endpoint_for_what_it_missed(buffered):
    """A pod published three batches before the router subscribed: the router asks the pod's replay endpoint
    (vLLM's protocol) for them and knows every block at once; where the pod's buffer no longer holds them
    all (buffer_steps 1), the router learns from what comes next instead (nothing is guessed)."""
    import tempfile

    from neuronfleet.contract import KvEventsConfig
    from neuronfleet.runtime.engine.kv_event_publisher import KvEventPublisher
    from neuronfleet.runtime.engine.kv_events import BlockStored
    from neuronfleet.runtime.routing.kv_event_index import Subscriptions
    from neuronfleet.runtime.routing.prefix_routing import token_blocks

    folder = tempfile.mkdtemp(prefix="nf-kv", dir="/tmp")  # an ipc path must be short
    config = KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{folder}/pub.sock",
                            replay_endpoint=f"ipc://{folder}/replay.sock", buffer_steps=buffered)  # fmt: skip
    tokens = list(range(100, 180))
    blocks = token_blocks(tokens)  # 5 blocks of 16

    async def scenario() -> None:
        subs = Subscriptions()
        publisher = KvEventPublisher(config)
        try:
            for i in range(3):  # before anyone listens: 3 batches, one block each, chained
                publisher.publish([BlockStored([i + 1], i or None, tokens[16 * i : 16 * (i + 1)], 16)])
            await asyncio.sleep(0.3)  # (sent: the publisher's thread has taken them)
            subs.follow("http://127.0.0.1:1", publisher.endpoint, publisher.replay_endpoint)
            pod = subs.pods["http://127.0.0.1:1"]
            # then a batch per block, each the next one, until one lands (a PUB socket drops what it sends
            # before the subscriber is connected; a replay brings those back too where the buffer has them)
            for i in range(3, 5):
                publisher.publish([BlockStored([i + 1], i, tokens[16 * i : 16 * (i + 1)], 16)])
                await asyncio.sleep(0.2)
            await wait_until_async(lambda: pod.batches > 0, "a batch received")
            if buffered > 1:
                await wait_until_async(lambda: pod.held(blocks) == 5, "every block, the missed ones replayed")
                assert subs.replayed >= 3 and subs.gaps == 0
            else:
                await asyncio.sleep(0.5)
                assert pod.held(blocks) == 0 and subs.replayed == 0  # its parent unknown: not named
        finally:
            subs.close()
            publisher.close()

    asyncio.run(scenario())


@pytest.mark.real_model
def test_a_second_router_replica_routes_a_conversations_next_turn_by_the_pods_kv_events(
    smollm2_dir, tmp_path
):
    """Two router replicas over two prefill pods that publish KV-cache events: a conversation's first turn
    goes through one replica, its next turn through the other, which never sent it anything and still
    chooses the prefill pod that holds its history (decision `prefix`, from the pod's events); that pod finds
    the history in its cache, and the answer equals the unified engine's."""
    import tempfile

    from openai import OpenAI

    folder = tempfile.mkdtemp(prefix="nf-kv", dir="/tmp")  # an ipc path must be short
    (tmp_path / "token").write_text(TOKEN)
    common = ("--max-seq-len", "256", "--internal-token-file", str(tmp_path / "token"), *EXACT_DTYPE_OPTIONS)

    def events(name: str) -> tuple[str, str]:
        return "--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                 "endpoint": f"ipc://{folder}/{name}.sock"})  # fmt: skip

    document = " ".join(f"Item {i} is a {w}." for i, w in enumerate(["red apple", "green pear", "blue plum",
                        "yellow lemon", "orange carrot", "purple grape"] * 3))  # fmt: skip
    history = [{"role": "system", "content": "Answer from this list. " + document},
               {"role": "user", "content": "What is item 3?"}]  # fmt: skip
    with (
        running_server(smollm2_dir, "--role", "decode", "--slots", "2", *common) as (decode, _),
        running_server(smollm2_dir, "--role", "prefill", "--slots", "2", *events("a"), *common) as (pa, _),
        running_server(smollm2_dir, "--role", "prefill", "--slots", "2", *events("b"), *common) as (pb, _),
        running_server(smollm2_dir, "--role", "router", "--prefill", pa, "--prefill", pb, "--decode", decode,
                       "--peer-probe-interval", "0.5", *common) as (one, _),
        running_server(smollm2_dir, "--role", "router", "--prefill", pa, "--prefill", pb, "--decode", decode,
                       "--peer-probe-interval", "0.5", *common) as (two, _),
    ):  # fmt: skip

        def ask(router: str, messages: list[dict]) -> str:
            client = OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
            resp = client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=8, temperature=0
            )
            return resp.choices[0].message.content

        def cached(pod: str) -> float:
            return metric(two, "neuronfleet:router_pod_cached_blocks", role="prefill", pod=pod)

        answer = ask(one, history)
        # the pod that prefilled it (a prefill pod counts its prompt tokens as prefix cache queries)
        holder = max((pa, pb), key=lambda p: metric(p, "vllm:prefix_cache_queries_total"))
        wait_until(lambda: cached(holder) > 0, "the second router hears what the first turn stored")
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And item 4?"}]
        hits = metric(holder, "vllm:prefix_cache_hits_total")
        unified = unified_reference(smollm2_dir)
        ids = unified.tokenizer.encode_chat(history)
        want = unified.generate([ids], SamplingParams(max_tokens=8))[0].text
        assert ask(two, history) == want
        assert metric(two, "neuronfleet:router_routing_decisions_total", role="prefill", reason="prefix") == 1
        assert metric(holder, "vllm:prefix_cache_hits_total") - hits >= len(ids) // 2  # it found the history
