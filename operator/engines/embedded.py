"""The embedded engine: neuronfleet's own runtime (`neuronfleet serve`), artifacts = the folder
`neuronfleet compile` wrote (compile.json from the runtime ConfigMap)."""

from __future__ import annotations

from neuronfleet.contract import COMPILE_CONFIG_FILE, CONFIG_MOUNT, MODEL_MOUNT, ServeConfig

from ..pod_metrics import NEURONFLEET
from ..spec import NeuronModelSpec
from .common import Container, artifacts_dir, own_image

METRICS = NEURONFLEET  # our runtime exports the signals under these names


def image(spec: NeuronModelSpec) -> str:
    return own_image(spec)


def serve(config: ServeConfig, spec: NeuronModelSpec) -> Container:
    """`neuronfleet serve` with a role's options (`engines.serve_config`). Prefill and decode pods moving KV
    caches over EFA (NIXL's LIBFABRIC backend) turn off the EFA provider's shared-memory path, which the
    Neuron disaggregated-inference tutorial requires when a prefill and a decode pod share a node
    (`vllm_plugin.DI_TUTORIAL`); their EFA devices and IPC_LOCK come with every EFA pod (pod_parts)."""
    env = {}
    if config.role in ("prefill", "decode") and spec.serving.kvTransfer.over_efa:
        env["FI_EFA_ENABLE_SHM_TRANSFER"] = "0"  # the scheduler may put P and D on one node
    return Container(own_image(spec), ["neuronfleet", "serve", *config.to_args()], env=env)


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    return {}  # compile.json, written by the builders, is all `neuronfleet compile` reads


def compile_passes(spec: NeuronModelSpec) -> int:
    """Our compile converts and validates the weights on cpu, and with neuron.compiledSteps compiles a graph
    per bucket, as a server compiling every graph does (one pass in engines.timeouts); else no graph compile
    (the compile Job's deadline is the download's and engines.timeouts' floor)."""
    return 0 if spec.neuron.compiledSteps == "off" else 1


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    command = ["neuronfleet", "compile", "--config", f"{CONFIG_MOUNT}/{COMPILE_CONFIG_FILE}"]
    command += ["--out", artifacts_dir(compile_hash)]
    if spec.model.uri.startswith("pvc://"):
        command += ["--model-mount", MODEL_MOUNT]
    return Container(image(spec), command)
