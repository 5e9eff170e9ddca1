"""`neuronfleet compile`: what the compile Job runs for the embedded engine. It turns a model source into
artifacts/<hash>/ on the compile cache volume, once.

For the torch backend (instanceType cpu) the work is real: fetch the model (file:// folder or GGUF file,
pvc:// path, hf:// through the Hub when a token allows it), convert its weights to the target dtype as
safetensors, load them into the model runner to validate every shape against config.json and the buckets,
and record the tokenizer, the buckets and the shapes. On Neuron instance types the same folder is the input
of the NxDI compile, which needs the Neuron SDK (only in the runtime-neuron image).

The folder appears whole or not at all: everything is written to a temporary folder beside it, renamed into
place, and `manifest.json` (the completion marker the operator and serving pods trust) is written last.
When a complete folder exists already, the command finishes at once (a cache hit).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

TERMINATION_LOG = (
    "/dev/termination-log"  # Kubernetes shows its content as the container's termination message
)
MODEL_MOUNT = "/var/lib/neuronfleet/model"  # where serving and compile pods mount pvc:// models
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


class CompileError(ValueError):
    """The compile cannot run: a bad config or a model source that is missing or unsupported."""


def load_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CompileError(f"compile config {path} does not exist") from None
    except ValueError as e:
        raise CompileError(f"compile config {path} is not JSON: {e}") from None
    missing = [
        k for k in ("compileHash", "model", "dtype", "sequenceLength", "maxInputLength") if k not in config
    ]
    if missing:
        raise CompileError(f"compile config {path} lacks {', '.join(missing)} (written by the operator)")
    return config


def resolve_source(uri: str, revision: str | None, work: Path, model_mount: str = MODEL_MOUNT) -> Path:
    """A local folder or .gguf file for the model URI (a pvc:// claim is mounted at `model_mount`)."""
    if uri.startswith("file://"):
        path = Path(uri.removeprefix("file://"))
    elif uri.startswith("pvc://"):
        path = Path(model_mount) / uri.removeprefix("pvc://").split("/", 1)[1]
    elif uri.startswith("hf://"):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise CompileError("hf:// models need huggingface_hub in the runtime image") from None
        token = os.environ.get("HF_TOKEN")  # from the NeuronModel's secretRef, never from the spec
        path = Path(
            snapshot_download(uri.removeprefix("hf://"), revision=revision, token=token, cache_dir=work)
        )
    else:
        raise CompileError(f"model source {uri} is not supported by the embedded engine's compile yet")
    if not path.exists():
        raise CompileError(f"model source {uri} not found at {path}")
    return path


def _buckets(config: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The context and generation buckets asked for (empty: derived from the sequence length)."""
    buckets = config.get("buckets") or {}
    return buckets.get("context") or [], buckets.get("generation") or []


def convert(source: Path, out: Path, config: dict[str, Any]) -> None:
    """Weights to safetensors in the target dtype, tokenizer and config beside them, then a full load."""
    import torch
    from safetensors.torch import load_file, save_file

    from .config import RuntimeConfig
    from .gguf_import import import_gguf
    from .model_runner import ModelRunner

    dtype = config["dtype"]
    out.mkdir(parents=True)
    if source.is_file() and source.suffix == ".gguf":
        import_gguf(source, out, dtype=dtype)
    elif source.is_dir() and (source / "config.json").is_file():
        shards = sorted(source.glob("*.safetensors"))
        if not shards:
            raise CompileError(f"{source} holds no .safetensors weights")
        target = getattr(torch, dtype)
        for shard in shards:
            tensors = {k: v.to(target).contiguous() for k, v in load_file(str(shard)).items()}
            save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
        model_config = json.loads((source / "config.json").read_text())
        model_config["torch_dtype"] = dtype
        (out / "config.json").write_text(json.dumps(model_config, indent=2))
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
    else:
        raise CompileError(f"{source} is neither a Hugging Face model folder nor a .gguf file")
    context, generation = _buckets(config)
    # Loading validates every tensor's shape against config.json and the buckets against the lengths.
    runtime = RuntimeConfig(
        slots=1, max_seq_len=int(config["sequenceLength"]), dtype=dtype, prefill_buckets=context,
        decode_buckets=generation,
    )  # fmt: skip
    ModelRunner(out, runtime)


def report(manifest: dict[str, Any]) -> dict[str, Any]:
    """Leave the manifest as the container's termination message, where the operator reads it."""
    path = Path(os.environ.get("NEURONFLEET_TERMINATION_LOG", TERMINATION_LOG))
    if path.parent.is_dir() and os.access(path.parent if not path.exists() else path, os.W_OK):
        path.write_text(json.dumps(manifest))
    return manifest


def compile_artifacts(
    config_path: Path, out: Path, log=print, model_mount: str = MODEL_MOUNT
) -> dict[str, Any]:
    """Produce `out` (artifacts/<hash>/) from the config; returns the manifest (a cache hit at once)."""
    out = Path(out)
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        log(f"cache hit: {out} is complete")
        return report({**json.loads(manifest_path.read_text()), "cacheHit": True})
    config = load_config(config_path)
    if config.get("instanceType", "cpu") != "cpu":
        try:
            import neuronx_distributed_inference  # noqa: F401
        except ImportError:
            raise CompileError(
                f"instanceType {config['instanceType']} compiles with NxDI, which this image lacks; run the "
                "runtime-neuron image (AWS Neuron SDK) for Neuron targets"
            ) from None
        raise CompileError(
            "the NxDI compile of the embedded engine is not built yet; use engine vllm on Neuron"
        )
    started = time.monotonic()
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        source = resolve_source(
            config["model"]["uri"], config["model"].get("revision"), staging / "download", model_mount
        )
        convert(source, staging / "model", config)
        shutil.rmtree(staging / "download", ignore_errors=True)
        (staging / "compile.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():  # an incomplete folder from an interrupted compile
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    manifest = {
        "compileHash": config["compileHash"],
        "engine": config.get("engine", "embedded"),
        "bytes": size,
        "seconds": round(time.monotonic() - started, 3),
        "compiledAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.rename(manifest_path)  # last: the folder is complete from here on
    log(f"compiled {config['model']['uri']} into {out} ({size} bytes)")
    return report({**manifest, "cacheHit": False})
