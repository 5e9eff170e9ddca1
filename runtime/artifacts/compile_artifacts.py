"""`neuronfleet compile`: what the compile Job runs for the embedded engine. It turns a model source into
artifacts/<hash>/ on the compile cache volume (the model's own folder of the claim, which is all its pods
mount), once.

For the torch backend (instanceType cpu) the work is real: fetch the model (file:// folder or GGUF file,
pvc:// path, hf:// through the Hub when a token allows it, s3:// into the cache's sources/ folder, resumable
and verified: runtime/artifacts/s3_source.py, removed once compiled), convert its weights to the target dtype
as safetensors (weight-only int8/int4 when compile.json asks: runtime/model/quantize.py), load them into the
model runner to validate every shape against config.json and the buckets, and record the tokenizer, the
buckets and the shapes. With compiledSteps, the passes are compiled too: an AOTInductor package per bucket on
cpu (`compile_graphs`), or on trn2 and trn3 TorchNeuron's NEFF cache warmed for every bucket on the node's
device (`warm_neff`, experimental: runtime/model/neuron_device.py); other Neuron instance types are refused.

The folder appears whole or not at all: everything is written to a temporary folder beside it, renamed into
place, and `manifest.json` (the completion marker the operator and serving pods trust) is written last.
When a complete folder exists already, the command finishes at once (a cache hit).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from neuronfleet.contract import (
    HF_TOKEN_ENVS,
    MODEL_MOUNT,
    SOURCE_UNAVAILABLE,
    TERMINATION_LOG,
    TERMINATION_LOG_ENV,
    TORCHNEURON_FAMILIES,
    CompileConfig,
    instance_family,
    length_refusal,
    model_length_limit,
)
from neuronfleet.runtime.artifacts.s3_source import Progress, S3Unavailable, cache_folder, download
from neuronfleet.runtime.progress import Reporter, watch_folder

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",  # (where it is there, the chat template: serving.tokenizer.chat_template)
)


class CompileError(ValueError):
    """The compile cannot run: a bad config or a model source that is missing or unsupported."""


class SourceUnavailable(CompileError):
    """The model source could not be read (a missing path, a Hub error): it may be there on a later try."""

    def __init__(self, uri: str, why: str) -> None:  # (on one line: a Hub client's error spans several)
        super().__init__(
            f"{SOURCE_UNAVAILABLE} {uri}: " + "; ".join(filter(None, map(str.strip, why.splitlines())))
        )


def load_config(path: Path) -> CompileConfig:
    try:
        return CompileConfig.model_validate_json(Path(path).read_text())
    except FileNotFoundError:
        raise CompileError(f"compile config {path} does not exist") from None
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'the file'}: {err['msg']}" for err in e.errors()
        )
        raise CompileError(f"compile config {path} is not what the operator writes: {problems}") from None


def resolve_source(
    uri: str, revision: str | None, work: Path, model_mount: str = MODEL_MOUNT, files: tuple[str, ...] = (),
    cache: Path | None = None, on_progress: Progress | None = None,
) -> Path:  # fmt: skip
    """A local folder or .gguf file for the model URI (a pvc:// claim is mounted at `model_mount`); from the
    Hub only `files` when given; an s3:// prefix into its folder under the compile `cache`'s sources/ (where
    a later try resumes; under `work` without a cache), reporting `on_progress(bytes_done, bytes_total,
    files_done, files_total)`."""
    if uri.startswith("s3://"):
        try:
            return download(uri, cache_folder(cache, uri) if cache else work / "s3", on_progress)
        except S3Unavailable as e:
            raise SourceUnavailable(uri, e.why) from None
    if uri.startswith("file://"):
        path = Path(uri.removeprefix("file://"))
    elif uri.startswith("pvc://"):
        path = Path(model_mount) / uri.removeprefix("pvc://").split("/", 1)[1]
    elif uri.startswith("hf://"):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise CompileError("hf:// models need huggingface_hub in the runtime image") from None
        token = os.environ.get(HF_TOKEN_ENVS[0])  # from the NeuronModel's secretRef, never from the spec
        repo_id = uri.removeprefix("hf://")
        hub = {"revision": revision, "token": token, "cache_dir": work, "allow_patterns": list(files) or None}
        # What it will download (huggingface_hub 2.4: dry_run lists each file with its size), for the totals;
        # a dry run that fails leaves them unknown: the download itself then says why (not found, gated...).
        total = files_total = None
        with contextlib.suppress(Exception):
            plan = [f for f in snapshot_download(repo_id, dry_run=True, **hub) if f.will_download]
            sizes = [f.file_size for f in plan]
            total, files_total = (sum(sizes) if None not in sizes else None), len(plan)  # type: ignore[arg-type]
        blobs = work / f"models--{repo_id.replace('/', '--')}" / "blobs"  # the Hub cache's layout
        try:  # the blobs measured as they arrive
            with watch_folder(blobs, on_progress or (lambda *_: None), total, files_total):
                path = Path(snapshot_download(repo_id, **hub))
        except Exception as e:  # not found, gated, no network: huggingface_hub's errors say which
            raise SourceUnavailable(uri, f"{type(e).__name__}: {e}") from None
    else:
        raise CompileError(f"model source {uri} is not supported by the embedded engine's compile yet")
    if not path.exists():
        raise SourceUnavailable(uri, f"not found at {path}")
    return path


def convert(
    source: Path,
    out: Path,
    config: CompileConfig,
    tokenizer: Path | None = None,
    progress: Reporter | None = None,
) -> None:
    """Weights to safetensors in the target dtype, tokenizer (the model's, or `tokenizer`'s files when
    given) and config beside them, then a full load (phases convert and validate of `progress`)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.model_runner import ModelRunner
    from neuronfleet.runtime.model.dtypes import resolve_dtype
    from neuronfleet.runtime.model.gguf_import import import_gguf
    from neuronfleet.runtime.model.quantize import quantize_folder

    progress = progress or Reporter()
    progress.phase("convert")  # (reading the source: its totals follow once known)
    dtype = resolve_dtype(config.dtype, "neuron" if config.compiledSteps == "neuron" else "cpu")
    out.mkdir(parents=True)
    if source.is_file() and source.suffix == ".gguf":
        import_gguf(source, out, dtype=dtype, progress=progress)
    elif source.is_dir() and (source / "config.json").is_file():
        shards = sorted(source.glob("*.safetensors"))
        if not shards:
            raise CompileError(f"{source} holds no .safetensors weights")
        target = getattr(torch, dtype)
        progress.phase("convert", sum(s.stat().st_size for s in shards), len(shards))
        for shard in shards:
            tensors, read = {}, 0
            with safe_open(str(shard), "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    tensor = f.get_tensor(name)
                    tensors[name] = tensor.to(target).contiguous()
                    read += tensor.numel() * tensor.element_size()
                    progress.advance(bytes=tensor.numel() * tensor.element_size())
            save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
            progress.advance(bytes=shard.stat().st_size - read, files=1)  # (its header)
        model_config = json.loads((source / "config.json").read_text())
        model_config["torch_dtype"] = dtype
        (out / "config.json").write_text(json.dumps(model_config, indent=2))
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
    else:
        raise CompileError(f"{source} is neither a Hugging Face model folder nor a .gguf file")
    if tokenizer is not None:
        if not (tokenizer / "tokenizer.json").is_file():
            raise CompileError(f"tokenizer {config.model.tokenizer} holds no tokenizer.json")
        (out / "chat_template.jinja").unlink(missing_ok=True)  # (the model's would outrank the tokenizer's)
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, out / name)
    if (
        config.quantization != "none"
    ):  # once, here: serving pods load the stored int8/int4 weights as they are
        quantize_folder(out, config.quantization)
    # Loading validates every tensor's shape against config.json and the buckets against the lengths (with
    # compiled passes, the load that compiles them does: the model is loaded once)
    progress.phase("validate")
    if config.compiledSteps == "inductor":
        compile_graphs(out, config, dtype, progress)
        return
    if config.compiledSteps == "neuron":
        warm_neff(out, config, dtype, progress)
        return
    runtime = RuntimeConfig(
        slots=1, max_seq_len=config.sequenceLength, max_input_len=config.maxInputLength, dtype=dtype,
        prefill_buckets=config.buckets.context,
        decode_buckets=config.buckets.generation,
    )  # fmt: skip
    ModelRunner(out, runtime)


def _pods_tables(config: CompileConfig, dtype: str, compiled_steps: str) -> tuple[Any, list[tuple]]:
    """The pods' RuntimeConfig (their slots, lengths and buckets, as `engines.serve_config` gives them) and
    every bucket its compiled passes run (`compiled_buckets`); a table of too many graphs is a CompileError
    saying one that fits."""
    from neuronfleet.contract import compiled_buckets
    from neuronfleet.runtime.engine.config import RuntimeConfig

    try:
        pods = RuntimeConfig(
            slots=config.batchSize, max_seq_len=config.sequenceLength, max_input_len=config.maxInputLength,
            dtype=dtype, prefill_buckets=config.buckets.context, decode_buckets=config.buckets.generation,
            compiled_steps=compiled_steps,
        )  # fmt: skip
    except ValueError as e:
        raise CompileError(str(e)) from e
    return pods, compiled_buckets(pods.slots, pods.prefill_buckets, pods.decode_buckets)


def compile_graphs(out: Path, config: CompileConfig, dtype: str, progress: Reporter) -> None:
    """The passes compiled ahead for the pods (`compiled_ahead`): a package per bucket of the pods' tables,
    into `out`/graphs/."""
    from neuronfleet.runtime.engine.model_runner import ModelRunner
    from neuronfleet.runtime.model.compiled_ahead import compile_ahead

    pods, table = _pods_tables(config, dtype, "inductor")
    model = ModelRunner(out, pods).model  # plain weights in the activations' dtype, as a compiled pod's
    progress.phase("compile", total_files=len(table))
    compile_ahead(model, out, table, out, lambda done, total: progress.advance(files=1))


def warm_neff(
    out: Path, config: CompileConfig, dtype: str, progress: Reporter, backend: str = "neuron",
    device: str = "neuron",
) -> None:  # fmt: skip
    """TorchNeuron's NEFF cache warmed for the pods (`neuron_device`): every bucket of the pods' tables
    compiled once on this node's Neuron device, into `out`/neff/, and warmed.json written last. At a
    tensor parallelism above 1 the Job runs a rank per NeuronCore as the pods do (`tp_ranks.Ranks`, each rank
    a `neuron_device.Warmer`), so each rank's graphs, its share's with their all-reduces, are the pods'.
    `backend` and `device` swapped (aot_eager, cpu: gloo between the ranks): the same path with no device,
    as the tests run it."""
    from neuronfleet.runtime.engine.tp_ranks import Ranks
    from neuronfleet.runtime.model import neuron_device

    pods, table = _pods_tables(config, dtype, "neuron")
    neuron_device.use_cache(out / neuron_device.NEFF_DIR)  # before torch-neuronx reads it (the ranks too)
    if device == "neuron" and (why := neuron_device.import_backend()) is not None:
        raise CompileError(why)
    warming = neuron_device.Warming(
        device, config.tensorParallel, dtype, pods.slots, pods.max_seq_len, tuple(table), backend,
        pods.compiled_graphs,
    )  # fmt: skip
    progress.phase("compile", total_files=len(table))
    ranks = Ranks.start(out, warming, neuron_device.Warmer) if warming.tensor_parallel > 1 else None
    try:
        warmer = neuron_device.Warmer(out, warming, 0, lambda done, total: progress.advance(files=1))
    finally:
        if ranks is not None:
            ranks.stop()
    neuron_device.write_warmed(out, neuron_device.neff_key(warmer.model, out, backend), table)


def check_lengths(source: Path, config: CompileConfig) -> None:
    """Refuse a sequenceLength past what the model was trained for (`contract.model_length_limit` of its
    config.json, or its GGUF file's `llama.context_length`), read before anything is converted (the full
    load at the end, `RuntimeConfig.check_model`, would refuse it too, after the conversion); the message
    says what would be right."""
    from neuronfleet.runtime.model.gguf_file import GGUFFile

    if source.is_dir() and (source / "config.json").is_file():
        limit = model_length_limit(json.loads((source / "config.json").read_text()))
        where = "its config.json"
    elif source.is_file() and source.suffix == ".gguf":
        limit, where = GGUFFile(source).fields.get("llama.context_length"), "its GGUF llama.context_length"
    else:
        return  # convert says what the source is not
    if isinstance(limit, int) and config.sequenceLength > limit:
        raise CompileError(length_refusal(config.sequenceLength, limit, where))


def report(manifest: dict[str, Any]) -> dict[str, Any]:
    """Leave the manifest as the container's termination message, where the operator reads it."""
    path = Path(os.environ.get(TERMINATION_LOG_ENV, TERMINATION_LOG))
    if path.parent.is_dir() and os.access(path.parent if not path.exists() else path, os.W_OK):
        path.write_text(json.dumps(manifest))
    return manifest


def compile_artifacts(
    config_path: Path, out: Path, log=print, model_mount: str = MODEL_MOUNT, progress: Reporter | None = None
) -> dict[str, Any]:
    """Produce `out` (artifacts/<hash>/) from the config, telling `progress` how it goes; returns the
    manifest (a cache hit at once)."""
    progress = progress or Reporter()
    out = Path(out)
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        log(f"cache hit: {out} is complete")
        return report({**json.loads(manifest_path.read_text()), "cacheHit": True})
    config = load_config(config_path)
    torchneuron = instance_family(config.instanceType) in TORCHNEURON_FAMILIES
    if config.instanceType != "cpu" and not (torchneuron and config.compiledSteps == "neuron"):
        raise CompileError(
            f"instanceType {config.instanceType} with compiledSteps {config.compiledSteps}: the embedded "
            "engine compiles for cpu, and for trn2 and trn3 with compiledSteps neuron (TorchNeuron, "
            "experimental); use engine vllm on other Neuron instance types"
        )
    started = time.monotonic()
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    cache = out.parent.parent  # the compile cache (artifacts/<hash>/ is `out`): s3:// downloads resume there
    try:
        if config.model.uri.startswith(("hf://", "s3://")):  # (a local folder or file is read where it is)
            progress.phase("download")
        source = resolve_source(
            config.model.uri, config.model.revision, staging / "download", model_mount, cache=cache,
            on_progress=progress.on_progress,
        )  # fmt: skip
        tokenizer = None
        if config.model.tokenizer:
            tokenizer = resolve_source(
                config.model.tokenizer, None, staging / "download", model_mount, files=TOKENIZER_FILES,
                cache=cache,
            )  # fmt: skip
        check_lengths(source, config)  # before any conversion: a refusal at once, not after minutes
        convert(source, staging / "model", config, tokenizer, progress)
        for uri in (config.model.uri, config.model.tokenizer or ""):
            if uri.startswith("s3://"):  # converted into the artifacts: serving never reads the download
                shutil.rmtree(cache_folder(cache, uri), ignore_errors=True)
        shutil.rmtree(staging / "download", ignore_errors=True)
        (staging / "compile.json").write_text(config.to_json())
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():  # an incomplete folder from an interrupted compile
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    manifest = {
        "compileHash": config.compileHash,
        "engine": config.engine,
        "bytes": size,
        "seconds": round(time.monotonic() - started, 3),
        "compiledAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.rename(manifest_path)  # last: the folder is complete from here on
    progress.finish()
    log(f"compiled {config.model.uri} into {out} ({size} bytes)")
    return report({**manifest, "cacheHit": False})
