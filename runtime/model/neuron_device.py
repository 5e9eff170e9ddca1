"""TorchNeuron: our runtime's compiled passes on a Trainium2 or Trainium3 device, and the NEFF cache the
compile Job warms for the pods. The one module that talks to the Neuron device. Experimental: it has not run
on a device (what only a device can prove: tests/device/neuron_smoke.py).

The pinned contract (torch-neuronx 2.13.3.1, with torch 2.13, in Neuron SDK 2.34.0). Each fact is as
documented for that version:

- torch-neuronx 2.13.* goes with PyTorch 2.13, and 2.14.* with 2.14. SDK 2.34.0 ships 2.13.3.1 and 2.14.3.1
  on Trn2 and Trn3. Sources: github.com/aws-neuron/torch-neuronx/releases/tag/v2.34.0; the Neuron docs'
  release-notes/2.34.0 and release-notes/components/torchneuron.
- `import torch_neuronx` registers the `neuron` device (a PrivateUse1 backend) and the `neuron`
  torch.distributed backend. Source: the Neuron docs, torch/guides/torch-distributed.
- `torch.compile(backend="neuron")` compiles Dynamo -> AOT Autograd -> StableHLO -> neuronx-cc -> a NEFF.
  It compiles on the first call of each input signature (shapes and dtypes), a graph each, and has no
  TorchInductor. `fullgraph=True` is supported and raises on a graph break. `dynamic=True` is rejected, so a
  new shape compiles again. Only `mode="default"` is supported. Sources: the Neuron docs,
  torch/compile/reference-torch-compile and torch/compile/about-torch-compile.
- NEFFs go into a persistent cache at `TORCH_NEURONX_NEFF_CACHE_DIR`, written atomically, safe across
  processes and nodes. Source: the Neuron docs, compiler/about-compiler-artifacts and the env-var reference.
  Its default, /tmp/neff_cache, is read from torch-neuronx's source and is UNVERIFIED in the docs.
- `TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION` defaults to true from 2.33: a graph that fails to compile
  raises, rather than running eagerly. Source: the Neuron docs, torch/reference/env-vars.
- No documented setting makes a NEFF cache miss an error, and no compile-only mode is documented for
  TorchNeuron itself. vLLM-Neuron's CPU compilation page documents `NEURON_PLATFORM_TARGET_OVERRIDE` for
  compiling with no device, but not for TorchNeuron. So the compile Job runs on a node of the serving
  family, and a pod that must not compile holds the `fail_on_recompile` stance once it has warmed
  (`CompiledSteps.freeze`).

The flow. The compile Job (on a Neuron node) points the cache at the artifacts' `neff/` folder. It runs every
bucket once on each rank (`Warmer`, `CompiledSteps.warm`), which compiles and stores each NEFF, and writes
`neff/warmed.json` last (`write_warmed`): the key and the buckets. A serving pod copies that folder to its own
disk and points the cache there (`use_local_cache`). It checks the key (`warmed_steps`), runs every warmed
bucket once (each a cache hit), and then compiles nothing. Where the key differs or nothing was warmed, the
pod says so and runs the passes op by op on the device, never compiling a graph.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuronfleet.contract import NEURON_TARGET_ENV, TORCHNEURON_PINNED
from neuronfleet.runtime.model.compiled_ahead import key_differences, model_key, write_manifest
from neuronfleet.runtime.model.compiled_steps import Bucket, CompiledSteps
from neuronfleet.runtime.model.llama import LlamaModel
from neuronfleet.runtime.model.model_config import load_model_config
from neuronfleet.runtime.model.tensor_parallel import Shard

NEFF_DIR = "neff"  # in the artifacts folder: the NEFF cache the compile Job warmed
WARMED = "warmed.json"  # in NEFF_DIR, written last: the cache is complete once it is there
CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
TARGET_ENV = NEURON_TARGET_ENV  # the instance family the operator runs the Job and pods on
LOCAL_CACHE = "/tmp/neff"  # a pod's own copy (its /tmp is an emptyDir)

log = logging.getLogger(__name__)


def import_backend() -> str | None:
    """Import torch-neuronx, which registers the `neuron` device and compile backend; why it cannot be used
    where it cannot (None when it can)."""
    try:
        import torch_neuronx  # noqa: F401  (registers the device and the backend)
    except ImportError as e:
        return (
            f"the neuron device needs torch-neuronx {TORCHNEURON_PINNED['torch-neuronx']} (Neuron SDK "
            f"{TORCHNEURON_PINNED['neuron-sdk']}), as the runtime-neuron image has it: {e}. Serve on cpu, or "
            "run the runtime-neuron image"
        )
    return None


def backend_version() -> str:
    try:
        return importlib.metadata.version("torch-neuronx")
    except importlib.metadata.PackageNotFoundError:
        return "none"


Backend = str | Callable[..., Any]  # a compile backend's name, or the backend (the tests' recorder)


def neff_key(model: LlamaModel, model_dir: Path, backend: Backend) -> dict[str, str]:
    """What a warmed NEFF depends on besides its bucket: torch's and torch-neuronx's versions, the instance
    family compiled for (`TARGET_ENV`), the dtype, the cache's shape, the model's config.json, and the
    tensor parallelism (each rank's graphs are its share's). A pod uses the cache only with an equal key."""
    return {
        **model_key(model, model_dir),
        "tensor_parallel": str(model.shard.world if model.shard is not None else 1),  # each rank's share
        "backend": backend if isinstance(backend, str) else type(backend).__name__,
        "torch-neuronx": backend_version(),
        "target": os.environ.get(TARGET_ENV, "unset"),
    }


def write_warmed(out: Path, key: dict[str, str], table: Iterable[Bucket]) -> dict[str, Any]:
    """The compile Job's last word on the cache: `out`/neff/warmed.json, the key and the buckets warmed."""
    folder = Path(out) / NEFF_DIR
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"key": key, "buckets": [list(b) for b in table]}
    write_manifest(folder / WARMED, manifest)
    return manifest


@dataclass(frozen=True)
class Warming:
    """What the compile Job warms, as every rank of it needs it (sent to the ranks it spawns): the pods'
    device, tensor parallelism, dtype, cache shape and bucket table, and the compile backend's name."""

    device: str
    tensor_parallel: int
    dtype: str
    slots: int
    max_seq_len: int
    table: tuple[Bucket, ...]
    backend: str = "neuron"
    graphs: int = 64


class Warmer:
    """One rank of the compile Job's warming at a tensor parallelism: its share of the model on its device
    (its NeuronCore: `tp_ranks` sets which before the runtime starts), every bucket of the table run once in
    the table's order, as every rank does, so that the passes' all-reduces meet. Built as a runner is (the
    compile Job starts the other ranks with it, `tp_ranks.Ranks`), it runs no steps after."""

    def __init__(
        self, model_dir: str | Path, warming: Warming, rank: int = 0,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:  # fmt: skip
        shard = Shard(rank, warming.tensor_parallel) if warming.tensor_parallel > 1 else None
        dtype = getattr(torch, warming.dtype)
        model_dir = Path(model_dir)
        self.model = LlamaModel(
            model_dir, load_model_config(model_dir), warming.slots, warming.max_seq_len, dtype,
            torch.device(warming.device), None, False, dtype, pack=False, shard=shard,
        )  # fmt: skip
        steps = CompiledSteps(self.model, warming.backend, warming.graphs)
        started = time.monotonic()
        steps.warm(list(warming.table), progress)
        log.info("warmed %d graphs in %.1f s", len(warming.table), time.monotonic() - started)

    def execute(self, work: Any) -> None:
        raise RuntimeError("a rank of the compile Job's warming runs no serving steps")


def use_cache(folder: Path) -> None:
    """Point TorchNeuron's NEFF cache at `folder` (before torch-neuronx is imported)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(folder)


def use_local_cache(
    model_dir: Path, local: Path = Path(LOCAL_CACHE), copy: bool = True
) -> dict[str, Any] | None:
    """A serving pod's copy of the compile Job's cache (`model_dir`/neff/, on the shared volume) on its own
    disk, which TorchNeuron's cache then names; the warmed manifest, or None where the Job warmed none
    (the cache is left unset: the pod compiles nothing anyway). `copy` False: the copy another process of
    the pod made (a tensor-parallel server's rank 0, before it started the others)."""
    source = Path(model_dir) / NEFF_DIR
    if not (source / WARMED).is_file():
        return None
    if copy:
        started = time.monotonic()
        shutil.copytree(source, local, dirs_exist_ok=True)
        log.info("copied the NEFF cache to %s in %.1f s", local, time.monotonic() - started)
    use_cache(local)
    return json.loads((local / WARMED).read_text())


def warmed_steps(
    model: LlamaModel, model_dir: Path, manifest: dict[str, Any] | None, table: Iterable[Bucket],
    backend: Backend = "neuron", graphs: int = 64,
) -> tuple[CompiledSteps | None, str | None]:  # fmt: skip
    """A serving pod's compiled passes: each bucket of its `table` that the compile Job warmed, run once (a
    cache hit), then frozen (`CompiledSteps.freeze`: nothing compiled while serving). (None, why) where the
    manifest is missing or was made for another pod: its passes then run op by op."""
    if manifest is None:
        return None, (
            f"no warmed NEFF cache in {Path(model_dir) / NEFF_DIR} (the compile Job warms one with "
            "neuron.compiledSteps neuron); running the passes op by op, compiling nothing. Compile the "
            "model again"
        )
    diffs = key_differences(manifest.get("key", {}), neff_key(model, model_dir, backend))
    if diffs:
        return None, (
            f"the NEFF cache was warmed for another pod: {', '.join(diffs)}; running the passes op by op, "
            "compiling nothing. Compile again for this pod's instance type and settings"
        )
    warmed = {tuple(b) for b in manifest.get("buckets", [])}
    wanted = list(table)
    steps = CompiledSteps(model, backend, graphs)
    started = time.monotonic()
    steps.warm([b for b in wanted if b in warmed])
    steps.freeze()
    missing = [b for b in wanted if b not in warmed]
    log.info("loaded %d warmed graphs in %.1f s%s", len(wanted) - len(missing), time.monotonic() - started,
             f"; {len(missing)} buckets were not warmed and run op by op" if missing else "")  # fmt: skip
    return steps, None
