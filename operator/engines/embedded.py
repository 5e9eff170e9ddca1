"""The embedded engine: neuronfleet's own runtime (`neuronfleet serve`), artifacts = the folder
`neuronfleet compile` wrote (compile.json from the runtime ConfigMap). On cpu it runs the runtime-cpu image on
any node. On trn2 and trn3 (neuron.compiledSteps neuron, experimental) it runs TorchNeuron in the
runtime-neuron image: the compile Job on a node of the serving instance type with the cores it serves on
(no compile-only mode is documented for TorchNeuron: runtime/model/neuron_device.py) warms every bucket's NEFF
into the artifacts, and the pods load them, each told the instance family the NEFFs were compiled for."""

from __future__ import annotations

from neuronfleet.contract import (
    COMPILE_CONFIG_FILE,
    CONFIG_MOUNT,
    MODEL_MOUNT,
    NEURON_TARGET_ENV,
    TORCHNEURON_PINNED,
    ServeConfig,
    instance_family,
)

from ..pod_metrics import NEURONFLEET
from ..spec import NeuronModelSpec
from .common import Container, artifacts_dir, own_image

METRICS = NEURONFLEET  # our runtime exports the signals under these names


def _torchneuron(spec: NeuronModelSpec) -> bool:
    return spec.neuron.compiledSteps == "neuron"


def _target_env(spec: NeuronModelSpec) -> dict[str, str]:
    """The instance family a TorchNeuron compile and its pods run on: part of the NEFFs' key."""
    return {NEURON_TARGET_ENV: instance_family(spec.neuron.instanceType)} if _torchneuron(spec) else {}


def notice(spec: NeuronModelSpec) -> tuple[str, str] | None:
    """Engine embedded on trn2 and trn3 is experimental: said on acceptance (Validated's reason)."""
    if not _torchneuron(spec):
        return None
    tp = spec.neuron.tensorParallel
    return "Experimental", (
        f"engine embedded on {spec.neuron.instanceType} is experimental: TorchNeuron (torch-neuronx "
        f"{TORCHNEURON_PINNED['torch-neuronx']}, Neuron SDK {TORCHNEURON_PINNED['neuron-sdk']}) has not run "
        "on a device with our runtime yet; the compile Job warms a graph per bucket on a node of this "
        "instance type"
        + (f", a rank per NeuronCore at tensorParallel {tp}, as the pods run" if tp > 1 else "")
    )


def image(spec: NeuronModelSpec) -> str:
    return own_image(spec)


def serve(config: ServeConfig, spec: NeuronModelSpec) -> Container:
    """`neuronfleet serve` with a role's options (`engines.serve_config`). Prefill and decode pods moving KV
    caches over EFA (NIXL's LIBFABRIC backend) turn off the EFA provider's shared-memory path, which the
    Neuron disaggregated-inference tutorial requires when a prefill and a decode pod share a node
    (`vllm_plugin.DI_TUTORIAL`); their EFA devices and IPC_LOCK come with every EFA pod (pod_parts)."""
    env = _target_env(spec)
    if config.role in ("prefill", "decode") and spec.serving.kvTransfer.over_efa:
        env["FI_EFA_ENABLE_SHM_TRANSFER"] = "0"  # the scheduler may put P and D on one node
    return Container(own_image(spec), ["neuronfleet", "serve", *config.to_args()], env=env)


def compile_files(spec: NeuronModelSpec, compile_hash: str) -> dict[str, str]:
    return {}  # compile.json, written by the builders, is all `neuronfleet compile` reads


def compile_passes(spec: NeuronModelSpec) -> int:
    """Our compile converts and validates the weights, and with neuron.compiledSteps compiles a graph per
    bucket (AOTInductor on cpu, TorchNeuron on trn2 and trn3), as a server compiling every graph does (one
    pass in engines.timeouts); else no graph compile (the compile Job's deadline is the download's and
    engines.timeouts' floor)."""
    return 0 if spec.neuron.compiledSteps == "off" else 1


def compile_container(spec: NeuronModelSpec, compile_hash: str) -> Container:
    command = ["neuronfleet", "compile", "--config", f"{CONFIG_MOUNT}/{COMPILE_CONFIG_FILE}"]
    command += ["--out", artifacts_dir(compile_hash)]
    if spec.model.uri.startswith("pvc://"):
        command += ["--model-mount", MODEL_MOUNT]
    return Container(image(spec), command, env=_target_env(spec), needs_neuron=_torchneuron(spec))
