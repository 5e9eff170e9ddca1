"""Every spec field meant for the runtime reaches the process that serves it: each sample in crds/samples/ is
rendered by `neuronfleet render` (the objects the operator applies), and every role's command, environment
and compile config is read back, field by field, the way the process reads it:

- our runtime (the embedded engine, and every engine's router): the real `neuronfleet serve` parser into
  `contract.ServeConfig`, then the runtime's own `RuntimeConfig`, whose limits are what `/info` reports;
- vLLM (over NxD Inference on Inf2/Trn1, the vLLM Neuron plugin on Trn2/Trn3), TGI and SGLang: an argparse
  parser that knows only the flags documented for the pinned version (an unknown flag fails the parse), and
  TGI's documented environment variables (the names and their sources are each engine module's PINNED;
  tests/unit/test_engine_tgi.py, test_engine_sglang.py and test_engine_vllm_*.py check them in depth).

A field an engine has no setting for must be refused by validation (never dropped): checked below too."""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from support import ROOT, neuronfleet_command

from neuronfleet.cli import build_parser
from neuronfleet.contract import (
    COMPILE_CONFIG_FILE,
    HF_TOKEN_ENVS,
    KV_EVENTS_CONFIG,
    KV_EVENTS_PORT,
    CompileConfig,
    KvEventsConfig,
    ServeConfig,
)
from neuronfleet.operator import validation
from neuronfleet.operator.engines import sglang, tgi, vllm, vllm_plugin
from neuronfleet.operator.spec_base import quantity_value
from neuronfleet.runtime.engine.config import RuntimeConfig

SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
ROLE_LABEL = "neuronfleet.dev/role"


def render(path: Path) -> list[dict]:
    out = subprocess.run(
        [*neuronfleet_command(), "render", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def manifest(path: Path) -> tuple[dict, object]:
    obj = yaml.safe_load(path.read_text())
    spec, errors = validation.parse(obj)
    assert not errors and spec is not None
    return obj, spec


def deployments(objects: list[dict]) -> dict[str, dict]:
    """The serving Deployments by role (one per role: the samples render one compile hash)."""
    out: dict[str, dict] = {}
    for o in objects:
        if o["kind"] == "Deployment":
            role = o["metadata"]["labels"][ROLE_LABEL]
            assert role not in out, f"two Deployments for role {role}"
            out[role] = o
    return out


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def serve_args(command: list[str]) -> ServeConfig:
    assert command[:2] == ["neuronfleet", "serve"], command
    return ServeConfig.from_namespace(build_parser().parse_args(command[1:]))


# ---- the external engines' documented flags (the pinned versions of operator/engines/) ------------------


def vllm_parser() -> argparse.ArgumentParser:
    """`vllm serve` flags used here (vLLM 0.16.0 and 0.24.0: vllm/engine/arg_utils.py; every emitted name with
    its source and values: tests/unit/test_engine_vllm_nxdi.py and test_engine_vllm_plugin.py)."""
    p = argparse.ArgumentParser(prog="vllm serve", exit_on_error=False)
    p.add_argument("model")
    for flag in ("--host", "--revision", "--served-model-name"):
        p.add_argument(flag)
    for flag in (
        "--port",
        "--tensor-parallel-size",
        "--max-num-seqs",
        "--max-model-len",
        "--num-gpu-blocks-override",
        "--max-num-batched-tokens",
    ):
        p.add_argument(flag, type=int)
    p.add_argument("--dtype", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"])
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument("--enable-expert-parallel", action="store_true")
    p.add_argument("--additional-config", type=json.loads)
    p.add_argument("--kv-transfer-config", type=json.loads)
    p.add_argument("--kv-events-config", type=json.loads)
    return p


def sglang_parser() -> argparse.ArgumentParser:
    """`python -m sglang.launch_server` flags (SGLang's ServerArgs at the image's commit 43881a7:
    https://docs.sglang.io/advanced_features/server_arguments.html)."""
    p = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    for flag in (
        "--model-path",
        "--host",
        "--revision",
        "--served-model-name",
        "--disaggregation-transfer-backend",
    ):
        p.add_argument(flag)
    for flag in (
        "--port", "--tp-size", "--max-running-requests", "--context-length", "--ep-size",
        "--disaggregation-bootstrap-port",
    ):  # fmt: skip
        p.add_argument(flag, type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e5m2", "fp8_e4m3"])
    p.add_argument("--dtype", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"])
    return p


def tgi_parser() -> argparse.ArgumentParser:
    """text-generation-launcher flags (TGI v3.3.5 launcher/src/main.rs), after the image's entrypoint."""
    p = argparse.ArgumentParser(prog="text-generation-launcher", exit_on_error=False)
    p.add_argument("--model-id", required=True)
    return p


TGI_ENV = {  # TGI v3.3.5 backends/neuron/server/text_generation_server/tgi_env.py, and PORT (the launcher's)
    "HF_NUM_CORES", "HF_AUTO_CAST_TYPE", "MAX_BATCH_SIZE", "MAX_TOTAL_TOKENS", "MAX_INPUT_TOKENS",
    "MAX_BATCH_PREFILL_TOKENS", "PORT",
}  # fmt: skip


def pinned_names(pinned, kind: str) -> set[str]:
    return {f.name for f in pinned.facts if f.kind == kind}


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


# ---- the checks --------------------------------------------------------------------------------------------


def check_ours(config: ServeConfig, spec, name: str, role: str) -> None:
    """Our runtime: every shape of the spec in the serve options, and the runtime's limits (what /info and
    the request checks use) equal to the spec's."""
    n = spec.neuron
    assert config.role == role
    assert config.port == spec.serving.port
    assert config.served_model_name == name
    assert config.dtype == n.dtype
    assert config.slots == n.batchSize
    assert config.max_seq_len == n.sequenceLength
    assert config.max_input_len == n.maxInputLength
    assert config.prefill_buckets == (n.buckets.context or None)
    assert config.decode_buckets == (n.buckets.generation or None)
    host_kv = None if n.hostKVCache is None or role == "router" else int(quantity_value(n.hostKVCache))
    assert config.host_kv_cache_bytes == host_kv  # the host KV store's size (None: the runtime's default)
    runtime = RuntimeConfig(
        slots=config.slots,
        max_seq_len=config.max_seq_len,
        max_input_len=config.max_input_len or 0,
        prefill_buckets=config.prefill_buckets or (),
        decode_buckets=config.decode_buckets or (),
        dtype=config.dtype,
    )  # fmt: skip  (as `neuronfleet serve` builds it)
    assert runtime.max_prompt_len == n.maxInputLength  # /info max_input_tokens
    assert runtime.max_seq_len == n.sequenceLength  # /info max_total_tokens
    assert runtime.dtype == n.dtype  # /info model_dtype
    assert runtime.slots == n.batchSize  # /info max_concurrent_requests
    if role in ("prefill", "decode"):  # the KV transport (the engine's default when the spec names none)
        assert config.kv_transport == spec.serving.kvTransfer.transport
    # sampling defaults reach the pods that parse requests (unified, our router), by generation_config's names
    sampling = spec.serving.sampling
    given = {"temperature": sampling.temperature, "top_p": sampling.topP, "top_k": sampling.topK,
             "repetition_penalty": sampling.repetitionPenalty}  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    parses = role in ("unified", "router") and bool(given)
    assert (json.loads(config.override_generation_config) if config.override_generation_config else None) == (
        given if parses else None
    )
    # prefill pods, and unified pods behind a front door, publish KV-cache events for a kv-aware router (it
    # subscribes at the address it probes, or where their ready answer says)
    behind_a_door = role == "unified" and front_door_expected(spec)
    publishes = role in ("prefill", "unified") and spec.serving.routing.policy == "kv-aware"
    publishes = publishes and (role == "prefill" or behind_a_door)
    assert (config.kv_events_config is not None) == publishes
    if publishes:
        events = KvEventsConfig.parse(config.kv_events_config)
        assert events.publishes and events.endpoint.startswith("tcp://*:")  # bound on every interface


def check_engine_router(config: ServeConfig, spec, name: str) -> None:
    """Our router in front of vLLM's or SGLang's own servers: their P/D protocol, no model (the engines check
    requests against the shapes themselves) but vLLM's tokenizer where it routes kv-aware (it follows the
    prefill servers' KV-cache events at the port they publish on), the port the engine pods serve on,
    SGLang's bootstrap port."""
    follows = spec.engine == "vllm" and spec.serving.routing.policy == "kv-aware"
    assert (config.role, config.peer_protocol) == ("router", spec.engine)
    assert (config.model is not None) == follows == (config.peer_kv_events == KV_EVENTS_CONFIG)
    assert config.port == spec.serving.port and config.served_model_name == name
    assert all(p.endswith(f":{spec.serving.port}") for p in [*config.prefill, *config.decode])
    assert (config.bootstrap_port is not None) == (spec.engine == "sglang")


def front_door_expected(spec) -> bool:
    """docs/front-door.md: every unified model gets a front door, but one behind an inference gateway that
    does not scale to zero (the gateway's pool is its pods)."""
    a = spec.autoscaling
    zero = a.enabled and a.scaleToZero
    return zero or spec.serving.gateway is None


def check_routing(config: ServeConfig, spec) -> None:
    """The policy the spec names; the load margin it names, else a quarter of a pod's slots, at least 2; a
    pod's prefix cache as its slots full at the sequence length (and our runtime's host KV store); a pod's
    slots its batch size."""
    r, n = spec.serving.routing, spec.neuron
    margin = r.loadMargin if r.loadMargin is not None else max(2, n.batchSize // 4)
    assert (config.routing, config.routing_load_margin) == (r.policy, margin)
    slots = n.batchSize * n.sequenceLength  # our runtime's host KV store holds as much again by default
    assert config.routing_cache_tokens == (2 * slots if spec.engine == "embedded" and n.hostKVCache is None
                                           else slots) or n.hostKVCache is not None  # fmt: skip
    assert config.routing_pod_slots == n.batchSize


def check_front_door(config: ServeConfig, spec, name: str, unified: dict) -> None:
    """A unified model's front door: its unified pods by their headless Service, no model files but, where
    the pods publish their KV-cache events (they declare the port), the tokenizer of the folder they load,
    to follow them."""
    assert (config.role, config.served_model_name) == ("router", name)
    assert config.unified == [f"dns://{name}-unified:{spec.serving.port}"]
    command = container(unified)["command"]
    publishes = any(p["name"] == "kv-events" for p in container(unified)["ports"])
    if not publishes:
        assert (config.model, config.peer_kv_events) == (None, None)
        return
    loads = serve_args(command).model if command[0] == "neuronfleet" else command[command.index("vllm") + 2]
    assert (config.model, config.peer_kv_events) == (loads, KV_EVENTS_CONFIG)


def check_compile_config(objects: list[dict], spec) -> None:
    """The compile-time fields (tensor parallelism, quantization, overrides...) in compile.json, which the
    compile Job reads for the embedded engine, with the engine's own Neuron settings in its own names."""
    n = spec.neuron
    data = next(
        o["data"] for o in objects if o["kind"] == "ConfigMap" and COMPILE_CONFIG_FILE in o.get("data", {})
    )
    c = CompileConfig.model_validate_json(data[COMPILE_CONFIG_FILE])
    assert (c.engine, c.instanceType, c.tensorParallel) == (spec.engine, n.instanceType, n.tensorParallel)
    assert (c.batchSize, c.sequenceLength, c.maxInputLength, c.dtype) == (
        n.batchSize, n.sequenceLength, n.maxInputLength, n.dtype,
    )  # fmt: skip
    assert (c.buckets.context, c.buckets.generation) == (n.buckets.context, n.buckets.generation)
    if spec.engine == "vllm" and vllm.contract(spec) is vllm_plugin:  # the plugin's own keys, no NxDI one
        assert c.neuronConfig == vllm_plugin.neuron_config(spec)
    elif spec.engine == "sglang":  # TorchNeuron: its shapes are its flags
        assert c.neuronConfig == {}
    else:
        check_neuron_config(c.neuronConfig, spec)


def check_neuron_config(nc: dict, spec) -> None:
    """NxDI's NeuronConfig (field names: neuronx_distributed_inference.models.config.NeuronConfig)."""
    n = spec.neuron
    assert (nc["tp_degree"], nc["batch_size"], nc["seq_len"]) == (
        n.tensorParallel,
        n.batchSize,
        n.sequenceLength,
    )
    assert (nc["max_context_length"], nc["torch_dtype"]) == (n.maxInputLength, n.dtype)
    assert nc.get("context_encoding_buckets", []) == n.buckets.context
    assert nc.get("token_generation_buckets", []) == n.buckets.generation
    assert nc.get("logical_nc_config") == n.logicalCores
    assert nc.get("quantization_dtype") == (None if n.quantization == "none" else n.quantization)
    for key, value in n.overrides.items():
        assert nc[key] == value


def vllm_neuron_config(engine: dict, override: dict) -> dict:
    """The NxDI NeuronConfig the vllm-neuron plugin builds: its defaults from vLLM's arguments, then the
    override (vllm-project/vllm-neuron@0.2.2+lts:vllm_neuron/worker/neuronx_distributed_model_loader.py,
    _get_default_neuron_config and _get_neuron_config_after_override)."""
    defaults = {
        "tp_degree": engine["tensor_parallel_size"],
        "batch_size": engine["max_num_seqs"],
        "max_context_length": engine["max_model_len"],
        "seq_len": engine["max_model_len"],
        "torch_dtype": engine["dtype"],
    }
    return {**defaults, **override}


def check_vllm_neuron_config(engine: dict, spec) -> None:
    """Every shape reaches NxDI, through vLLM's arguments or the plugin's override_neuron_config."""
    n = spec.neuron
    nc = vllm_neuron_config(engine, engine["additional_config"]["override_neuron_config"])
    assert (nc["tp_degree"], nc["batch_size"], nc["seq_len"], nc["torch_dtype"]) == (
        n.tensorParallel, n.batchSize, n.sequenceLength, n.dtype,
    )  # fmt: skip
    assert nc["max_context_length"] == n.maxInputLength + 1 == n.sequenceLength  # vLLM admits maxInputLength
    assert nc.get("context_encoding_buckets", []) == n.buckets.context
    assert nc.get("token_generation_buckets", []) == n.buckets.generation
    assert nc.get("logical_nc_config") == n.logicalCores
    assert nc.get("quantization_dtype") == {"none": None, "int8": "int8", "fp8": "f8e4m3"}[n.quantization]
    assert nc["save_sharded_checkpoint"] is True  # the artifacts hold the sharded weights serving loads
    assert engine["enable_prefix_caching"] is False and engine["num_gpu_blocks_override"] == n.batchSize
    for key, value in n.overrides.items():
        assert nc[key] == value


def check_vllm_plugin(c: dict, spec, name: str, role: str) -> None:
    """The vLLM Neuron plugin (Trn2/Trn3): the shapes in vLLM's flags, the buckets and expert parallelism in
    --additional-config's neuron_config (reference-configuration.md at SDK v2.32.0), the role's own tensor
    parallelism and KV connector, the model from the compile's folder."""
    n = spec.neuron
    assert c["command"][:2] == ["/bin/sh", "-c"] and c["command"][4:6] == ["vllm", "serve"]  # start guard
    args = vllm_parser().parse_args(c["command"][6:])
    assert args.port == spec.serving.port and args.served_model_name == name
    assert args.model.startswith("/")  # a folder: the compile's download, or the mounted source
    assert args.tensor_parallel_size == validation.role_tensor_parallel(spec, role)
    assert (args.max_num_seqs, args.max_model_len, args.dtype) == (n.batchSize, n.sequenceLength, n.dtype)
    config = (args.additional_config or {}).get("neuron_config", {})
    assert config.get("num_batched_tokens_buckets", []) == n.buckets.context
    assert args.max_num_batched_tokens == (max(n.buckets.context) if n.buckets.context else None)
    assert config.get("decode_context_length_buckets", []) == n.buckets.generation
    assert config.get("ep_degree") == n.expertParallel and args.enable_expert_parallel == bool(
        n.expertParallel
    )
    assert args.kv_cache_dtype == (None if n.kvCacheDtype == "auto" else n.kvCacheDtype)
    for key, value in n.overrides.items():
        assert config[key] == value
    kv = args.kv_transfer_config
    if role == "unified":
        assert kv is None
    else:
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert kv["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"]}  # NIXL over EFA
    lnc = n.logicalCores or validation.topology.INSTANCES[n.instanceType].default_logical_cores
    assert env_of(c)["NEURON_LOGICAL_NC_CONFIG"] == str(lnc)


def check_vllm(c: dict, spec, name: str, role: str) -> None:
    n = spec.neuron
    if n.instanceType.startswith("trn2") or n.instanceType.startswith("trn3"):
        return check_vllm_plugin(c, spec, name, role)
    assert role == "unified"  # disaggregated vLLM over NxD Inference is refused
    assert c["command"][:2] == ["/bin/sh", "-c"] and c["command"][4:6] == ["vllm", "serve"]  # start guard
    args = vllm_parser().parse_args(c["command"][6:])
    assert args.port == spec.serving.port
    assert args.served_model_name == name
    assert args.revision == spec.model.revision
    engine = {
        "tensor_parallel_size": args.tensor_parallel_size, "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len, "dtype": args.dtype, "additional_config": args.additional_config,
        "enable_prefix_caching": not args.no_enable_prefix_caching,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
    }  # fmt: skip
    check_vllm_neuron_config(engine, spec)


def check_vllm_plugin_compile(objects: list[dict], spec) -> None:
    """compile.sh starts `vllm serve` once per tensor parallelism the pods run, with their arguments (no KV
    connector), so the graphs it compiles are the ones they load."""
    script = next(o["data"]["compile.sh"] for o in objects if "compile.sh" in o.get("data", {}))
    roles = ("prefill", "decode") if spec.serving.mode == "disaggregated" else ("unified",)
    serving = {validation.role_tensor_parallel(spec, r): r for r in roles}
    started = [
        shlex.split(line.rstrip(" &")) for line in script.splitlines() if line.startswith("vllm serve")
    ]
    assert sorted(int(w[w.index("--tensor-parallel-size") + 1]) for w in started) == (
        validation.tensor_parallel_degrees(spec))  # fmt: skip
    for words in started:
        args = vllm_parser().parse_args(words[2:])
        role = serving[args.tensor_parallel_size]
        pod = vllm_parser().parse_args(container(deployments(objects)[role])["command"][6:])
        ignored = ("host", "port", "kv_transfer_config", "served_model_name")
        assert {k: v for k, v in vars(args).items() if k not in ignored} == {
            k: v for k, v in vars(pod).items() if k not in ignored
        }


def check_vllm_compile(objects: list[dict], spec) -> None:
    """The compile Job's `LLM(model, **ENGINE_ARGS)` (vllm.LLM takes the engine arguments as keywords): the
    same shapes as the serving pods', or the artifacts would not be the ones they load."""
    if spec.neuron.instanceType.startswith(("trn2", "trn3")):
        return check_vllm_plugin_compile(objects, spec)
    script = next(o["data"]["compile_vllm.py"] for o in objects if "compile_vllm.py" in o.get("data", {}))
    assigned = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(script).body
        if isinstance(node, ast.Assign) and node.targets[0].id in ("MODEL", "REVISION", "ENGINE_ARGS")
    }
    assert assigned["MODEL"] == spec.model.uri.removeprefix("hf://")
    assert assigned["REVISION"] == spec.model.revision
    check_vllm_neuron_config(assigned["ENGINE_ARGS"], spec)


def check_sglang(c: dict, spec, name: str, role: str) -> None:
    n = spec.neuron
    assert c["command"][:3] == ["python", "-m", "sglang.launch_server"]
    args = sglang_parser().parse_args(c["command"][3:])
    assert args.port == spec.serving.port
    assert args.tp_size == n.tensorParallel
    assert args.max_running_requests == n.batchSize
    assert args.context_length == n.sequenceLength
    assert args.dtype == n.dtype
    assert args.served_model_name == name
    assert args.revision == spec.model.revision
    assert args.disaggregation_mode == (role if role in ("prefill", "decode") else None)
    assert args.disaggregation_bootstrap_port == (sglang.BOOTSTRAP_PORT if role == "prefill" else None)
    assert args.ep_size == n.expertParallel and args.mem_fraction_static == n.memoryFraction
    assert args.kv_cache_dtype == {"auto": None, "fp8": "fp8_e4m3"}[n.kvCacheDtype]
    assert env_of(c)["SGLANG_PLATFORM"] == "neuron"
    assert {e["name"] for e in c["env"]} - set(HF_TOKEN_ENVS) <= pinned_names(sglang.PINNED, "env")


def check_tgi(c: dict, spec) -> None:
    n = spec.neuron
    guard, launcher = c["command"][:4], c["command"][4:]  # the start guard, then the launcher
    assert guard[:2] == ["/bin/sh", "-c"] and guard[3] == "tgi-start-guard"
    assert launcher[0] == "/tgi-entrypoint.sh"  # the image's entrypoint, which runs the launcher
    tgi_parser().parse_args(launcher[1:])
    env = env_of(c)
    assert set(env) >= TGI_ENV
    assert set(env) <= pinned_names(tgi.PINNED, "env")
    assert env["HF_NUM_CORES"] == str(n.tensorParallel)
    assert env["HF_AUTO_CAST_TYPE"] == {"bfloat16": "bf16", "float16": "fp16"}[n.dtype]
    assert env["MAX_BATCH_SIZE"] == str(n.batchSize)
    assert env["MAX_TOTAL_TOKENS"] == str(n.sequenceLength)
    assert env["MAX_INPUT_TOKENS"] == str(n.maxInputLength)
    assert env["PORT"] == str(spec.serving.port)


def check_tgi_compile(objects: list[dict], spec) -> None:
    """The compile Job's steps (compile.sh): a Hub model is downloaded at the spec's revision, then exported
    with the serving pods' shapes (optimum-neuron's own parser reads them: tests/unit/test_engine_tgi.py)."""
    script = next(o["data"]["compile.sh"] for o in objects if "compile.sh" in o.get("data", {}))
    lines = [shlex.split(line) for line in script.splitlines()]
    download = next(words for words in lines if words[:1] == ["python3"])
    assert download[2:4] == [spec.model.uri.removeprefix("hf://"), spec.model.revision or ""]
    export = next(words for words in lines if words[:3] == ["optimum-cli", "export", "neuron"])
    flags = dict(zip(export[3:-1:2], export[4:-1:2], strict=True))
    n = spec.neuron
    assert flags["--model"] == download[4] and flags["--task"] == "text-generation"
    assert (flags["--batch_size"], flags["--sequence_length"]) == (str(n.batchSize), str(n.sequenceLength))
    assert flags["--num_cores"] == str(n.tensorParallel)
    assert flags["--auto_cast_type"] == {"bfloat16": "bf16", "float16": "fp16"}[n.dtype]


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_runtime_field_of_every_sample_reaches_every_roles_process(path):
    check_every_role(path)


@pytest.mark.parametrize(
    ("base", "neuron"),
    [
        ("llama-3.1-8b-vllm-inf2.yaml", {"revision": "v1", "quantization": "fp8", "dtype": "float16",
         "overrides": {"fused_qkv": True},
         "buckets": {"context": [1024, 8191], "generation": [4096, 8192]}}),
        ("llama-3.3-70b-vllm-trn2.yaml", {"revision": "v5", "dtype": "float16", "expertParallel": 8,
         "kvCacheDtype": "fp8", "overrides": {"num_seqs_buckets": [1, 16]},
         "buckets": {"context": [1024, 8192], "generation": [4096, 8192]}}),
        ("llama-3.3-70b-vllm-trn2-disaggregated.yaml", {"dtype": "float16", "kvCacheDtype": "fp8"}),
        ("llama-3.1-70b-vllm-trn1.yaml", {"revision": "v2", "quantization": "int8"}),
        ("gpt-oss-120b-sglang-trn3-disaggregated.yaml", {"revision": "v3", "dtype": "float16"}),
        ("llama-3.2-3b-tgi-inf2.yaml", {"revision": "v4", "dtype": "float16", "maxInputLength": 1024}),
        ("smollm2-135m-local-cpu-disaggregated.yaml", {"dtype": "float32", "maxInputLength": 200,
         "buckets": {"context": [64, 200], "generation": [256, 512]}}),
    ],
)  # fmt: skip
def test_fields_the_samples_leave_at_their_defaults_reach_the_process_too(base, neuron, tmp_path):
    path = tmp_path / base
    path.write_text(yaml.safe_dump(spec_with(base, **neuron)))
    check_every_role(path)


def check_every_role(path: Path) -> None:
    obj, spec = manifest(path)
    name = obj["metadata"]["name"]
    objects = render(path)
    by_role = deployments(objects)
    roles = ["prefill", "decode", "router"]
    if spec.serving.mode == "unified":
        roles = ["unified", "router"] if front_door_expected(spec) else ["unified"]
    assert sorted(by_role) == sorted(roles)
    for role, deployment in by_role.items():
        c = container(deployment)
        assert c["ports"][0]["containerPort"] == spec.serving.port
        numbers = [p["containerPort"] for p in c["ports"]]
        assert len(set(numbers)) == len(numbers), c["ports"]  # one listener a port
        events = next((p for p in c["ports"] if p["name"] == "kv-events"), None)
        if events is not None:  # the port its KV-cache events are published on is the one it declares
            command = c["command"]
            if command[:2] == ["neuronfleet", "serve"]:
                config = KvEventsConfig.parse(serve_args(command).kv_events_config)
            else:  # vLLM's own flag, the same JSON (behind its start guard)
                vllm = vllm_parser().parse_args(command[command.index("vllm") + 2 :])
                config = KvEventsConfig.model_validate(vllm.kv_events_config)
            assert config.publishes and config.endpoint == f"tcp://*:{events['containerPort']}"
            assert events["containerPort"] == KV_EVENTS_PORT
            replay = next(p for p in c["ports"] if p["name"] == "kv-replay")
            assert config.replay_endpoint == f"tcp://*:{replay['containerPort']}"
        if role == "router":  # every router routes as the spec says (docs/routing.md)
            check_routing(serve_args(c["command"]), spec)
        if role == "router" and spec.serving.mode == "unified":
            check_front_door(serve_args(c["command"]), spec, name, by_role["unified"])
        elif role == "router" and spec.engine in ("vllm", "sglang"):
            check_engine_router(serve_args(c["command"]), spec, name)
        elif spec.engine == "embedded" or role == "router":
            check_ours(serve_args(c["command"]), spec, name, role)
        elif spec.engine == "vllm":
            check_vllm(c, spec, name, role)
        elif spec.engine == "sglang":
            check_sglang(c, spec, name, role)
        else:
            check_tgi(c, spec)
    if spec.engine == "embedded":
        check_compile_config(objects, spec)
    if spec.engine == "vllm":
        check_vllm_compile(objects, spec)
    if spec.engine == "tgi":
        check_tgi_compile(objects, spec)


def test_the_local_samples_serve_what_they_ask_for():
    """The local samples ask for dtype auto (the default: each pod resolves it for its own CPU) and 384 input
    tokens; the unified pod and every role of the disaggregated one, the router too, are told so (an older
    operator told them float32 and 512, the router 2048)."""
    for path in ("smollm2-135m-local-cpu.yaml", "smollm2-135m-local-cpu-disaggregated.yaml"):
        for role, deployment in deployments(render(ROOT / "crds" / "samples" / path)).items():
            if role == "router" and "disaggregated" not in path:
                continue  # the unified model's front door parses no request: it forwards them
            config = serve_args(container(deployment)["command"])
            assert (config.dtype, config.max_input_len, config.max_seq_len) == ("auto", 384, 512)


def spec_with(base: str, **neuron) -> dict:
    """A sample with some neuron fields changed (`revision` goes to spec.model)."""
    obj = yaml.safe_load((ROOT / "crds" / "samples" / base).read_text())
    if "revision" in neuron:
        obj["spec"]["model"]["revision"] = neuron.pop("revision")
    obj["spec"]["neuron"].update(neuron)
    return obj


@pytest.mark.parametrize(
    ("base", "neuron", "message"),
    [
        ("llama-3.2-3b-tgi-inf2.yaml", {"quantization": "int8"},
         r"neuron.quantization int8: TGI's Neuron export \(optimum-neuron\) has no setting for it; use none"),
        ("llama-3.2-3b-tgi-inf2.yaml", {"buckets": {"context": [1024, 3072]}},
         r"neuron.buckets: TGI's Neuron export .* compiles its own length buckets"),
        ("gpt-oss-120b-sglang-trn3-disaggregated.yaml", {"maxInputLength": 4096},
         r"neuron.maxInputLength 4096 must be neuron.sequenceLength - 1 \(8191\) for engine sglang: SGLang "
         r"bounds a prompt by the context length only \(--context-length\)"),
        ("gpt-oss-120b-sglang-trn3-disaggregated.yaml", {"quantization": "fp8"},
         r"neuron.quantization fp8: SGLang-Neuron has no setting for it"),
        ("gpt-oss-120b-sglang-trn3-disaggregated.yaml", {"overrides": {"fused_qkv": True}},
         r"neuron.overrides are NxDI NeuronConfig fields, which SGLang-Neuron does not read"),
        ("gpt-oss-120b-sglang-trn3-disaggregated.yaml", {"logicalCores": 2},
         r"neuron.logicalCores: SGLang-Neuron has no setting for it"),
        ("gpt-oss-120b-sglang-trn3-disaggregated.yaml", {"expertParallel": 3},
         r"neuron.expertParallel 3 must divide neuron.tensorParallel 8 \(SGLang's --ep-size\)"),
        ("llama-3.2-3b-tgi-inf2.yaml", {"kvCacheDtype": "fp8"},
         r"neuron.kvCacheDtype: TGI's Neuron export \(optimum-neuron\) has no setting for a KV cache type; "
         r"remove it, or use engine vllm on Trn2/Trn3 or engine sglang on Trn3"),
        ("smollm2-135m-local-cpu.yaml", {"memoryFraction": 0.5},
         r"neuron.memoryFraction: engine embedded \(neuronfleet's runtime\) has no setting for a device "
         r"memory fraction"),
    ],
)  # fmt: skip
def test_a_field_the_engine_cannot_honour_is_refused_saying_what_works(base, neuron, message):
    report = validation.check(spec_with(base, **neuron))
    assert not report.ok
    assert any(re.search(message, e) for e in report.errors), report.errors


def test_engines_that_take_every_field_refuse_none_of_them():
    for obj in (
        spec_with("llama-3.1-8b-vllm-inf2.yaml", quantization="fp8", overrides={"fused_qkv": True},
                  buckets={"context": [1024, 8191], "generation": [4096, 8192]}),
        spec_with("llama-3.3-70b-vllm-trn2-disaggregated.yaml", expertParallel=8, kvCacheDtype="fp8",
                  overrides={"num_seqs_buckets": [1, 16]}, buckets={"context": [1024], "generation": [4096]}),
        spec_with("gpt-oss-120b-sglang-trn3-disaggregated.yaml", expertParallel=4, kvCacheDtype="fp8",
                  memoryFraction=0.7),
    ):  # fmt: skip
        assert validation.check(obj).ok, validation.check(obj).errors


def test_a_role_tensor_parallelism_is_refused_where_one_runs_for_both_roles():
    obj = yaml.safe_load(
        (ROOT / "crds" / "samples" / "gpt-oss-120b-sglang-trn3-disaggregated.yaml").read_text()
    )
    obj["spec"]["serving"]["decode"]["tensorParallel"] = 16
    errors = validation.check(obj).errors
    expected = "serving.decode.tensorParallel: SGLang-Neuron runs neuron.tensorParallel in every role"
    assert any(e.startswith(expected) for e in errors), errors


@pytest.mark.parametrize(
    ("base", "section", "fields", "message"),
    [
        ("gpt-oss-120b-sglang-trn3-disaggregated.yaml", "compile", {"nodeSelector": {"pool": "cpu"}},
         r"compile.nodeSelector: engine sglang runs no compile Job for this model"),
        ("gpt-oss-120b-sglang-trn3-disaggregated.yaml", "compile", {"activeDeadlineSeconds": 600},
         r"compile.activeDeadlineSeconds: engine sglang runs no compile Job"),
        ("smollm2-135m-local-cpu-disaggregated.yaml", "serving",
         {"kvTransfer": {"transport": "tcp", "efaInterfaces": 2}},
         r"serving.kvTransfer.efaInterfaces: EFA devices are requested for prefill and decode pods with "
         r"kvTransfer.transport efa \(or nixl with backend libfabric\) only"),
    ],
)  # fmt: skip
def test_a_field_nothing_would_read_is_refused(base, section, fields, message):
    obj = yaml.safe_load((ROOT / "crds" / "samples" / base).read_text())
    obj["spec"].setdefault(section, {}).update(fields)
    errors = validation.check(obj).errors
    assert any(re.search(message, e) for e in errors), errors


def test_the_compile_image_and_a_cpu_models_scheduler_are_used():
    from neuronfleet.operator import builders

    obj = yaml.safe_load((ROOT / "crds" / "samples" / "llama-3.3-70b-vllm-trn2.yaml").read_text())
    plain = validation.parse(obj)[0]
    obj["spec"]["compile"]["image"] = "mirror.example.com/vllm-neuronx:0.24.0.1.1.0"
    spec = validation.parse(obj)[0]
    assert builders.compile_hash(spec) != builders.compile_hash(plain)  # another compiler, other artifacts
    (job,) = [o for o in builders.build_all(builders.Owner("m", "ns"), spec) if o["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == obj["spec"]["compile"]["image"]
    cpu = yaml.safe_load((ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml").read_text())
    cpu["spec"]["scheduling"] = {"schedulerName": "batch-scheduler"}
    spec = validation.parse(cpu)[0]
    dep, door = [o for o in builders.build_all(builders.Owner("m", "ns"), spec, serving_hash="h")
                 if o["kind"] == "Deployment"]  # fmt: skip
    assert dep["spec"]["template"]["spec"]["schedulerName"] == "batch-scheduler"
    assert "schedulerName" not in door["spec"]["template"]["spec"]  # the front door: no devices to place
