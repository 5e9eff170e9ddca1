"""The compiled passes made ahead of serving, by the compile Job, and loaded by the pods: one AOTInductor
package per bucket (`torch._inductor.aoti_compile_and_package`, torch 2.13.0), written into the artifacts'
`graphs/` folder with `graphs.json`, the key they were compiled for and the buckets they hold.

Why AOTInductor and not Inductor's own cache: a cache hit of `torch.compile` still needs a C++ compiler in the
pod (torch 2.13.0 raises InvalidCxxCompiler without one, measured) and 2.6 s a graph to trace and load again,
against 13.7 s to compile it (a tiny Llama's decode graph, 2-core EPYC); a package loads in about 1 s with no
compiler at all and runs the same kernels (docs/benchmarks.md).

A package holds the pass's code and no weights: the step is exported (`torch.export`) with the weights and
each layer's key and value caches as its inputs (`_Step`), so every bucket shares the pod's one copy of the
weights, a package is a couple of MB, and the KV cache is written in place (inputs the graph mutates). What
the code depends on is the key (`graph_key`): torch's version, the CPU's vector instructions
(`cpu_features`), the dtype, the slots and sequence length (the cache's shape), the model's config.json; a pod
whose key differs runs the passes op by op and says why (`key_mismatch`), never compiling in the pod. A bucket
without a package (a prefill group asking several tokens' logits a row) runs op by op too, said once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from neuronfleet.runtime.model.compiled_steps import Bucket, sample_inputs
from neuronfleet.runtime.model.llama import LlamaModel

GRAPHS_DIR = "graphs"  # in the artifacts folder
GRAPHS_MANIFEST = "graphs.json"  # in GRAPHS_DIR, written last: the folder is complete once it is there

log = logging.getLogger(__name__)


def model_key(model: LlamaModel, model_dir: Path) -> dict[str, str]:
    """What any compiled pass of this model depends on besides its bucket and its backend: torch's version,
    the dtype, the cache's shape (slots, sequence length) and the model's config.json (`graph_key` here,
    `neuron_device.neff_key` for TorchNeuron add their backend's own)."""
    config = (Path(model_dir) / "config.json").read_bytes()
    return {
        "torch": torch.__version__,
        "dtype": str(model.dtype).removeprefix("torch."),
        "slots": str(model.slots),
        "max_seq_len": str(model.max_seq_len),
        "config.json": hashlib.sha256(config).hexdigest()[:16],
    }


def graph_key(model: LlamaModel, model_dir: Path) -> dict[str, str]:
    """What a package's code depends on besides its bucket (a pod loads packages only with an equal key)."""
    return {**model_key(model, model_dir), "cpu": cpu_features()}


def cpu_features() -> str:
    """The vector instructions this CPU has that Inductor compiles for (AVX2, AVX512, VNNI, AVX512-BF16,
    AMX), read from the CPU as torch's own dispatch does (`torch.cpu`): Inductor's own pick
    (`cpu_vec_isa.pick_vec_isa`) builds a test program, which needs the compiler a pod does not have."""
    names = ("avx2", "avx512", "vnni", "avx512_bf16", "amx_tile", "amx_fp16")
    have = [n for n in names if getattr(torch.cpu, f"_is_{n}_supported", lambda: False)()]
    return " ".join(have) or "none"


def key_differences(made: dict[str, str], here: dict[str, str]) -> list[str]:
    """Each field of the key `here` that the key things were `made` for differs in, said with both values."""
    return [f"{k} {made.get(k)} (here {here[k]})" for k in here if made.get(k) != here[k]]


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """A folder's manifest, written whole (a temporary file renamed): once it is there, the folder is."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.rename(path)


def key_mismatch(compiled: dict[str, str], here: dict[str, str]) -> str | None:
    """Why packages compiled for `compiled` cannot run here, naming each difference; None when they can."""
    diffs = key_differences(compiled, here)
    if not diffs:
        return None
    return (
        f"the compiled graphs were made for another pod: {', '.join(diffs)}; running the passes op by op. "
        "Compile again for this pod's node type and settings, or serve with --compiled-steps off"
    )


def _weight_slots(model: LlamaModel) -> list[tuple[Any, str]]:
    """(object, attribute) of every weight tensor the passes read, in a fixed order (a tied head's weight is
    its embedding's own tensor, given once per place it is read)."""
    w, out = model.weights, []
    for owner in [w.embed, w.norm, w.lm_head] + [
        part for layer in w.layers for part in (layer.input_norm, layer.post_norm, layer.qkv, layer.o,
                                                layer.gate_up, layer.down)
    ]:  # fmt: skip
        out += [(owner, a) for a in ("weight", "bias") if isinstance(getattr(owner, a, None), torch.Tensor)]
    return out


def _weights(model: LlamaModel) -> list[torch.Tensor]:
    """The weight tensors of `_weight_slots`, in their order: a package's second input."""
    return [getattr(owner, attr) for owner, attr in _weight_slots(model)]


class _Step(torch.nn.Module):
    """A pass of `model` with its weights and its layers' key and value caches as inputs: what is exported,
    so that a package holds code only. Each layer's cache is an input of its own (the views the model's
    passes write, `LlamaModel.layer_kv`): a write into one is then a write into that layer's cache, where
    with the whole cache as one input each layer's write would be a copy of all of it. `forward` puts the
    inputs in place of the model's own tensors for the pass (while tracing, the traced stand-ins), then puts
    the model's back."""

    def __init__(self, model: LlamaModel, kind: str) -> None:
        super().__init__()
        self.model, self.kind, self.slots = model, kind, _weight_slots(model)

    def forward(self, caches: list[torch.Tensor], weights: list[torch.Tensor], *inputs: Any) -> torch.Tensor:
        m = self.model
        saved = [getattr(o, a) for o, a in self.slots], m.layer_kv
        try:
            for (owner, attr), tensor in zip(self.slots, weights, strict=True):
                setattr(owner, attr, tensor)
            m.layer_kv = list(zip(caches[0::2], caches[1::2], strict=True))
            return m.decode_logits(*inputs) if self.kind == "decode" else m.prefill_logits(*inputs)
        finally:
            for (owner, attr), tensor in zip(self.slots, saved[0], strict=True):
                setattr(owner, attr, tensor)
            m.layer_kv = saved[1]


def layer_caches(model: LlamaModel) -> list[torch.Tensor]:
    """The model's key and value caches, layer by layer (K, V, K, V, ...): a package's first input."""
    return [t for pair in model.layer_kv for t in pair]


def _name(bucket: Bucket) -> str:
    return "-".join(str(x) for x in bucket)


def compile_ahead(
    model: LlamaModel,
    model_dir: Path,
    table: Iterable[Bucket],
    out: Path,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> dict[str, Any]:
    """Compile every bucket of `table` into `out`/graphs/ (a package each) and write graphs.json last; returns
    it. `progress(done, total)` after each."""
    folder = Path(out) / GRAPHS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    weights = _weights(model)
    table, graphs = list(table), {}
    for done, bucket in enumerate(table, 1):
        started = time.monotonic()
        args = (layer_caches(model), weights, *sample_inputs(model, bucket))
        with torch.inference_mode(False), torch.no_grad():
            program = torch.export.export(_Step(model, bucket[0]), args, strict=False)
        path = folder / f"{_name(bucket)}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        graphs[_name(bucket)] = list(bucket)
        log.info("compiled the %s graph of bucket %s ahead in %.1f s (%d of %d)", bucket[0], bucket[1:],
                 time.monotonic() - started, done, len(table))  # fmt: skip
        progress(done, len(table))
    manifest = {"key": graph_key(model, model_dir), "graphs": graphs}
    write_manifest(folder / GRAPHS_MANIFEST, manifest)
    return manifest


class AheadGraphs:
    """The packages of a model's artifacts, loaded: `run(bucket, inputs)` gives a bucket's logits from its
    package, or None where it has none (the caller runs the pass op by op)."""

    def __init__(self, model: LlamaModel, runners: dict[Bucket, Any]) -> None:
        self.model, self.runners = model, runners
        self.weights = _weights(model)
        self.caches = layer_caches(model)
        self.missing: set[Bucket] = set()

    @classmethod
    def load(cls, model: LlamaModel, model_dir: Path) -> tuple[AheadGraphs | None, str | None]:
        """The packages in `model_dir`/graphs/ if their key is this pod's: (graphs, None); (None, why) when
        they cannot run here; (None, None) when there are none."""
        manifest_path = Path(model_dir) / GRAPHS_DIR / GRAPHS_MANIFEST
        if not manifest_path.is_file():
            return None, None
        started, runners = time.monotonic(), {}
        try:
            manifest = json.loads(manifest_path.read_text())
            why = key_mismatch(manifest.get("key", {}), graph_key(model, model_dir))
            if why is not None:
                return None, why
            for name, bucket in manifest["graphs"].items():
                package = str(manifest_path.parent / f"{name}.pt2")
                runners[tuple(bucket)] = torch._inductor.aoti_load_package(package)
        except (OSError, ValueError, KeyError, AttributeError, RuntimeError) as e:  # broken, or cut short
            return None, (
                f"the compiled graphs in {manifest_path.parent} could not be loaded ({type(e).__name__}: "
                f"{e}); running the passes op by op. Compile the model again, or serve with "
                "--compiled-steps off"
            )
        log.info("loaded %d compiled graphs in %.1f s", len(runners), time.monotonic() - started)
        return cls(model, runners), None

    def run(self, bucket: Bucket, inputs: Sequence[Any]) -> torch.Tensor | None:
        runner = self.runners.get(bucket)
        if runner is None:
            if bucket not in self.missing:
                self.missing.add(bucket)
                log.warning("no compiled graph for the %s bucket %s: it runs op by op", bucket[0], bucket[1:])
            return None
        out = runner(self.caches, self.weights, *inputs)
        return out[0] if isinstance(out, (list, tuple)) else out
