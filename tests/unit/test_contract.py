"""The operator <-> runtime contract (neuronfleet/contract.py): what the operator renders, the runtime parses
back into the same configuration: every serving role's command line of every sample through the real
`neuronfleet serve` parser, and compile.json through `neuronfleet compile`'s reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support import ROOT

from neuronfleet import contract
from neuronfleet.cli import build_parser
from neuronfleet.contract import KV_EVENTS_CONFIG, CompileConfig, ServeConfig
from neuronfleet.operator import builders, engines, validation
from neuronfleet.runtime.artifacts.compile_artifacts import CompileError, load_config

SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")


def parsed(path: Path):
    spec, errors = validation.parse(yaml.safe_load(path.read_text()))
    assert not errors
    return spec


def serve_subparser():
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command")  # type: ignore[union-attr]
    return sub.choices["serve"]


def test_every_serve_option_is_a_field_and_every_field_a_serve_option():
    dests = {a.dest for a in serve_subparser()._actions if a.dest != "help"}
    assert dests == set(ServeConfig.model_fields)


def test_the_serve_parsers_defaults_are_the_configurations_defaults():
    args = build_parser().parse_args(["serve", "--model", "/m"])
    assert ServeConfig.from_namespace(args) == ServeConfig(model="/m")
    assert ServeConfig(model="/m").to_args() == ["--model", "/m"]


def test_every_option_renders_and_parses_back():
    config = ServeConfig(
        model="/m", role="decode", host="0.0.0.0", port=9000, slots=3, max_seq_len=128, max_input_len=64,
        prefill_buckets=[16, 64], decode_buckets=[32, 128], prefill=["http://a:1", "http://b:2"],
        decode=["dns://d:3"], served_model_name="x", kv_transport="nixl", kv_port=7001,
        kv_nixl_backend="libfabric",
        internal_token_file="/t", dtype="bfloat16", quantization="int4", prefix_reuse=False, kv_leases=2,
        host_kv_cache_bytes=1 << 20, decode_graph=False, compiled_steps="inductor", tensor_parallel=2,
        kv_wait=1.5,
        kv_lease_ttl=9.0, kv_advertise="10.0.0.1:7001", peer_probe_interval=0.5, local_prefill_below=16,
        peer_timeout=5.0, peer_hosts_file="/h", max_waiting=3, max_queue_wait=7.0, max_body_bytes=1000,
        header_timeout=4.0, body_timeout=8.0, grace_period=2.0,
        kv_events_config='{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}',
        override_generation_config='{"temperature": 0.2}',
    )  # fmt: skip
    # routers that speak an engine's protocol: the options only they take (SGLang's reads no model; vLLM's
    # reads its tokenizer to name its prefill peers' KV-cache events)
    engine_router = ServeConfig(role="router", peer_protocol="sglang", bootstrap_port=8998)
    vllm_router = ServeConfig(
        role="router", peer_protocol="vllm", model="/m", peer_kv_events=KV_EVENTS_CONFIG
    )
    # a front door to unified pods, holding at zero
    front_door = ServeConfig(role="router", unified=["dns://u:8000"], hold_requests=4, hold_seconds=60.0,
                             wake_url="http://op:8080/wake/ns/m", routing="least-loaded",
                             routing_load_margin=0, routing_cache_tokens=4096, routing_pod_slots=4,
                             max_resumes=1, router_queue=False)  # fmt: skip
    given = (
        config.model_fields_set
        | engine_router.model_fields_set
        | vllm_router.model_fields_set
        | front_door.model_fields_set
    )
    assert given == set(ServeConfig.model_fields)  # nothing left at its default
    for each in (config, engine_router, vllm_router, front_door):
        args = build_parser().parse_args(["serve", *each.to_args()])
        assert ServeConfig.from_namespace(args) == each


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_the_operators_serve_commands_parse_into_the_configuration_it_rendered(path):
    spec = parsed(path)
    chash = builders.compile_hash(spec)
    deployments = {
        o["metadata"]["labels"]["neuronfleet.dev/role"]: o
        for o in builders.build_all(OWNER, spec, serving_hash=chash)
        if o["kind"] == "Deployment"
    }
    ours = [r for r in builders.serving_roles(spec) if spec.engine == "embedded" or r == "router"]
    assert ours or spec.engine != "embedded"
    for role in ours:
        suffix = builders.serving_set(spec, chash)
        rendered = engines.serve_config(
            spec, role, chash, model=OWNER.name, namespace=OWNER.namespace,
            set_suffix=None if suffix == builders.UNIFIED_SET else suffix,
        )  # fmt: skip
        command = deployments[role]["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[:2] == ["neuronfleet", "serve"]
        args = build_parser().parse_args(command[1:])
        assert ServeConfig.from_namespace(args) == rendered, role
        assert args.role == role and args.served_model_name == "m"


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_the_operators_compile_json_is_what_the_compile_reads(path, tmp_path):
    spec = parsed(path)
    chash = builders.compile_hash(spec)
    config_map = builders.build_config_map(OWNER, spec, chash)
    (tmp_path / contract.COMPILE_CONFIG_FILE).write_text(config_map["data"][contract.COMPILE_CONFIG_FILE])
    read = load_config(tmp_path / contract.COMPILE_CONFIG_FILE)
    assert read == builders.compile_config(spec, chash)
    assert read.compileHash == chash and read.model.uri == spec.model.uri
    assert read.sequenceLength == spec.neuron.sequenceLength
    assert read.buckets.context == spec.neuron.buckets.context


def test_a_compile_json_the_operator_did_not_write_is_refused_naming_the_field(tmp_path):
    good = CompileConfig.model_validate(
        {"compileHash": "h", "model": {"uri": "file:///m"}, "batchSize": 1, "sequenceLength": 64,
         "maxInputLength": 32, "dtype": "float32"}
    )  # fmt: skip
    path = tmp_path / "compile.json"
    path.write_text(good.to_json().replace('"sequenceLength"', '"seqLen"'))
    with pytest.raises(CompileError, match=r"sequenceLength: Field required.*seqLen: Extra inputs"):
        load_config(path)
    path.write_text("{")
    with pytest.raises(CompileError, match="is not what the operator writes"):
        load_config(path)
    with pytest.raises(CompileError, match="does not exist"):
        load_config(tmp_path / "absent.json")
