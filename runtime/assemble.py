"""What `neuronfleet serve` runs, assembled from its `ServeConfig` (the contract the operator renders): the
engine and HTTP server of a unified, prefill or decode pod (a prefill or decode pod with its KV agent, leases
and internal routes), or a router (ours over prefill and decode pods, one speaking vLLM's or SGLang's own P/D
protocol, or a unified model's front door); then served until SIGTERM, draining. A router imports no torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import NoReturn

from neuronfleet.contract import INTERNAL_TOKEN_ENV, PEER_HOSTS_FILE_ENV, POD_IP_ENV, ServeConfig
from neuronfleet.runtime.engine.config import RuntimeConfig

log = logging.getLogger(__name__)


def run(args: ServeConfig) -> int:
    """Build what the config describes and serve it until SIGTERM or SIGINT; ValueError for a bad setting
    (before anything loads where it can be told)."""
    if args.role == "router":  # before the engine's imports: a router loads no torch
        return _serve_router(args)
    from neuronfleet.runtime.engine.engine import AsyncEngine, Engine
    from neuronfleet.runtime.serving.server import RuntimeServer

    config = RuntimeConfig.from_serve(args)
    if config.tensor_parallel > 1 and args.role != "unified":
        raise ValueError(
            f"--tensor-parallel {config.tensor_parallel} serves role unified only (a prefill or decode pod's "
            "KV hand-off moves one process's cache): serve this role at --tensor-parallel 1"
        )
    role_setup = _role_setup(args, config) if args.role in ("prefill", "decode") else None
    _log_info()
    publisher = _kv_event_publisher(args)

    def make_engine() -> Engine:
        engine = Engine.from_model_dir(args.model, config)
        if publisher is not None:
            engine.publish_kv_events(publisher.publish)
        return engine

    defaults = _sampling_defaults(args)  # (a bad override fails here, before the model loads)
    engine = AsyncEngine(make_engine)
    engine.kv_events_endpoint = publisher.endpoint if publisher is not None else None
    engine.kv_events_replay = publisher.replay_endpoint if publisher is not None else None
    engine.kv_events_auth = publisher.auth if publisher is not None else None
    server = RuntimeServer(
        engine,
        args.served_model_name or Path(args.model).name,
        max_body_bytes=args.max_body_bytes,
        sampling_defaults=defaults,
    )
    if role_setup is not None:  # the role's routes, and its metrics in the server's registry
        routes, startup, cleanup = role_setup(engine, server.registry)
        server.extra_routes.extend(routes)
        server.on_startup.extend(startup)
        server.on_cleanup.extend(cleanup)
    return _serve_until_stopped(server, args)


def _sampling_defaults(args: ServeConfig):
    """What a request that leaves a sampling field out gets: the model folder's generation_config.json, under
    --override-generation-config."""
    import json

    from neuronfleet.runtime.serving.sampling_params import SamplingDefaults

    path = Path(args.model or "") / "generation_config.json"
    config = json.loads(path.read_text()) if args.model and path.is_file() else {}
    override = json.loads(args.override_generation_config) if args.override_generation_config else None
    return SamplingDefaults.of(config, override, "--override-generation-config over generation_config.json")


def _kv_event_publisher(args: ServeConfig):
    """The pod's KV-cache event publisher, when --kv-events-config asks for one: authenticated and encrypted
    with the model's secret where it is given, on the pod's own address (POD_IP) where a wildcard is asked."""
    from neuronfleet.contract import KvEventsConfig

    if args.kv_events_config is None or not (config := KvEventsConfig.parse(args.kv_events_config)).publishes:
        return None
    from neuronfleet.runtime.engine.kv_event_publisher import KvEventPublisher

    return KvEventPublisher(
        config, secret=_optional_token(args), bind_host=os.environ.get(POD_IP_ENV) or None
    )


def _log_info() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _serve_until_stopped(server, args: ServeConfig) -> NoReturn:
    """Serve (`server.serve`), logging at INFO, until SIGTERM or SIGINT, then drain; then the process ends
    at once, exit 0, its output flushed: Python's finalization would run while daemon threads may still be
    inside native code (torch's, NIXL's), which can abort the process (`terminate called without an active
    exception`, seen once in CI on a prefill pod that had drained cleanly)."""
    from neuronfleet.runtime.serving.server import serve

    _log_info()  # (a unified server set it up before loading its model: once is enough)
    timeouts = (args.header_timeout, args.body_timeout)
    asyncio.run(serve(server, args.host, args.port, args.grace_period, *timeouts))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _optional_token(args: ServeConfig) -> str | None:
    """The model's internal token where one is given (--internal-token-file, else INTERNAL_TOKEN_ENV)."""
    token = os.environ.get(INTERNAL_TOKEN_ENV, "")
    if args.internal_token_file:
        token = Path(args.internal_token_file).read_text().strip()
    return token or None


def _internal_token(args: ServeConfig) -> str:
    token = _optional_token(args)
    if not token:
        raise ValueError(
            f"--role {args.role} needs the model's internal token: --internal-token-file FILE (mounted from "
            f"a Secret) or {INTERNAL_TOKEN_ENV}"
        )
    return token


def _serve_router(args: ServeConfig) -> int:
    """The public endpoint of a disaggregated model: tokenizer and chat template here, the work on peers.
    Imports no torch (the router's image needs none)."""
    if args.peer_hosts_file:  # before any peer is resolved
        os.environ[PEER_HOSTS_FILE_ENV] = args.peer_hosts_file
    if args.unified:  # a front door to unified pods: no model code (at most the tokenizer), no token
        return _serve_front_door(args)
    if args.peer_protocol != "neuronfleet":  # an engine's own P/D protocol: no model code (at most the
        return _serve_engine_router(args)  # tokenizer), no token

    from neuronfleet.runtime.model.model_config import load_model_config
    from neuronfleet.runtime.routing.router import RemoteBackend
    from neuronfleet.runtime.serving.backend import Limits
    from neuronfleet.runtime.serving.server import RuntimeServer
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    token = _internal_token(args)
    model = load_model_config(Path(args.model))
    config = RuntimeConfig.from_serve(args).check_model(model)
    tokenizer = Tokenizer(args.model, model.eos_token_ids)
    # --dtype auto stays `auto` here: each peer resolves it for its own CPU (a router loads no torch)
    limits = Limits(
        config.max_seq_len, config.max_prompt_len, config.slots, config.dtype, "remote",
        dtype_auto=config.dtype == "auto",
    )  # fmt: skip
    eos = frozenset(model.eos_token_ids) | tokenizer.eos_token_ids
    backend = RemoteBackend(
        tokenizer, eos, limits, args.prefill or [], args.decode or [], token,
        probe_interval=args.peer_probe_interval, kv_timeout=args.kv_wait, peer_timeout=args.peer_timeout,
        local_prefill_below=args.local_prefill_below, hold_requests=args.hold_requests,
        hold_seconds=args.hold_seconds, wake_url=args.wake_url, routing=_routing(args),
        max_resumes=args.max_resumes,
        max_queue_wait=args.max_queue_wait,
    )  # fmt: skip
    name = args.served_model_name or Path(args.model).name
    server = RuntimeServer(backend, name, max_body_bytes=args.max_body_bytes, on_startup=[backend.start],
                           sampling_defaults=_sampling_defaults(args))  # fmt: skip
    return _serve_until_stopped(server, args)


def _serve_engine_router(args: ServeConfig) -> int:
    """A router in front of vLLM or SGLang prefill and decode servers, speaking their P/D protocol."""
    from neuronfleet.runtime.routing.pd_proxy import EngineRouter

    tokenizer = _tokenizer(args)
    router = EngineRouter(
        args.peer_protocol, args.prefill or [], args.decode or [], model_name=args.served_model_name or "",
        bootstrap_port=args.bootstrap_port, probe_interval=args.peer_probe_interval,
        peer_timeout=args.peer_timeout, max_body_bytes=args.max_body_bytes, hold_requests=args.hold_requests,
        hold_seconds=args.hold_seconds, wake_url=args.wake_url, wake_token=_optional_token(args),
        routing=_routing(args), tokenizer=tokenizer,
        peer_kv_events=args.peer_kv_events if tokenizer else None, max_resumes=args.max_resumes,
    )  # fmt: skip
    return _serve_until_stopped(router, args)


def _serve_front_door(args: ServeConfig) -> int:
    """A front door to unified pods of any engine: every request passed on as is, held at zero, and waiting
    for a slot while every pod's are taken."""
    from neuronfleet.runtime.routing.front_door import FrontDoor

    tokenizer = _tokenizer(args)
    door = FrontDoor(
        args.unified or [], model_name=args.served_model_name or "", probe_interval=args.peer_probe_interval,
        peer_timeout=args.peer_timeout, max_body_bytes=args.max_body_bytes, hold_requests=args.hold_requests,
        hold_seconds=args.hold_seconds, wake_url=args.wake_url, wake_token=_optional_token(args),
        routing=_routing(args), tokenizer=tokenizer,
        peer_kv_events=args.peer_kv_events if tokenizer else None, max_resumes=args.max_resumes,
        max_queue_wait=args.max_queue_wait, router_queue=args.router_queue,
    )  # fmt: skip
    return _serve_until_stopped(door, args)


def _tokenizer(args: ServeConfig):
    """A router's tokenizer where it is given the model (--model): only the tokenizer, to cut prompts into the
    token blocks the pods cache; None without one (no tokenizer is loaded). One that cannot be read (the
    artifacts gone from under the pod) is said, and the router routes by the prompts' text instead: routing
    knows less, but the model's public endpoint stays up."""
    if not args.model:
        return None
    from neuronfleet.runtime.model.model_config import ModelLoadError
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    try:
        return Tokenizer(args.model)
    except (ModelLoadError, OSError, ValueError) as e:
        log.warning("--model %s: the tokenizer cannot be read (%s); routing by the prompts' text, without "
                    "the pods' KV-cache events", args.model, e)  # fmt: skip
        return None


def _routing(args: ServeConfig):
    """A router's routing policy and knobs, from its options."""
    from neuronfleet.runtime.routing.prefix_routing import Routing

    return Routing(
        args.routing, args.routing_load_margin, args.routing_cache_tokens, pod_slots=args.routing_pod_slots
    )


def _role_setup(args: ServeConfig, config):
    """For --role prefill|decode: the token and the KV transport, checked before the model loads (nixl or efa
    without what NIXL's backend needs fails here, saying what is missing); returns a function that builds the
    role's routes once the engine exists."""
    from neuronfleet.runtime.kv.kv_transfer import TransportUnavailable
    from neuronfleet.runtime.kv.transports import make_agent
    from neuronfleet.runtime.model.model_config import load_model_config

    token = _internal_token(args)
    model_id = args.served_model_name or Path(args.model).name
    advertise = None
    if args.kv_advertise or os.environ.get(POD_IP_ENV):
        host, _, port = (args.kv_advertise or os.environ[POD_IP_ENV]).partition(":")
        advertise = (host, int(port) if port else None)
    elif args.host in ("0.0.0.0", "::") and args.kv_transport == "tcp":
        raise ValueError(
            f"--role {args.role} listening on {args.host} needs the address prefill pods reach it at: "
            f"--kv-advertise HOST or the {POD_IP_ENV} environment variable"
        )
    identity = f"{args.role}-{secrets.token_hex(6)}"  # new at every start: peers notice a restart
    try:  # a writer stalled mid-payload loses its connection after twice its own deadline
        agent = make_agent(args.kv_transport, identity, model_id, args.host, backend=args.kv_nixl_backend,
                           advertise=advertise, stall_seconds=2 * args.kv_wait, secret=token)  # fmt: skip
    except TransportUnavailable as e:  # a usage error, reported as main() reports a bad flag
        raise ValueError(str(e)) from None

    def build(engine, registry):
        import torch

        from neuronfleet.runtime.kv.leases import LeasePool
        from neuronfleet.runtime.kv.roles import DecodeRole, KVMetrics, PrefillRole

        async def start_agent(app) -> None:
            await agent.start(args.kv_port)

        async def stop_agent(app) -> None:  # (NIXL's thread must not be inside a call when Python exits)
            await agent.stop()

        if args.role == "prefill":
            metrics = KVMetrics(registry, model_id, role="prefill")
            role = PrefillRole(engine, agent, token, timeout=args.kv_wait, metrics=metrics)
            return role.routes(), [], [stop_agent]

        c = load_model_config(args.model)
        leases = LeasePool(
            agent, count=args.kv_leases or config.slots, layers=c.num_layers, kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, max_tokens=config.max_prompt_len,
            dtype=getattr(torch, engine.limits.dtype),  # the engine's, `auto` resolved: what import_kv takes
            ttl=args.kv_lease_ttl,
        )  # fmt: skip
        metrics = KVMetrics(registry, model_id, leases)
        role = DecodeRole(engine, agent, leases, token, wait_seconds=args.kv_wait, metrics=metrics)
        return role.routes(), [start_agent], [stop_agent]

    return build
